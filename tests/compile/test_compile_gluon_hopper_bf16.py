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
- no local memory (no spills in SASS, none in the main loop: tests/compile/compile_report.py
  reads the loop) and shared memory within sm_90's 227 KB.
Under TRITON_INTERPRET=1 (tests/conftest.py) kernels cannot be compiled, so one subprocess
per Triton, with the variable unset, compiles every case and reports JSON. Skips, with the
reason, where that Triton's Gluon lacks what the kernel uses (Triton < 3.6).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compile_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMEM_LIMIT_SM90 = 232448

# (input dtype, head dim, config name or None for the default): Flux/Wan/Hunyuan d128 in both
# dtypes, SD3/LTX d64, head dim 256, a padded head dim (40 -> BLOCK_D 64, TMA zero-fills the
# rest).
JOBS = [("bf16", 128, None), ("fp16", 128, None), ("bf16", 64, None), ("bf16", 256, None), ("bf16", 40, None)]
TRITONS = ["installed", "3.6"]

WORKER = r"""
import importlib, importlib.util, json, os, re, subprocess, sys, tempfile
from collections import Counter

root, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, os.path.join(root, "tests", "compile"))
import compile_report
name = "triton_accel_compile_gluon_bf16"
spec = importlib.util.spec_from_file_location(name, os.path.join(root, "__init__.py"),
                                              submodule_search_locations=[root])
mod = importlib.util.module_from_spec(spec)
sys.modules[name] = mod
spec.loader.exec_module(mod)
g = importlib.import_module(name + ".kernels.attention.gluon_hopper_bf16")
glu = importlib.import_module(name + ".kernels.attention.gluon_hopper")
refusal = glu.gluon_api_refusal()
if refusal:
    print("RESULT " + json.dumps(dict(refusal=refusal)))
    sys.exit(0)
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
out = []
for dtype, d, cfg_name in jobs:
    cfg = g.GLUON_BF16_CONFIGS[cfg_name] if cfg_name else g.default_config(d)
    for kname, fn, sig, const, attrs, warps in g.compile_specs(dtype, d, cfg):
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
            listing = compile_report.disassemble(k.asm["cubin"], triton)
            per_tile = g.block_head_dim(d) // 16 + cfg["BLOCK_N"] // 16
            loop = None if listing is None else compile_report.main_loop(listing, per_tile)
            out.append(dict(
                ok=True, kernel=kname, cubin=len(k.asm.get("cubin", b"")), shared=k.metadata.shared,
                mma=dict(Counter(re.findall(r"\b(wgmma\.mma_async[\w.]*)", ptx))),
                other_mma=len(re.findall(r"\bmma\.sync", ptx)),
                setmaxnreg=re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx),
                reqntid=re.findall(r"\.reqntid\s+(\d+)", ptx),
                tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.4d\.shared::\w+\.global\.mbarrier", ptx)),
                mbarrier_waits=len(re.findall(r"mbarrier\.try_wait", ptx)),
                local="ld.local" in ptx or "st.local" in ptx, loop=loop,
                sass=None if sass is None else dict(
                    hgmma=len(re.findall(r"\bHGMMA\.", sass)), hmma=len(re.findall(r"\bHMMA\.", sass)),
                    spills=len(re.findall(r"\b(?:STL|LDL)\b", sass)),
                    hgmma_types=sorted(set(re.findall(r"HGMMA\.\w+\.(F32(?:\.\w+)?)", sass))))))
        except Exception as e:
            out.append(dict(ok=False, kernel=kname, error=f"{type(e).__name__}: {e}"[-800:]))
print("RESULT " + json.dumps(dict(refusal=None, triton=triton.__version__, results=out)))
"""


_REPORTS: dict = {}


@pytest.fixture(params=TRITONS, ids=[f"triton-{t}" for t in TRITONS])
def report(request):
    return compile_report.cached_report(request.param, WORKER, JOBS, ROOT, _REPORTS)


def _ids(jobs):
    return [f"{t}-d{d}" + (f"-{c}" if c else "") for t, d, c in jobs]


def _config(job):
    from triton_accel.kernels.attention.gluon_hopper_bf16 import GLUON_BF16_CONFIGS, default_config

    return GLUON_BF16_CONFIGS[job[2]] if job[2] else default_config(job[1])


def _expected_wgmma(job):
    from triton_accel.kernels.attention.gluon_hopper_bf16 import block_head_dim

    cfg = _config(job)
    qk, pv = block_head_dim(job[1]) // 16, cfg["BLOCK_N"] // 16
    return 2 * (qk + (qk + pv) + pv)  # per consumer: prologue Q.K^T, a loop step, the last tile's P.V


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
    dtype = job[0]
    r = report[job]
    assert r["ok"], r.get("error")
    mma = r["mma"]
    assert mma, "no wgmma in the PTX"
    ptx_type = {"bf16": "bf16", "fp16": "f16"}[dtype]
    pattern = rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.{ptx_type}\.{ptx_type}"
    assert all(re.fullmatch(pattern, i) for i in mma), mma
    assert r["other_mma"] == 0, "mma.sync in a Hopper kernel: some product left wgmma"
    assert sum(mma.values()) == _expected_wgmma(job), mma
    if r["sass"] is not None:
        assert r["sass"]["hgmma"] > 0 and r["sass"]["hmma"] == 0, r["sass"]
        # nvdisasm names bf16 operands (F32.BF16) and leaves fp16, the default, unnamed (F32).
        assert r["sass"]["hgmma_types"] == [{"bf16": "F32.BF16", "fp16": "F32"}[dtype]], r["sass"]["hgmma_types"]


@pytest.mark.parametrize("job", JOBS, ids=_ids(JOBS))
def test_warp_specialised_structure(report, job):
    r = report[job]
    assert r["ok"], r.get("error")
    kinds = {kind for kind, _ in r["setmaxnreg"]}
    assert kinds == {"inc", "dec"}, r["setmaxnreg"]
    producer = str(_config(job)["PRODUCER_REGS"])
    assert ("dec", producer) in [tuple(x) for x in r["setmaxnreg"]], r["setmaxnreg"]
    assert r["reqntid"] == ["384"], r["reqntid"]  # 3 partitions: 4 + 4 + 1 warps in 3 warpgroups
    # Q (two boxes), K and V: 4-D TMA boxes read from the caller's tensors, no staging copy.
    assert r["tma_loads"] >= 4 and r["mbarrier_waits"] >= 4, (r["tma_loads"], r["mbarrier_waits"])


@pytest.mark.parametrize("job", JOBS, ids=_ids(JOBS))
def test_main_loop_has_no_spills(report, job):
    compile_report.main_loop_of(report[job])
