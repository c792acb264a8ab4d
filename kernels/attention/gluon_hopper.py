"""Full-FP8 attention forward for Hopper (sm_90) written in Gluon, warp-specialised.

Same numerics and inputs as attention_fp8_full (quantize_qkv's Q8/K8/VT8 with per-block
scales, K and V smoothing, the outlier side operands, the 448 shift inside exp2, V's
per-channel scale and mean in the epilogue); what changes is who does what inside a CTA:
- one producer warp issues TMA loads of the key tiles (K8 + its side columns) and of the
  transposed value tiles (VT8) into STAGES-deep rings, each slot guarded by a "full"
  mbarrier (TMA bytes landed) and an "empty" one (both consumers done with it: count 2);
- two consumer warpgroups own 64 query rows each (BLOCK_M = 128 per CTA, sharing every
  K/V tile and the query block scale) and run the online softmax on async wgmma. The
  scheduler interleaves them, so one warpgroup's exp2 runs while the other's MMAs do;
  inside each, the Q.K^T of tile j+1 is issued before the softmax of tile j (it runs on
  the tensor cores meanwhile), as in FlashAttention-3.
- P.V: P is cast to e4m3 in registers and fed as wgmma's register A operand, VT8's tile
  (keys contiguous) as its K-major B operand. TWO_LEVEL puts each tile's P.V in a fresh
  accumulator added in fp32 (FP8 wgmma keeps a ~22-bit accumulator, see attention_fp8_full);
  with the next tile's scores also live that is 64 more fp32 registers per thread, so it
  needs BLOCK_N = 64 and runs 25% slower. Its error equals one-level accumulation's at every
  measured shape (up to 33k keys), so the default chains P.V into one accumulator at
  BLOCK_N = 128 (GLUON_CONFIGS says what was measured).
Serves what attention_fp8_full serves (fp16/bf16, head dims 1..128, any lengths, no mask,
no causal, no GQA); the launcher raises GluonUnsupportedError otherwise.
The Gluon API moves between Triton minors (warp_specialize's signature changed in 3.6);
gluon_refusal() checks the installed Triton for every name used here, so older or newer
ones are refused with a reason and attention_fp8_full stays the fallback.
"""
from __future__ import annotations

import inspect
import logging
import math
import struct
from functools import lru_cache

import torch

from ..core import cache_registry, env_settings
from ..core import device as _device
from .fp8_quant import N_OUTLIER, padded_head_dim, quantize_qkv
from ..core.kernel_common import LAUNCH_OPTIONS, sm_count
from ..core.gpu_rules import GLUON_CAPABILITY, feature_refusal, gluon_release_refusal

log = logging.getLogger("triton_accel.kernels.attention.gluon_hopper")  # not __name__: the clone's folder name

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # TMA global -> shared copy: `async_copy_global_to_shared` up to 3.8, `async_load` from
    # 3.8 on (3.9 removed the old name).
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _IMPORT_ERROR = None
except Exception as e:  # no Triton, or a Triton whose Gluon lacks these names: refused with this
    triton = gluon = gl = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

ROWS_PER_WARPGROUP = 64  # one wgmma M-extent per warpgroup; two warpgroups per CTA
BLOCK_M = 2 * ROWS_PER_WARPGROUP
MAX_HEAD_DIM = 128
# log2(448) rounded down, as in attention_fp8_full: exp2(S - m + LOG2_P_SCALE) <= 448.
LOG2_P_SCALE = 8.8073

# BLOCK_N (also quantize_qkv's key block), ring depth, TWO_LEVEL, registers per thread of
# the second consumer warpgroup and of the producer warp (setmaxnreg; the default partition,
# consumer 0, gets what is left of the 64K: 256). Measured on the H200 (Triton 3.6,
# 2026-12-02, benchmarks/RESULTS.md), kernel alone, TFLOP/s:
# "sm90" Wan 778-795, HunyuanVideo 773-797, Flux 696-699; STAGES=3 the same within noise
# (801 / 777 / 710); "sm90_two_level" 606-611 / 592-608 / 535 with rel. L2 within 1e-4 of
# one-level on every input (Wan outlier 0.0062 vs 0.0063), so one-level is the default.
# The loop-shape options (UNROLL, EARLY_RESCALE, PERM_P, ROWSUM_MMA; _mainloop, _softmax_tile
# and _pv_update say what each removes from a tile, counted in the SASS: 64 register copies,
# 64 multiplies before P.V, 24 shuffles + 16 selects of P's layout change, 64 row-sum adds)
# are compile-checked here (tests/compile/test_compile_gluon_hopper.py). On an H100 (2026-12-05,
# benchmarks/RESULTS.md) "sm90_lean"'s kernel ran 832 / 747 TFLOP/s at Wan / Flux against
# "sm90"'s 795 / 700, but its quantiser then stored V's permuted keys byte by byte (16 % of the
# Wan call). With that fixed (H100, 2026-12-05): kernel 824 / 748 against 800 / 686, and the
# Wan 2.1 14B step 1975 ms against 2049 (two fresh processes each, the same accuracy), so
# "sm90_lean" is the default (default_config). "sm90_lean_rowsum" fails the Gaussian accuracy
# bar (cosine 0.974 at Wan: e4m3 row sums are too coarse).
_LOOP_DEFAULTS = dict(UNROLL=1, EARLY_RESCALE=False, PERM_P=False, ROWSUM_MMA=False, POLY_EXP=0, MERGED_EMPTY=False,
                      PV_BEHIND=False, PINGPONG=False, PERSISTENT=False, PV_SPLIT=1)
# The lean loop (the default): two key tiles a trip, P in wgmma's operand order, the
# output rescaled early; the variants below are lean plus one option each.
_LEAN = dict(BLOCK_N=128, STAGES=2, TWO_LEVEL=False, CONSUMER_REGS=232, PRODUCER_REGS=24,
             **dict(_LOOP_DEFAULTS, UNROLL=2, EARLY_RESCALE=True, PERM_P=True))
GLUON_CONFIGS = {
    "sm90": dict(BLOCK_N=128, STAGES=2, TWO_LEVEL=False, CONSUMER_REGS=232, PRODUCER_REGS=24, **_LOOP_DEFAULTS),
    "sm90_two_level": dict(BLOCK_N=64, STAGES=3, TWO_LEVEL=True, CONSUMER_REGS=232, PRODUCER_REGS=24,
                           **_LOOP_DEFAULTS),
    "sm90_unroll": dict(BLOCK_N=128, STAGES=2, TWO_LEVEL=False, CONSUMER_REGS=232, PRODUCER_REGS=24,
                        **dict(_LOOP_DEFAULTS, UNROLL=2)),
    "sm90_early": dict(BLOCK_N=128, STAGES=2, TWO_LEVEL=False, CONSUMER_REGS=232, PRODUCER_REGS=24,
                       **dict(_LOOP_DEFAULTS, EARLY_RESCALE=True)),
    "sm90_permp": dict(BLOCK_N=128, STAGES=2, TWO_LEVEL=False, CONSUMER_REGS=232, PRODUCER_REGS=24,
                       **dict(_LOOP_DEFAULTS, PERM_P=True)),
    "sm90_lean": dict(_LEAN),
    # lean + the row sums of P on the tensor cores (_pv_update's ROWSUM_MMA): 64 FADDs and 4
    # shuffles a tile become 4 wgmmas of N = 8; l then sums the e4m3 P that P.V multiplies.
    # 240 registers: at 232 ptxas (Triton 3.6) reloads a spilled value in the loop.
    "sm90_lean_rowsum": dict(_LEAN, CONSUMER_REGS=240, ROWSUM_MMA=True),
    # lean with 1 (2) of every 8 exponentials of P on the FMA pipe (_exp2_p, POLY_EXP): at
    # FP8 a 128 x 128 tile pair costs the tensor cores and the MUFU pipe about 1024 cycles
    # each, and the measured ~2400 says they barely overlap; these move an eighth (a quarter)
    # of the MUFU work to 7 full-rate instructions per element (FMNMX, 3 FADD, 2 FFMA, LEA in
    # the SASS): 8 (16) MUFU.EX2 fewer and 56 (112) more FMA-pipe instructions per thread and
    # tile, against lean's ~440. Measured slower (H100, kernel alone): Wan 824 / 779
    # TFLOP/s against lean's 871, Flux 710 / 719 against 746, the same accuracy: the loop is not
    # bound by the MUFU pipe. Kept opt-in for comparisons (TRITON_ACCEL_GLUON_VARIANT).
    "sm90_lean_poly12": dict(_LEAN, POLY_EXP=1),
    "sm90_lean_poly25": dict(_LEAN, POLY_EXP=2),
    # lean with one "slot free" signal per key tile instead of two (MERGED_EMPTY): each
    # mbarrier arrive of a 4-warp partition costs a warpgroup bar.sync (three per tile in
    # lean's SASS, after the wait on P.V). V[j]'s release also frees K[j]'s slot, so the
    # producer refills both on it; K then lands one tile later than with its own signal,
    # which a third ring stage gives back (3 x 36 KB of shared memory). Opt-in until timed.
    "sm90_lean_merged": dict(_LEAN, STAGES=3, MERGED_EMPTY=True),
    # FlashAttention-3's order (_mainloop_pv_behind): a trip issues Q.K^T of tile j and P.V of
    # tile j-1 together, then runs tile j's softmax under that P.V. One score tile is live
    # instead of lean's two, and no wgmma crosses the back edge. PINGPONG adds FA3's turn
    # barriers: the two warpgroups issue their MMAs in alternation, so one's softmax can run
    # under the other's MMAs instead of both softmaxes contending for the MUFU pipe at once
    # and both MMA groups for the tensor cores after. Measured slower on an H100 (2026-12-06,
    # kernel alone, TFLOP/s): Wan 811 / 767 against lean's 864, Flux 705 / 729 against 752, the
    # same accuracy. In the SASS (ptxas of Triton 3.6 and 3.9) the wait for P.V(j-1) lands
    # before tile j's exponentials whatever the source order (a softmax that no longer runs
    # under its own P.V), and under ping-pong one warp per scheduler runs a softmax alone,
    # its latencies no longer hidden by the other warpgroup's. Opt-in for comparisons.
    "sm90_pv_behind": dict(_LEAN, UNROLL=1, EARLY_RESCALE=False, PV_BEHIND=True),
    "sm90_pingpong": dict(_LEAN, UNROLL=1, EARLY_RESCALE=False, PV_BEHIND=True, PINGPONG=True),
    # lean as a persistent kernel (PERSISTENT): one CTA per SM walks the (query block, head)
    # tiles in the launch grid's order, the ring's slots and phases running on across tiles,
    # and Q double-buffered, so the producer loads the next tile's Q and first key tiles
    # while the consumers finish a tile and write its output. Built to remove a CTA tile's
    # fill and drain, which Flux's speed against Wan's seemed to show (36 key tiles a CTA tile
    # against 256). Bit-equal to lean everywhere; measured no faster (H100, 2026-12-06, kernel
    # alone, TFLOP/s): Flux 746-750 against 746-747, Wan 822-849 against 864-869, HunyuanVideo
    # 801 against 857. Flux's deficit is its last wave instead (gluon_waves_bench.py: 6.55
    # waves at 746, the same 36 key tiles a CTA tile in 9.00 whole waves at 800). Opt-in.
    "sm90_lean_persistent": dict(_LEAN, PERSISTENT=True),
    # lean with each tile's P.V issued in PV_SPLIT column slices of P (_softmax_pv_split): the
    # first slice's P.V goes to the tensor cores as soon as its exponentials are done and runs
    # under the next slice's, so a warpgroup waits at the end of a tile for the last slice's
    # P.V only (BLOCK_N / PV_SPLIT keys) instead of the whole tile's. In lean the two
    # warpgroups' softmaxes tend to run at the same time (sharing the MUFU pipe, the tensor
    # cores doing only the next Q.K^T meanwhile) and both P.Vs after them with the MUFU pipe
    # idle; a slice's P.V moves tensor-core work into the softmax phase. The slices are a
    # register bit of the accumulator layout (no data moves) and VT8's tile read as column
    # slices of the same shared-memory slot; the SASS shows the slices' wgmmas between the
    # exponentials. Measured slower (H200, 2026-12-06, kernel alone, TFLOP/s): pvsplit4 Flux
    # 727, Wan 817, HunyuanVideo 783 against lean's 725-739 / 831-845 / 826-841; pvsplit2
    # 706 / 773 / 783; the same accuracy. The extra wgmma issues and their warpgroup fences
    # cost more than the overlap gains. Opt-in for comparisons. Two slices keep a wider e4m3
    # slice live: 240 registers (ptxas spills in the loop at 232).
    "sm90_lean_pvsplit2": dict(_LEAN, PV_SPLIT=2, CONSUMER_REGS=240),
    "sm90_lean_pvsplit4": dict(_LEAN, PV_SPLIT=4),
}

# POLY_EXP's exponential, 2^x for x <= LOG2_P_SCALE: x clamped at -126 (2^-126, the smallest
# normal; the masked -inf keys land there and P's e4m3 cast makes them 0), rounded to the
# nearest integer j by the 1.5 * 2^23 addition (j sits in t's low mantissa bits, f = x - j in
# [-0.5, 0.5] is exact), 2^f by a degree-2 polynomial with p(0) = 1 fitted for relative error
# (max 1.96e-3 in float32: P is then cast to e4m3, whose rounding is up to 3.1 %), and 2^j
# added into the exponent field: bits(t) << 23 keeps j's low 9 bits, enough for j in
# [-126, 9]. POLY_COEFFS is the torch twin's source (exp2_poly) and the asm's hex constants.
POLY_COEFFS = (0.70294189453125, 0.2398640364408493)  # c1, c2 (float32-exact): 2^f ~ 1 + f (c1 + f c2)
POLY_CLAMP = -126.0


def _f32_hex(v: float) -> str:
    return "0f" + struct.pack(">f", v).hex().upper()


def _poly_asm(out: str, arg: str) -> str:
    c1, c2 = (_f32_hex(c) for c in POLY_COEFFS)
    return ("{ .reg .f32 x, t, j, f, p; .reg .b32 ti, pi; "
            f"max.f32 x, {arg}, {_f32_hex(POLY_CLAMP)}; add.rn.f32 t, x, 0f4B400000; sub.rn.f32 j, t, 0f4B400000; "
            f"sub.rn.f32 f, x, j; fma.rn.f32 p, f, {c2}, {c1}; fma.rn.f32 p, p, f, 0f3F800000; "
            f"mov.b32 ti, t; mov.b32 pi, p; shl.b32 ti, ti, 23; add.s32 pi, pi, ti; mov.b32 {out}, pi; }} ")


POLY_PACK = 8  # elements per inline-asm invocation: POLY_EXP counts in eighths


def exp2_asm(poly_exp: int) -> str:
    """The inline PTX of POLY_EXP = poly_exp (1..POLY_PACK): POLY_PACK elements an invocation
    ($0.. out, $POLY_PACK.. in), the last poly_exp of them by the polynomial, the others by
    ex2.approx (MUFU)."""
    n = POLY_PACK
    return "".join(f"ex2.approx.ftz.f32 ${i}, ${i + n}; " if i < n - poly_exp else _poly_asm(f"${i}", f"${i + n}")
                   for i in range(n))


def exp2_poly(x: torch.Tensor) -> torch.Tensor:
    """The polynomial exponential of _poly_asm on float32 torch tensors, operation by operation
    (tests compare it with 2^x and the asm's constants with POLY_COEFFS). fma.rn is emulated
    in float64: the float32 product is exact there, the sum rounded twice (rarely 1 ulp off)."""
    x = torch.clamp_min(x.float(), POLY_CLAMP)
    t = x + 12582912.0
    j = t - 12582912.0
    f = x - j
    c1, c2 = POLY_COEFFS
    p = (f.double() * c2 + c1).float()
    p = (p.double() * f.double() + 1.0).float()
    bits = (p.view(torch.int32).long() + (t.view(torch.int32).long() << 23)) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def loop_options(config: dict) -> dict:
    """UNROLL / EARLY_RESCALE / PERM_P / ROWSUM_MMA of `config`, with the defaults for configs
    written before these options existed (a tuning file, a benchmark's dict)."""
    return {k: config.get(k, v) for k, v in _LOOP_DEFAULTS.items()}

# Every Gluon name this file uses, checked by gluon_refusal() before any launch.
_REQUIRED = {
    "gl": ("warp_specialize", "allocate_shared_memory", "NVMMADistributedLayout", "NVMMASharedLayout",
           "DotOperandLayout", "SliceLayout", "static_range", "convert_layout", "float8e4nv", "exp2"),
    "hopper": ("warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared", "mbarrier", "tma"),
    "mbarrier": ("MBarrierLayout", "init", "invalidate", "expect", "wait", "arrive"),
}


# PERM_P's relabelling of a [rows, n] P tile viewed as [rows, n // 32, 2, 2, 2, 2, 2]: the
# kernel's gl.permute spells it out (Triton 3.6's permute takes no constexpr tuple; a test
# reads the kernel's source against this), p_relabel() is its torch twin for tests, and
# quantize_qkv's v_key_order() is the same map on key indices.
P_RELABEL_ORDER = (0, 1, 2, 4, 5, 3, 6)


def p_relabel(p: torch.Tensor) -> torch.Tensor:
    """What PERM_P does to a [rows, n] P tile's columns (n a multiple of 32), on a torch
    tensor: column n of p lands at column v_key_order(n)."""
    rows, n = p.shape
    return p.reshape(rows, n // 32, 2, 2, 2, 2, 2).permute(P_RELABEL_ORDER).reshape(rows, n)


class GluonUnsupportedError(RuntimeError):
    """The call, the device or the installed Triton cannot run the Gluon kernel; says why."""


def gluon_api_refusal(triton_version: str | None = None) -> str | None:
    """Why the installed Triton's Gluon lacks what this kernel uses, or None."""
    version = triton_version if triton_version is not None else _device.triton_version()
    return _api_refusal_for(version)


# Remembered per version string: the check inspects warp_specialize's signature (~50 us),
# which every launch would otherwise pay (a Flux-sized call's kernel runs ~400 us).
@lru_cache(maxsize=None)
def _api_refusal_for(version: str) -> str | None:
    rule = feature_refusal("gluon", version)
    if rule is not None:
        return rule.reason
    if _IMPORT_ERROR is not None:
        return f"Triton {version}: Gluon's Hopper API does not import ({_IMPORT_ERROR})"
    from triton.experimental.gluon.language.nvidia import hopper

    return api_gaps(version, gl, hopper)


def api_gaps(version: str | None, gl_module, hopper_module) -> str | None:
    """What `gl_module` (triton.experimental.gluon.language) and `hopper_module` (its
    nvidia.hopper) lack of what the kernel calls, as a reason, or None. Separate from the
    import so tests can hand it the API of another Triton minor."""
    spaces = {"gl": gl_module, "hopper": hopper_module, "mbarrier": getattr(hopper_module, "mbarrier", None),
              "tma": getattr(hopper_module, "tma", None)}
    missing = [f"{space}.{name}" for space, names in _REQUIRED.items() for name in names
               if not hasattr(spaces[space], name)]
    tma_module = spaces["tma"]
    if not any(hasattr(tma_module, n) for n in ("async_load", "async_copy_global_to_shared")):
        missing.append("tma.async_load (or tma.async_copy_global_to_shared)")
    if missing:
        return f"Triton {version}: Gluon lacks {', '.join(missing)}"
    # 3.4 / 3.5 took (default_args, default_partition, worker_args, ...); 3.6+ one list of
    # (function, args) pairs, which is what the kernel below passes.
    params = list(inspect.signature(gl_module.warp_specialize).parameters)
    if not params or params[0] != "functions_and_args":
        return (f"Triton {version}: gl.warp_specialize takes ({', '.join(params[:3])}, ...), "
                "not the (functions_and_args, worker_num_warps, worker_num_regs) form of Triton 3.6+")
    return None


cache_registry.register("kernels.attention.gluon_hopper.api_refusal", _api_refusal_for.cache_clear)


def gluon_refusal(device, kernel: str = "fp8") -> str | None:
    """Why the Gluon `kernel` ("fp8" here, "bf16" attention_gluon_hopper_bf16's) cannot run on
    `device`, or None: only NVIDIA sm_90 (wgmma and setmaxnreg are sm_90a instructions) with a
    Triton whose Gluon has all used here, on which that kernel ran right on a GPU (_release_refusal)."""
    reason = gluon_api_refusal()
    if reason:
        return reason
    device = torch.device(device)
    if device.type != "cuda":
        return f"the Gluon Hopper kernel needs an NVIDIA sm_90 GPU (got a {device.type} device; no interpreter path)"
    info = _device.describe(device)
    if info.vendor != "nvidia":
        return f"the Gluon Hopper kernel supports NVIDIA GPUs only; {info.name} is {info.arch}"
    if info.capability != GLUON_CAPABILITY:
        major, minor = info.capability or (0, 0)
        return f"the Gluon Hopper kernel uses sm_90a's wgmma and setmaxnreg; {info.name} is sm_{major}{minor}"
    return _release_refusal(kernel)


def call_refusal(q, k, v, attn_mask=None, is_causal=False) -> str | None:
    """Why these tensors cannot be served (same contract as attention_fp8_full), or None."""
    from .fp8_full import call_refusal as fp8_full_call_refusal

    return fp8_full_call_refusal(q, k, v, attn_mask, is_causal)


if gluon is not None:
    _EXP2_ASM_1 = gl.constexpr(exp2_asm(1))
    _EXP2_ASM_2 = gl.constexpr(exp2_asm(2))
    _EXP2_ASM_CONSTRAINTS = gl.constexpr(",".join(["=f"] * POLY_PACK + ["f"] * POLY_PACK))
    _POLY_PACK = gl.constexpr(POLY_PACK)

    @gluon.jit
    def _exp2_p(x, POLY_EXP: gl.constexpr):
        # P's exponentials: all on the MUFU pipe (16 a clock per SM), or POLY_EXP of every
        # eight on the FMA pipe (exp2_asm; 7 full-rate instructions each, see POLY_COEFFS).
        if POLY_EXP == 1:
            return gl.inline_asm_elementwise(_EXP2_ASM_1, _EXP2_ASM_CONSTRAINTS, [x], dtype=gl.float32,
                                             is_pure=True, pack=_POLY_PACK)
        elif POLY_EXP == 2:
            return gl.inline_asm_elementwise(_EXP2_ASM_2, _EXP2_ASM_CONSTRAINTS, [x], dtype=gl.float32,
                                             is_pure=True, pack=_POLY_PACK)
        else:
            gl.static_assert(POLY_EXP == 0, "POLY_EXP is 0, 1 or 2 (eighths of P's exponentials)")
            return gl.exp2(x)

    @gluon.jit
    def _ring_slot(r, STAGES: gl.constexpr):
        # Ring position r >= 0 (tiles count up from 0): a power-of-two ring's slot is a mask,
        # not a signed remainder with its sign fix-ups (a persistent CTA's r is a runtime
        # sum: its remainders cost ~20 uniform instructions a tile in the SASS).
        if (STAGES & (STAGES - 1)) == 0:
            return r & (STAGES - 1)
        else:
            return r % STAGES

    @gluon.jit
    def _ring_phase(r, STAGES: gl.constexpr):
        # The parity of r's lap round the ring: the mbarrier phase its slot is on.
        if STAGES == 2:
            return (r >> 1) & 1
        elif STAGES == 4:
            return (r >> 2) & 1
        else:
            return (r // STAGES) & 1

    @gluon.jit
    def _load_tile(q_desc, qs_desc, k_desc, ks_desc, v_desc, ones_desc, q_smem, qs_smem, k_ring, ks_ring, v_ring,
                   ones_smem, q_bar, k_full, k_empty, v_full, v_empty, QB, q_row0, k_row0, v_row0, n_kb, R0,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, N_OUT: gl.constexpr, ROWSUM_MMA: gl.constexpr,
                   MERGED_EMPTY: gl.constexpr):
        # One CTA tile's loads: its Q (both warpgroups' rows, into Q buffer QB / 2), then its
        # key tiles K0, V0, K1, V1...: a consumer asks for K[j+1] before V[j], which the ring
        # allows whenever STAGES >= 2 (slot (j+1) % STAGES was freed at j+1-STAGES). Key tile
        # j is the ring's R0 + j-th (R0 > 0 only for a persistent CTA's later tiles).
        q_bytes: gl.constexpr = q_desc.block_type.nbytes + qs_desc.block_type.nbytes * (N_OUT > 0)
        mbarrier.expect(q_bar, 2 * q_bytes + ones_desc.block_type.nbytes * ROWSUM_MMA)
        if ROWSUM_MMA:  # the ones tile of the row-sum product, once, with Q
            _tma_load(ones_desc, [0, 0], q_bar, ones_smem)
        for wg in gl.static_range(2):
            _tma_load(q_desc, [q_row0 + wg * 64, 0], q_bar, q_smem.index(QB + wg))
            if N_OUT > 0:
                _tma_load(qs_desc, [q_row0 + wg * 64, 0], q_bar, qs_smem.index(QB + wg))
        k_bytes: gl.constexpr = k_desc.block_type.nbytes + ks_desc.block_type.nbytes * (N_OUT > 0)
        for j in range(n_kb):
            slot = _ring_slot(R0 + j, STAGES)
            phase = _ring_phase(R0 + j, STAGES)
            # Parity phase ^ 1 on a fresh barrier passes at once: the first lap needs no wait.
            # MERGED_EMPTY: V[j - STAGES]'s release is also K[j - STAGES]'s (read before it).
            if MERGED_EMPTY:
                mbarrier.wait(v_empty.index(slot), phase ^ 1)
            else:
                mbarrier.wait(k_empty.index(slot), phase ^ 1)
            mbarrier.expect(k_full.index(slot), k_bytes)
            _tma_load(k_desc, [k_row0 + j * BLOCK_N, 0], k_full.index(slot), k_ring.index(slot))
            if N_OUT > 0:
                _tma_load(ks_desc, [k_row0 + j * BLOCK_N, 0], k_full.index(slot), ks_ring.index(slot))
            if not MERGED_EMPTY:
                mbarrier.wait(v_empty.index(slot), phase ^ 1)
            mbarrier.expect(v_full.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [v_row0, j * BLOCK_N], v_full.index(slot), v_ring.index(slot))

    @gluon.jit
    def _load_partition(q_desc, qs_desc, k_desc, ks_desc, v_desc, ones_desc, q_smem, qs_smem, k_ring, ks_ring,
                        v_ring, ones_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty, LQ_PAD, LK_PAD, NQB,
                        n_kb, N_TILES, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr,
                        N_OUT: gl.constexpr, ROWSUM_MMA: gl.constexpr, MERGED_EMPTY: gl.constexpr,
                        PERSISTENT: gl.constexpr):
        # One warp. A CTA tile is (query block start_m, batch*head bh): Q rows bh * LQ_PAD +
        # 128 start_m, K rows from bh * LK_PAD, VT rows from bh * BLOCK_D.
        if PERSISTENT:
            # Tile t = bh * NQB + start_m, the launch grid's order: the SMs work on neighbouring
            # query blocks of a head at a time (its K and V shared in L2). Tile i of this CTA
            # loads Q into buffer i % 2 once both warpgroups released that buffer (tile i - 2).
            i = 0
            for t in range(gl.program_id(0), N_TILES, gl.num_programs(0)):
                bh = t // NQB
                buf = i % 2
                mbarrier.wait(q_empty.index(buf), ((i // 2) & 1) ^ 1)
                _load_tile(q_desc, qs_desc, k_desc, ks_desc, v_desc, ones_desc, q_smem, qs_smem, k_ring, ks_ring,
                           v_ring, ones_smem, q_full.index(buf), k_full, k_empty, v_full, v_empty, 2 * buf,
                           bh * LQ_PAD + (t - bh * NQB) * 128, bh * LK_PAD, bh * BLOCK_D, n_kb, i * n_kb, BLOCK_N,
                           STAGES, N_OUT, ROWSUM_MMA, MERGED_EMPTY)
                i += 1
        else:
            bh = gl.program_id(1)
            _load_tile(q_desc, qs_desc, k_desc, ks_desc, v_desc, ones_desc, q_smem, qs_smem, k_ring, ks_ring, v_ring,
                       ones_smem, q_full.index(0), k_full, k_empty, v_full, v_empty, 0,
                       bh * LQ_PAD + gl.program_id(0) * 128, bh * LK_PAD, bh * BLOCK_D, n_kb, 0, BLOCK_N, STAGES,
                       N_OUT, ROWSUM_MMA, MERGED_EMPTY)

    @gluon.jit
    def _issue_qk(q, qs, k_ring, ks_ring, k_full, s_zero, j, STAGES: gl.constexpr, N_OUT: gl.constexpr):
        slot = _ring_slot(j, STAGES)
        mbarrier.wait(k_full.index(slot), _ring_phase(j, STAGES))
        s = warpgroup_mma(q, k_ring.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if N_OUT > 0:
            # The outlier channels' residual products: one more k-step on the same accumulator.
            s = warpgroup_mma(qs, ks_ring.index(slot).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _softmax_tile(s, m_i, l_i, c, cols, LK, acc, p_layout: gl.constexpr, o_layout: gl.constexpr,
                      BOUNDARY: gl.constexpr, EARLY_RESCALE: gl.constexpr, PERM_P: gl.constexpr,
                      ROWSUM_MMA: gl.constexpr, POLY_EXP: gl.constexpr, CAST_P: gl.constexpr = True):
        # c = sq * sk > 0 de-quantises and holds sm_scale * log2(e): max(s) * c is the max of
        # the scaled scores and the de-quantising multiply folds into the exp2's argument.
        if BOUNDARY:
            s = gl.where(gl.expand_dims(cols < LK, 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * c)
        alpha = gl.exp2(m_i - m_new)
        a = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        if EARLY_RESCALE:
            # acc is free here (the last P.V was waited for): rescaled before P's exp2 in
            # program order, its 64 multiplies a thread can issue while the MUFU pipe works on
            # the exponentials instead of delaying the next P.V (they sat right before it).
            acc = acc * a
        p = _exp2_p(s * c - gl.expand_dims(m_new - 8.8073, 1), POLY_EXP)  # in [0, 448]: LOG2_P_SCALE
        if not ROWSUM_MMA:  # else the row sum is P8 . ones on the tensor cores (_pv_update)
            l_i = l_i * alpha + gl.sum(p, 1)
        if CAST_P:
            p = _p_operand(p, p_layout, PERM_P)
        return p, alpha, a, m_new, l_i, acc

    @gluon.jit
    def _p_operand(p, p_layout: gl.constexpr, PERM_P: gl.constexpr):
        # P (fp32, in [0, 448]) as P.V's e4m3 register A operand.
        p8 = p.to(gl.float8e4nv)
        if PERM_P:
            # The accumulator layout gives a thread columns 8c + 2t + e of each 32-column
            # k-step (t its lane mod 4, e one register bit); wgmma's 8-bit A operand wants
            # columns 16h + 4t + f. Relabelling the columns by the bit permutation below puts
            # every element where the A layout wants it already (register renaming, no
            # shuffles); V's keys were stored in the same order (quantize_qkv(v_key_perm=True)),
            # so P.V sums the same products.
            rows: gl.constexpr = p8.shape[0]
            n: gl.constexpr = p8.shape[1]
            p8 = gl.reshape(p8, [rows, n // 32, 2, 2, 2, 2, 2])  # (k-step, c1, c0, t1, t0, e)
            p8 = gl.permute(p8, [0, 1, 2, 4, 5, 3, 6])  # P_RELABEL_ORDER: (k-step, c1, t1, t0, c0, e)
            p8 = gl.reshape(p8, [rows, n])
        return gl.convert_layout(p8, p_layout)

    @gluon.jit
    def _pv_update(acc, p8, a, alpha, l_i, ones_smem, v_ring, v_full, o_zero, j, l_layout: gl.constexpr,
                   STAGES: gl.constexpr, TWO_LEVEL: gl.constexpr, EARLY_RESCALE: gl.constexpr,
                   ROWSUM_MMA: gl.constexpr):
        slot = _ring_slot(j, STAGES)
        mbarrier.wait(v_full.index(slot), _ring_phase(j, STAGES))
        if TWO_LEVEL:
            pv = warpgroup_mma(p8, v_ring.index(slot).permute((1, 0)), o_zero, use_acc=False, is_async=True)
        elif EARLY_RESCALE:
            pv = warpgroup_mma(p8, v_ring.index(slot).permute((1, 0)), acc, is_async=True)
        else:
            pv = warpgroup_mma(p8, v_ring.index(slot).permute((1, 0)), acc * a, is_async=True)
        if ROWSUM_MMA:
            # The row sums of P (as the e4m3 values P.V multiplies) as one more product with
            # a ones tile, l_i a [rows, 8] accumulator whose 8 columns are equal: 4 wgmmas of
            # N = 8 instead of 64 FADDs and 4 shuffles a thread per tile.
            a_l = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, l_layout)), 1)
            l_i = warpgroup_mma(p8, ones_smem.permute((1, 0)), l_i * a_l, is_async=True)
        return pv, l_i

    @gluon.jit
    def _accumulate(acc, pv, a, TWO_LEVEL: gl.constexpr, EARLY_RESCALE: gl.constexpr):
        if TWO_LEVEL:
            if EARLY_RESCALE:
                return acc + pv
            else:
                return acc * a + pv
        else:
            return pv

    @gluon.jit
    def _halves(x):
        # Columns [0, n/2) and [n/2, n) of a [rows, n] tile. The wgmma accumulator layout gives
        # a thread columns 8i + 2t + e with i a register index, so column bit n/2 is a bit of
        # i: the split picks registers and moves no data.
        rows: gl.constexpr = x.shape[0]
        n: gl.constexpr = x.shape[1]
        return gl.split(gl.permute(gl.reshape(x, [rows, 2, n // 2]), [0, 2, 1]))

    @gluon.jit
    def _pv_slice(acc, x, v_tile, C0: gl.constexpr, p_layout: gl.constexpr, PERM_P: gl.constexpr,
                  POLY_EXP: gl.constexpr):
        # One column slice of P (x = its exp2 arguments) times VT8's keys C0.. of the tile,
        # issued onto acc (in flight or not: the wgmmas of a tile chain on one accumulator).
        # PERM_P's relabelling acts inside each 32-column k-step, so a slice of it is the
        # same relabelling of the slice's keys.
        p = _exp2_p(x, POLY_EXP)
        w: gl.constexpr = x.shape[1]
        acc = warpgroup_mma(_p_operand(p, p_layout, PERM_P), v_tile.slice(C0, w, dim=1).permute((1, 0)), acc,
                            is_async=True)
        return acc, p

    @gluon.jit
    def _softmax_pv_split(s, m_i, l_i, c, cols, LK, acc, v_ring, v_full, r, p_layout: gl.constexpr,
                          o_layout: gl.constexpr, BOUNDARY: gl.constexpr, PERM_P: gl.constexpr,
                          POLY_EXP: gl.constexpr, STAGES: gl.constexpr, PV_SPLIT: gl.constexpr):
        # _softmax_tile + _pv_update (EARLY_RESCALE, one-level) with P.V issued slice by
        # slice: slice i's P.V runs on the tensor cores while slice i+1's exponentials run on
        # the MUFU pipe. Returns the in-flight P.V (acc once waited for), alpha, m, l. The row
        # sum adds the slices elementwise first (same layout) and reduces once.
        if BOUNDARY:
            s = gl.where(gl.expand_dims(cols < LK, 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * c)
        alpha = gl.exp2(m_i - m_new)
        a = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        acc = acc * a
        x = s * c - gl.expand_dims(m_new - 8.8073, 1)  # in [.., LOG2_P_SCALE]: P <= 448
        n: gl.constexpr = x.shape[1]
        slot = _ring_slot(r, STAGES)
        v_tile = v_ring.index(slot)
        x0, x1 = _halves(x)
        mbarrier.wait(v_full.index(slot), _ring_phase(r, STAGES))
        if PV_SPLIT == 2:
            acc, p_sum = _pv_slice(acc, x0, v_tile, 0, p_layout, PERM_P, POLY_EXP)
            acc, p = _pv_slice(acc, x1, v_tile, n // 2, p_layout, PERM_P, POLY_EXP)
            p_sum = p_sum + p
        else:
            gl.static_assert(PV_SPLIT == 4, "PV_SPLIT is 1, 2 or 4")
            x00, x01 = _halves(x0)
            x10, x11 = _halves(x1)
            acc, p_sum = _pv_slice(acc, x00, v_tile, 0, p_layout, PERM_P, POLY_EXP)
            acc, p = _pv_slice(acc, x01, v_tile, n // 4, p_layout, PERM_P, POLY_EXP)
            p_sum = p_sum + p
            acc, p = _pv_slice(acc, x10, v_tile, n // 2, p_layout, PERM_P, POLY_EXP)
            p_sum = p_sum + p
            acc, p = _pv_slice(acc, x11, v_tile, 3 * (n // 4), p_layout, PERM_P, POLY_EXP)
            p_sum = p_sum + p
        l_i = l_i * alpha + gl.convert_layout(gl.sum(p_sum, 1), m_new.type.layout)
        return acc, alpha, m_new, l_i

    @gluon.jit
    def _kv_step(s, acc, m_i, l_i, j, R0, q, qs, k_ring, ks_ring, v_ring, ones_smem, k_full, k_empty, v_full,
                 v_empty, s_zero, o_zero, offs_n, q_scale, SK, LK, p_layout: gl.constexpr, o_layout: gl.constexpr,
                 l_layout: gl.constexpr, STAGES: gl.constexpr, N_OUT: gl.constexpr, TWO_LEVEL: gl.constexpr,
                 EARLY_RESCALE: gl.constexpr, PERM_P: gl.constexpr, ROWSUM_MMA: gl.constexpr,
                 POLY_EXP: gl.constexpr, MERGED_EMPTY: gl.constexpr, PV_SPLIT: gl.constexpr = 1):
        # One key tile j that is not the last: tile j+1's scores go to the tensor cores
        # first and run under tile j's softmax. R0 + j is the tile's place in the ring's
        # sequence (R0 = 0 unless PERSISTENT: the key tiles of the CTA's earlier tiles).
        s_next = _issue_qk(q, qs, k_ring, ks_ring, k_full, s_zero, R0 + j + 1, STAGES, N_OUT)
        c = q_scale * gl.load(SK + j)
        if PV_SPLIT > 1:
            gl.static_assert(EARLY_RESCALE and not (TWO_LEVEL or ROWSUM_MMA), "PV_SPLIT splits lean's P.V")
            pv, alpha, m_i, l_i = _softmax_pv_split(s, m_i, l_i, c, offs_n, LK, acc, v_ring, v_full, R0 + j, p_layout,
                                                    o_layout, False, PERM_P, POLY_EXP, STAGES, PV_SPLIT)
            a = acc  # unused: one-level accumulation returns pv
        else:
            p8, alpha, a, m_i, l_i, acc = _softmax_tile(s, m_i, l_i, c, offs_n, LK, acc, p_layout, o_layout, False,
                                                        EARLY_RESCALE, PERM_P, ROWSUM_MMA, POLY_EXP)
            pv, l_i = _pv_update(acc, p8, a, alpha, l_i, ones_smem, v_ring, v_full, o_zero, R0 + j, l_layout,
                                 STAGES, TWO_LEVEL, EARLY_RESCALE, ROWSUM_MMA)
        if ROWSUM_MMA:
            s, pv, l_i = warpgroup_mma_wait(0, deps=(s_next, pv, l_i))
        else:
            s, pv = warpgroup_mma_wait(0, deps=(s_next, pv))
        if not MERGED_EMPTY:
            mbarrier.arrive(k_empty.index(_ring_slot(R0 + j + 1, STAGES)), count=1)
        mbarrier.arrive(v_empty.index(_ring_slot(R0 + j, STAGES)), count=1)
        acc = _accumulate(acc, pv, a, TWO_LEVEL, EARLY_RESCALE)
        return s, acc, m_i, l_i

    @gluon.jit
    def _mainloop(q, qs, k_ring, ks_ring, v_ring, ones_smem, k_full, k_empty, v_full, v_empty, s_zero, o_zero, acc,
                  m_i, l_i, offs_n, q_scale, SK, LK, NKB, R0, p_layout: gl.constexpr, o_layout: gl.constexpr,
                  l_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, N_OUT: gl.constexpr,
                  TWO_LEVEL: gl.constexpr, UNROLL: gl.constexpr, EARLY_RESCALE: gl.constexpr, PERM_P: gl.constexpr,
                  ROWSUM_MMA: gl.constexpr, POLY_EXP: gl.constexpr, MERGED_EMPTY: gl.constexpr,
                  PV_SPLIT: gl.constexpr = 1):
        # Each warpgroup on its own: Q.K^T of tile j+1 is issued before tile j's softmax;
        # the two warpgroups interleave as the warp schedulers see fit (FlashAttention-3's
        # explicit ping-pong, turn barriers between the warpgroups, measured 15-20% slower
        # here on the H200: 642 against 770 TFLOP/s at Wan; again in session 38 as the
        # PV_BEHIND / PINGPONG configs, _mainloop_pv_behind). Also measured, none faster (H200,
        # Triton 3.6, 2026-12-04, benchmarks/RESULTS.md):
        # - P.V kept one tile behind so that tile j's softmax runs under both Q.K^T(j+1) and
        #   P.V(j-1). With two P tiles live it needs BLOCK_N = 64 (128 spills in 232 registers;
        #   a P.V left running across the back edge makes ptxas serialise every wgmma, C7514),
        #   and the smaller tile costs more than the overlap gains: Wan kernel 587-610 TFLOP/s
        #   against 785 here (BLOCK_N = 64 without the lag: 644).
        # - the key block's scale loaded one tile ahead (752-780 at Wan), 240 consumer registers
        #   (782), both, or with STAGES=3: all within the run's +-3 % of this loop (786).
        # - exp2 in f16x2 does not halve the MUFU work: ptxas splits ex2.approx.f16x2 (and
        #   bf16x2) into two scalar MUFU.EX2 on sm_90 (checked in the SASS).
        # UNROLL = 2: in the one-tile loop tile j+1's scores land in fresh registers while
        # tile j's are still being read, and ptxas copies them back at the back edge (64 MOVs
        # per tile, after the wait, on the critical path: SASS of Triton 3.6 and 3.9). Two
        # tiles per trip let the two score tiles swap roles instead.
        s = _issue_qk(q, qs, k_ring, ks_ring, k_full, s_zero, R0, STAGES, N_OUT)
        s = warpgroup_mma_wait(0, deps=(s,))
        if not MERGED_EMPTY:
            mbarrier.arrive(k_empty.index(_ring_slot(R0, STAGES)), count=1)
        if UNROLL == 2:
            for jj in range(0, (NKB - 1) // 2):
                j = 2 * jj
                s, acc, m_i, l_i = _kv_step(s, acc, m_i, l_i, j, R0, q, qs, k_ring, ks_ring, v_ring, ones_smem, k_full,
                                            k_empty, v_full, v_empty, s_zero, o_zero, offs_n, q_scale, SK, LK,
                                            p_layout, o_layout, l_layout, STAGES, N_OUT, TWO_LEVEL, EARLY_RESCALE,
                                            PERM_P, ROWSUM_MMA, POLY_EXP, MERGED_EMPTY, PV_SPLIT=PV_SPLIT)
                s, acc, m_i, l_i = _kv_step(s, acc, m_i, l_i, j + 1, R0, q, qs, k_ring, ks_ring, v_ring, ones_smem,
                                            k_full, k_empty, v_full, v_empty, s_zero, o_zero, offs_n, q_scale, SK,
                                            LK, p_layout, o_layout, l_layout, STAGES, N_OUT, TWO_LEVEL,
                                            EARLY_RESCALE, PERM_P, ROWSUM_MMA, POLY_EXP, MERGED_EMPTY, PV_SPLIT=PV_SPLIT)
            # An odd count of inner tiles ends with one more inner step and the last tile in
            # their own branch: a branch that merged the score tile back (one step peeled
            # before or after the loop) made ptxas spill 1.5 KB and serialise the wgmmas.
            if (NKB - 1) % 2 == 1:
                s, acc, m_i, l_i = _kv_step(s, acc, m_i, l_i, NKB - 2, R0, q, qs, k_ring, ks_ring, v_ring, ones_smem,
                                            k_full, k_empty, v_full, v_empty, s_zero, o_zero, offs_n, q_scale, SK,
                                            LK, p_layout, o_layout, l_layout, STAGES, N_OUT, TWO_LEVEL,
                                            EARLY_RESCALE, PERM_P, ROWSUM_MMA, POLY_EXP, MERGED_EMPTY, PV_SPLIT=PV_SPLIT)
                acc, l_i = _last_tile(s, acc, m_i, l_i, q_scale, SK, LK, NKB, R0, offs_n, v_ring, ones_smem, v_full,
                                      v_empty, o_zero, p_layout, o_layout, l_layout, BLOCK_N, STAGES, TWO_LEVEL,
                                      EARLY_RESCALE, PERM_P, ROWSUM_MMA, POLY_EXP, PV_SPLIT=PV_SPLIT)
            else:
                acc, l_i = _last_tile(s, acc, m_i, l_i, q_scale, SK, LK, NKB, R0, offs_n, v_ring, ones_smem, v_full,
                                      v_empty, o_zero, p_layout, o_layout, l_layout, BLOCK_N, STAGES, TWO_LEVEL,
                                      EARLY_RESCALE, PERM_P, ROWSUM_MMA, POLY_EXP, PV_SPLIT=PV_SPLIT)
        else:
            for j in range(0, NKB - 1):
                s, acc, m_i, l_i = _kv_step(s, acc, m_i, l_i, j, R0, q, qs, k_ring, ks_ring, v_ring, ones_smem, k_full,
                                            k_empty, v_full, v_empty, s_zero, o_zero, offs_n, q_scale, SK, LK,
                                            p_layout, o_layout, l_layout, STAGES, N_OUT, TWO_LEVEL, EARLY_RESCALE,
                                            PERM_P, ROWSUM_MMA, POLY_EXP, MERGED_EMPTY, PV_SPLIT=PV_SPLIT)
            acc, l_i = _last_tile(s, acc, m_i, l_i, q_scale, SK, LK, NKB, R0, offs_n, v_ring, ones_smem, v_full, v_empty,
                                  o_zero, p_layout, o_layout, l_layout, BLOCK_N, STAGES, TWO_LEVEL, EARLY_RESCALE,
                                  PERM_P, ROWSUM_MMA, POLY_EXP, PV_SPLIT=PV_SPLIT)
        return acc, l_i

    @gluon.jit
    def _last_tile(s, acc, m_i, l_i, q_scale, SK, LK, NKB, R0, offs_n, v_ring, ones_smem, v_full, v_empty, o_zero,
                   p_layout: gl.constexpr, o_layout: gl.constexpr, l_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, TWO_LEVEL: gl.constexpr, EARLY_RESCALE: gl.constexpr, PERM_P: gl.constexpr,
                   ROWSUM_MMA: gl.constexpr, POLY_EXP: gl.constexpr, PV_SPLIT: gl.constexpr = 1):
        # The last key tile: the only one that can hold padded keys, masked to -inf here.
        last = NKB - 1
        c = q_scale * gl.load(SK + last)
        if PV_SPLIT > 1:
            pv, alpha, m_i, l_i = _softmax_pv_split(s, m_i, l_i, c, last * BLOCK_N + offs_n, LK, acc, v_ring, v_full,
                                                    R0 + last, p_layout, o_layout, True, PERM_P, POLY_EXP, STAGES,
                                                    PV_SPLIT)
            a = acc  # unused: one-level accumulation returns pv
        else:
            p8, alpha, a, m_i, l_i, acc = _softmax_tile(s, m_i, l_i, c, last * BLOCK_N + offs_n, LK, acc, p_layout,
                                                        o_layout, True, EARLY_RESCALE, PERM_P, ROWSUM_MMA, POLY_EXP)
            pv, l_i = _pv_update(acc, p8, a, alpha, l_i, ones_smem, v_ring, v_full, o_zero, R0 + last, l_layout,
                                 STAGES, TWO_LEVEL, EARLY_RESCALE, ROWSUM_MMA)
        if ROWSUM_MMA:
            pv, l_i = warpgroup_mma_wait(0, deps=(pv, l_i))
        else:
            pv = warpgroup_mma_wait(0, deps=(pv,))
        mbarrier.arrive(v_empty.index(_ring_slot(R0 + last, STAGES)), count=1)
        acc = _accumulate(acc, pv, a, TWO_LEVEL, EARLY_RESCALE)
        return acc, l_i

    # PINGPONG's turn barriers: hardware named barriers 10 and 11 (Triton's partitions use 0-2
    # in this kernel's PTX). Warpgroup w waits on 10 + w (bar.sync, 128 threads) until the other
    # warpgroup's 128 threads have arrived on it (bar.arrive): 256 in all.
    _TURN_WAIT_0 = gl.constexpr("bar.sync 10, 256;\n\tmov.u32 $0, 0;")
    _TURN_WAIT_1 = gl.constexpr("bar.sync 11, 256;\n\tmov.u32 $0, 0;")
    _TURN_PASS_0 = gl.constexpr("bar.arrive 11, 256;\n\tmov.u32 $0, 0;")  # warpgroup 0 hands the turn to 1
    _TURN_PASS_1 = gl.constexpr("bar.arrive 10, 256;\n\tmov.u32 $0, 0;")

    @gluon.jit
    def _turn_barrier(ASM_0: gl.constexpr, ASM_1: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr):
        # Not pure: the asm has no inputs, and only its side effect (the barrier) matters.
        if PINGPONG:
            if WG == 0:
                gl.inline_asm_elementwise(ASM_0, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            else:
                gl.inline_asm_elementwise(ASM_1, "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _turn_wait(WG: gl.constexpr, PINGPONG: gl.constexpr):
        _turn_barrier(_TURN_WAIT_0, _TURN_WAIT_1, WG, PINGPONG)

    @gluon.jit
    def _turn_pass(WG: gl.constexpr, PINGPONG: gl.constexpr):
        _turn_barrier(_TURN_PASS_0, _TURN_PASS_1, WG, PINGPONG)

    @gluon.jit
    def _pv_behind_step(acc, p, a, m_i, l_i, j, q, qs, k_ring, ks_ring, v_ring, ones_smem, k_full, k_empty,
                        v_full, v_empty, s_zero, o_zero, cols, q_scale, SK, LK, p_layout: gl.constexpr,
                        o_layout: gl.constexpr, l_layout: gl.constexpr, STAGES: gl.constexpr, N_OUT: gl.constexpr,
                        PERM_P: gl.constexpr, POLY_EXP: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr,
                        BOUNDARY: gl.constexpr):
        # Tile j (> 0): its Q.K^T and tile j-1's P.V go to the tensor cores in one turn; tile
        # j's softmax then runs while that P.V does. acc comes in rescaled for tile j-1's row
        # maxima and leaves rescaled for tile j's (after the wait: its multiplies stay out of
        # the turn, which the other warpgroup waits on).
        _turn_wait(WG, PINGPONG)
        s = _issue_qk(q, qs, k_ring, ks_ring, k_full, s_zero, j, STAGES, N_OUT)
        pv, l_i = _pv_update(acc, _p_operand(p, p_layout, PERM_P), a, a, l_i, ones_smem, v_ring, v_full, o_zero,
                             j - 1, l_layout, STAGES, False, True, False)
        _turn_pass(WG, PINGPONG)
        s = warpgroup_mma_wait(1, deps=(s,))  # Q.K^T done; P.V (issued last) may still run
        mbarrier.arrive(k_empty.index(j % STAGES), count=1)
        c = q_scale * gl.load(SK + j)
        # acc is not passed: it is in flight (P.V); without EARLY_RESCALE the softmax leaves its
        # acc argument alone, so s_zero stands in.
        p, alpha, a, m_i, l_i, _ = _softmax_tile(s, m_i, l_i, c, cols, LK, s_zero, p_layout, o_layout, BOUNDARY,
                                                 False, PERM_P, False, POLY_EXP, False)
        # P among the wait's operands keeps the softmax before the wait in the PTX; ptxas still
        # moves the wait ahead of the exponentials in the SASS (GLUON_CONFIGS' comment).
        acc, p = warpgroup_mma_wait(0, deps=(pv, p))
        mbarrier.arrive(v_empty.index((j - 1) % STAGES), count=1)
        return acc * a, p, a, m_i, l_i

    @gluon.jit
    def _mainloop_pv_behind(q, qs, k_ring, ks_ring, v_ring, ones_smem, k_full, k_empty, v_full, v_empty, s_zero,
                            o_zero, acc, m_i, l_i, offs_n, q_scale, SK, LK, NKB, p_layout: gl.constexpr,
                            o_layout: gl.constexpr, l_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr, N_OUT: gl.constexpr, PERM_P: gl.constexpr,
                            POLY_EXP: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr):
        # FlashAttention-3's consumer loop. With PINGPONG, warpgroup 1 hands warpgroup 0 the
        # first turn, and warpgroup 0 takes one turn more at the end, so each barrier sees as
        # many arrives as waits (NKB + 1 on 10, NKB on 11) and none is left pending at exit;
        # strict alternation keeps one warpgroup at most one arrive ahead of the other's wait.
        if WG == 1:
            _turn_pass(WG, PINGPONG)
        # Tile 0 (masked like a last tile: it is one when NKB == 1).
        _turn_wait(WG, PINGPONG)
        s = _issue_qk(q, qs, k_ring, ks_ring, k_full, s_zero, 0, STAGES, N_OUT)
        _turn_pass(WG, PINGPONG)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(0), count=1)
        c = q_scale * gl.load(SK)
        p, alpha, a, m_i, l_i, _ = _softmax_tile(s, m_i, l_i, c, offs_n, LK, s_zero, p_layout, o_layout, True,
                                                 False, PERM_P, False, POLY_EXP, False)
        for j in range(1, NKB - 1):
            acc, p, a, m_i, l_i = _pv_behind_step(acc, p, a, m_i, l_i, j, q, qs, k_ring, ks_ring, v_ring,
                                                   ones_smem, k_full, k_empty, v_full, v_empty, s_zero, o_zero,
                                                   offs_n, q_scale, SK, LK, p_layout, o_layout, l_layout, STAGES,
                                                   N_OUT, PERM_P, POLY_EXP, WG, PINGPONG, False)
        if NKB > 1:  # the last tile, the only one beyond tile 0 that can hold padded keys
            last = NKB - 1
            acc, p, a, m_i, l_i = _pv_behind_step(acc, p, a, m_i, l_i, last, q, qs, k_ring, ks_ring,
                                                   v_ring, ones_smem, k_full, k_empty, v_full, v_empty, s_zero,
                                                   o_zero, last * BLOCK_N + offs_n, q_scale, SK, LK, p_layout,
                                                   o_layout, l_layout, STAGES, N_OUT, PERM_P, POLY_EXP, WG,
                                                   PINGPONG, True)
        if WG == 0:
            _turn_wait(WG, PINGPONG)
        # The last tile's P.V, outside the turns: nothing else is left to overlap it with.
        pv, l_i = _pv_update(acc, _p_operand(p, p_layout, PERM_P), a, a, l_i, ones_smem, v_ring, v_full, o_zero,
                             NKB - 1, l_layout, STAGES, False, True, False)
        acc = warpgroup_mma_wait(0, deps=(pv,))
        mbarrier.arrive(v_empty.index((NKB - 1) % STAGES), count=1)
        return acc, l_i

    @gluon.jit
    def _consumer_tile(q, qs, q_bar, q_phase, k_ring, ks_ring, v_ring, ones_smem, k_full, k_empty, v_full, v_empty,
                       SQ, SK, SV, VMEAN, O, stride_ob, stride_oh, stride_om, stride_od, H, bh, start_m, R0, LQ, LK,
                       NQB, NKB, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                       BLOCK_D: gl.constexpr, STAGES: gl.constexpr, N_OUT: gl.constexpr, TWO_LEVEL: gl.constexpr,
                       UNROLL: gl.constexpr, EARLY_RESCALE: gl.constexpr, PERM_P: gl.constexpr,
                       ROWSUM_MMA: gl.constexpr, POLY_EXP: gl.constexpr, MERGED_EMPTY: gl.constexpr,
                       PV_BEHIND: gl.constexpr, PINGPONG: gl.constexpr, PV_SPLIT: gl.constexpr = 1):
        # This warpgroup's 64 query rows of CTA tile (start_m, bh), Q in `q` / `qs` once q_bar
        # completes phase q_phase; its key tiles are the ring's R0-th onwards.
        ROWS: gl.constexpr = 64
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_D, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 8, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

        bh64 = bh.to(gl.int64)
        q_scale = gl.load(SQ + bh64 * NQB + start_m)
        SK = SK + bh64 * NKB
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        o_zero = gl.zeros([ROWS, BLOCK_D], gl.float32, o_layout)
        acc = gl.zeros([ROWS, BLOCK_D], gl.float32, o_layout)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
        if ROWSUM_MMA:
            l_i = gl.zeros([ROWS, 8], gl.float32, l_layout)  # P8 . ones: 8 equal columns
        else:
            l_i = gl.zeros([ROWS], gl.float32, row_layout)
        offs_n = gl.arange(0, BLOCK_N, layout=col_layout)

        mbarrier.wait(q_bar, q_phase)
        if PV_BEHIND:
            gl.static_assert(not (TWO_LEVEL or (ROWSUM_MMA or MERGED_EMPTY)), "PV_BEHIND is lean's loop reordered")
            gl.static_assert(PV_SPLIT == 1, "PV_SPLIT is for lean's loop")
            acc, l_i = _mainloop_pv_behind(q, qs, k_ring, ks_ring, v_ring, ones_smem, k_full, k_empty, v_full,
                                           v_empty, s_zero, o_zero, acc, m_i, l_i, offs_n, q_scale, SK, LK, NKB,
                                           p_layout, o_layout, l_layout, BLOCK_N, STAGES, N_OUT, PERM_P, POLY_EXP,
                                           WG, PINGPONG)
        else:
            gl.static_assert(not PINGPONG, "PINGPONG needs PV_BEHIND")
            acc, l_i = _mainloop(q, qs, k_ring, ks_ring, v_ring, ones_smem, k_full, k_empty, v_full, v_empty,
                                 s_zero, o_zero, acc, m_i, l_i, offs_n, q_scale, SK, LK, NKB, R0, p_layout, o_layout,
                                 l_layout, BLOCK_N, STAGES, N_OUT, TWO_LEVEL, UNROLL, EARLY_RESCALE, PERM_P,
                                 ROWSUM_MMA, POLY_EXP, MERGED_EMPTY, PV_SPLIT=PV_SPLIT)
        if ROWSUM_MMA:
            l_i = gl.max(l_i, 1)

        # Epilogue in fp32: V's per-channel scale, 1 / l (the 448 of P cancels) and V's mean.
        o_row0 = (bh // H).to(gl.int64) * stride_ob + (bh % H).to(gl.int64) * stride_oh
        offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
        rows = start_m * 128 + WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
        sv = gl.load(SV + bh64 * BLOCK_D + offs_d)
        v_mean = gl.load(VMEAN + bh64 * BLOCK_D + offs_d)
        inv_l = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout))
        out = acc * gl.expand_dims(inv_l, 1) * gl.expand_dims(sv, 0) + gl.expand_dims(v_mean, 0)
        ptrs = O + o_row0 + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(offs_d * stride_od, 0)
        mask = gl.expand_dims(rows < LQ, 1) & gl.expand_dims(offs_d < HEAD_DIM, 0)
        gl.store(ptrs, out.to(O.dtype.element_ty), mask=mask)

    @gluon.jit
    def _consumer_partition(q_smem, qs_smem, k_ring, ks_ring, v_ring, ones_smem, q_full, q_empty, k_full, k_empty,
                            v_full, v_empty, SQ, SK, SV, VMEAN, O, stride_ob, stride_oh, stride_om, stride_od, H, LQ,
                            LK, NQB, NKB, N_TILES, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                            BLOCK_D: gl.constexpr, STAGES: gl.constexpr, N_OUT: gl.constexpr,
                            TWO_LEVEL: gl.constexpr, UNROLL: gl.constexpr, EARLY_RESCALE: gl.constexpr,
                            PERM_P: gl.constexpr, ROWSUM_MMA: gl.constexpr, POLY_EXP: gl.constexpr,
                            MERGED_EMPTY: gl.constexpr, PV_BEHIND: gl.constexpr, PINGPONG: gl.constexpr,
                            PERSISTENT: gl.constexpr, PV_SPLIT: gl.constexpr = 1):
        if PERSISTENT:
            # The producer's tile order (_load_partition); Q buffer i % 2 goes back to it once
            # this tile's output is written (it refills the buffer for tile i + 2).
            i = 0
            for t in range(gl.program_id(0), N_TILES, gl.num_programs(0)):
                bh = t // NQB
                buf = i % 2
                _consumer_tile(q_smem.index(2 * buf + WG), qs_smem.index(2 * buf + WG), q_full.index(buf),
                               (i // 2) & 1, k_ring, ks_ring, v_ring, ones_smem, k_full, k_empty, v_full, v_empty,
                               SQ, SK, SV, VMEAN, O, stride_ob, stride_oh, stride_om, stride_od, H, bh,
                               t - bh * NQB, i * NKB, LQ, LK, NQB, NKB, WG, HEAD_DIM, BLOCK_N, BLOCK_D, STAGES,
                               N_OUT, TWO_LEVEL, UNROLL, EARLY_RESCALE, PERM_P, ROWSUM_MMA, POLY_EXP, MERGED_EMPTY,
                               PV_BEHIND, PINGPONG, PV_SPLIT=PV_SPLIT)
                mbarrier.arrive(q_empty.index(buf), count=1)
                i += 1
        else:
            _consumer_tile(q_smem.index(WG), qs_smem.index(WG), q_full.index(0), 0, k_ring, ks_ring, v_ring,
                           ones_smem, k_full, k_empty, v_full, v_empty, SQ, SK, SV, VMEAN, O, stride_ob, stride_oh,
                           stride_om, stride_od, H, gl.program_id(1), gl.program_id(0), 0, LQ, LK, NQB, NKB, WG,
                           HEAD_DIM, BLOCK_N, BLOCK_D, STAGES, N_OUT, TWO_LEVEL, UNROLL, EARLY_RESCALE, PERM_P,
                           ROWSUM_MMA, POLY_EXP, MERGED_EMPTY, PV_BEHIND, PINGPONG, PV_SPLIT=PV_SPLIT)

    @gluon.jit
    def _attn_fp8_gluon_fwd(
        q_desc, qs_desc, k_desc, ks_desc, v_desc, ones_desc, SQ, SK, SV, VMEAN, O,
        stride_ob, stride_oh, stride_om, stride_od,
        H, LQ, LK, LQ_PAD, LK_PAD, NQB, NKB, N_TILES,
        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr,
        N_OUT: gl.constexpr, TWO_LEVEL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, UNROLL: gl.constexpr, EARLY_RESCALE: gl.constexpr, PERM_P: gl.constexpr,
        ROWSUM_MMA: gl.constexpr, POLY_EXP: gl.constexpr, MERGED_EMPTY: gl.constexpr, PV_BEHIND: gl.constexpr,
        PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr, PV_SPLIT: gl.constexpr,
    ):
        # Grid (NQB, B*H), one CTA tile each, or with PERSISTENT (min(SMs, N_TILES),) CTAs
        # walking N_TILES = NQB * B*H tiles.
        gl.static_assert(not (PERSISTENT and (PV_BEHIND or ROWSUM_MMA)), "PERSISTENT is for lean's loop")
        Q_BUFS: gl.constexpr = 2 if PERSISTENT else 1
        # Shared memory is allocated before the partitions fork: Q for both warpgroups
        # (16 KB at d128; twice when PERSISTENT), the K ring (K8 + side columns) and the VT ring.
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * Q_BUFS] + q_desc.block_type.shape, q_desc.layout)
        qs_smem = gl.allocate_shared_memory(qs_desc.dtype, [2 * Q_BUFS] + qs_desc.block_type.shape, qs_desc.layout)
        k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        ks_ring = gl.allocate_shared_memory(ks_desc.dtype, [STAGES] + ks_desc.block_type.shape, ks_desc.layout)
        v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        ones_smem = gl.allocate_shared_memory(ones_desc.dtype, ones_desc.block_type.shape, ones_desc.layout)
        q_full = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
        k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(Q_BUFS):
            mbarrier.init(q_full.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # both warpgroups done with the buffer
        for i in gl.static_range(STAGES):
            mbarrier.init(k_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            # Both consumer warpgroups read every slot: it is free once both have arrived.
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)
        fence_async_shared()

        gl.warp_specialize([
            (_consumer_partition, (q_smem, qs_smem, k_ring, ks_ring, v_ring, ones_smem, q_full, q_empty, k_full,
                                   k_empty, v_full, v_empty, SQ, SK, SV, VMEAN, O, stride_ob, stride_oh, stride_om,
                                   stride_od, H, LQ, LK, NQB, NKB, N_TILES, 0, HEAD_DIM, BLOCK_N, BLOCK_D, STAGES,
                                   N_OUT, TWO_LEVEL, UNROLL, EARLY_RESCALE, PERM_P, ROWSUM_MMA, POLY_EXP,
                                   MERGED_EMPTY, PV_BEHIND, PINGPONG, PERSISTENT, PV_SPLIT)),
            (_consumer_partition, (q_smem, qs_smem, k_ring, ks_ring, v_ring, ones_smem, q_full, q_empty, k_full,
                                   k_empty, v_full, v_empty, SQ, SK, SV, VMEAN, O, stride_ob, stride_oh, stride_om,
                                   stride_od, H, LQ, LK, NQB, NKB, N_TILES, 1, HEAD_DIM, BLOCK_N, BLOCK_D, STAGES,
                                   N_OUT, TWO_LEVEL, UNROLL, EARLY_RESCALE, PERM_P, ROWSUM_MMA, POLY_EXP,
                                   MERGED_EMPTY, PV_BEHIND, PINGPONG, PERSISTENT, PV_SPLIT)),
            (_load_partition, (q_desc, qs_desc, k_desc, ks_desc, v_desc, ones_desc, q_smem, qs_smem, k_ring, ks_ring,
                               v_ring, ones_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty, LQ_PAD, LK_PAD,
                               NQB, NKB, N_TILES, BLOCK_N, BLOCK_D, STAGES, N_OUT, ROWSUM_MMA, MERGED_EMPTY,
                               PERSISTENT)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---- host side ----------------------------------------------------------------------------

def _fp8_layout(block_shape):
    return shared_layout(tuple(block_shape), "fp8e4nv")


# get_default_for costs ~20 us a call and a launch needs up to five: remembered per
# (block shape, element type), the only inputs of the answer.
@lru_cache(maxsize=None)
def shared_layout(block_shape: tuple, dtype_name: str):
    """The NVMMA shared layout of a TMA box of `block_shape` with elements `dtype_name`
    (fp8e4nv, bf16, fp16): 128-byte swizzle where the box's rows allow it."""
    dtype = {"fp8e4nv": gl.float8e4nv, "bf16": gl.bfloat16, "fp16": gl.float16}[dtype_name]
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), dtype)


cache_registry.register("kernels.attention.gluon_hopper.shared_layout", shared_layout.cache_clear)


def _block_shapes(block_n: int, block_d: int, side: int):
    """TMA box of each operand: Q / Q-side per warpgroup (64 rows), K / K-side per key tile,
    VT as [head dim, keys] (keys contiguous: the K-major B operand of P.V)."""
    return dict(q=[ROWS_PER_WARPGROUP, block_d], qs=[ROWS_PER_WARPGROUP, side], k=[block_n, block_d],
                ks=[block_n, side], v=[block_d, block_n], ones=[8, block_n])


# The ROWSUM_MMA configs' B operand: 8 rows of e4m3 ones (K-major like VT8), one per device
# and key tile width, with its TMA descriptor, kept for the process (1 KB); every launch
# passes the descriptor (the other configs never read it).
@lru_cache(maxsize=None)
def _ones_descriptor(device: torch.device, block_n: int):
    ones = torch.ones(8, block_n, device=device).to(torch.float8_e4m3fn)
    return TensorDescriptor.from_tensor(ones, [8, block_n], _fp8_layout([8, block_n]))


cache_registry.register("kernels.attention.gluon_hopper.ones_descriptor", _ones_descriptor.cache_clear)


# TRITON_ACCEL_GLUON_VARIANT -> the FP8 config default_config() returns.
_VARIANT_CONFIGS = {"default": "sm90_lean", "lean": "sm90_lean", "classic": "sm90", "lean_rowsum": "sm90_lean_rowsum",
                    "lean_poly12": "sm90_lean_poly12", "lean_poly25": "sm90_lean_poly25",
                    "lean_merged": "sm90_lean_merged", "pv_behind": "sm90_pv_behind", "pingpong": "sm90_pingpong",
                    "persistent": "sm90_lean_persistent", "pvsplit2": "sm90_lean_pvsplit2",
                    "pvsplit4": "sm90_lean_pvsplit4"}


def default_config(device=None) -> dict:
    """GLUON_CONFIGS["sm90_lean"] (the measured loop: on an H100, 3-9 % faster kernels
    than "sm90" and 74 ms less per Wan 2.1 14B step), "sm90" under TRITON_ACCEL_GLUON_VARIANT=
    classic, "sm90_lean_rowsum" / "sm90_lean_poly12" / "sm90_lean_poly25" / "sm90_lean_merged" /
    "sm90_pv_behind" / "sm90_pingpong" / "sm90_lean_persistent" under lean_rowsum / lean_poly12 /
    lean_poly25 / lean_merged / pv_behind / pingpong / persistent (benchmarks)."""
    del device  # one target: sm_90
    return dict(GLUON_CONFIGS[_VARIANT_CONFIGS[env_settings.gluon_variant()]])


def attention_gluon_fp8(q, k, v, scale=None, config=None, n_outlier: int = N_OUTLIER):
    """softmax(q k^T * scale) v with Q.K^T and P.V in e4m3 on sm_90, quantisation included;
    q, k, v [B, H, L, D] fp16/bf16 (any strides, D <= 128, no mask, no causal, no GQA, any
    lengths >= 1); output in q's dtype, [B, H, Lq, D] in q's memory layout (torch.empty_like):
    for ComfyUI's q, a view of [B, Lq, H, D] memory, the [B, Lq, H * D] it hands back is then a
    view, not a transposing copy (0.3-0.4 ms a call at Wan 2.1 14B; torch's flash SDPA allocates
    its output the same way). Raises GluonUnsupportedError with the reason when the device,
    Triton or the call is refused."""
    reason = call_refusal(q, k, v) or gluon_refusal(q.device)
    if reason:
        raise GluonUnsupportedError(f"attention_gluon_fp8: {reason}")
    config = config or default_config(q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if q.shape[2] == 0 or q.shape[0] * q.shape[1] == 0:
        return torch.empty_like(q)
    if k.shape[2] == 0:
        raise GluonUnsupportedError("attention_gluon_fp8: zero keys (softmax over nothing)")
    qkv = quantize_for_config(q, k, v, scale, config, n_outlier)
    return attention_gluon_fp8_quantized(qkv, q.shape, k.shape[2], q.dtype, q.device, config,
                                         out=torch.empty_like(q))


def quantize_for_config(q, k, v, scale: float, config: dict, n_outlier: int = N_OUTLIER):
    """quantize_qkv's operands as this config's kernel reads them: its tiles (BLOCK_M, the
    config's BLOCK_N) and, for PERM_P configs, V's keys in v_key_order()."""
    return quantize_qkv(q, k, v, scale, BLOCK_M, config["BLOCK_N"], n_outlier,
                        v_key_perm=bool(loop_options(config)["PERM_P"]))


def attention_gluon_fp8_quantized(qkv, q_shape, lk: int, dtype, device, config, out=None):
    """The Gluon kernel alone on quantize_qkv(..., block_m=128, block_n=config's BLOCK_N), into
    `out` ([B, H, Lq, D] of `dtype`, any strides) or a new contiguous tensor."""
    B, H, Lq, D = q_shape
    if out is None:
        out = torch.empty(B, H, Lq, D, dtype=dtype, device=device)
    elif out.shape != (B, H, Lq, D) or out.dtype != dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not [{B}, {H}, {Lq}, {D}] {dtype}")
    bh, lq_pad, block_d = qkv.q8.shape
    lk_pad = qkv.k8.shape[1]
    if qkv.block_m != BLOCK_M or qkv.block_n != config["BLOCK_N"]:
        raise ValueError(f"quantize_qkv blocks ({qkv.block_m}, {qkv.block_n}) != kernel's ({BLOCK_M}, {config['BLOCK_N']})")
    loop = loop_options(config)
    if bool(loop["PERM_P"]) != qkv.v_key_perm:
        # A mismatch would not fail: it would pair P's columns with the wrong keys.
        raise ValueError(f"config PERM_P={loop['PERM_P']} needs quantize_qkv(v_key_perm={bool(loop['PERM_P'])}), "
                         f"got v_key_perm={qkv.v_key_perm}")
    side = max(2 * qkv.n_outlier, 16)  # the side operands' width (16 bytes, unused, when n_outlier = 0)
    shapes = _block_shapes(config["BLOCK_N"], block_d, side)
    flat = dict(q=qkv.q8.view(bh * lq_pad, block_d), qs=qkv.qs.view(bh * lq_pad, side),
                k=qkv.k8.view(bh * lk_pad, block_d), ks=qkv.ks.view(bh * lk_pad, side),
                v=qkv.vt8.view(bh * block_d, lk_pad))
    desc = {n: TensorDescriptor.from_tensor(t, shapes[n], _fp8_layout(shapes[n])) for n, t in flat.items()}
    desc["ones"] = _ones_descriptor(torch.device(device), config["BLOCK_N"])
    n_tiles = qkv.sq.shape[1] * bh
    grid = (min(n_tiles, sm_count(torch.device(device).index or 0)),) if loop["PERSISTENT"] else (qkv.sq.shape[1], bh)
    _attn_fp8_gluon_fwd[grid](
        desc["q"], desc["qs"], desc["k"], desc["ks"], desc["v"], desc["ones"], qkv.sq, qkv.sk, qkv.sv, qkv.vmean,
        out,
        *out.stride(), H, Lq, lk, lq_pad, lk_pad, qkv.sq.shape[1], qkv.sk.shape[1], n_tiles,
        HEAD_DIM=D, BLOCK_N=config["BLOCK_N"], BLOCK_D=block_d, STAGES=config["STAGES"], N_OUT=qkv.n_outlier,
        TWO_LEVEL=config["TWO_LEVEL"], CONSUMER_REGS=config["CONSUMER_REGS"],
        PRODUCER_REGS=config["PRODUCER_REGS"], **loop, num_warps=4, **LAUNCH_OPTIONS)
    return out


def compile_specs(dtype: str, head_dim: int, config: dict, n_outlier: int = N_OUTLIER):
    """[(name, kernel, signature, constexprs, attrs, num_warps)] for
    triton.compile(GluonASTSource(...)) of the attention kernel, specialised as a launch on
    contiguous [B, H, L, D] tensors specialises it (tensor descriptors by their block shape
    and shared layout)."""
    block_d = padded_head_dim(head_dim)
    side = max(2 * n_outlier, 16)
    shapes = _block_shapes(config["BLOCK_N"], block_d, side)
    descs = {f"{n}_desc": f"tensordesc<fp8e4nv[{', '.join(map(str, s))}],{_fp8_layout(s)!r}>" for n, s in shapes.items()}
    names = ["q_desc", "qs_desc", "k_desc", "ks_desc", "v_desc", "ones_desc", "SQ", "SK", "SV", "VMEAN", "O",
             "stride_ob", "stride_oh", "stride_om", "stride_od", "H", "LQ", "LK", "LQ_PAD", "LK_PAD", "NQB", "NKB", "N_TILES"]
    types = dict(descs, O=f"*{dtype}", **{n: "*fp32" for n in ("SQ", "SK", "SV", "VMEAN")})
    sig = {n: types.get(n, "i32") for n in names}
    const = dict(stride_od=1, HEAD_DIM=head_dim, BLOCK_N=config["BLOCK_N"], BLOCK_D=block_d, STAGES=config["STAGES"],
                 N_OUT=n_outlier, TWO_LEVEL=config["TWO_LEVEL"], CONSUMER_REGS=config["CONSUMER_REGS"],
                 PRODUCER_REGS=config["PRODUCER_REGS"], **loop_options(config))
    for n in const:
        sig[n] = "constexpr"
    order = list(sig)
    aligned = ["SV", "VMEAN", "O", "stride_ob", "stride_oh", "stride_om", "LQ_PAD", "LK_PAD"]
    attrs = {(order.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return [("_attn_fp8_gluon_fwd", _attn_fp8_gluon_fwd, sig, const, attrs, 4)]


__all__ = ["attention_gluon_fp8", "attention_gluon_fp8_quantized", "gluon_refusal", "gluon_api_refusal",
           "api_gaps", "call_refusal", "compile_specs", "default_config", "GluonUnsupportedError", "GLUON_CONFIGS",
           "MAX_HEAD_DIM", "BLOCK_M", "loop_options", "p_relabel", "P_RELABEL_ORDER", "quantize_for_config"]


# At the end of the file: a line added above the @gluon.jit kernels would move their line
# numbers, which are part of their cache keys (every user would recompile them).
def _release_refusal(kernel: str) -> str | None:
    """gpu_rules.gluon_release_refusal's reason for the installed Triton: the Gluon kernels run
    only on the minors where they were checked on a GPU (GLUON_GPU_VERIFIED)."""
    rule = gluon_release_refusal(kernel, _device.triton_version())
    return rule.reason if rule is not None else None
