"""FP8 W8A8 Linear (y = x @ W.T + b) in Triton: weight and activation quantisation, the
persistent GEMM, its configs per arch and the launcher. The public entry is kernels.linear
(method "fp8_w8a8"), which calls `prepare` and `run_linear` below.

Numerics:
- weights: float8 e4m3 with one scale per output channel (amax / 448), quantised once per
  layer (`quantize_weight`), or taken as they come from an FP8 checkpoint (already e4m3 with
  a per-tensor or per-channel scale);
- activations: one scale per token (row), computed by a small kernel that reads the bf16 row
  once and writes e4m3 plus the scale. Per-token scales keep a token with large values from
  crushing the others' resolution; outlier *channels* (the same few columns large in every
  token) still share their row's scale, which is what e4m3's 3 mantissa bits tolerate: rel.
  L2 0.027-0.029 against cuBLAS BF16 at Flux/Wan shapes on the H200 with 20x outlier
  channels, the same as torch._scaled_mm row-wise (that rounding is e4m3's, not the kernel's);
- the GEMM accumulates in fp32 and applies row scale x channel scale, the bias and the output
  cast in its epilogue, so the only extra pass over memory is the activation quantisation
  (2.4-4.3 TB/s measured, the H200 copies at 4.3: 3-13 % of a Linear call). Fusing it into the
  GEMM prologue instead was not built: each program would re-read the bf16 rows (2 bytes an
  element instead of 1) once per N tile (12-54 N tiles at these shapes) and convert them in
  the MMA loop, while the most it can save is the fp8 write and re-read (a third of the
  separate pass's bytes).

Layout: e4m3 wgmma (sm_90) needs both operands K-major. x [M, K] is; the weight is kept as
nn.Linear stores it, [N, K] row-major, i.e. W.T is K-major, and the kernel multiplies by the
transposed view of each [BLOCK_N, BLOCK_K] tile.

The GEMM is persistent (one program per SM walks tiles NUM_PROGRAMS apart) with grouped tile
order (GROUP_M row tiles share one sweep of N tiles, so a weight tile is reused from L2 while
it is hot). Where the tiles leave the last wave partial and K is long (tail_split), those last
tiles are cut along K across the idle SMs and summed by the slice that finishes last. On
sm_90 tiles come through TMA descriptors (zero-filled out of bounds, clipped stores);
elsewhere through pointer loads with rows clamped into range (their results are dropped by the
masked store), so the main loop carries no row masks. K and N must be multiples of 16 (TMA
strides and MMA depth); M is anything.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import NamedTuple

import torch

from ..core.kernel_common import tl, triton  # None, None where Triton does not import

from ..core import cache_registry, direct_launch, env_settings
from ..core import device as _device
from ..core.gpu_rules import feature_refusal
from ..core.kernel_common import LAUNCH_OPTIONS, arch_family, cdiv, family_in, fp8_device_refusal, next_pow2, sm_count

# The weight and activation quantisation and the split tail live beside; their names stay
# importable from here (this module's API).
from .fp8_quant import (ALIGN_ELEMENTS, AMAX_FLOOR, FP8_MAX, IN_DTYPES, QUANT_LOOP_BLOCK,  # noqa: F401
                        QUANT_ONE_PASS_MAX, Fp8LinearUnsupportedError, Fp8LinearWeight, check_features,
                        quantize_weight)
from .tail_split import (INTERPRETER_PROGRAMS, TAIL_LOCK_REGIONS, TAIL_ROWS, TAIL_SPLIT_MAX,  # noqa: F401
                         TailSplit, tail_lock_region, tail_rows, tail_split)

if triton is not None:
    from .fp8_quant import quant_rows_fp8
    from .gemm_common import activation, load_k_tile, scale_bias, store_tile, tile_coords, tile_operands

log = logging.getLogger("triton_accel.kernels.linear.fp8")  # not __name__: the clone's folder name


# Tiles per arch family (kernel_common.arch_family; sm_120 falls back to sm89). Keys: BLOCK_M,
# BLOCK_N, BLOCK_K, GROUP_M (row tiles per group of the tile order), num_warps, num_stages,
# TMA (tensor descriptors, Hopper+).
# sm90: the FP8 persistent-TMA tile of Triton's matmul tutorial (128x256x128, 3 stages: 208 KB
# of shared memory with the epilogue's TMA-store buffer; 8 warps = two warpgroups of 64 rows).
# It won benchmarks/linear_bench.py's sweep against 128x128 / 256x128 tiles, BLOCK_K 64 and the
# pointer-load variant; GROUP_M 16 for Flux's MLP up and down (8/16/32 tie elsewhere).
# sm89 / sm120 (~100 KB of shared memory, mma.sync): 128x128x64 x 3 stages = 48 KB, untimed.
# SPLIT_TAIL (sm90, interpreter): the last, partial wave of tiles may be split along K
# (tail_split); the value is a split's fixed cost in K tiles of MMA time (~0.9 us each for
# 128x256x128 e4m3). sm90's 12: a split into 2 costs ~9 us more than half the K loop
# (benchmarks/linear_bench.py; the partials' stores, the counter's fence, the last slice's sum),
# so Flux's K = 3072 GEMMs (24 K tiles) are not split and those of K = 12288 / 15360 are.
LINEAR_FP8_CONFIGS = {
    "sm90": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=16, num_warps=8, num_stages=3, TMA=True,
                 SPLIT_TAIL=12),
    "sm89": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, TMA=False),
    # AMD with OCP FP8 dots (gfx950, gfx12; gpu_rules.amd_fp8_refusal): sm89's tile, which fits
    # 64 KB of LDS (32 KB as Triton 3.9 compiles it for gfx1201); untimed, not run on AMD here.
    "hip": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, TMA=False),
    # The interpreter runs on numpy: small tiles keep CPU tests fast and still walk several
    # tiles per program, partial tiles and several K steps.
    "interpreter": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1, TMA=False,
                        SPLIT_TAIL=0),
}

# Activations the GEMM epilogue applies to output columns >= act_from (kernels.linear.dispatch's
# `activation`): the code each kernel's ACT constexpr takes. 0 is none; epilogue_act() picks
# the hardware-tanh variant where it can run.
ACTIVATIONS = {"gelu_tanh": 1}
ACT_GELU_TANH_HW = 2  # gelu_tanh through tanh.approx.f32 (NVIDIA sm_75+, 16-bit outputs)


def epilogue_act(act: int, device: torch.device, out_dtype: torch.dtype) -> int:
    """The ACT constexpr for a launch: gelu_tanh becomes its tanh.approx.f32 form on NVIDIA
    GPUs when the output is 16-bit (whose rounding hides the instruction's ~2^-11 error)."""
    if (act == ACTIVATIONS["gelu_tanh"] and device.type == "cuda" and torch.version.hip is None
            and out_dtype in (torch.float16, torch.bfloat16)):
        return ACT_GELU_TANH_HW
    return act

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_weight_rows(weight: torch.Tensor) -> Fp8LinearWeight:
    """Per-output-channel e4m3 of a float weight [N, K] through the activation row kernel (a
    weight row is an output channel): one read of the weight, one e4m3 write, no host sync.

    For weights quantised on every call and then dropped (ComfyUI's dynamic VRAM streams them
    into a transient buffer, so there is nothing to keep): `quantize_weight`'s torch ops make
    several passes over an fp32 copy, fine once per layer, not per call. The scale is the same
    (channel amax / 448); the value is x * (448 / amax) instead of x / (amax / 448), which can
    differ in the last bit before the e4m3 rounding.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features]; got shape {tuple(weight.shape)}")
    n, k = weight.shape
    check_features(n, k)
    if weight.dtype not in IN_DTYPES:
        raise Fp8LinearUnsupportedError(f"the row quantiser takes float16/bfloat16/float32 weights; got {weight.dtype}")
    q, s = quantize_activation(weight if weight.stride(-1) == 1 else weight.contiguous())
    return Fp8LinearWeight(q, s)


def config_family(arch: str) -> str:
    """The key of LINEAR_FP8_CONFIGS for a device arch ("sm90", "sm89", "sm120"...)."""
    return family_in(LINEAR_FP8_CONFIGS, arch_family(arch))


if triton is not None:

    @triton.jit
    def _store_activated_copy(S, out, rm, rn, M, N, stride_sm, ACT_FROM):
        # The activated columns (>= ACT_FROM) once more, into S: a contiguous [M, N - ACT_FROM]
        # tensor whose column 0 is ACT_FROM (SPLIT_ACT).
        s_ptrs = S + rm.to(tl.int64)[:, None] * stride_sm + (rn - ACT_FROM)[None, :]
        tl.store(s_ptrs, out.to(S.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] >= ACT_FROM) & (rn[None, :] < N))

    @triton.jit
    def _tail_slice(unit, DP_TILES, k_tiles, num_pid_m, num_pid_n, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr):
        # Unit u of the split tail: tile DP_TILES + u // SPLIT_K, K tiles [k_lo, k_hi) of it.
        # Consecutive units (one per program) are the slices of one tile.
        tail = unit // SPLIT_K
        part = unit % SPLIT_K
        pid_m, pid_n = tile_coords(DP_TILES + tail, num_pid_m, num_pid_n, GROUP_M)
        return tail, pid_m, pid_n, part * k_tiles // SPLIT_K, (part + 1) * k_tiles // SPLIT_K

    @triton.jit
    def _tail_partial(acc, unit, tail, WS, LOCKS, C, SA, SB, BIAS, off_m, off_n, M, N, stride_cm, ACT_FROM,
                      HAS_BIAS: tl.constexpr, ACT: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, RED_ROWS: tl.constexpr):
        # One K slice's fp32 partial goes to its own workspace slot; the slice that arrives last
        # at the tile's counter sums the SPLIT_K slots in slot order (the same bits whichever
        # slice is last, so a launch repeats exactly), RED_ROWS rows at a time (a whole second
        # fp32 tile would not fit the registers beside the first), then runs the epilogue.
        # The barrier puts every thread's partial before the counter's release; the loads skip
        # L1 (.cg): the other slices' partials were written by other SMs.
        tile_elems = BLOCK_M * BLOCK_N
        cols = tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        tl.store(WS + unit * tile_elems + rows[:, None] * BLOCK_N + cols[None, :], acc)
        tl.debug_barrier()
        arrived = tl.atomic_add(LOCKS + tail, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tl.atomic_xchg(LOCKS + tail, 0)  # zero again for the next launch
            base = WS + tail * SPLIT_K * tile_elems  # < 2^31: at most 8 * sm_count slices
            rn = off_n + cols
            for r in tl.static_range(0, BLOCK_M, RED_ROWS):
                offs = (r + tl.arange(0, RED_ROWS))[:, None] * BLOCK_N + cols[None, :]
                total = tl.load(base + offs, cache_modifier=".cg")
                for j in tl.static_range(1, SPLIT_K):
                    total += tl.load(base + j * tile_elems + offs, cache_modifier=".cg")
                rm = off_m + r + tl.arange(0, RED_ROWS)
                out = activation(scale_bias(total, SA, SB, BIAS, rm, rn, M, N, HAS_BIAS), rn, ACT, ACT_FROM)
                store_tile(C, out, rm, rn, M, N, stride_cm)

    @triton.jit
    def _fp8_linear_tma(
        a_desc, b_desc, c_desc, s_desc, SA, SB, BIAS, M, N, K, ACT_FROM, C, WS, LOCKS, DP_TILES,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
        EPILOGUE_SUBTILE: tl.constexpr, ACT: tl.constexpr, SPLIT_ACT: tl.constexpr, SPLIT_K: tl.constexpr,
        RED_ROWS: tl.constexpr,
    ):
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        # FLATTEN folds the tile loop and the K loop into one software-pipelined loop (Triton's
        # persistent-matmul tutorial): the next tile's first TMA loads are issued while this
        # tile's epilogue runs, instead of the pipeline draining and refilling per tile.
        # Tiles from DP_TILES on are the split tail (tail_split), after this loop.
        for tile in tl.range(tl.program_id(0), DP_TILES, NUM_PROGRAMS, flatten=FLATTEN):
            pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            # Out-of-bounds rows / K columns arrive as zeros from TMA: no masks in the loop.
            for ki in range(k_tiles):
                a = a_desc.load([off_m, ki * BLOCK_K])
                b = b_desc.load([off_n, ki * BLOCK_K])
                acc = tl.dot(a, b.T, acc)
            rm = off_m + tl.arange(0, BLOCK_M)
            rn = off_n + tl.arange(0, BLOCK_N)
            out = scale_bias(acc, SA, SB, BIAS, rm, rn, M, N, HAS_BIAS)
            if ACT != 0:
                if off_n + BLOCK_N > ACT_FROM:  # tiles left of the activated columns skip it
                    out = activation(out, rn, ACT, ACT_FROM)
            out = out.to(c_desc.dtype)
            if EPILOGUE_SUBTILE:
                # Two half-width stores through a half-size staging buffer: the shared memory
                # saved goes to the operand ring (c_desc's block is [BLOCK_M, BLOCK_N // 2]).
                halves = tl.permute(tl.reshape(out, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
                left, right = tl.split(halves)
                c_desc.store([off_m, off_n], left)  # TMA clips partial tiles
                c_desc.store([off_m, off_n + BLOCK_N // 2], right)
                if SPLIT_ACT:
                    # ACT_FROM is a multiple of BLOCK_N here (the launcher's rule): a tile is
                    # activated whole or not at all.
                    if off_n >= ACT_FROM:
                        s_desc.store([off_m, off_n - ACT_FROM], left)
                        s_desc.store([off_m, off_n - ACT_FROM + BLOCK_N // 2], right)
            else:
                c_desc.store([off_m, off_n], out)  # TMA clips the partial tile
                if SPLIT_ACT:
                    if off_n >= ACT_FROM:
                        s_desc.store([off_m, off_n - ACT_FROM], out)
        if SPLIT_K > 1:
            for unit in range(tl.program_id(0), (num_pid_m * num_pid_n - DP_TILES) * SPLIT_K, NUM_PROGRAMS):
                tail, pid_m, pid_n, k_lo, k_hi = _tail_slice(unit, DP_TILES, k_tiles, num_pid_m, num_pid_n, GROUP_M,
                                                             SPLIT_K)
                off_m = pid_m * BLOCK_M
                off_n = pid_n * BLOCK_N
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for ki in range(k_lo, k_hi):
                    a = a_desc.load([off_m, ki * BLOCK_K])
                    b = b_desc.load([off_n, ki * BLOCK_K])
                    acc = tl.dot(a, b.T, acc)
                _tail_partial(acc, unit, tail, WS, LOCKS, C, SA, SB, BIAS, off_m, off_n, M, N, N, ACT_FROM, HAS_BIAS,
                              ACT, SPLIT_K, BLOCK_M, BLOCK_N, RED_ROWS)

    @triton.jit
    def _fp8_linear_ptr(
        A, B, C, S, SA, SB, BIAS, M, N, K, stride_am, stride_bn, stride_cm, stride_sm, ACT_FROM, WS, LOCKS,
        DP_TILES,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, EVEN_K: tl.constexpr, ACT: tl.constexpr,
        SPLIT_ACT: tl.constexpr, SPLIT_K: tl.constexpr, RED_ROWS: tl.constexpr,
    ):
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), DP_TILES, NUM_PROGRAMS):
            rm, rn, a_ptrs, b_ptrs = tile_operands(tile, A, B, M, N, stride_am, stride_bn, num_pid_m, num_pid_n,
                                                    GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                a, b = load_k_tile(a_ptrs, b_ptrs, ki, K, BLOCK_K, EVEN_K, 0.0, 0.0)
                acc = tl.dot(a, tl.trans(b), acc)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
            out = activation(scale_bias(acc, SA, SB, BIAS, rm, rn, M, N, HAS_BIAS), rn, ACT, ACT_FROM)
            store_tile(C, out, rm, rn, M, N, stride_cm)
            if SPLIT_ACT:  # masked: tiles left of ACT_FROM store nothing there
                _store_activated_copy(S, out, rm, rn, M, N, stride_sm, ACT_FROM)
        if SPLIT_K > 1:  # the split tail (no SPLIT_ACT: the launcher does not split those)
            for unit in range(tl.program_id(0), (num_pid_m * num_pid_n - DP_TILES) * SPLIT_K, NUM_PROGRAMS):
                tail, pid_m, pid_n, k_lo, k_hi = _tail_slice(unit, DP_TILES, k_tiles, num_pid_m, num_pid_n, GROUP_M,
                                                             SPLIT_K)
                rm, rn, a_ptrs, b_ptrs = tile_operands(DP_TILES + tail, A, B, M, N, stride_am, stride_bn, num_pid_m,
                                                        num_pid_n, GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K)
                a_ptrs += k_lo * BLOCK_K
                b_ptrs += k_lo * BLOCK_K
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for ki in range(k_lo, k_hi):
                    a, b = load_k_tile(a_ptrs, b_ptrs, ki, K, BLOCK_K, EVEN_K, 0.0, 0.0)
                    acc = tl.dot(a, tl.trans(b), acc)
                    a_ptrs += BLOCK_K
                    b_ptrs += BLOCK_K
                _tail_partial(acc, unit, tail, WS, LOCKS, C, SA, SB, BIAS, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N,
                              stride_cm, ACT_FROM, HAS_BIAS, ACT, SPLIT_K, BLOCK_M, BLOCK_N, RED_ROWS)


class _CudaFacts(NamedTuple):
    """What every call on one kind of CUDA device would otherwise work out again (a Flux step
    makes ~150 of our Linear calls, each checked three times: tens of microseconds of host time)."""

    refusal: str | None
    config: dict  # the arch's tile config (copied by callers that change it)
    host_tma: bool  # the installed Triton has host tensor descriptors


_cuda_facts_cache: dict[tuple, _CudaFacts] = {}
cache_registry.register("kernels.linear.fp8.cuda_facts", _cuda_facts_cache.clear)
# Direct-launch key of a GEMM -> (TMA kernel?, its descriptor blocks): the plan's arguments.
_gemm_layouts: dict = {}
cache_registry.register("kernels.linear.fp8.gemm_layouts", _gemm_layouts.clear)


def _cuda_facts(device: torch.device) -> _CudaFacts:
    # Keyed by what decides them (the device's description, the Triton version), both cached
    # lookups themselves, so a changed answer (a test's fake GPU) is never served stale.
    info, version = _device.describe(device), _device.triton_version()
    facts = _cuda_facts_cache.get((info, version))
    if facts is None:
        refusal = fp8_device_refusal(device, "FP8 Linear")
        config = {} if refusal else dict(LINEAR_FP8_CONFIGS[config_family(info.arch)])
        facts = _cuda_facts_cache[(info, version)] = _CudaFacts(
            refusal, config, feature_refusal("host_tensor_descriptor", version) is None)
    return facts


def _check_device(device: torch.device) -> bool:
    """Raise Fp8LinearUnsupportedError where the kernels cannot run; True on the interpreter."""
    reason = _cuda_facts(device).refusal if device.type == "cuda" else fp8_device_refusal(device, "FP8 Linear")
    if reason is not None:
        raise Fp8LinearUnsupportedError(reason)
    return device.type == "cpu"


def default_config(device: torch.device, interpreter: bool) -> dict:
    if interpreter:
        return dict(LINEAR_FP8_CONFIGS["interpreter"])
    return dict(LINEAR_FP8_CONFIGS[config_family(_device.describe(device).arch)])


def quantize_activation(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 of a [M, K] activation (unit last stride): (x_fp8 [M, K], scale [M] fp32)."""
    interpreter = _check_device(x2d.device)
    m, k = x2d.shape
    y = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x2d.device)
    s = torch.empty((m,), dtype=torch.float32, device=x2d.device)
    if m == 0:
        return y, s
    args = (x2d, y, s, k, x2d.stride(0))
    key = None
    if direct_launch.usable(x2d):
        key = _quant_key(x2d.device, x2d.dtype, m, k, x2d.stride(0), x2d.data_ptr() % 16)
        plan = direct_launch.lookup(key)
        if plan is not None:
            direct_launch.launch(plan, x2d.device.index, args)
            return y, s
    one_pass = k <= QUANT_ONE_PASS_MAX
    block = next_pow2(k, 1) if one_pass else QUANT_LOOP_BLOCK
    warps = 8 if block >= 4096 else 4
    consts = dict(BLOCK_K=block, ONE_PASS=one_pass, EXACT_CAST=interpreter)
    kernel = quant_rows_fp8[(m,)](*args, **consts, num_warps=warps, **LAUNCH_OPTIONS)
    if key is not None:
        direct_launch.record(key, kernel, (m,), tuple(consts[n] for n in _QUANT_CONSTEXPRS), args, out_index=1)
    return y, s


def _quant_key(device, dtype, m: int, k: int, stride_m: int, align: int) -> tuple:
    """Direct-launch key of the activation quantisation: everything the JIT specialises on
    (shapes, strides, dtype, the input pointer's 16-byte alignment; the outputs are fresh)."""
    return ("fp8_quant_rows", device, dtype, m, k, stride_m, align)


def _gemm_key(device, m: int, n: int, k: int, out_dtype, has_bias: bool, act: int, act_from: int, config,
              w: Fp8LinearWeight, x_align: int, x_stride: int, x_scale_align: int, bias_align: int,
              bias_dtype, act_out_align: int | None = None) -> tuple:
    """Direct-launch key of the GEMM: shapes, dtypes, the epilogue, the config and the
    pointers' 16-byte alignment (a weight sliced out of a fused one may be unaligned). Without
    a bias the kernel gets x_scale in its place: bias_align/bias_dtype are then x_scale's."""
    return ("fp8_gemm", device, m, n, k, out_dtype, has_bias, int(act), act_from,
            None if config is None else tuple(sorted(config.items())), x_align,
            w.weight.data_ptr() % 16, x_scale_align, w.scale.data_ptr() % 16,
            bias_align, bias_dtype, x_stride, w.weight.stride(0), act_out_align)


def _subtiled(cfg: dict, fp32_out: bool) -> bool:
    """EPILOGUE_SUBTILE for a TMA launch: as configured, and always for fp32 outputs, whose
    full [BLOCK_M, BLOCK_N] staging tile (128 KB at sm90's 128x256) would not fit beside the
    operand ring (272 KB of the H100/H200's 227 KB)."""
    return bool(cfg.get("EPILOGUE_SUBTILE", False)) or fp32_out


def _tma_usable(*tensors: torch.Tensor, host_tma: bool | None = None) -> bool:
    """Host TMA descriptors: Triton 3.4+ and 16-byte aligned bases (a weight sliced out of a
    fused one may not be); otherwise the pointer-load kernel serves the call. `host_tma`: the
    Triton half already known (_CudaFacts), else asked here."""
    if host_tma is None:
        host_tma = feature_refusal("host_tensor_descriptor", _device.triton_version()) is None
    return host_tma and all(t.data_ptr() % 16 == 0 for t in tensors)


def fp8_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, w: Fp8LinearWeight, bias: torch.Tensor | None,
             out_dtype: torch.dtype, config: dict | None = None, act: int = 0, act_from: int = 0,
             act_out: torch.Tensor | None = None) -> torch.Tensor:
    """(x_fp8 * x_scale) @ (W * w_scale).T + bias, cast to out_dtype: the GEMM alone; `act`
    (ACTIVATIONS' code, 0 none) applied to output columns >= act_from. `act_out`: a contiguous
    [M, N - act_from] tensor of out_dtype that also receives those activated columns (the
    output keeps them too): a consumer that needs them contiguous (a torch.cat) reads it."""
    m, k = x_fp8.shape
    n = w.out_features
    device = x_fp8.device
    interpreter = _check_device(device)
    out = torch.empty((m, n), dtype=out_dtype, device=device)
    if m == 0:
        return out
    bias_arg = bias if bias is not None else x_scale  # placeholder pointer, never read
    act_from = int(act_from)
    key = None
    if direct_launch.usable(out):
        key = _gemm_key(device, m, n, k, out_dtype, bias is not None, act, act_from, config, w,
                        x_fp8.data_ptr() % 16, x_fp8.stride(0), x_scale.data_ptr() % 16,
                        bias_arg.data_ptr() % 16, bias_arg.dtype,
                        None if act_out is None else act_out.data_ptr() % 16)
        plan = direct_launch.lookup(key)
        if plan is not None:
            tma, blocks, tail = _gemm_layouts[key]
            args = _gemm_args(tma, x_fp8, x_scale, w, bias_arg, out, blocks, act_from, act_out=act_out, tail=tail)
            if args is not None:
                direct_launch.launch(plan, device.index, args)
                return out
    if config is None:
        cfg = default_config(device, True) if interpreter else _cuda_facts(device).config
    else:
        cfg = config
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tiles = cdiv(m, bm) * cdiv(n, bn)
    sms = INTERPRETER_PROGRAMS if interpreter else sm_count(device.index or 0)
    split = act_out is not None
    tail = TailSplit(1, tiles, 0)
    if not split and (cfg.get("TAIL_SPLIT_K") or (cfg.get("SPLIT_TAIL") is not None
                                                   and env_settings.split_tail_enabled())):
        # The activated copy (SPLIT_ACT) has no split form: its tiles stay whole.
        tail = tail_split(tiles, sms, cdiv(k, bk), cfg.get("SPLIT_TAIL"), bm, bn, cfg.get("TAIL_SPLIT_K"))
    programs = sms if tail.split > 1 else min(tiles, sms)
    consts = dict(HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
                  NUM_PROGRAMS=programs, ACT=epilogue_act(int(act), device, out_dtype), SPLIT_ACT=split)
    # The interpreter takes the TMA kernel only when a test's config asks for it by name.
    tma = (bool(cfg.get("TMA")) and (not interpreter or config is not None)
           and _tma_usable(x_fp8, w.weight, host_tma=None if interpreter else _cuda_facts(device).host_tma)
           # The TMA epilogue copies whole tiles: the copy must start on a tile and its rows
           # (and base) be 16-byte aligned; otherwise the pointer kernel copies per element.
           and (not split or (act_from % bn == 0 and act_out.data_ptr() % 16 == 0
                              and (act_out.stride(0) * act_out.element_size()) % 16 == 0)))
    if tma:
        # Two stores per activated tile: half-width staging keeps them inside shared memory.
        subtile = _subtiled(cfg, out_dtype == torch.float32) or split
        consts.update(FLATTEN=bool(cfg.get("FLATTEN", False)), EPILOGUE_SUBTILE=subtile)
        blocks = (bm, bn, bk, bn // 2 if subtile else bn)
        fn, order = _fp8_linear_tma, _TMA_CONSTEXPRS
    else:
        consts.update(EVEN_K=k % bk == 0)
        blocks = None
        fn, order = _fp8_linear_ptr, _PTR_CONSTEXPRS
    args = _gemm_args(tma, x_fp8, x_scale, w, bias_arg, out, blocks, act_from, act_out=act_out, tail=tail)
    if args is None:  # no counters for a split inside this capture: whole tiles
        tail = TailSplit(1, tiles, 0)
        programs = min(tiles, sms)
        consts["NUM_PROGRAMS"] = programs
        args = _gemm_args(tma, x_fp8, x_scale, w, bias_arg, out, blocks, act_from, act_out=act_out, tail=tail)
    consts.update(SPLIT_K=tail.split, RED_ROWS=tail_rows(tail.split, bm))
    kernel = fn[(programs,)](*args, **consts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                             **LAUNCH_OPTIONS)
    if key is not None and kernel is not None:
        # How to rebuild the arguments for the plan (descriptors are per call: new tensors).
        _gemm_layouts[key] = (tma, blocks, tail)
        direct_launch.record(key, kernel, (programs,), tuple(consts[n] for n in order), args, out=out,
                             rebind=lambda probe: _gemm_args(tma, x_fp8, x_scale, w, bias_arg, probe, blocks,
                                                             act_from, act_out=act_out, tail=tail))
    return out


def _gemm_args(tma: bool, x_fp8, x_scale, w: Fp8LinearWeight, bias_arg, out, blocks, act_from: int,
               w_desc=None, act_out=None, templates=None, *, tail: TailSplit) -> tuple | None:
    """The GEMM kernels' runtime arguments (constexprs excluded), in signature order. `w_desc`:
    the weight's TMA descriptor when the caller keeps one (it only changes with the weight).
    Without `act_out` the output stands in for it (SPLIT_ACT off: never written). `templates`:
    the (x, output, activated copy) descriptors of an earlier call of this signature, rebased
    onto this call's tensors (_rebased) instead of built. `tail`: the launch's TailSplit; a
    split's workspace is allocated here, per call. None where a split launch finds no counters
    (tail_lock_region)."""
    m, k = x_fp8.shape
    n = out.shape[1]
    if tail.split == 1:
        # Unused by the kernel (SPLIT_K 1): placeholders of the right kind, every tile whole.
        split_args = (x_scale, x_scale, tail.dp_tiles)
    else:
        locks = tail_lock_region(out.device)
        if locks is None:
            return None
        split_args = (torch.empty(tail.workspace, dtype=torch.float32, device=out.device), locks, tail.dp_tiles)
    if tma:
        if templates is not None:
            c_desc = _rebased(templates[1], out)
            return (_rebased(templates[0], x_fp8), w_desc, c_desc,
                    c_desc if act_out is None else _rebased(templates[2], act_out), x_scale, w.scale, bias_arg, m, n,
                    k, act_from, out, *split_args)
        from triton.tools.tensor_descriptor import TensorDescriptor

        bm, bn, bk, bn_out = blocks
        if w_desc is None:
            w_desc = TensorDescriptor(w.weight, [n, k], [k, 1], [bn, bk])
        c_desc = TensorDescriptor(out, [m, n], [n, 1], [bm, bn_out])
        s_desc = c_desc if act_out is None else TensorDescriptor(act_out, [m, n - act_from], [n - act_from, 1],
                                                                 [bm, bn_out])
        return (TensorDescriptor(x_fp8, [m, k], [k, 1], [bm, bk]), w_desc, c_desc, s_desc, x_scale, w.scale,
                bias_arg, m, n, k, act_from, out, *split_args)
    s = out if act_out is None else act_out
    return (x_fp8, w.weight, out, s, x_scale, w.scale, bias_arg, m, n, k, x_fp8.stride(0), w.weight.stride(0),
            out.stride(0), s.stride(0), act_from, *split_args)


def _rebased(template, base: torch.Tensor):
    """A copy of the TensorDescriptor `template` over `base`, a tensor of the template's dtype,
    shape and strides from the caching allocator (16-byte aligned, as the template's base was):
    the constructor's checks, which the template passed, cost ~4 us a descriptor, three a GEMM
    call on the host-bound Flux step. Whatever fields this Triton's descriptor has are copied."""
    desc = object.__new__(type(template))
    desc.__dict__.update(template.__dict__)
    desc.base = base
    return desc


def fp8_linear(x: torch.Tensor, w: Fp8LinearWeight, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, config: dict | None = None) -> torch.Tensor:
    """y = x @ W.T + bias with x quantised per token to e4m3 and W from `quantize_weight`.

    x: [..., K] float16/bfloat16/float32; the result has x's leading dims and out_dtype
    (default: x's dtype), computed in fp32 from the e4m3 products.
    """
    if not isinstance(w, Fp8LinearWeight):
        raise TypeError("w must come from quantize_weight()")
    k = w.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    if x.dtype not in IN_DTYPES:
        raise Fp8LinearUnsupportedError(f"FP8 Linear takes float16/bfloat16/float32 activations; got {x.dtype}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in OUT_DTYPES:
        raise Fp8LinearUnsupportedError(f"FP8 Linear writes float16/bfloat16/float32; got {out_dtype}")
    if x.device != w.weight.device or (bias is not None and bias.device != x.device):
        raise ValueError("x, the weight and the bias must be on one device")
    if bias is not None and bias.shape != (w.out_features,):
        raise ValueError(f"bias must have shape ({w.out_features},); got {tuple(bias.shape)}")
    _check_device(x.device)
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    x_fp8, x_scale = quantize_activation(x2d)
    out = fp8_gemm(x_fp8, x_scale, w, bias.contiguous() if bias is not None else None, out_dtype, config)
    return out.reshape(*x.shape[:-1], w.out_features)


def prepare(weight: torch.Tensor, weight_scale=None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """kernels.linear.dispatch's entry: (e4m3 weight [N, K], fp32 scale [N], rotation 0)."""
    w = quantize_weight(weight, weight_scale)
    return w.weight, w.scale, 0


def run_linear(x2d: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               rotation: int, out_dtype: torch.dtype, act: int = 0, act_from: int = 0,
               act_out: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.linear.dispatch's entry: a checked [M, K] call (unit last stride) on a prepared weight;
    `act_out` a checked contiguous [M, N - act_from] copy of the activated columns."""
    _check_device(x2d.device)
    x_fp8, x_scale = quantize_activation(x2d)
    return fp8_gemm(x_fp8, x_scale, Fp8LinearWeight(weight, scale), bias, out_dtype, act=act, act_from=act_from,
                    act_out=act_out)


class DirectCall:
    """One Linear call signature's two launches (activation quantisation, GEMM), repeated.

    Made after a call of that signature ran through fp8_linear's checked path; from then on a
    call with the same input layout, output dtype, epilogue and bias layout (the caller's key)
    allocates the three outputs and launches both kernels from their verified direct-launch
    plans, keeping the weight's TMA descriptor: about half the host time of the checked path.
    Returns None, and the caller takes the checked path, while a plan is not verified yet (the
    JIT launch verifies it on the second call) or direct launches are off."""

    __slots__ = ("quant_key", "gemm_key", "tma", "blocks", "tail", "w", "m", "n", "k", "out_dtype", "act_from",
                 "device", "device_index", "bias_align", "act_out_align", "w_desc", "templates")

    def __init__(self, quant_key, gemm_key, tma, blocks, w: Fp8LinearWeight, m, n, k, out_dtype, act_from,
                 device, bias_align, act_out_align=None, tail: TailSplit | None = None):
        self.quant_key, self.gemm_key, self.tma, self.blocks = quant_key, gemm_key, tma, blocks
        # The split the plan was compiled for (its SPLIT_K); None: whole tiles.
        self.tail = tail if tail is not None else TailSplit(1, cdiv(m, blocks[0]) * cdiv(n, blocks[1]), 0)
        self.w, self.m, self.n, self.k, self.out_dtype, self.act_from = w, m, n, k, out_dtype, act_from
        self.device, self.device_index, self.bias_align = device, device.index or 0, bias_align
        self.act_out_align = act_out_align  # None: calls without the activated copy
        self.w_desc = None
        self.templates = None  # the first call's (x, output, activated copy) descriptors, where tma, no bases
        if tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            self.w_desc = TensorDescriptor(w.weight, [n, k], [k, 1], [blocks[1], blocks[2]])

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, act_out: torch.Tensor | None = None):
        quant, gemm = direct_launch.lookup(self.quant_key), direct_launch.lookup(self.gemm_key)
        if (quant is None or gemm is None or not direct_launch.usable(x)
                or torch.cuda.current_device() != self.device_index
                or (bias is not None and bias.data_ptr() % 16 != self.bias_align)
                or (act_out is None) != (self.act_out_align is None)
                or (act_out is not None and act_out.data_ptr() % 16 != self.act_out_align)):
            return None
        m, n, device = self.m, self.n, self.device
        y, s = self._quantized(x, quant)
        out = torch.empty((m, n), dtype=self.out_dtype, device=device)
        args = _gemm_args(self.tma, y, s, self.w, s if bias is None else bias, out, self.blocks, self.act_from,
                          self.w_desc, None if act_out is None else act_out.view(m, n - self.act_from),
                          self.templates, tail=self.tail)
        if args is None:
            return None
        if self.tma and self.templates is None:
            # Without their bases: a template holding this call's output and e4m3 input would
            # keep them alive as long as the DirectCall (gigabytes over a model's layers).
            self.templates = (_rebased(args[0], None), _rebased(args[2], None), _rebased(args[3], None))
        direct_launch.launch(gemm, self.device_index, args)
        return out

    def _quantized(self, x: torch.Tensor, quant) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 rows, scales) of x; inside quantize_once(x), the rows given there or the copy
        made there first for this key and stream."""
        index = self.device_index
        scope = _QUANTIZE_ONCE.get()
        shared = None
        if scope is not None and scope.x is x:
            stream = direct_launch.current_stream(index)
            rows = scope.rows
            if rows is not None and stream == scope.stream and rows[0].shape == (self.m, self.k):
                scope.used += 1
                return rows
            shared, key = scope.shared, (self.quant_key, stream)
            hit = shared.get(key)
            if hit is not None:
                return hit
        m, k, device = self.m, self.k, self.device
        y = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=device)
        s = torch.empty((m,), dtype=torch.float32, device=device)
        direct_launch.launch(quant, index, (x.view(m, k), y, s, k, k))
        if shared is not None:
            shared[key] = (y, s)
        return y, s


class QuantizeOnce:
    """The state of one quantize_once block: the activation, rows made for it elsewhere (and the
    stream they were written on), the copies made inside, how many GEMMs read the given rows."""

    __slots__ = ("x", "rows", "stream", "shared", "used")

    def __init__(self, x: torch.Tensor, rows, stream):
        self.x, self.rows, self.stream = x, rows, stream
        self.shared: dict = {}
        self.used = 0


# The QuantizeOnce of the quantize_once block that runs, if any.
_QUANTIZE_ONCE: contextvars.ContextVar = contextvars.ContextVar("triton_accel_quantize_once", default=None)


def _stream_of(x: torch.Tensor):
    """The stream a kernel launched now on x's device writes on (None off CUDA)."""
    return direct_launch.current_stream(x.device.index or 0) if x.is_cuda else None


@contextlib.contextmanager
def quantize_once(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Inside this block, the Linear calls that read this very tensor (the same object) share one
    e4m3 copy of it: Wan's q, k and v read one activation, one quantisation instead of three.
    rows: x's e4m3 rows and scales already made, in quantize_activation's format and bits, on
    the current stream (a fused norm kernel writes them beside x): then no call quantises x.
    The caller promises x is not written while the block runs: ComfyUI samples under
    torch.inference_mode, whose tensors keep no version counter to check it by. Served by
    DirectCall (the repeated calls of a signature); the first calls take the checked path.
    Yields the block's QuantizeOnce (`.used`: how many GEMMs read the given rows)."""
    scope = QuantizeOnce(x, rows, _stream_of(x) if rows is not None else None)
    token = _QUANTIZE_ONCE.set(scope)
    try:
        yield scope
    finally:
        _QUANTIZE_ONCE.reset(token)


def direct_call(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype, act: int = 0, act_from: int = 0,
                act_out: torch.Tensor | None = None) -> DirectCall | None:
    """A DirectCall for calls like this one (x [..., K] contiguous, on CUDA) after it ran through
    the checked path, or None where that path must always serve it: direct launches off,
    another layout, no rows, a GEMM the checked path launched without a direct-launch key."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if (not direct_launch.usable(x) or m == 0 or not x.is_contiguous()
            or (bias is not None and not bias.is_contiguous())):
        return None
    w = Fp8LinearWeight(weight, scale)
    n, device = w.out_features, x.device
    bias_align = bias.data_ptr() % 16 if bias is not None else 0
    # The quantised activation, its scales and the output are fresh tensors from the caching
    # allocator (512-byte aligned): alignment 0, as in the keys the checked path recorded.
    quant_key = _quant_key(device, x.dtype, m, k, k, x.data_ptr() % 16)
    act_out_align = None if act_out is None else act_out.data_ptr() % 16
    gemm_key = _gemm_key(device, m, n, k, out_dtype, bias is not None, act, int(act_from), None, w, 0, k, 0,
                         bias_align, bias.dtype if bias is not None else torch.float32, act_out_align)
    layout = _gemm_layouts.get(gemm_key)
    if layout is None:
        return None
    tma, blocks, tail = layout
    return DirectCall(quant_key, gemm_key, tma, blocks, w, m, n, k, out_dtype, int(act_from), device, bias_align,
                      act_out_align, tail)


# The kernels' constexpr names in signature order: a direct launch appends their values.
_QUANT_CONSTEXPRS = direct_launch.constexpr_order(quant_rows_fp8) if triton is not None else ()
_TMA_CONSTEXPRS = direct_launch.constexpr_order(_fp8_linear_tma) if triton is not None else ()
_PTR_CONSTEXPRS = direct_launch.constexpr_order(_fp8_linear_ptr) if triton is not None else ()


def compile_specs(config: dict, out_dtype: str = "bf16", has_bias: bool = True, tma: bool | None = None,
                  act: int = 0, split: bool = False, split_k: int = 1):
    """[(kernel, signature, constexprs, attrs, options)] for triton.compile(ASTSource(...)): the
    activation quantisation and the GEMM as a launch on contiguous tensors specialises them.
    `split_k`: the GEMM with its last wave split that many ways along K (tail_split)."""
    quant_sig = {"X": "*bf16", "Y": "*fp8e4nv", "S": "*fp32", "K": "i32", "stride_xm": "i32",
                 "BLOCK_K": "constexpr", "ONE_PASS": "constexpr", "EXACT_CAST": "constexpr"}
    quant_const = dict(BLOCK_K=8192, ONE_PASS=True, EXACT_CAST=False)
    quant_attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    specs = [(quant_rows_fp8, quant_sig, quant_const, quant_attrs, dict(num_warps=8, num_stages=1))]
    use_tma = config.get("TMA", False) if tma is None else tma
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    const = dict(HAS_BIAS=has_bias, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config["GROUP_M"], NUM_PROGRAMS=132)
    scalars = {"SA": "*fp32", "SB": "*fp32", "BIAS": "*bf16", "M": "i32", "N": "i32", "K": "i32"}
    if use_tma:
        subtile = _subtiled(config, out_dtype == "fp32") or split
        c_type = f"tensordesc<{out_dtype}[{bm}, {bn // 2 if subtile else bn}]>"
        sig = {"a_desc": f"tensordesc<fp8e4nv[{bm}, {bk}]>", "b_desc": f"tensordesc<fp8e4nv[{bn}, {bk}]>",
               "c_desc": c_type, "s_desc": c_type, **scalars, "ACT_FROM": "i32", "C": f"*{out_dtype}"}
        const.update(FLATTEN=bool(config.get("FLATTEN", False)), EPILOGUE_SUBTILE=subtile)
        fn, aligned = _fp8_linear_tma, ["SA", "SB", "BIAS", "N", "K", "C"]
    else:
        sig = {"A": "*fp8e4nv", "B": "*fp8e4nv", "C": f"*{out_dtype}", "S": f"*{out_dtype}", **scalars,
               "stride_am": "i32", "stride_bn": "i32", "stride_cm": "i32", "stride_sm": "i32", "ACT_FROM": "i32"}
        fn, aligned = _fp8_linear_ptr, ["A", "B", "C", "S", "SA", "SB", "BIAS", "N", "K", "stride_am", "stride_bn",
                                        "stride_cm", "stride_sm"]
        const["EVEN_K"] = True
    # The split tail's workspace and counters (placeholders, the x scales, without a split).
    sig.update(WS="*fp32", LOCKS="*i32" if split_k > 1 else "*fp32", DP_TILES="i32")
    aligned += ["WS", "LOCKS"]
    const["ACT"] = int(act)
    const["SPLIT_ACT"] = bool(split)
    const["SPLIT_K"] = int(split_k)
    const["RED_ROWS"] = tail_rows(split_k, bm)  # the kernels' last constexpr
    for name in const:
        sig[name] = "constexpr"
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    specs.append((fn, sig, const, attrs, dict(num_warps=config["num_warps"], num_stages=config["num_stages"])))
    return specs


__all__ = ["prepare", "run_linear", "Fp8LinearWeight", "Fp8LinearUnsupportedError", "LINEAR_FP8_CONFIGS", "quantize_weight",
           "quantize_weight_rows", "quantize_activation", "fp8_gemm", "fp8_linear", "config_family", "compile_specs", "FP8_MAX",
           "ACTIVATIONS", "ACT_GELU_TANH_HW", "epilogue_act", "TailSplit", "tail_split", "tail_lock_region"]
