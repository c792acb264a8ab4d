"""Who may run the Gluon Hopper BF16/FP16 attention kernel, decided on the CPU (no GPU here).

The kernel runs only on sm_90: its numerics are measured on the H200 by
benchmarks/gluon_attention_bench.py (bf16 rel. L2 vs float32 0.0021-0.0024 and fp16
0.0003, equal to cuDNN's, at odd lengths, GQA, head dims 40/64/80/128/256 and permuted
layouts: benchmarks/RESULTS.md); its PTX and SASS are pinned
by tests/compile/test_compile_gluon_hopper_bf16.py. Here: every other device gets a reason,
the calls it cannot serve (dtype, mask, causal, GQA ratios, head dims, strides TMA cannot
read in place) are refused with one, and the launcher's host-side pieces (TMA descriptors on
the caller's tensors, the remembered API check and shared layouts) behave. No numeric
tolerances here: nothing is computed on the CPU.
"""
from __future__ import annotations

import pytest
import torch
from triton_accel.kernels.attention import gluon_hopper as glu
from triton_accel.kernels.attention import gluon_hopper_bf16 as glb
from triton_accel.kernels.core import device as device_mod
from triton_accel.kernels.core.device import DeviceInfo

DTYPES = [torch.bfloat16, torch.float16]

# name -> (DeviceInfo, words the reason must contain; None: accepted)
DEVICES = {
    "H100 sm_90": (DeviceInfo("cuda", "nvidia", "NVIDIA H100 80GB HBM3", (9, 0), "sm90"), None),
    "H200 sm_90": (DeviceInfo("cuda", "nvidia", "NVIDIA H200", (9, 0), "sm90"), None),
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
    reason = glb.gluon_bf16_refusal(torch.device("cuda", 0))
    if words is None:
        assert reason is None
    else:
        assert reason and words in reason, reason


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_non_cuda_devices_are_refused(device):
    reason = glb.gluon_bf16_refusal(device)
    assert reason and ("sm_90" in reason or "Triton" in reason), reason


def _qkv(dtype, shape, kv_heads=None, kv_dim=None, lk=None, layout="bhld"):
    B, H, L, D = shape
    Hk, Lk = kv_heads or H, lk or L

    def make(heads, length, dim):
        if layout == "blhd":  # ComfyUI's heads: a [B, L, H, D] tensor seen as [B, H, L, D]
            return torch.randn(B, length, heads, dim, dtype=dtype).transpose(1, 2)
        return torch.randn(B, heads, length, dim, dtype=dtype)

    return make(H, L, D), make(Hk, Lk, kv_dim or D), make(Hk, Lk, kv_dim or D)


# name -> (inputs, extra call arguments, words of the reason; None: served). Real shapes
# (Flux, SD3, Wan, LTX-like GQA, head dim 256) and named edge cases.
CALLS = {
    "flux d128": (dict(shape=(1, 2, 64, 128)), {}, None),
    "flux d128 [B,L,H,D] view": (dict(shape=(1, 2, 64, 128), layout="blhd"), {}, None),
    "sd3 d64 odd length": (dict(shape=(2, 2, 77, 64)), {}, None),
    "wan cross-attention 512 keys": (dict(shape=(1, 2, 100, 128), lk=512), {}, None),
    "GQA 32/8": (dict(shape=(1, 32, 16, 128), kv_heads=8), {}, None),
    "head dim 256": (dict(shape=(1, 2, 16, 256)), {}, None),
    "head dim 40 (zero-filled to 64)": (dict(shape=(1, 1, 33, 40)), {}, None),
    "one query, one key": (dict(shape=(1, 1, 1, 128), lk=1), {}, None),
    "head dim 320": (dict(shape=(1, 1, 16, 320)), {}, "head dim"),
    "GQA 3/2": (dict(shape=(1, 3, 16, 64), kv_heads=2), {}, "multiple"),
    "k head dim differs": (dict(shape=(1, 2, 16, 64), kv_dim=128), {}, "head dim"),
    "head dim 36 (72-byte rows)": (dict(shape=(1, 2, 16, 36)), {}, "16-byte"),
    "batch x heads over the grid limit": (dict(shape=(2731, 24, 1, 64)), {}, "grid"),
    "mask": (dict(shape=(1, 1, 16, 64)), dict(attn_mask=torch.zeros(16, 16)), "mask"),
    "causal": (dict(shape=(1, 1, 16, 64)), dict(is_causal=True), "causal"),
}


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("case", list(CALLS))
def test_call_refusal(dtype, case):
    inputs, extra, words = CALLS[case]
    reason = glb.call_refusal(*_qkv(dtype, **inputs), **extra)
    if dtype == torch.float32:
        assert reason and "float16 or bfloat16" in reason, reason
    elif words is None:
        assert reason is None, reason
    else:
        assert reason and words in reason, reason


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_transposed_head_dim_is_refused(dtype):
    q, k, v = _qkv(dtype, (1, 2, 64, 128))
    k_t = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, head dim strided
    reason = glb.call_refusal(q, k_t, v)
    assert reason and "k's head dim is not contiguous" in reason, reason


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mismatched_or_malformed_tensors_are_refused(dtype):
    q, k, v = _qkv(dtype, (1, 2, 64, 128))
    k_expanded = k[:, :1].expand(1, 2, 64, 128)  # GQA written as an expand: zero head stride
    assert "expanded view" in glb.call_refusal(q, k_expanded, v)
    assert "k and v must match" in glb.call_refusal(q, k, v[:, :, :32])
    assert "[B, H, L, D]" in glb.call_refusal(q[0], k, v)
    assert "float16 or bfloat16" in glb.call_refusal(q, k.float(), v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 24, 100, 128), (2, 12, 77, 256)], ids=["flux", "hd256"])
def test_launcher_refuses_cpu_with_reason(dtype, shape):
    q, k, v = _qkv(dtype, shape)
    with pytest.raises(glb.GluonUnsupportedError, match="attention_gluon_bf16: .*(sm_90|Triton)"):
        glb.attention_gluon_bf16(q, k, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_launcher_names_the_call_problem_first(dtype):
    """A call no device could serve says so, not merely that the device is wrong."""
    q, k, v = _qkv(dtype, (1, 3, 16, 64), kv_heads=2)
    with pytest.raises(glb.GluonUnsupportedError, match="attention_gluon_bf16: 3 query heads .* 2 key/value"):
        glb.attention_gluon_bf16(q, k, v)


@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
def test_configs_fit_the_head_dim(head_dim):
    """BLOCK_D is the head dim rounded up to a power of two >= 64; head dim 256 halves the
    key tile (its fp32 output alone is 128 registers a thread)."""
    cfg = glb.default_config(head_dim)
    block_d = glb.block_head_dim(head_dim)
    assert block_d == max(64, 1 << (head_dim - 1).bit_length())
    assert cfg["BLOCK_N"] == (64 if block_d == 256 else 128)
    ring = cfg["STAGES"] * 2 * cfg["BLOCK_N"] * block_d * 2 + 2 * 64 * block_d * 2
    assert ring <= 227 * 1024, f"Q + K/V rings need {ring} B of shared memory"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [128, 64, 40, 256])
def test_compile_specs_descriptors_parse(dtype, head_dim):
    """compile_specs' tensor-descriptor types are what Triton's signature parser reads: 4-D
    boxes [1, 1, rows, BLOCK_D] over [B, H, L, D] (the launcher builds the same ones)."""
    if not _api_ok():
        pytest.skip(f"installed Triton refused: {glu.gluon_api_refusal()}")
    from triton.language import str_to_ty

    (name, _, sig, const, _, warps), = glb.compile_specs(dtype, head_dim)
    block_d, block_n = glb.block_head_dim(head_dim), glb.default_config(head_dim)["BLOCK_N"]
    expect = dict(q_desc=[1, 1, 64, block_d], k_desc=[1, 1, block_n, block_d], v_desc=[1, 1, block_n, block_d])
    for arg, shape in expect.items():
        ty = str_to_ty(sig[arg], None)
        assert list(ty.block_type.shape) == shape, (arg, sig[arg])
        assert ty.layout.element_bitwidth == 16
    assert name == "_attn_bf16_gluon_fwd" and warps == 4 and const["BLOCK_D"] == block_d


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["contiguous", "blhd view", "one-row slice", "batch of one, odd batch stride"])
def test_descriptors_read_the_callers_tensor_in_place(dtype, case):
    """The TMA descriptor describes the caller's tensor itself (no copy): its base, shape and
    strides, except that a size-1 dimension's stride (never stepped over, but still checked
    by TMA for 16-byte alignment) is replaced by an aligned one."""
    if not _api_ok():
        pytest.skip(f"installed Triton refused: {glu.gluon_api_refusal()}")
    base = torch.randn(2, 64, 4, 128, dtype=dtype)
    t = {"contiguous": base.transpose(1, 2).contiguous(), "blhd view": base.transpose(1, 2),
         "one-row slice": base.transpose(1, 2)[:, :, 5:6], "batch of one, odd batch stride":
         torch.randn(1, 4, 64, 136, dtype=dtype)[..., :128].as_strided((1, 4, 64, 128), (7, 64 * 136, 136, 1))}[case]
    assert glb.call_refusal(t, t, t) is None
    desc = glb._descriptor(t, [1, 1, 64, 128])
    assert desc.base is t and list(desc.shape) == list(t.shape)
    size = t.element_size()
    for dim, (stride, n) in enumerate(zip(desc.strides[:3], t.shape[:3])):
        assert (stride * size) % 16 == 0, (case, desc.strides)
        if n > 1:
            assert stride == t.stride(dim)
    assert desc.strides[3] == 1


def test_api_check_and_layouts_are_remembered(monkeypatch):
    """Per launch, the Gluon API check (inspect.signature of warp_specialize, ~50 us) and the
    shared layouts (~20 us each) are looked up, not recomputed: at Flux size they were a
    third of the call's host time."""
    if not _api_ok():
        pytest.skip(f"installed Triton refused: {glu.gluon_api_refusal()}")
    calls = []
    real_gaps = glu.api_gaps
    monkeypatch.setattr(glu, "api_gaps", lambda *a: calls.append(a) or real_gaps(*a))
    glu._api_refusal_for.cache_clear()
    for _ in range(3):
        assert glu.gluon_api_refusal() is None
    assert len(calls) == 1
    first = glu.shared_layout((1, 1, 64, 128), "bf16")
    assert glu.shared_layout((1, 1, 64, 128), "bf16") is first
    assert glu.shared_layout((64, 128), "fp8e4nv").element_bitwidth == 8
    from triton_accel.kernels.core import cache_registry

    assert {"kernels.attention.gluon_hopper.api_refusal",
            "kernels.attention.gluon_hopper.shared_layout"} <= set(cache_registry.names())
