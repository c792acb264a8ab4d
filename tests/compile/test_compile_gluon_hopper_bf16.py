"""The Gluon Hopper BF16/FP16 attention kernel compiles for sm_90 without a GPU, with the
intended structure in its PTX and SASS: triton.compile(GluonASTSource(...),
target=GPUTarget("cuda", 90, 32)), for the installed Triton and, where
tests/versions/version_matrix.py installed it, Triton 3.6 (the H200 test machine's).

What must show:
- every matrix instruction is `wgmma.mma_async ... .f32.bf16.bf16` (`.f32.f16.f16` for fp16
  inputs): Q.K^T and P.V on the tensor cores with fp32 accumulators, P in the input dtype,
  as many as the two consumer warpgroups issue: per consumer, Q.K^T in the prologue and the
  loop (BLOCK_D/16 k-steps each), P.V in the loop and for the last tile (BLOCK_N/16 each);
  in SASS, HGMMA only (no HMMA: no product fell back to mma.sync);
- warp specialisation: `setmaxnreg` raising the consumers' registers and lowering the
  producer warp's to PRODUCER_REGS, 384 threads (4 + 4 + 1 warps in 3 warpgroups), TMA
  tensor loads (4-D boxes straight from [B, H, L, D]) completing on mbarriers;
- no local memory (no spills in SASS) and shared memory within sm_90's 227 KB.
Under TRITON_INTERPRET=1 (tests/conftest.py) kernels cannot be compiled, so one subprocess
per Triton, with the variable unset, compiles every case and reports JSON. Skips, with the
reason, where that Triton's Gluon lacks what the kernel uses (Triton < 3.6).
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
VERSIONS = ROOT / ".cache" / "triton-versions"
SMEM_LIMIT_SM90 = 232448

# (input dtype, head dim): Flux/Wan/Hunyuan d128 in both dtypes, SD3/LTX d64, head dim 256,
# a padded head dim (40 -> BLOCK_D 64, TMA zero-fills the rest).
JOBS = [("bf16", 128), ("fp16", 128), ("bf16", 64), ("bf16", 256), ("bf16", 40)]
TRITONS = ["installed", "3.6"]

WORKER = r"""
import importlib, importlib.util, json, os, re, subprocess, sys, tempfile
from collections import Counter

root, jobs = sys.argv[1], json.loads(sys.argv[2])
name = "triton_accel_compile_gluon_bf16"
spec = importlib.util.spec_from_file_location(name, os.path.join(root, "__init__.py"),
                                              submodule_search_locations=[root])
mod = importlib.util.module_from_spec(spec)
sys.modules[name] = mod
spec.loader.exec_module(mod)
g = importlib.import_module(name + ".kernels.attention_gluon_hopper_bf16")
glu = importlib.import_module(name + ".kernels.attention_gluon_hopper")
refusal = glu.gluon_api_refusal()
if refusal:
    print("RESULT " + json.dumps(dict(refusal=refusal)))
    sys.exit(0)
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
out = []
for dtype, d in jobs:
    for kname, fn, sig, const, attrs, warps in g.compile_specs(dtype, d):
        try:
            k = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=warps))
            ptx = k.asm["ptx"]
            sass = None
            if os.path.exists(nvdisasm):
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(k.asm["cubin"])
                    f.flush()
                    p = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True)
                    sass = p.stdout if p.returncode == 0 else None
            out.append(dict(
                ok=True, kernel=kname, cubin=len(k.asm.get("cubin", b"")), shared=k.metadata.shared,
                mma=dict(Counter(re.findall(r"\b(wgmma\.mma_async[\w.]*)", ptx))),
                other_mma=len(re.findall(r"\bmma\.sync", ptx)),
                setmaxnreg=re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx),
                reqntid=re.findall(r"\.reqntid\s+(\d+)", ptx),
                tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.4d\.shared::\w+\.global\.mbarrier", ptx)),
                mbarrier_waits=len(re.findall(r"mbarrier\.try_wait", ptx)),
                local="ld.local" in ptx or "st.local" in ptx,
                sass=None if sass is None else dict(
                    hgmma=len(re.findall(r"\bHGMMA\.", sass)), hmma=len(re.findall(r"\bHMMA\.", sass)),
                    spills=len(re.findall(r"\b(?:STL|LDL)\b", sass)),
                    hgmma_types=sorted(set(re.findall(r"HGMMA\.\w+\.(F32(?:\.\w+)?)", sass))))))
        except Exception as e:
            out.append(dict(ok=False, kernel=kname, error=f"{type(e).__name__}: {e}"[-800:]))
print("RESULT " + json.dumps(dict(refusal=None, triton=triton.__version__, results=out)))
"""


def _compile_all(which: str):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton >= 3.9 warns when unset
    if which != "installed":
        site = VERSIONS / f"triton-{which}"
        if not (site / ".installed").exists():
            return dict(skip=f"{site} not installed (tests/versions/version_matrix.py {which} installs it)")
        env["PYTHONPATH"] = str(site)
    p = subprocess.run([sys.executable, "-c", WORKER, str(ROOT), json.dumps(JOBS)], capture_output=True,
                       text=True, env=env, timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"compile worker failed:\n{p.stderr[-3000:]}"
    rep = json.loads(lines[-1][7:])
    if rep["refusal"]:
        return dict(skip=f"Triton ({which}) cannot build the Gluon kernel: {rep['refusal']}")
    return dict(zip(map(tuple, JOBS), rep["results"]))


_REPORTS: dict = {}


@pytest.fixture(params=TRITONS, ids=[f"triton-{t}" for t in TRITONS])
def report(request):
    pytest.importorskip("triton")
    if request.param not in _REPORTS:
        _REPORTS[request.param] = _compile_all(request.param)
    rep = _REPORTS[request.param]
    if "skip" in rep:
        print(f"SKIP reason: {rep['skip']}")
        pytest.skip(rep["skip"])
    return rep


def _ids(jobs):
    return [f"{t}-d{d}" for t, d in jobs]


def _expected_wgmma(head_dim):
    from triton_accel.kernels.attention_gluon_hopper_bf16 import block_head_dim, default_config

    per_consumer = 2 * (block_head_dim(head_dim) // 16) + 2 * (default_config(head_dim)["BLOCK_N"] // 16)
    return 2 * per_consumer


@pytest.mark.parametrize("job", JOBS, ids=_ids(JOBS))
def test_compiles_within_limits(report, job):
    r = report[job]
    assert r["ok"], r.get("error")
    assert r["cubin"] > 0, "no binary"
    assert r["shared"] <= SMEM_LIMIT_SM90, f"needs {r['shared']} B of shared memory"
    assert not r["local"], "local memory in the PTX"
    if r["sass"] is not None:
        assert r["sass"]["spills"] == 0, f"{r['sass']['spills']} STL/LDL in SASS: registers spill"


@pytest.mark.parametrize("job", JOBS, ids=_ids(JOBS))
def test_every_mma_is_16bit_wgmma_with_fp32_accumulation(report, job):
    dtype, head_dim = job
    r = report[job]
    assert r["ok"], r.get("error")
    mma = r["mma"]
    assert mma, "no wgmma in the PTX"
    ptx_type = {"bf16": "bf16", "fp16": "f16"}[dtype]
    pattern = rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.{ptx_type}\.{ptx_type}"
    assert all(re.fullmatch(pattern, i) for i in mma), mma
    assert r["other_mma"] == 0, "mma.sync in a Hopper kernel: some product left wgmma"
    assert sum(mma.values()) == _expected_wgmma(head_dim), mma
    if r["sass"] is not None:
        assert r["sass"]["hgmma"] > 0 and r["sass"]["hmma"] == 0, r["sass"]
        # nvdisasm names bf16 operands (F32.BF16) and leaves fp16, the default, unnamed (F32).
        assert r["sass"]["hgmma_types"] == [{"bf16": "F32.BF16", "fp16": "F32"}[dtype]], r["sass"]["hgmma_types"]


@pytest.mark.parametrize("job", JOBS, ids=_ids(JOBS))
def test_warp_specialised_structure(report, job):
    from triton_accel.kernels.attention_gluon_hopper_bf16 import default_config

    r = report[job]
    assert r["ok"], r.get("error")
    kinds = {kind for kind, _ in r["setmaxnreg"]}
    assert kinds == {"inc", "dec"}, r["setmaxnreg"]
    producer = str(default_config(job[1])["PRODUCER_REGS"])
    assert ("dec", producer) in [tuple(x) for x in r["setmaxnreg"]], r["setmaxnreg"]
    assert r["reqntid"] == ["384"], r["reqntid"]  # 3 partitions: 4 + 4 + 1 warps in 3 warpgroups
    # Q (two boxes), K and V: 4-D TMA boxes read from the caller's tensors, no staging copy.
    assert r["tma_loads"] >= 4 and r["mbarrier_waits"] >= 4, (r["tma_loads"], r["mbarrier_waits"])
