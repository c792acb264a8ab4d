"""The FP8 kernels compile to binaries for sm_89 / sm_90 / sm_120 and are refused below sm_89,
without a GPU: triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32)).

Under TRITON_INTERPRET=1 (set by tests/conftest.py) @triton.jit gives interpreter functions
that cannot be compiled, so one subprocess with the variable unset compiles every case (in
parallel, one worker per core) and reports JSON; the tests assert on that report.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
fp8 = importlib.import_module("triton_accel.kernels.attention.fp8")
device_mod = importlib.import_module("triton_accel.kernels.core.device")
gpu_rules = importlib.import_module("triton_accel.kernels.core.gpu_rules")

# Largest shared memory one block may use (bytes), per target.
SMEM_LIMIT = {89: 101376, 90: 232448, 120: 101376}

# (cc, dtype, head_dim, mask_kind 0/1 bool/2 additive, causal): every shipped config class on
# Hopper (the main target), the largest-footprint variants (bool mask: an extra uint8 tile per
# stage; d256) on the 100 KB parts.
GOOD = [
    (90, "fp16", 128, 0, False),  # Flux / Wan
    (90, "bf16", 160, 1, False),
    (90, "fp16", 40, 2, True),  # SD1.5
    (89, "bf16", 128, 1, False),
    (89, "fp16", 160, 2, False),
    (120, "bf16", 128, 0, False),
    (120, "fp16", 64, 1, False),  # SDXL
]
BAD = [(75, "fp16", 64, 0, False), (80, "fp16", 64, 0, False), (86, "bf16", 128, 0, False)]

WORKER = r"""
import importlib, importlib.util, json, os, sys
from concurrent.futures import ProcessPoolExecutor

root, jobs = sys.argv[1], json.loads(sys.argv[2])

def load():
    name = "triton_accel_compile"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, "__init__.py"),
                                                      submodule_search_locations=[root])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return importlib.import_module(name + ".kernels.attention.fp8")

def compile_job(job):
    cc, dtype, d, mask_kind, causal = job
    fp8 = load()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    family = fp8.config_family(f"sm{cc}")
    cfg = fp8.FP8_ATTENTION_CONFIGS[family][fp8.head_dim_class(d)]
    out = []
    for fn, sig, const, attrs in fp8.compile_specs(dtype, d, cfg, mask_kind, causal):
        name = fn.__name__ if hasattr(fn, "__name__") else fn.fn.__name__
        is_attn = "attn" in name
        opts = dict(num_warps=cfg["num_warps"] if is_attn else 4, num_stages=cfg["num_stages"] if is_attn else 3)
        try:
            k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", cc, 32), options=opts)
            out.append(dict(kernel=name, ok=True, cubin=len(k.asm.get("cubin", b"")), shared=k.metadata.shared,
                            config=cfg))
        except Exception as e:
            out.append(dict(kernel=name, ok=False, error=f"{type(e).__name__}: {e}"[-600:], config=cfg))
    return out

if __name__ == "__main__":
    load()
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as ex:
        results = list(ex.map(compile_job, [tuple(j) for j in jobs]))
    print("RESULT " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton >= 3.9 warns when unset
    jobs = GOOD + BAD
    p = subprocess.run([sys.executable, "-c", WORKER, str(ROOT), json.dumps(jobs)], capture_output=True,
                       text=True, env=env, timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"compile worker failed:\n{p.stderr[-3000:]}"
    return dict(zip(map(tuple, jobs), json.loads(lines[-1][7:])))


@pytest.mark.parametrize("job", GOOD, ids=[f"sm{j[0]}-{j[1]}-d{j[2]}-mask{j[3]}{'-causal' if j[4] else ''}"
                                           for j in GOOD])
def test_compiles_for_fp8_targets(report, job):
    results = report[job]
    assert [r["kernel"] for r in results] == ["_quant_fp8", "_attn_fp8_fwd"]
    for r in results:
        assert r["ok"], r.get("error")
        assert r["cubin"] > 0, f"{r['kernel']}: no binary"
        assert r["shared"] <= SMEM_LIMIT[job[0]], (
            f"{r['kernel']} {r['config']} needs {r['shared']} B of shared memory, sm_{job[0]} has {SMEM_LIMIT[job[0]]}")


@pytest.mark.parametrize("job", BAD, ids=[f"sm{j[0]}" for j in BAD])
def test_triton_refuses_fp8_below_sm89(report, job):
    for r in report[job]:
        assert not r["ok"], f"{r['kernel']} compiled for sm_{job[0]}"
        assert "fp8e4nv" in r["error"], r["error"]


@pytest.mark.parametrize("cc", [75, 80, 86])
def test_launcher_refuses_below_sm89_with_our_message(monkeypatch, cc):
    major, minor = divmod(cc, 10)
    name = {75: "Tesla T4", 80: "NVIDIA A100-SXM4-80GB", 86: "NVIDIA GeForce RTX 3090"}[cc]
    info = device_mod.DeviceInfo("cuda", "nvidia", name, (major, minor), f"sm{cc}")
    monkeypatch.setattr(fp8._device, "describe", lambda device=None: info)
    with pytest.raises(fp8.FP8UnsupportedError) as e:
        fp8._check_device(torch.device("cuda", 0))
    assert e.value.reason == f"FP8 tensor cores need sm_89+ ({name} is sm_{cc})"
    # the launcher's words are gpu_rules.py's, the ones the registry and the Settings node show
    assert e.value.reason == gpu_rules.capability_refusal("nvidia", (major, minor), name, fp8=True).reason


@pytest.mark.parametrize("cc", [89, 90, 100, 120])
def test_launcher_accepts_sm89_and_newer(monkeypatch, cc):
    major, minor = divmod(cc, 10)
    info = device_mod.DeviceInfo("cuda", "nvidia", f"gpu sm{cc}", (major, minor), f"sm{cc}")
    monkeypatch.setattr(fp8._device, "describe", lambda device=None: info)
    assert fp8._check_device(torch.device("cuda", 0)) is False  # False: not the interpreter
