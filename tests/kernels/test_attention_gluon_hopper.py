"""Who may run the Gluon Hopper FP8 attention kernel, decided on the CPU (no GPU here).

The kernel itself runs only on sm_90 (its numerics are measured on the H200 by
benchmarks/gluon_attention_bench.py; its PTX is pinned by
tests/compile/test_compile_gluon_hopper.py). Here: every other device and every Triton whose
Gluon lacks a name the kernel calls gets a reason (never an exception at import or call),
and the calls it cannot serve are refused like attention_fp8_full's.
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from triton_accel.kernels.attention import gluon_hopper as glu
from triton_accel.kernels.core import device as device_mod
from triton_accel.kernels.core.device import DeviceInfo

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ROOT / ".cache" / "triton-versions"  # tests/versions/version_matrix.py installs them

# name -> (DeviceInfo, words the reason must contain; None: accepted)
DEVICES = {
    "H100 sm_90": (DeviceInfo("cuda", "nvidia", "NVIDIA H100 80GB HBM3", (9, 0), "sm90"), None),
    "RTX 4090 sm_89": (DeviceInfo("cuda", "nvidia", "NVIDIA GeForce RTX 4090", (8, 9), "sm89"), "sm_89"),
    "A100 sm_80": (DeviceInfo("cuda", "nvidia", "NVIDIA A100-SXM4-80GB", (8, 0), "sm80"), "sm_80"),
    "B200 sm_100": (DeviceInfo("cuda", "nvidia", "NVIDIA B200", (10, 0), "sm100"), "sm_100"),
    "RTX 5090 sm_120": (DeviceInfo("cuda", "nvidia", "NVIDIA GeForce RTX 5090", (12, 0), "sm120"), "sm_120"),
    "MI300X gfx942": (DeviceInfo("cuda", "amd", "AMD Instinct MI300X", (9, 4), "gfx942"), "NVIDIA"),
}


def _api_ok() -> bool:
    return glu.gluon_api_refusal() is None


@pytest.mark.parametrize("name", list(DEVICES))
def test_device_refusal(monkeypatch, name):
    info, words = DEVICES[name]
    if not _api_ok():
        pytest.skip(f"installed Triton refused first: {glu.gluon_api_refusal()}")
    monkeypatch.setattr(device_mod, "describe", lambda device=None: info)
    # A Triton minor the kernel was checked on (the release rule: test_gluon_release_gate.py).
    monkeypatch.setattr(device_mod, "triton_version", lambda: "3.6.0")
    reason = glu.gluon_refusal(torch.device("cuda", 0))
    if words is None:
        assert reason is None
    else:
        assert reason and words in reason, reason


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_non_cuda_devices_are_refused(device):
    reason = glu.gluon_refusal(device)
    assert reason and ("sm_90" in reason or "Triton" in reason), reason


@pytest.mark.parametrize("version", ["3.2.0", "3.3.1", ""], ids=["3.2.0", "3.3.1", "unknown"])
def test_tritons_without_gluon_are_refused(version):
    reason = glu.gluon_api_refusal(version)
    assert reason and "3.4+" in reason, reason


def _fake_api(warp_specialize_params=("functions_and_args", "worker_num_warps", "worker_num_regs"),
              drop=(), tma_names=("async_copy_global_to_shared",)):
    """(gl, hopper) modules with the names the kernel calls, minus `drop`; warp_specialize
    with the given parameters (3.5's form differs)."""
    def warp_specialize(*args):
        return args

    warp_specialize.__signature__ = inspect.Signature(
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in warp_specialize_params])
    gl_fake = SimpleNamespace(**{n: object() for n in glu._REQUIRED["gl"] if f"gl.{n}" not in drop})
    if "gl.warp_specialize" not in drop:
        gl_fake.warp_specialize = warp_specialize
    tma = SimpleNamespace(**{n: object() for n in tma_names})
    mbarrier = SimpleNamespace(**{n: object() for n in glu._REQUIRED["mbarrier"] if f"mbarrier.{n}" not in drop})
    hopper = SimpleNamespace(**{n: object() for n in glu._REQUIRED["hopper"] if f"hopper.{n}" not in drop})
    hopper.tma, hopper.mbarrier = tma, mbarrier
    return gl_fake, hopper


# name -> (fake API, words the reason must contain; None: accepted)
API_CASES = {
    "3.6-like (old TMA name)": (dict(), None),
    "3.9-like (async_load only)": (dict(tma_names=("async_load",)), None),
    "3.5-like warp_specialize": (dict(warp_specialize_params=("default_args", "default_partition", "worker_args")),
                                 "default_args"),
    "no warpgroup_mma": (dict(drop=("hopper.warpgroup_mma",)), "hopper.warpgroup_mma"),
    "no mbarrier.expect": (dict(drop=("mbarrier.expect",)), "mbarrier.expect"),
    "no TMA load": (dict(tma_names=()), "tma.async_load"),
    "no warp_specialize": (dict(drop=("gl.warp_specialize",)), "gl.warp_specialize"),
}


@pytest.mark.parametrize("case", list(API_CASES))
def test_api_gaps(case):
    kwargs, words = API_CASES[case]
    reason = glu.api_gaps("3.x", *_fake_api(**kwargs))
    if words is None:
        assert reason is None
    else:
        assert reason and words in reason, reason


# Real releases at the boundaries (installed by tests/versions/version_matrix.py when present).
REAL = {"3.4": "warpgroup_mma", "3.5": "default_args", "3.6": None, "3.9": None}


@pytest.mark.parametrize("minor", list(REAL))
def test_real_triton_minor(minor):
    site = VERSIONS / f"triton-{minor}"
    if not (site / ".installed").exists():
        print(f"SKIP reason: {site} not installed (tests/versions/version_matrix.py {minor} installs it)")
        pytest.skip(f"Triton {minor} not installed under {VERSIONS}")
    code = ("import importlib.util, sys; root = sys.argv[1]; "
            "spec = importlib.util.spec_from_file_location('ta', root + '/__init__.py', submodule_search_locations=[root]); "
            "m = importlib.util.module_from_spec(spec); sys.modules['ta'] = m; spec.loader.exec_module(m); "
            "import importlib; g = importlib.import_module('ta.kernels.attention.gluon_hopper'); "
            "print('REASON', g.gluon_api_refusal())")
    env = dict(os.environ, PYTHONPATH=str(site))
    p = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, env=env, timeout=300)
    lines = [ln[7:] for ln in p.stdout.splitlines() if ln.startswith("REASON ")]
    assert p.returncode == 0 and lines, p.stderr[-2000:]
    words = REAL[minor]
    if words is None:
        assert lines[-1] == "None"
    else:
        assert words in lines[-1], lines[-1]


def _qkv(dtype, shape, kv_heads=None, kv_dim=None):
    B, H, L, D = shape
    q = torch.randn(B, H, L, D, dtype=dtype)
    k = torch.randn(B, kv_heads or H, L, kv_dim or D, dtype=dtype)
    return q, k, k.clone()


# (shape, edge case) -> words of the reason; None: served. Shapes: Flux / SD3 heads, odd lengths.
CALLS = {
    "flux d128": (dict(shape=(1, 2, 64, 128)), {}, None),
    "sd3 d64 odd length": (dict(shape=(2, 2, 77, 64)), {}, None),
    "d40 padded": (dict(shape=(1, 1, 33, 40)), {}, None),
    "head dim 160": (dict(shape=(1, 1, 16, 160)), {}, "head dim"),
    "GQA": (dict(shape=(1, 4, 16, 64), kv_heads=2), {}, "GQA"),
    "mask": (dict(shape=(1, 1, 16, 64)), dict(attn_mask=torch.zeros(16, 16)), "mask"),
    "causal": (dict(shape=(1, 1, 16, 64)), dict(is_causal=True), "causal"),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(CALLS))
def test_call_refusal(dtype, case):
    inputs, extra, words = CALLS[case]
    reason = glu.call_refusal(*_qkv(dtype, **inputs), **extra)
    if dtype == torch.float32:
        assert reason and "float16 or bfloat16" in reason, reason
    elif words is None:
        assert reason is None, reason
    else:
        assert reason and words in reason, reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_launcher_refuses_cpu_with_reason(dtype):
    q, k, v = _qkv(dtype, (1, 2, 100, 128))
    with pytest.raises(glu.GluonUnsupportedError, match="attention_gluon_fp8: .*(sm_90|Triton)"):
        glu.attention_gluon_fp8(q, k, v)


@pytest.mark.parametrize("cfg", list(glu.GLUON_CONFIGS))
@pytest.mark.parametrize("head_dim", [128, 64, 40])
def test_compile_specs_descriptors_parse(cfg, head_dim):
    """The tensor-descriptor types of compile_specs are what Triton's signature parser reads
    (the launcher builds its descriptors with the same shapes and layouts)."""
    if not _api_ok():
        pytest.skip(f"installed Triton refused: {glu.gluon_api_refusal()}")
    from triton.language import str_to_ty

    (name, _, sig, const, _, warps), = glu.compile_specs("bf16", head_dim, glu.GLUON_CONFIGS[cfg])
    block_d = max(32, 1 << (head_dim - 1).bit_length())
    expect = dict(q_desc=[64, block_d], k_desc=[glu.GLUON_CONFIGS[cfg]["BLOCK_N"], block_d],
                  v_desc=[block_d, glu.GLUON_CONFIGS[cfg]["BLOCK_N"]], qs_desc=[64, 32],
                  ones_desc=[8, glu.GLUON_CONFIGS[cfg]["BLOCK_N"]])
    for arg, shape in expect.items():
        ty = str_to_ty(sig[arg], None)
        assert list(ty.block_type.shape) == shape, (arg, sig[arg])
        assert ty.layout.element_bitwidth == 8
    assert name == "_attn_fp8_gluon_fwd" and warps == 4 and const["BLOCK_D"] == block_d


@pytest.mark.parametrize("layout", ["comfyui_token_major", "contiguous"])
def test_output_follows_q_layout(monkeypatch, layout):
    """The output is allocated like q (torch.empty_like) and its strides reach the kernel: for
    ComfyUI's q, a [B, H, L, D] view of [B, L, H, D] memory, the [B, L, H * D] ComfyUI makes of
    the output is a view, not a transposing copy. The launch is recorded, not run (no sm_90
    here): what it would write through is the tensor returned."""
    B, H, L, D = 1, 3, 40, 64
    if layout == "contiguous":
        q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16) for _ in range(3))
    else:
        q, k, v = (torch.randn(B, L, H * D, dtype=torch.bfloat16).view(B, L, H, D).transpose(1, 2) for _ in range(3))
    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append(args)

    cfg = glu.default_config()
    quantized = SimpleNamespace(q8=torch.zeros(B * H, 64, 64), k8=torch.zeros(B * H, 128, 64), qs=torch.zeros(B * H, 64, 16),
                                ks=torch.zeros(B * H, 128, 16), vt8=torch.zeros(B * H, 64, 128), sq=torch.zeros(B * H, 1),
                                sk=torch.zeros(B * H, 1), sv=None, vmean=None, n_outlier=0, block_m=glu.BLOCK_M,
                                block_n=cfg["BLOCK_N"], v_key_perm=True)
    monkeypatch.setattr(glu, "call_refusal", lambda *a, **k: None)
    monkeypatch.setattr(glu, "gluon_refusal", lambda device: None)
    monkeypatch.setattr(glu, "quantize_for_config", lambda *a, **k: quantized)
    monkeypatch.setattr(glu.TensorDescriptor, "from_tensor", staticmethod(lambda *a, **k: None))
    monkeypatch.setattr(glu, "_ones_descriptor", lambda *a: None)
    monkeypatch.setattr(glu, "_attn_fp8_gluon_fwd", Kernel())
    out = glu.attention_gluon_fp8(q, k, v)
    (args,) = launches
    at = next(i for i, a in enumerate(args) if a is out)
    assert tuple(args[at + 1:at + 5]) == out.stride()
    assert out.shape == q.shape and out.stride() == q.stride()
    if layout == "contiguous":
        assert out.is_contiguous()
    else:
        assert out.transpose(1, 2).is_contiguous()  # ComfyUI's reshape to [B, L, H * D] is a view
        assert out.transpose(1, 2).reshape(B, L, H * D).data_ptr() == out.data_ptr()
