"""Quantisation of Q, K and V for the full-FP8 attention kernel (attention_fp8_full.py).

Four launches, all memory-bound (the fourth reads the stored V again, a quarter of V's bf16 bytes):
1. `fp8_stats_kernel`, one program per (chunk of rows, batch*head): per-channel partial
   statistics of the sequence: max|q|, sum/min/max of k and of v. A mean over the whole
   sequence cannot be had inside the quantising pass without a grid-wide barrier, so this
   small first pass (plus 2.) is the price of K and V smoothing and of choosing the outlier
   channels; it reads V once more and one row in QK_STRIDE of Q and K (Q only when outlier
   channels are on; every row of short sequences: qk_stride()).
2. `_fp8_finalize_kernel`, one program per (batch*head): reduces the partials to the K mean,
   the V mean, V's per-channel scale and the N_OUT "outlier" channels.
3. `_fp8_quant_kernel`, one program per row block: Q and K to e4m3 with one scale per block
   (BLOCK_M rows of Q, BLOCK_N rows of K: the attention kernel de-quantises a score tile with
   one multiply), V minus its mean to e4m3 with one scale per channel, written transposed
   ([D, L]: Hopper's fp8 wgmma takes its B operand K-major only, and for P.V the reduction
   runs over keys).
4. `_v_mean_fix_kernel`, one program per (batch*head, 8 channels): reads the stored V back and
   takes its mean rounding error out of the V mean the attention kernels add back.
Numerics:
- K minus its mean over the sequence: softmax(q.(k - m)) = softmax(q.k) since q.m is one
  constant per query row; real models put a large common offset on K that would otherwise
  set every block's scale. V minus its mean m_v: P.(V - m_v) + m_v = P.V because P's rows sum
  to one, and the mean (often large, per channel) is then added back exactly in fp32.
- softmax scale * log2(e) is folded into Q's block scale (the kernel uses exp2).
- e4m3 keeps 3 mantissa bits, so each product carries ~2-3% relative error, and a score's
  error is ~3% of the scores' spread. A few channels 10-100x larger than the rest (real
  DiT Q/K have them) make the spread large and softmax sharp: 4% rel. L2 in emulation on our
  outlier inputs. The N_OUT channels with the largest max|q_c| * max|k_c - m_c| therefore
  also get their rounding residual quantised: Q_side = [q_lo, q_hi], K_side = [k_hi, k_lo]
  on the same block scales, so dot(Q_side, K_side) = q_lo.k_hi + q_hi.k_lo and those
  channels' products carry ~2**-8 relative error instead of ~2**-4 (1.3% rel. L2 on the
  same inputs). The side operands are 2*N_OUT = 32 fp8 wide: one extra wgmma k-step.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.kernel_common import tl, triton  # None, None where Triton does not import

from ..core.kernel_common import LAUNCH_OPTIONS, LOG2E, cdiv  # noqa: E402  (one constant for every kernel)

if triton is not None:
    from ..core.kernel_common import reduce_stat_partials

FP8_MAX = 448.0  # largest finite float8 e4m3fn
# Outlier channels given a second (residual) fp8 term. 2*N_OUT = 32 is the depth of one fp8
# wgmma / mma k-step, so the side dot costs one instruction per score tile.
N_OUTLIER = 16
# _v_mean_fix_kernel's tile: V_FIX_CHANNELS rows of VT8 (channels) by V_FIX_KEYS keys a step.
V_FIX_CHANNELS = 8
V_FIX_KEYS = 1024
STATS_ROWS = 512  # rows per stats program of the INT8 quantisation (FP8: QUANT_TUNING, twice as many)
# Launch shape of the first three kernels (quantize_qkv's `tuning` overrides any key, for sweeps):
# STATS_ROWS rows per stats program, read STATS_SUB rows a step with STATS_WARPS warps and the
# loop's loads software-pipelined STATS_STAGES deep; QUANT_WARPS for the quantising kernel
# (None: 8 for 128x128 tiles, else 4); Q_SAMPLE: the stats read Q's rows only in every
# Q_SAMPLE-th chunk (Q's statistics only rank the outlier channels; K and V are read whole).
# STATS_STAGES=3 and the rest are the winners of benchmarks/fp8_quant_bench.py --sweep (the
# stats kernel a third faster pipelined; 128- or 256-row programs, 64-row steps and 8 warps
# slower; Q_SAMPLE > 1 saved little, left at 1). The outlier columns are loaded again: picking
# them out of the register tile with tl.gather was slower.
# QK_STRIDE: the statistics read every QK_STRIDE-th row of Q and K (V whole) where that still
# leaves QK_MIN_ROWS rows of each. Exact enough because nothing needs them exactly: K's mean
# only centres K (softmax(q.(k - m)) = softmax(q.k) for ANY vector m, and each K block gets its
# own scale from its own rows in the quantising pass), and max|q|, K's extrema only rank the
# outlier channels. V's mean and extrema stay exact: V's per-channel scale must bound every
# value (a sampled maximum could clip). Q and K are 2/3 of the statistics' bytes.
# QK_STRIDE=8, STATS_ROWS=1024 (half the chunks for the finalising pass) and QUANT_WARPS=4 for
# 128x128 tiles each made the three kernels faster in fp8_quant_bench.py --sweep.
# V_MEAN_FIX: take V's mean rounding error out of vmean (_v_mean_fix_kernel; 0 gives V's exact
# mean, for comparisons: benchmarks/fp8_quant_bench.py --sweep times both).
QUANT_TUNING = dict(STATS_ROWS=2 * STATS_ROWS, STATS_SUB=None, STATS_WARPS=4, STATS_STAGES=3, QUANT_WARPS=4,
                    Q_SAMPLE=1, QK_STRIDE=8, QK_MIN_ROWS=256, V_MEAN_FIX=1)


def qk_stride(lq: int, lk: int, tune: dict) -> int:
    """The row stride of Q's and K's statistics for these lengths (1: every row)."""
    stride = int(tune["QK_STRIDE"])
    return stride if stride > 1 and min(lq, lk) >= stride * int(tune["QK_MIN_ROWS"]) else 1


class QuantizedQKV(NamedTuple):
    """What the attention kernel reads. Rows padded to whole blocks, head dim to BLOCK_D;
    padding is zero (padded keys are masked in the kernel, padded queries never stored)."""

    q8: torch.Tensor  # [B*H, LQ_PAD, BLOCK_D] e4m3, scaled by sm_scale*log2(e)/sq
    sq: torch.Tensor  # [B*H, NQB] fp32 block scales (include sm_scale*log2(e))
    qs: torch.Tensor  # [B*H, LQ_PAD, 2*N] e4m3 side operand [q_lo, q_hi] on sq
    k8: torch.Tensor  # [B*H, LK_PAD, BLOCK_D] e4m3 of k - mean_k
    sk: torch.Tensor  # [B*H, NKB] fp32
    ks: torch.Tensor  # [B*H, LK_PAD, 2*N] e4m3 side operand [k_hi, k_lo] on sk
    vt8: torch.Tensor  # [B*H, BLOCK_D, LK_PAD] e4m3 of (v - mean_v) / sv, transposed (keys permuted: v_key_perm)
    sv: torch.Tensor  # [B*H, BLOCK_D] fp32 per-channel scales of V
    vmean: torch.Tensor  # [B*H, BLOCK_D] fp32: V's mean less VT8's mean rounding error (_v_mean_fix_kernel)
    n_outlier: int
    block_m: int
    block_n: int
    v_key_perm: bool = False  # VT8's keys in v_key_order() within each 32-key group


def v_key_order(n: int) -> int:
    """Where quantize_qkv(v_key_perm=True) stores key n in VT8: bits 1-2 and 3 of n's place
    inside its 32-key group swap places (n = 16 c1 + 8 c0 + 2 t + e -> 16 c1 + 4 t + 2 c0 + e),
    the column order in which the Gluon kernel hands P to wgmma without shuffles."""
    return (n & ~31) | (n & 16) | ((n >> 1) & 3) << 2 | ((n >> 3) & 1) << 1 | (n & 1)


def padded_head_dim(head_dim: int) -> int:
    """Power of two >= 32: an fp8 MMA k-step consumes 32 elements of depth."""
    return max(32, 1 << (head_dim - 1).bit_length())


if triton is not None:

    @triton.jit
    def _round_e4m3_grid(y):
        # The Triton interpreter's fp32 -> e4m3 conversion drops the carry when rounding
        # crosses a power of two (31.6 becomes 16) and rounds ties away from zero. Rounding
        # to e4m3's grid first (3 mantissa bits, subnormal step 2**-9) makes its cast exact;
        # GPUs convert correctly (cvt.rn), so only interpreter launches take this path.
        e = tl.floor(tl.log2(tl.maximum(tl.abs(y), 0.015625)))
        step = tl.exp2(e - 3.0)
        return ((y / step + 12582912.0) - 12582912.0) * step  # 1.5 * 2**23: round half to even

    @triton.jit
    def cast_e4m3(y, EXACT_CAST: tl.constexpr):
        if EXACT_CAST:
            y = _round_e4m3_grid(y)
        return y.to(tl.float8e4nv)

    @triton.jit
    def _column_stats(X, stride_l, stride_d, chunk, L, cols, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
                      SUB: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr, STRIDE: tl.constexpr = 1):
        """(sum, min, max) per channel of rows [chunk*ROWS, (chunk+1)*ROWS) that are < L and,
        with STRIDE > 1, multiples of STRIDE (ROWS is one: the chunks sample one row set).

        Accumulated elementwise in [SUB, BLOCK_D] registers and reduced over rows once at the
        end: a row reduction per step crosses warps through shared memory and a barrier, and
        measured 0.64 TB/s on the H200 (1.56 ms of Wan's 2.15 ms quantisation)."""
        a_sum = tl.zeros([SUB, BLOCK_D], dtype=tl.float32)
        a_min = tl.full([SUB, BLOCK_D], float("inf"), dtype=tl.float32)
        a_max = tl.full([SUB, BLOCK_D], float("-inf"), dtype=tl.float32)
        for r in tl.range(0, ROWS // STRIDE, SUB, num_stages=STAGES):
            step = r + tl.arange(0, SUB)
            rows = chunk * ROWS + step * STRIDE
            inside = (rows[:, None] < L) & (cols[None, :] < HEAD_DIM)
            if STRIDE > 1:  # ROWS // STRIDE may be less than SUB
                inside = inside & (step[:, None] < ROWS // STRIDE)
            x = tl.load(X + rows[:, None].to(tl.int64) * stride_l + cols[None, :] * stride_d,
                        mask=inside, other=0.0).to(tl.float32)
            a_sum += x
            a_min = tl.minimum(a_min, tl.where(inside, x, float("inf")))
            a_max = tl.maximum(a_max, tl.where(inside, x, float("-inf")))
        c_sum = tl.sum(a_sum, 0)
        c_min = tl.min(a_min, 0)
        c_max = tl.max(a_max, 0)
        return c_sum, c_min, c_max

    @triton.jit
    def fp8_stats_kernel(
        Q, K, V, PART,
        stride_qb, stride_qh, stride_ql, stride_qd,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_vb, stride_vh, stride_vl, stride_vd,
        H, LQ, LK, NCH, BH,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, SUB: tl.constexpr,
        NEED_Q: tl.constexpr, Q_SAMPLE: tl.constexpr, STAGES: tl.constexpr = 1, QK_STRIDE: tl.constexpr = 1,
    ):
        """PART[s, bh, chunk, :] for s = max|q|, sum k, min k, max k, sum v, min v, max v.
        Program (chunk, bh, role): role Q (only when NEED_Q), K or V, one tensor each. Q and K
        read every QK_STRIDE-th row only (quantize_qkv says why that is exact enough)."""
        chunk = tl.program_id(0)
        bh = tl.program_id(1)
        role = tl.program_id(2) + (0 if NEED_Q else 1)
        off_b = bh // H
        off_h = bh % H
        cols = tl.arange(0, BLOCK_D)
        plane = BH * NCH * BLOCK_D  # partials are small: int32 is enough
        P = PART + (bh.to(tl.int64) * NCH + chunk) * BLOCK_D + cols
        if role == 0:
            if chunk % Q_SAMPLE == 0:
                Xq = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
                c_sum, c_min, c_max = _column_stats(Xq, stride_ql, stride_qd, chunk, LQ, cols, HEAD_DIM, ROWS,
                                                    SUB, BLOCK_D, STAGES, QK_STRIDE)
                tl.store(P, tl.maximum(c_max, -c_min))  # max|q|; -inf on empty chunks, never picked
            else:
                tl.store(P, tl.full([BLOCK_D], float("-inf"), dtype=tl.float32))  # not sampled
        elif role == 1:
            Xk = K + off_b.to(tl.int64) * stride_kb + off_h.to(tl.int64) * stride_kh
            c_sum, c_min, c_max = _column_stats(Xk, stride_kl, stride_kd, chunk, LK, cols, HEAD_DIM, ROWS, SUB,
                                                BLOCK_D, STAGES, QK_STRIDE)
            tl.store(P + plane, c_sum)
            tl.store(P + 2 * plane, c_min)
            tl.store(P + 3 * plane, c_max)
        else:
            Xv = V + off_b.to(tl.int64) * stride_vb + off_h.to(tl.int64) * stride_vh
            c_sum, c_min, c_max = _column_stats(Xv, stride_vl, stride_vd, chunk, LK, cols, HEAD_DIM, ROWS, SUB,
                                                BLOCK_D, STAGES)
            tl.store(P + 4 * plane, c_sum)
            tl.store(P + 5 * plane, c_min)
            tl.store(P + 6 * plane, c_max)

    @triton.jit
    def _fp8_finalize_kernel(
        PART, KMEAN, VMEAN, SV, IDX,
        LK, K_ROWS, NCH, BH,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, N_OUT: tl.constexpr, CH: tl.constexpr,
    ):
        """Per (batch*head): K mean (over the K_ROWS rows the statistics read), V mean, V scale
        (max|v - mean| / 448), outlier channels."""
        bh = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        plane = BH * NCH * BLOCK_D  # partials are small: int32 is enough
        P = PART + bh.to(tl.int64) * NCH * BLOCK_D
        q_amax, k_sum, k_min, k_max, v_sum, v_min, v_max = reduce_stat_partials(P, plane, cols, NCH, BLOCK_D, CH, True)
        cin = cols < HEAD_DIM
        k_mean = tl.where(cin, k_sum / K_ROWS, 0.0)
        v_mean = tl.where(cin, v_sum / LK, 0.0)
        v_dev = tl.where(cin, tl.maximum(v_max - v_mean, v_mean - v_min), 0.0)
        tl.store(KMEAN + bh * BLOCK_D + cols, k_mean)
        tl.store(VMEAN + bh * BLOCK_D + cols, v_mean)
        tl.store(SV + bh * BLOCK_D + cols, tl.maximum(v_dev, 1e-30) / 448.0)
        if N_OUT > 0:
            k_dev = tl.where(cin, tl.maximum(k_max - k_mean, k_mean - k_min), 0.0)
            # A product bound: it ranks a channel by the largest score term it can produce,
            # whether the outlier sits on the q side, the k side or both. Padding channels
            # rank last (-1) and, once picked, are pushed to -inf so each index comes once.
            imp = tl.where(cin, q_amax * k_dev, -1.0)
            for i in tl.static_range(N_OUT):
                j = tl.argmax(imp, 0)
                tl.store(IDX + bh * N_OUT + i, j.to(tl.int32))
                imp = tl.where(cols == j, float("-inf"), imp)

    @triton.jit
    def quant_rows(
        X, stride_l, stride_d, rows, cols, L, HEAD_DIM: tl.constexpr, MEAN, scale_mul,
    ):
        inside = (rows[:, None] < L) & (cols[None, :] < HEAD_DIM)
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_l + cols[None, :] * stride_d,
                    mask=inside, other=0.0).to(tl.float32)
        # Padding rows and channels stay exactly zero after smoothing: padded keys are
        # masked in the kernel but a non-zero pad would still inflate the block's scale.
        return tl.where(inside, (x - MEAN) * scale_mul, 0.0)

    @triton.jit
    def _split_outliers(
        X, stride_l, stride_d, rows, idx, L, HEAD_DIM: tl.constexpr, MEAN_PTR, scale_mul, inv_s,
        SUB_MEAN: tl.constexpr, EXACT_CAST: tl.constexpr,
    ):
        """(hi, lo) e4m3 of the N_OUT chosen channels, in the block's fp8 units: hi is the
        value the main operand holds, lo its rounding residual."""
        inside = (rows[:, None] < L) & (idx[None, :] < HEAD_DIM)
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_l + idx[None, :] * stride_d,
                    mask=inside, other=0.0).to(tl.float32)
        if SUB_MEAN:
            x = x - tl.load(MEAN_PTR + idx)[None, :]
        x = tl.where(inside, x * scale_mul * inv_s, 0.0)
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        hi = cast_e4m3(x, EXACT_CAST)
        lo = cast_e4m3(x - hi.to(tl.float32), EXACT_CAST)
        return hi, lo

    @triton.jit
    def _v_mean_fix_kernel(VT8, VMEAN, UNIT, VMEAN_FIX, unit_mul, LK, LK_PAD,
                           BLOCK_D: tl.constexpr, CHANNELS: tl.constexpr, KEYS: tl.constexpr):
        """Program (bh, j): for channels j*CHANNELS.. of head bh, VMEAN_FIX = VMEAN minus the mean
        of the stored values (VT8 [BH, BLOCK_D, LK_PAD], keys contiguous, padding keys zero) in
        input units (UNIT * unit_mul per stored unit): the de-quantised V (stored * unit +
        VMEAN_FIX) then has V's mean. The stored values' sum is their rounding errors' sum plus
        the sum of (v - mean) / unit, which is zero over a channel's keys up to the fp32
        rounding of the mean (the uncorrected mean carries that as well).

        Why: V arrives in bf16, whose grid sits in a fixed relation to e4m3's for a channel's
        scale and mean, so the rounding errors of a channel do not average out over the keys:
        they leave a bias of ~1e-4 of V's spread. Attention passes any per-channel offset of V
        straight to the output (P's rows sum to one), while the output of a flat softmax over
        L keys shrinks like 1/sqrt(L): in torch emulation (bf16 Gaussian inputs) V's rounding
        was 0.028 rel. L2 of the output at 4608 keys and 0.040 at 33390, 0.021 at both once the
        bias is taken out (benchmarks/fp8_v_bias_emulation.py).

        Why a second read of V instead of sums taken while quantising (measured on an H100):
        any per-channel sum inside _fp8_quant_kernel made its V role need the tile in two
        layouts (rows of channels as loaded, rows of keys as stored), and Triton 3.6 computed
        the whole tile twice: 255 registers and a spill against 168 (ptxas, sm_90a), 2 resident
        programs an SM instead of 3, the quantising pass 29-46 % slower for every role (Wan
        0.570 -> 0.738 ms, Flux 0.056 -> 0.082) whether the sums went through atomics or plain
        stores. Reading the 1-byte VT8 again costs a quarter of V's bf16 read. Sums in a fixed
        order: a repeat gives the same bits (step graphs compare a replay with the eager call).
        e4m3 values are multiples of 2**-9 below 448, so each lane's running sum is exact in fp32
        up to 2**24 * 2**-9 = 32768, i.e. for LK_PAD / KEYS <= 73 steps (Wan: 32)."""
        bh = tl.program_id(0)
        ch = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
        keys = tl.arange(0, KEYS)
        row = VT8 + (bh.to(tl.int64) * BLOCK_D + ch[:, None]) * LK_PAD
        acc = tl.zeros([CHANNELS, KEYS], dtype=tl.float32)
        for k0 in range(0, LK_PAD, KEYS):
            acc += tl.load(row + k0 + keys[None, :], mask=(k0 + keys < LK_PAD)[None, :], other=0.0).to(tl.float32)
        unit = tl.load(UNIT + bh * BLOCK_D + ch) * unit_mul
        tl.store(VMEAN_FIX + bh * BLOCK_D + ch, tl.load(VMEAN + bh * BLOCK_D + ch) - tl.sum(acc, 1) * unit / LK)

    @triton.jit
    def _fp8_quant_kernel(
        Q, K, V, KMEAN, VMEAN, SV, IDX,
        Q8, SQ, QS, K8, SK, KS, VT8,
        stride_qb, stride_qh, stride_ql, stride_qd,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_vb, stride_vh, stride_vl, stride_vd,
        q_scale_mul,
        H, LQ, LK, LQ_PAD, LK_PAD, NQB, NKB,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        N_OUT: tl.constexpr, EXACT_CAST: tl.constexpr, V_KEY_PERM: tl.constexpr = False,
    ):
        """Program (i, bh, role) quantises block i of Q (role 0), K (role 1) or V (role 2):
        three independent tiles per launch rather than three in a row per program, so more
        loads are in flight and each program holds one fp32 tile in registers."""
        i = tl.program_id(0)
        bh = tl.program_id(1)
        role = tl.program_id(2)
        off_b = bh // H
        off_h = bh % H
        cols = tl.arange(0, BLOCK_D)
        if (role == 0) & (i < NQB):
            rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
            Xq = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
            x = quant_rows(Xq, stride_ql, stride_qd, rows, cols, LQ, HEAD_DIM, 0.0, q_scale_mul)
            s = tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), 1e-30) / 448.0
            y = tl.minimum(tl.maximum(x / s, -448.0), 448.0)
            base = bh.to(tl.int64) * LQ_PAD
            tl.store(Q8 + (base + rows[:, None]) * BLOCK_D + cols[None, :], cast_e4m3(y, EXACT_CAST))
            tl.store(SQ + bh.to(tl.int64) * NQB + i, s)
            if N_OUT > 0:
                side = tl.arange(0, N_OUT)
                idx = tl.load(IDX + bh * N_OUT + side)
                hi, lo = _split_outliers(Xq, stride_ql, stride_qd, rows, idx, LQ, HEAD_DIM, KMEAN,
                                         q_scale_mul, 1.0 / s, False, EXACT_CAST)
                ptr = QS + (base + rows[:, None]) * (2 * N_OUT) + side[None, :]
                tl.store(ptr, lo)
                tl.store(ptr + N_OUT, hi)
        if (role == 1) & (i < NKB):
            rows = i * BLOCK_N + tl.arange(0, BLOCK_N)
            Xk = K + off_b.to(tl.int64) * stride_kb + off_h.to(tl.int64) * stride_kh
            k_mean = tl.load(KMEAN + bh * BLOCK_D + cols)
            x = quant_rows(Xk, stride_kl, stride_kd, rows, cols, LK, HEAD_DIM, k_mean[None, :], 1.0)
            s = tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), 1e-30) / 448.0
            y = tl.minimum(tl.maximum(x / s, -448.0), 448.0)
            base = bh.to(tl.int64) * LK_PAD
            tl.store(K8 + (base + rows[:, None]) * BLOCK_D + cols[None, :], cast_e4m3(y, EXACT_CAST))
            tl.store(SK + bh.to(tl.int64) * NKB + i, s)
            if N_OUT > 0:
                side = tl.arange(0, N_OUT)
                idx = tl.load(IDX + bh * N_OUT + side)
                hi, lo = _split_outliers(Xk, stride_kl, stride_kd, rows, idx, LK, HEAD_DIM,
                                         KMEAN + bh * BLOCK_D, 1.0, 1.0 / s, True, EXACT_CAST)
                ptr = KS + (base + rows[:, None]) * (2 * N_OUT) + side[None, :]
                tl.store(ptr, hi)
                tl.store(ptr + N_OUT, lo)
        if (role == 2) & (i < NKB):
            rows = i * BLOCK_N + tl.arange(0, BLOCK_N)
            Xv = V + off_b.to(tl.int64) * stride_vb + off_h.to(tl.int64) * stride_vh
            v_mean = tl.load(VMEAN + bh * BLOCK_D + cols)
            inv_sv = 1.0 / tl.load(SV + bh * BLOCK_D + cols)
            src = rows
            if V_KEY_PERM:
                # Slot p of VT8 holds key v_key_order^-1(p) (inside p's 32-key group, so inside
                # this tile). The permutation goes on the rows loaded, each still a contiguous
                # head-dim vector, and not on the store: permuted store addresses are no longer
                # affine in the key, and the store falls apart into single bytes (on an H100
                # Wan's quantisation took 16 % of the attention time that way, 3 % without).
                src = (rows & -32) | (rows & 16) | ((rows >> 1) & 1) << 3 | ((rows >> 2) & 3) << 1 | (rows & 1)
            x = quant_rows(Xv, stride_vl, stride_vd, src, cols, LK, HEAD_DIM, v_mean[None, :], 1.0)
            y = tl.minimum(tl.maximum(x * inv_sv[None, :], -448.0), 448.0)
            # Stored [D, L]: keys contiguous, the K-major layout P.V's fp8 MMA needs.
            tl.store(VT8 + (bh.to(tl.int64) * BLOCK_D + cols[:, None]) * LK_PAD + rows[None, :],
                     tl.trans(cast_e4m3(y, EXACT_CAST)))


def carve(buffer: torch.Tensor, shapes):
    """Views of consecutive pieces of one flat buffer (one allocation instead of several: at
    Flux's size the caching allocator's calls are a visible part of the quantisation's time).
    A piece is 16-byte aligned when the pieces before it are multiples of 16 bytes."""
    views, at = [], 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        views.append(buffer[at:at + n].view(shape))
        at += n
    return views


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block_m: int, block_n: int,
                 n_outlier: int = N_OUTLIER, exact_cast: bool = False, tuning: dict | None = None,
                 v_key_perm: bool = False) -> QuantizedQKV:
    """q [B, H, Lq, D], k/v [B, H, Lk, D] (fp16/bf16/fp32, any strides, same head count) ->
    QuantizedQKV for attention_fp8_full's kernel. `scale` is the softmax scale; block_m /
    block_n must be the attention kernel's tile sizes (one scale per tile). `tuning`: keys of
    QUANT_TUNING to override (launch shapes; the result is the same but for Q_SAMPLE, QK_STRIDE and
    QK_MIN_ROWS, which choose the rows the statistics read, and V_MEAN_FIX).
    v_key_perm stores VT8's keys in v_key_order() (the Gluon kernel's order of P's columns); needs
    block_n a multiple of 32."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    bh = B * H
    block_d = padded_head_dim(D)
    n = int(n_outlier)
    if n and (n & (n - 1) or n < 16):
        raise ValueError(f"n_outlier must be 0 or a power of two >= 16 (2*n is an fp8 MMA depth), got {n}")
    if v_key_perm and block_n % 32:
        raise ValueError(f"v_key_perm permutes keys inside groups of 32: block_n must be a multiple of 32, got {block_n}")
    tune = dict(QUANT_TUNING, **(tuning or {}))
    rows = int(tune["STATS_ROWS"])
    sub = int(tune["STATS_SUB"] or (32 if block_d >= 128 else 64))
    stride = qk_stride(Lq if n else Lk, Lk, tune)
    if rows & (rows - 1) or sub & (sub - 1) or rows % sub or stride & (stride - 1) or rows % stride:
        raise ValueError(f"STATS_ROWS ({rows}), STATS_SUB ({sub}) and QK_STRIDE ({stride}) must be powers of two, "
                         "ROWS a multiple of SUB and of QK_STRIDE")
    nch = max(cdiv(max(Lq if n else 0, Lk), rows), 1)
    nqb, nkb = cdiv(Lq, block_m), cdiv(Lk, block_n)
    lq_pad, lk_pad = nqb * block_m, nkb * block_n
    w = max(2 * n, 16)  # side operand width; 16 bytes when unused, keeping the pieces aligned
    dev = q.device
    # The block scales go last: only they may end up off 16-byte alignment (read as scalars).
    part, k_mean, v_mean, v_mean_fix, sv, sq, sk = carve(
        torch.empty(7 * bh * nch * block_d + 4 * bh * block_d + bh * (nqb + nkb), device=dev, dtype=torch.float32),
        [(7, bh, nch, block_d), (bh, block_d), (bh, block_d), (bh, block_d), (bh, block_d), (bh, nqb), (bh, nkb)])
    q8, k8, vt8, qs, ks = carve(
        torch.empty(bh * (lq_pad * block_d + 2 * lk_pad * block_d + (lq_pad + lk_pad) * w),
                    device=dev, dtype=torch.float8_e4m3fn),
        [(bh, lq_pad, block_d), (bh, lk_pad, block_d), (bh, block_d, lk_pad), (bh, lq_pad, w), (bh, lk_pad, w)])
    idx = torch.empty(bh, max(n, 1), device=dev, dtype=torch.int32)

    fp8_stats_kernel[(nch, bh, 3 if n else 2)](
        q, k, v, part, *q.stride(), *k.stride(), *v.stride(), H, Lq, Lk, nch, bh,
        HEAD_DIM=D, BLOCK_D=block_d, ROWS=rows, SUB=sub, NEED_Q=n > 0, Q_SAMPLE=int(tune["Q_SAMPLE"]),
        STAGES=int(tune["STATS_STAGES"]), QK_STRIDE=stride, num_warps=int(tune["STATS_WARPS"]), **LAUNCH_OPTIONS)
    _fp8_finalize_kernel[(bh,)](part, k_mean, v_mean, sv, idx, Lk, cdiv(Lk, stride), nch, bh,
                                HEAD_DIM=D, BLOCK_D=block_d, N_OUT=n, CH=16, num_warps=4, **LAUNCH_OPTIONS)
    big = max(block_m, block_n) * block_d >= 16384  # 128x128 fp32 tiles want 8 warps
    _fp8_quant_kernel[(max(nqb, nkb), bh, 3)](
        q, k, v, k_mean, v_mean, sv, idx, q8, sq, qs, k8, sk, ks, vt8,
        *q.stride(), *k.stride(), *v.stride(), float(scale) * LOG2E,
        H, Lq, Lk, lq_pad, lk_pad, nqb, nkb,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, N_OUT=n, EXACT_CAST=exact_cast,
        V_KEY_PERM=bool(v_key_perm), num_warps=int(tune["QUANT_WARPS"] or (8 if big else 4)), **LAUNCH_OPTIONS)
    fix = bool(tune["V_MEAN_FIX"])
    if fix:
        v_mean_fix_launch(vt8, v_mean, sv, v_mean_fix, 1.0, Lk)
    return QuantizedQKV(q8, sq, qs, k8, sk, ks, vt8, sv, v_mean_fix if fix else v_mean, n,
                        block_m, block_n, bool(v_key_perm))


def v_mean_fix_launch(vt8: torch.Tensor, v_mean: torch.Tensor, unit: torch.Tensor, out: torch.Tensor,
                      unit_mul: float, lk: int) -> None:
    """_v_mean_fix_kernel over vt8 [BH, BLOCK_D, LK_PAD] into out [BH, BLOCK_D]."""
    bh, block_d, lk_pad = vt8.shape
    _v_mean_fix_kernel[(bh, block_d // V_FIX_CHANNELS)](
        vt8, v_mean, unit, out, float(unit_mul), lk, lk_pad, BLOCK_D=block_d, CHANNELS=V_FIX_CHANNELS,
        KEYS=V_FIX_KEYS, num_warps=4, **LAUNCH_OPTIONS)


def quant_signature(names, types, constexprs, aligned):
    sig = {n: types.get(n, "i32") for n in names}
    for n in constexprs:
        sig[n] = "constexpr"
    order = list(sig)
    attrs = {(order.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return sig, attrs


def compile_specs(dtype: str, head_dim: int, block_m: int, block_n: int, n_outlier: int = N_OUTLIER,
                  v_key_perm: bool = False):
    """[(name, kernel, signature, constexprs, attrs, num_warps)] for
    triton.compile(ASTSource(...)): the three quantisation kernels specialised as a launch on
    contiguous [B, H, L, D] inputs specialises them (tests compile them for each target)."""
    block_d = padded_head_dim(head_dim)
    ptr = f"*{dtype}"
    strides = [f"stride_{t}{a}" for t in "qkv" for a in "bhld"]
    unit = {f"stride_{t}d": 1 for t in "qkv"}
    aligned_strides = [f"stride_{t}{a}" for t in "qkv" for a in "bhl"]

    const = dict(unit, HEAD_DIM=head_dim, BLOCK_D=block_d, ROWS=QUANT_TUNING["STATS_ROWS"],
                 SUB=QUANT_TUNING["STATS_SUB"] or (32 if block_d >= 128 else 64), NEED_Q=n_outlier > 0,
                 Q_SAMPLE=QUANT_TUNING["Q_SAMPLE"], STAGES=QUANT_TUNING["STATS_STAGES"],
                 QK_STRIDE=QUANT_TUNING["QK_STRIDE"])
    names = ["Q", "K", "V", "PART", *strides, "H", "LQ", "LK", "NCH", "BH", *const]
    sig, attrs = quant_signature(names, dict(Q=ptr, K=ptr, V=ptr, PART="*fp32"), const,
                            ["Q", "K", "V", "PART", *aligned_strides])
    stats = ("fp8_stats_kernel", fp8_stats_kernel, sig, const, attrs, QUANT_TUNING["STATS_WARPS"])

    const = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, N_OUT=n_outlier, CH=16)
    names = ["PART", "KMEAN", "VMEAN", "SV", "IDX", "LK", "K_ROWS", "NCH", "BH", *const]
    sig, attrs = quant_signature(names, dict(PART="*fp32", KMEAN="*fp32", VMEAN="*fp32", SV="*fp32", IDX="*i32"),
                            const, ["PART", "KMEAN", "VMEAN", "SV", "IDX"])
    finalize = ("_fp8_finalize_kernel", _fp8_finalize_kernel, sig, const, attrs, 4)

    const = dict(unit, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, N_OUT=n_outlier,
                 EXACT_CAST=False, V_KEY_PERM=v_key_perm)
    fp8 = ["Q8", "QS", "K8", "KS", "VT8"]
    f32 = ["KMEAN", "VMEAN", "SV", "SQ", "SK"]
    names = ["Q", "K", "V", "KMEAN", "VMEAN", "SV", "IDX", "Q8", "SQ", "QS", "K8", "SK", "KS", "VT8", *strides,
             "q_scale_mul", "H", "LQ", "LK", "LQ_PAD", "LK_PAD", "NQB", "NKB", *const]
    types = dict(Q=ptr, K=ptr, V=ptr, IDX="*i32", q_scale_mul="fp32", **{n: "*fp8e4nv" for n in fp8},
                 **{n: "*fp32" for n in f32})
    sig, attrs = quant_signature(names, types, const, ["Q", "K", "V", "IDX", *fp8, *f32, *aligned_strides,
                                                  "LQ_PAD", "LK_PAD"])
    warps = QUANT_TUNING["QUANT_WARPS"] or (8 if max(block_m, block_n) * block_d >= 16384 else 4)
    return [stats, finalize, ("_fp8_quant_kernel", _fp8_quant_kernel, sig, const, attrs, warps), v_mean_fix_spec(block_d)]


def v_mean_fix_spec(block_d: int):
    """_v_mean_fix_kernel's (name, kernel, signature, constexprs, attrs, num_warps) entry."""
    const = dict(BLOCK_D=block_d, CHANNELS=V_FIX_CHANNELS, KEYS=V_FIX_KEYS)
    f32 = ["VMEAN", "UNIT", "VMEAN_FIX"]
    sig, attrs = quant_signature(["VT8", *f32, "unit_mul", "LK", "LK_PAD", *const],
                            dict({n: "*fp32" for n in f32}, VT8="*fp8e4nv", unit_mul="fp32"), const,
                            ["VT8", *f32, "LK_PAD"])
    return ("_v_mean_fix_kernel", _v_mean_fix_kernel, sig, const, attrs, 4)


__all__ = ["QuantizedQKV", "compile_specs", "quantize_qkv", "padded_head_dim", "v_key_order", "N_OUTLIER", "FP8_MAX", "LOG2E",
           "QUANT_TUNING", "qk_stride", "v_mean_fix_launch", "v_mean_fix_spec"]
