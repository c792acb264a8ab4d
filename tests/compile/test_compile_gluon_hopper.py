"""The Gluon Hopper FP8 attention kernel compiles for sm_90 without a GPU, with the intended
structure in its PTX: triton.compile(GluonASTSource(...), target=GPUTarget("cuda", 90, 32)).

What the PTX must show:
- every matrix instruction is `wgmma.mma_async ... .e4m3.e4m3` with an fp32 accumulator
  (Q.K^T, the outlier side dot and P.V: a P.V left in 16 bits would show as bf16/f16), and
  as many as the two consumer warpgroups issue: per consumer, Q.K^T + side in the prologue
  and in the loop (BLOCK_D/32 + 1 k-steps each), P.V in the loop and for the last tile
  (BLOCK_N/32 k-steps each);
- warp specialisation: `setmaxnreg` raising the consumers' registers and lowering the
  producer warp's to PRODUCER_REGS, 12 warps per CTA (consumer 4 + consumer 4 + producer 1,
  padded to whole warpgroups), TMA tensor loads completing on mbarriers;
- no local memory (spills) and shared memory within sm_90's 227 KB.
Under TRITON_INTERPRET=1 (tests/conftest.py) kernels cannot be compiled, so one subprocess
with the variable unset compiles every case and reports JSON. Skips, with the reason, where
the installed Triton's Gluon lacks what the kernel uses (Triton < 3.6).
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
SMEM_LIMIT_SM90 = 232448

# (config name, head dim): the shipped config at d128 and d64 (SD3-like), the two-level one.
JOBS = [("sm90", 128), ("sm90", 64), ("sm90_two_level", 128)]

WORKER = r"""
import importlib, importlib.util, json, os, re, sys
from collections import Counter

root, jobs = sys.argv[1], json.loads(sys.argv[2])
name = "triton_accel_compile_gluon"
spec = importlib.util.spec_from_file_location(name, os.path.join(root, "__init__.py"),
                                              submodule_search_locations=[root])
mod = importlib.util.module_from_spec(spec)
sys.modules[name] = mod
spec.loader.exec_module(mod)
g = importlib.import_module(name + ".kernels.attention_gluon_hopper")
refusal = g.gluon_api_refusal()
if refusal:
    print("RESULT " + json.dumps(dict(refusal=refusal)))
    sys.exit(0)
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

out = []
for cfg_name, d in jobs:
    cfg = g.GLUON_CONFIGS[cfg_name]
    for kname, fn, sig, const, attrs, warps in g.compile_specs("bf16", d, cfg):
        try:
            k = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=warps))
            ptx = k.asm["ptx"]
            out.append(dict(
                ok=True, kernel=kname, cubin=len(k.asm.get("cubin", b"")), shared=k.metadata.shared,
                mma=dict(Counter(re.findall(r"\b(wgmma\.mma_async[\w.]*)", ptx))),
                other_mma=len(re.findall(r"\bmma\.sync", ptx)),
                setmaxnreg=re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx),
                reqntid=re.findall(r"\.reqntid\s+(\d+)", ptx),
                tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global\.mbarrier", ptx)),
                mbarrier_waits=len(re.findall(r"mbarrier\.try_wait", ptx)),
                local="ld.local" in ptx or "st.local" in ptx))
        except Exception as e:
            out.append(dict(ok=False, kernel=kname, error=f"{type(e).__name__}: {e}"[-800:]))
print("RESULT " + json.dumps(dict(refusal=None, triton=triton.__version__, results=out)))
"""


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton >= 3.9 warns when unset
    p = subprocess.run([sys.executable, "-c", WORKER, str(ROOT), json.dumps(JOBS)], capture_output=True,
                       text=True, env=env, timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"compile worker failed:\n{p.stderr[-3000:]}"
    rep = json.loads(lines[-1][7:])
    if rep["refusal"]:
        print(f"SKIP reason: {rep['refusal']}")
        pytest.skip(f"the installed Triton cannot build the Gluon kernel: {rep['refusal']}")
    return dict(zip(JOBS, rep["results"]))


def _ids(jobs):
    return [f"{c}-d{d}" for c, d in jobs]


def _expected_wgmma(cfg_name, head_dim):
    from triton_accel.kernels.attention_fp8_quant import padded_head_dim
    from triton_accel.kernels.attention_gluon_hopper import GLUON_CONFIGS

    block_n = GLUON_CONFIGS[cfg_name]["BLOCK_N"]
    qk = padded_head_dim(head_dim) // 32 + 1  # + the outlier side dot's one k-step
    pv = block_n // 32
    return 2 * (2 * qk + 2 * pv)


@pytest.mark.parametrize("job", JOBS, ids=_ids(JOBS))
def test_compiles_within_limits(report, job):
    r = report[job]
    assert r["ok"], r.get("error")
    assert r["cubin"] > 0, "no binary"
    assert r["shared"] <= SMEM_LIMIT_SM90, f"needs {r['shared']} B of shared memory"
    assert not r["local"], "spills to local memory"


@pytest.mark.parametrize("job", JOBS, ids=_ids(JOBS))
def test_every_mma_is_e4m3_wgmma(report, job):
    r = report[job]
    assert r["ok"], r.get("error")
    mma = r["mma"]
    assert mma, "no wgmma in the PTX"
    assert all(re.fullmatch(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", i) for i in mma), mma
    assert r["other_mma"] == 0, "mma.sync in a Hopper kernel: some product left wgmma"
    assert sum(mma.values()) == _expected_wgmma(*job), mma


@pytest.mark.parametrize("job", JOBS, ids=_ids(JOBS))
def test_warp_specialised_structure(report, job):
    from triton_accel.kernels.attention_gluon_hopper import GLUON_CONFIGS

    r = report[job]
    assert r["ok"], r.get("error")
    kinds = {kind for kind, _ in r["setmaxnreg"]}
    assert kinds == {"inc", "dec"}, r["setmaxnreg"]
    producer = str(GLUON_CONFIGS[job[0]]["PRODUCER_REGS"])
    assert ("dec", producer) in [tuple(x) for x in r["setmaxnreg"]], r["setmaxnreg"]
    assert r["reqntid"] == ["384"], r["reqntid"]  # 3 partitions: 4 + 4 + 1 warps in 3 warpgroups
    assert r["tma_loads"] >= 3 and r["mbarrier_waits"] >= 4, (r["tma_loads"], r["mbarrier_waits"])
