"""The full-FP8 attention kernels compile for sm_89 / sm_90 / sm_120 with FP8 tensor-core
instructions in the PTX, and are refused below sm_89, without a GPU:
triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32)).

What the PTX must show: on sm_90 every matrix instruction of the attention kernel is an
`wgmma.mma_async ... .e4m3.e4m3` (Q.K^T, the outlier side dot and P.V: a P.V left in 16 bits
would show as a bf16/f16 wgmma); on sm_89 and sm_120 they are `mma.sync ... .e4m3.e4m3`.
Under TRITON_INTERPRET=1 (tests/conftest.py) @triton.jit gives interpreter functions that
cannot be compiled, so one subprocess with the variable unset compiles every case (one
worker per core) and reports JSON; the tests assert on that report.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMEM_LIMIT = {89: 101376, 90: 232448, 120: 101376}  # bytes of shared memory one block may use

# (cc, dtype, head_dim, which kernels): all four kernels where the shipped config differs
# (sm90, sm89), the attention kernel alone for sm120 (sm89's config) and the refused targets.
GOOD = [(90, "bf16", 128, "all"), (89, "fp16", 64, "all"), (120, "bf16", 128, "attn")]
BAD = [(75, "fp16", 64, "attn"), (80, "bf16", 128, "attn"), (86, "bf16", 128, "attn")]

WORKER = r"""
import importlib, importlib.util, json, os, re, sys
from collections import Counter
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
    return importlib.import_module(name + ".kernels.attention.fp8_full")

def compile_job(job):
    cc, dtype, d, which = job
    full = load()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    cfg = full.FP8_FULL_CONFIGS["sm90" if cc == 90 else "sm89"]
    out = []
    for name, fn, sig, const, attrs, warps in full.compile_specs(dtype, d, cfg):
        if which == "attn" and name != "_attn_fp8_full_fwd":
            continue
        try:
            k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", cc, 32),
                               options=dict(num_warps=warps, num_stages=cfg["num_stages"]))
            ptx = k.asm["ptx"]
            mma = Counter(re.findall(r"\b(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", ptx))
            out.append(dict(kernel=name, ok=True, cubin=len(k.asm.get("cubin", b"")), shared=k.metadata.shared,
                            mma=dict(mma), local="ld.local" in ptx or "st.local" in ptx))
        except Exception as e:
            out.append(dict(kernel=name, ok=False, error=f"{type(e).__name__}: {e}"[-600:]))
    return out

if __name__ == "__main__":
    load()
    with ProcessPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as ex:
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


def _ids(jobs):
    return [f"sm{j[0]}-{j[1]}-d{j[2]}" for j in jobs]


@pytest.mark.parametrize("job", GOOD, ids=_ids(GOOD))
def test_compiles_within_shared_memory(report, job):
    results = report[job]
    expected = ["_attn_fp8_full_fwd"] if job[3] == "attn" else [
        "fp8_stats_kernel", "_fp8_finalize_kernel", "_fp8_quant_kernel", "_v_mean_fix_kernel", "_attn_fp8_full_fwd"]
    assert [r["kernel"] for r in results] == expected
    for r in results:
        assert r["ok"], r.get("error")
        assert r["cubin"] > 0, f"{r['kernel']}: no binary"
        assert r["shared"] <= SMEM_LIMIT[job[0]], f"{r['kernel']} needs {r['shared']} B of shared memory"
        assert not r["local"], f"{r['kernel']} spills to local memory"


@pytest.mark.parametrize("job", GOOD, ids=_ids(GOOD))
def test_attention_matrix_instructions_are_e4m3(report, job):
    attn = next(r for r in report[job] if r["kernel"] == "_attn_fp8_full_fwd")
    mma = attn["mma"]
    assert mma, "no matrix instructions in the PTX"
    if job[0] == 90:
        assert all(re.fullmatch(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", i) for i in mma), mma
        # Per key tile: Q.K^T over 128 channels (4 k-steps), the side dot (1) and P.V over
        # BLOCK_N = 128 keys (4); the hot loop and the partial last tile each have a copy.
        assert sum(mma.values()) == 2 * (4 + 1 + 4), mma
    else:
        assert all(re.fullmatch(r"mma\.sync\.aligned\.m16n8k32\.row\.col\.f32\.e4m3\.e4m3\.f32", i) for i in mma), mma


@pytest.mark.parametrize("job", BAD, ids=_ids(BAD))
def test_triton_refuses_below_sm89(report, job):
    for r in report[job]:
        assert not r["ok"], f"{r['kernel']} compiled for sm_{job[0]}"
        assert "fp8e4nv" in r["error"], r["error"]
