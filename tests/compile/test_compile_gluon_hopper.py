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
- no local memory (spills) and shared memory within sm_90's 227 KB;
- the shipped loop in the SASS of the main loop (tests/compile/compile_report.py): no spills
  anywhere; two key tiles a trip with few register copies at the back edge (a one-tile loop
  copies tile j+1's 64 score registers back at every back edge); P handed to P.V without
  selects and with only the row max and row sum's shuffles (P's columns relabelled into
  wgmma's operand order, V's keys stored to match, by a quantiser that keeps its vector
  stores); a tile's P.V k-steps back to back; no named barriers beyond Triton's own.
Under TRITON_INTERPRET=1 (tests/conftest.py) kernels cannot be compiled, so one subprocess
per Triton (the installed one and, where tests/versions/version_matrix.py installed it, 3.6,
the H200 test machine's) with the variable unset compiles every case and reports JSON.
Skips, with the reason, where that Triton's Gluon lacks what the kernel uses (Triton < 3.6).
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

# (config name, head dim): the shipped config at d128 and d64 (SD3-like).
JOBS = [("sm90_lean", 128), ("sm90_lean", 64)]
TRITONS = ["installed", "3.6"]

WORKER = r"""
import importlib, importlib.util, json, os, re, sys
from collections import Counter

root, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, os.path.join(root, "tests", "compile"))
import compile_report
name = "triton_accel_compile_gluon"
spec = importlib.util.spec_from_file_location(name, os.path.join(root, "__init__.py"),
                                              submodule_search_locations=[root])
mod = importlib.util.module_from_spec(spec)
sys.modules[name] = mod
spec.loader.exec_module(mod)
g = importlib.import_module(name + ".kernels.attention.gluon_hopper")
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
            listing = compile_report.disassemble(k.asm["cubin"], triton)
            block_d = max(32, 1 << (d - 1).bit_length())
            per_tile = block_d // 32 + 1 + cfg["BLOCK_N"] // 32
            out.append(dict(
                loop=None if listing is None else compile_report.main_loop(listing, per_tile),
                pv_gaps=None if listing is None else compile_report.register_a_mma_gaps(listing, per_tile),
                sass_spills=None if listing is None else compile_report.spills(listing),
                ok=True, kernel=kname, cubin=len(k.asm.get("cubin", b"")), shared=k.metadata.shared,
                mma=dict(Counter(re.findall(r"\b(wgmma\.mma_async[\w.]*)", ptx))),
                other_mma=len(re.findall(r"\bmma\.sync", ptx)),
                setmaxnreg=re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx),
                reqntid=re.findall(r"\.reqntid\s+(\d+)", ptx),
                tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global\.mbarrier", ptx)),
                named_barriers=[list(b) for b in re.findall(r"\bbar\.(sync|arrive)\s+(\d+),\s*(\d+);", ptx)],
                mbarrier_waits=len(re.findall(r"mbarrier\.try_wait", ptx)),
                nctaid="%nctaid.x" in ptx,
                local="ld.local" in ptx or "st.local" in ptx))
        except Exception as e:
            out.append(dict(ok=False, kernel=kname, error=f"{type(e).__name__}: {e}"[-800:]))
    if out[-1].get("ok"):
        # The quantiser that stores V's keys in the relabelled order, for the same target.
        from triton.compiler import ASTSource
        q = importlib.import_module(name + ".kernels.attention.fp8_quant")
        spec = [s for s in q.compile_specs("bf16", d, g.BLOCK_M, cfg["BLOCK_N"], v_key_perm=True)
                if s[0] == "_fp8_quant_kernel"][0]
        try:
            qk = triton.compile(ASTSource(*spec[1:5]), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=spec[5]))
            out[-1]["v_key_perm_quant"] = dict(ok=True, cubin=len(qk.asm.get("cubin", b"")),
                                               local="ld.local" in qk.asm["ptx"] or "st.local" in qk.asm["ptx"],
                                               byte_stores=len(re.findall(r"st\.global\.b8", qk.asm["ptx"])),
                                               v4_stores=len(re.findall(r"st\.global\.v4", qk.asm["ptx"])))
        except Exception as e:
            out[-1]["v_key_perm_quant"] = dict(ok=False, error=f"{type(e).__name__}: {e}"[-800:])
print("RESULT " + json.dumps(dict(refusal=None, triton=triton.__version__, results=out)))
"""


_REPORTS: dict = {}


@pytest.fixture(params=TRITONS, ids=[f"triton-{t}" for t in TRITONS])
def report(request):
    return compile_report.cached_report(request.param, WORKER, JOBS, ROOT, _REPORTS)


def _ids(jobs):
    return [f"{c}-d{d}" for c, d in jobs]


def _expected_wgmma(cfg_name, head_dim):
    from triton_accel.kernels.attention.fp8_quant import padded_head_dim
    from triton_accel.kernels.attention.gluon_hopper import GLUON_CONFIGS

    cfg = GLUON_CONFIGS[cfg_name]
    qk = padded_head_dim(head_dim) // 32 + 1  # + the outlier side dot's one k-step
    pv = cfg["BLOCK_N"] // 32
    # Per consumer: the prologue's Q.K^T, two steps a trip, then the odd-count branch (one
    # step + the last tile's P.V) and the even one (the last tile's P.V).
    return 2 * (qk + 2 * (qk + pv) + (qk + pv) + pv + pv)


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
    from triton_accel.kernels.attention.gluon_hopper import GLUON_CONFIGS

    r = report[job]
    assert r["ok"], r.get("error")
    kinds = {kind for kind, _ in r["setmaxnreg"]}
    assert kinds == {"inc", "dec"}, r["setmaxnreg"]
    producer = str(GLUON_CONFIGS[job[0]]["PRODUCER_REGS"])
    assert ("dec", producer) in [tuple(x) for x in r["setmaxnreg"]], r["setmaxnreg"]
    assert r["reqntid"] == ["384"], r["reqntid"]  # 3 partitions: 4 + 4 + 1 warps in 3 warpgroups
    assert r["tma_loads"] >= 3 and r["mbarrier_waits"] >= 4, (r["tma_loads"], r["mbarrier_waits"])
    # Triton's own partitions use named barriers 0-2 (bar.sync n, 128); the kernel adds none.
    assert all(int(b[1]) <= 2 for b in r["named_barriers"]), r["named_barriers"]
    assert not r["nctaid"], "one CTA a tile: no grid-stride loop"


@pytest.mark.parametrize("job", JOBS, ids=_ids(JOBS))
def test_main_loop_sass(report, job):
    """The shipped loop's shape, counted per key tile in the main loop's SASS."""
    r = report[job]
    quant = r["v_key_perm_quant"]  # compiled before the SASS is read: no cuobjdump needed
    assert quant["ok"] and quant["cubin"] > 0 and not quant["local"], quant
    # VT8's permuted keys must not cost the store its vectors (with the permutation on the
    # store addresses it fell apart into 64 single-byte stores a tile).
    assert quant["byte_stores"] == 0 and quant["v4_stores"] >= 8, quant
    loop = compile_report.main_loop_of(r)
    assert r["sass_spills"] == 0, f"{r['sass_spills']} STL/LDL in the shipped kernel's SASS"
    # Two key tiles a trip: the score tiles swap roles instead of 64 register copies a tile.
    assert loop["tiles"] == 2, loop
    assert loop["copies"] <= 16, loop["copies"]
    # P's columns are relabelled into the A operand's order: no selects, and only the row max
    # and row sum's shuffles (8 a tile; P's layout change cost 24 more and 16 selects).
    assert loop["per_tile"].get("SEL", 0) == 0, loop["per_tile"]
    assert loop["per_tile"]["SHFL"] <= 8, loop["per_tile"]["SHFL"]


@pytest.mark.parametrize("job", JOBS, ids=_ids(JOBS))
def test_pv_k_steps_back_to_back(report, job):
    """A key tile's P.V k-steps (QGMMA with P in registers) follow each other with no
    exponential between them: P.V is issued once P is whole."""
    from triton_accel.kernels.attention.gluon_hopper import GLUON_CONFIGS

    r = report[job]
    compile_report.main_loop_of(r)  # skips without cuobjdump; no spills in the loop
    k_steps = GLUON_CONFIGS[job[0]]["BLOCK_N"] // 32
    gaps = r["pv_gaps"]
    assert gaps and (len(gaps) + 1) % k_steps == 0, gaps
    for t in range((len(gaps) + 1) // k_steps):
        within = gaps[t * k_steps:(t + 1) * k_steps - 1]
        assert sum(1 for g in within if g > 0) == 0, (t, gaps)
