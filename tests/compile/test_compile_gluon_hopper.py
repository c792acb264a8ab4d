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
- the loop options (timed on an H100 in session 30, benchmarks/RESULTS.md; opt-in), in the SASS of the main loop
  (tests/compile/compile_report.py): no spills in any config's loop (none anywhere in the shipped
  default's SASS); UNROLL=2 at most a quarter of the one-tile loop's register copies a tile
  (that loop copies tile j+1's 64 score registers back at every back edge: 70-82 a tile with
  Triton 3.6 / 3.9, 1-4.5 unrolled); PERM_P no selects and a third of the shuffles (only the
  row max and row sum's: 8 a tile, against 24 + 16 selects for P's layout change); ROWSUM_MMA
  at most 8 FADDs a tile (70 in the shipped loop) and fewer instructions than lean; POLY_EXP
  (1 or 2 of every 8 of P's exponentials on the FMA pipe): that many fewer MUFU.EX2 a tile than
  lean's, the polynomial's instructions in their place (no conversion instruction: FRND / F2I
  run at the MUFU's rate), and no spills; MERGED_EMPTY one mbarrier arrive and one warpgroup
  bar.sync fewer a tile than lean (each arrive of a 4-warp partition comes with a bar.sync);
  PV_BEHIND one key tile a trip with both products in it and no more byte permutes than lean (an
  e4m3 P carried across the back edge costs ~100 a tile), PINGPONG the turn barriers 10 and 11
  (as many waits as arrives on each, none anywhere else) and two barrier instructions more a tile;
  PERSISTENT (a CTA per SM walking the tiles, grid-stride: the PTX reads %nctaid.x, no other
  config does) lean's inner loop, instruction for instruction within 1 % (d128), no spills in it, and a
  second Q buffer in shared memory.
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

# (config name, head dim): the shipped config at d128 and d64 (SD3-like), the two-level one,
# each loop option alone and all three (sm90_lean) at d128 and d64.
JOBS = [("sm90", 128), ("sm90", 64), ("sm90_two_level", 128), ("sm90_unroll", 128), ("sm90_early", 128),
        ("sm90_permp", 128), ("sm90_lean", 128), ("sm90_lean", 64), ("sm90_lean_rowsum", 128),
        ("sm90_lean_poly12", 128), ("sm90_lean_poly25", 128), ("sm90_lean_merged", 128), ("sm90_pv_behind", 128),
        ("sm90_pingpong", 128), ("sm90_pingpong", 64), ("sm90_lean_persistent", 128), ("sm90_lean_persistent", 64),
        ("sm90_lean_pvsplit2", 128), ("sm90_lean_pvsplit4", 128), ("sm90_lean_pvsplit4", 64)]
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
            rowsum = g.loop_options(cfg)["ROWSUM_MMA"]  # P.ones: one more wgmma per P.V k-step
            per_tile = block_d // 32 + 1 + cfg["BLOCK_N"] // 32 * (2 if rowsum else 1)
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
    if g.loop_options(cfg)["PERM_P"] and out[-1].get("ok"):
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
    from triton_accel.kernels.attention.gluon_hopper import GLUON_CONFIGS, loop_options

    cfg = GLUON_CONFIGS[cfg_name]
    qk = padded_head_dim(head_dim) // 32 + 1  # + the outlier side dot's one k-step
    pv = cfg["BLOCK_N"] // 32 * (2 if loop_options(cfg)["ROWSUM_MMA"] else 1)  # + P.ones per k-step
    if loop_options(cfg)["PV_BEHIND"]:
        # Tile 0's Q.K^T, the loop's step and the last tile's (a tile's Q.K^T with the previous
        # tile's P.V), then the last tile's P.V.
        return 2 * (3 * qk + 3 * pv)
    if loop_options(cfg)["UNROLL"] == 2:
        # Prologue Q.K^T, two steps a trip, then the odd-count branch (one step + the last
        # tile's P.V) and the even one (the last tile's P.V).
        return 2 * (qk + 2 * (qk + pv) + (qk + pv) + pv + pv)
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
    from triton_accel.kernels.attention.gluon_hopper import GLUON_CONFIGS

    r = report[job]
    assert r["ok"], r.get("error")
    kinds = {kind for kind, _ in r["setmaxnreg"]}
    assert kinds == {"inc", "dec"}, r["setmaxnreg"]
    producer = str(GLUON_CONFIGS[job[0]]["PRODUCER_REGS"])
    assert ("dec", producer) in [tuple(x) for x in r["setmaxnreg"]], r["setmaxnreg"]
    assert r["reqntid"] == ["384"], r["reqntid"]  # 3 partitions: 4 + 4 + 1 warps in 3 warpgroups
    assert r["tma_loads"] >= 3 and r["mbarrier_waits"] >= 4, (r["tma_loads"], r["mbarrier_waits"])


@pytest.mark.parametrize("job", JOBS, ids=_ids(JOBS))
def test_main_loop_sass(report, job):
    """What each loop option removes, counted per key tile in the main loop's SASS."""
    from triton_accel.kernels.attention.gluon_hopper import GLUON_CONFIGS, loop_options

    r = report[job]
    loop = compile_report.main_loop_of(r)
    if job[0] == "sm90":
        assert r["sass_spills"] == 0, f"{r['sass_spills']} STL/LDL in the shipped default's SASS"
    opts = loop_options(GLUON_CONFIGS[job[0]])
    base = report[("sm90", job[1])]["loop"]  # the one-tile, shuffling loop, same Triton and head dim
    if opts["UNROLL"] == 2:
        # POLY_EXP adds instructions by design (MUFU work traded for FMA-pipe work): judged
        # against lean below.
        compile_report.assert_unrolled(loop, base, fewer_instructions=not opts["POLY_EXP"])
    if opts["PERM_P"]:
        quant = r["v_key_perm_quant"]  # compiled before the SASS is read: no cuobjdump needed
        assert quant["ok"] and quant["cubin"] > 0 and not quant["local"], quant
        # VT8's permuted keys must not cost the store its vectors: with the permutation on the
        # store addresses it fell apart into 64 single-byte stores a tile (session 30, H100:
        # the quantisation's share of Wan's attention time went from 3 % to 16 %).
        assert quant["byte_stores"] == 0 and quant["v4_stores"] >= 8, quant
        assert loop["per_tile"].get("SEL", 0) == 0, loop["per_tile"]
        assert loop["per_tile"]["SHFL"] <= base["per_tile"]["SHFL"] / 3, (loop["per_tile"]["SHFL"],
                                                                          base["per_tile"]["SHFL"])
        assert loop["total"] < base["total"], (loop["total"], base["total"])
    if opts["POLY_EXP"]:
        # P's 64 exponentials a thread and tile: 8 * POLY_EXP leave the MUFU pipe (lean keeps
        # 66: P's 64 and the rows' rescale), each for 2 FFMA + 3 FADD + FMNMX + LEA; no
        # conversion instruction (FRND / F2I run at the MUFU's rate).
        lean = report[("sm90_lean", job[1])]["loop"]
        moved = 8 * opts["POLY_EXP"]
        pt, lpt = loop["per_tile"], lean["per_tile"]
        assert pt["MUFU"] == lpt["MUFU"] - moved, (pt["MUFU"], lpt["MUFU"])
        assert pt["FFMA"] >= lpt["FFMA"] + 2 * moved and pt["FADD"] >= lpt["FADD"] + 3 * moved, pt
        assert not any(pt.get(op) for op in ("FRND", "F2I", "I2F")), pt
        assert loop["total"] <= lean["total"] + 6.5 * moved, (loop["total"], lean["total"])
    if opts["MERGED_EMPTY"]:
        lean = report[("sm90_lean", job[1])]["loop"]["per_tile"]
        pt = loop["per_tile"]
        assert pt["SYNCS"] == lean["SYNCS"] - 1, (pt["SYNCS"], lean["SYNCS"])  # arrives + waits on mbarriers
        assert pt["BAR"] <= lean["BAR"] - 0.5, (pt["BAR"], lean["BAR"])
    if opts["ROWSUM_MMA"]:
        # The row sum left the FADD pipe (70 a tile in the shipped loop: 64 adds + reductions).
        assert loop["per_tile"].get("FADD", 0) <= 8, loop["per_tile"]
        assert loop["total"] < report[("sm90_lean", job[1])]["loop"]["total"], loop["total"]


@pytest.mark.parametrize("job", JOBS, ids=_ids(JOBS))
def test_turn_barriers_only_in_pingpong(report, job):
    """PINGPONG's named barriers: warpgroup 0 waits on 10 and arrives on 11, warpgroup 1 the
    other way round, 256 threads each. The kernel balances them (warpgroup 1's first arrive,
    warpgroup 0's last wait); in the PTX every wait site has an arrive site on the same barrier
    (4 on 10: tile 0, the loop, the last tile and the end; 3 on 11). Triton's own partitions
    use barriers 0-2 (bar.sync n, 128): no other config may touch 10 or 11."""
    from triton_accel.kernels.attention.gluon_hopper import GLUON_CONFIGS, loop_options

    r = report[job]
    assert r["ok"], r.get("error")
    turns = [tuple(b) for b in r["named_barriers"] if b[1] in ("10", "11")]
    if not loop_options(GLUON_CONFIGS[job[0]])["PINGPONG"]:
        assert turns == [], turns
        return
    from collections import Counter

    counts = Counter(turns)
    assert set(counts) == {("sync", "10", "256"), ("arrive", "10", "256"), ("sync", "11", "256"),
                           ("arrive", "11", "256")}, counts
    assert counts[("sync", "10", "256")] == counts[("arrive", "10", "256")] == 4, counts
    assert counts[("sync", "11", "256")] == counts[("arrive", "11", "256")] == 3, counts
    assert all(int(b[1]) <= 2 for b in r["named_barriers"] if b[1] not in ("10", "11")), r["named_barriers"]


@pytest.mark.parametrize("job", [j for j in JOBS if "pv_behind" in j[0] or "pingpong" in j[0]],
                         ids=_ids([j for j in JOBS if "pv_behind" in j[0] or "pingpong" in j[0]]))
def test_pv_behind_loop_sass(report, job):
    """FlashAttention-3's order in the SASS: one key tile a trip holding its Q.K^T and the
    previous tile's P.V (9 wgmmas at d128, 5 + 4), P carried across the back edge in fp32 (as
    e4m3 bytes it cost ~100 byte permutes a tile: no more PRMT than lean's 16), at most 12 % more
    instructions a tile than lean, ping-pong two barrier instructions more a tile than the same
    loop without it."""
    from triton_accel.kernels.attention.gluon_hopper import GLUON_CONFIGS, loop_options

    r = report[job]
    loop = compile_report.main_loop_of(r)
    pt = loop["per_tile"]
    lean = report[("sm90_lean", job[1])]["loop"]
    assert loop["tiles"] == 1, loop
    block_d = max(32, 1 << (job[1] - 1).bit_length())
    assert pt["QGMMA"] == block_d // 32 + 1 + GLUON_CONFIGS[job[0]]["BLOCK_N"] // 32, pt
    assert pt.get("PRMT", 0) <= lean["per_tile"].get("PRMT", 0), (pt.get("PRMT"), lean["per_tile"].get("PRMT"))
    # The loop-carried P's cast and the peeled tile's bookkeeping: 6-11 % over lean's loop.
    assert loop["total"] <= 1.12 * lean["total"], (loop["total"], lean["total"])
    if loop_options(GLUON_CONFIGS[job[0]])["PINGPONG"] and job[1] == 128:
        plain = report[("sm90_pv_behind", 128)]["loop"]["per_tile"]
        assert pt["BAR"] == plain["BAR"] + 2, (pt["BAR"], plain["BAR"])


@pytest.mark.parametrize("job", JOBS, ids=_ids(JOBS))
def test_persistent_keeps_leans_inner_loop(report, job):
    """The persistent CTA's ring positions are runtime sums (tile i's key tiles start at
    i * NKB): as signed remainders they cost ~20 uniform instructions a tile (4.5 %, seen in
    the SASS); _ring_slot / _ring_phase mask and shift instead. The inner loop must then be
    lean's: the same products, no spill in it, within 1 % of its instructions. Values kept
    across the inner loop may spill outside it (Triton 3.6: ~100 STL/LDL, once a tile)."""
    from triton_accel.kernels.attention.gluon_hopper import GLUON_CONFIGS, loop_options

    r = report[job]
    assert r["ok"], r.get("error")
    persistent = loop_options(GLUON_CONFIGS[job[0]])["PERSISTENT"]
    assert r["nctaid"] == persistent, "a grid-stride tile loop in a config that is not persistent, or none in one that is"
    if not persistent:
        return
    lean_r = report[("sm90_lean", job[1])]
    loop, lean = compile_report.main_loop_of(r), lean_r["loop"]
    assert loop["tiles"] == lean["tiles"] == 2, (loop, lean)
    pt = loop["per_tile"]
    assert pt["QGMMA"] == lean["per_tile"]["QGMMA"] and pt["MUFU"] == lean["per_tile"]["MUFU"], pt
    assert not pt.get("STL") and not pt.get("LDL"), pt
    # d128: 442.5 / 435.5 against lean's 442.5 / 439.5 (Triton 3.9 / 3.6); d64: 404 / 402.5 against
    # 397.5 / 394 (the ring position's bit operations and a few uniform moves).
    tolerance = 0.01 if job[1] == 128 else 0.025
    assert abs(loop["total"] - lean["total"]) <= tolerance * lean["total"], (loop["total"], lean["total"])
    block_d = max(32, 1 << (job[1] - 1).bit_length())
    second_q = 2 * 64 * (block_d + 32)  # both warpgroups' Q and outlier-side tiles, e4m3
    assert lean_r["shared"] + second_q <= r["shared"] <= lean_r["shared"] + second_q + 128, (r["shared"],
                                                                                             lean_r["shared"])


@pytest.mark.parametrize("job", JOBS, ids=_ids(JOBS))
def test_pv_split_interleaves_exponentials(report, job):
    """PV_SPLIT's point, in the SASS: between the P.V slices of a key tile the next slice's
    exponentials (MUFU.EX2) run; lean's P.V k-steps follow each other with none between."""
    from triton_accel.kernels.attention.gluon_hopper import GLUON_CONFIGS, loop_options

    r = report[job]
    compile_report.main_loop_of(r)  # skips without cuobjdump; no spills in the loop
    cfg = GLUON_CONFIGS[job[0]]
    split = loop_options(cfg)["PV_SPLIT"]
    if loop_options(cfg)["PV_BEHIND"] or cfg["TWO_LEVEL"] or loop_options(cfg)["ROWSUM_MMA"]:
        pytest.skip("P.V issued differently (no slices to look for)")
    k_steps = cfg["BLOCK_N"] // 32  # P.V k-steps a tile: QGMMA instructions with P in registers
    gaps = r["pv_gaps"]
    assert gaps and (len(gaps) + 1) % k_steps == 0, gaps
    for t in range((len(gaps) + 1) // k_steps):
        within = gaps[t * k_steps:(t + 1) * k_steps - 1]
        split_points = sum(1 for g in within if g > 0)
        if split == 1:
            assert split_points == 0, (t, gaps)
        else:
            assert split_points >= split - 1, (t, gaps)
