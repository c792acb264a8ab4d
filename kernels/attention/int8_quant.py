"""Quantisation of Q, K and V for the INT8 attention kernel (attention_int8.py).

Four launches, all memory-bound. attention_fp8_quant's statistics kernel runs twice: over Q
(max|q| per channel) and over K and V (per-channel sums / min / max). `_int8_finalize_kernel`
reduces them, per KV head, to K's mean, V's mean, V's largest deviation from its mean (stored
as max|v - mean_v| / 448, e4m3's scale, as attention_fp8_quant stores it) and a per-channel
balance factor. `_int8_quant_kernel`, one program per row block, then writes:
- Q in INT8 with one scale per query row ("per token"), the softmax scale and log2(e) folded
  into it (the kernel uses exp2). SageAttention 1 uses one scale per 128-row block; with a few
  Q channels 6-12x larger than the rest (what DiT activations show, see accuracy_inputs) a
  block's scale is set by its largest row: emulated in torch on our outlier inputs, per-block
  scales gave cosine 0.99946 / rel. L2 0.033 against float32, per-row 0.99985 / 0.017. The
  kernel applies the row scale as a vector in the FFMA that de-quantises the scores anyway.
- K minus its mean over the sequence (softmax(q.(k - m)) = softmax(q.k): q.m is one constant
  per query row), in INT8 with one scale per BLOCK_N keys, the attention kernel's key tile
  (one multiply de-quantises a score tile).
- Channel balancing (SmoothQuant's migration, exact: q.k = sum_c (q_c / f_c)(k_c * f_c)):
  f_c = sqrt(max|q_c| / max|k_c - mean_c|), clamped to [1/64, 64], divides Q's channel c and
  multiplies K's. Even with per-row scales, Q's outlier channels set every row's scale and
  leave the other channels a few INT8 levels: in the worst case measured (one head, emulated
  in torch) Q's rounding alone gave rel. L2 0.031, K's 0.009. Balancing moves half of that
  range (in log) onto K; in the kernel it took that case from 0.032 to 0.013. With GQA one factor serves a KV head, taken from the
  largest max|q_c| of the query heads that read it.
- V minus its mean (P.(V - m_v) + m_v = P.V since P's rows sum to one; the mean is added back
  in fp32), scaled per channel to [-V_RANGE, V_RANGE] where V_RANGE bounds what a key tile's
  P.V can reach in the kernel's FP16 accumulator (attention_int8.v_range), stored either as
  fp16 [L, D] (the FP16 P.V) or as e4m3 transposed to [D, L] (the FP8 P.V: keys contiguous,
  the K-major layout an fp8 MMA's second operand needs on Hopper).
INT8 rounds half away from zero (add +-0.5, truncate): the interpreter's and the GPU's
float -> int casts both truncate, so both give the same integers.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.kernel_common import tl, triton  # None, None where Triton does not import

from .fp8_quant import (QUANT_TUNING, STATS_ROWS, carve, quant_signature, padded_head_dim, v_mean_fix_launch,
                                  v_mean_fix_spec)
from .fp8_quant import compile_specs as _fp8_quant_specs
from ..core.kernel_common import LAUNCH_OPTIONS, LOG2E, cdiv

if triton is not None:
    from ..core.kernel_common import reduce_stat_partials
    from .fp8_quant import fp8_stats_kernel, quant_rows, cast_e4m3

INT8_MAX = 127.0
SV_UNIT = 448.0  # the statistics kernel stores max|v - mean_v| / 448 (its e4m3 scale)


class QuantizedInt8(NamedTuple):
    """What the INT8 attention kernel reads. Rows padded to whole blocks and the head dim to
    BLOCK_D, with zeros (padded keys are masked in the kernel, padded queries never stored).
    K/V tensors have one entry per KV head (GQA: several query heads read the same one)."""

    q8: torch.Tensor  # [B*Hq, LQ_PAD, BLOCK_D] int8 of q * sm_scale * log2(e) / sq
    sq: torch.Tensor  # [B*Hq, LQ_PAD] fp32 per-row scales (include sm_scale * log2(e))
    k8: torch.Tensor  # [B*Hk, LK_PAD, BLOCK_D] int8 of (k - mean_k) / sk
    sk: torch.Tensor  # [B*Hk, NKB] fp32 per-block scales
    v: torch.Tensor  # pv fp16: [B*Hk, LK_PAD, BLOCK_D] fp16; pv fp8: [B*Hk, BLOCK_D, LK_PAD] e4m3
    sv448: torch.Tensor  # [B*Hk, BLOCK_D] fp32: max|v - mean_v| / 448 per channel
    vmean: torch.Tensor  # [B*Hk, BLOCK_D] fp32 (pv fp8: less V's mean e4m3 rounding error)
    mig: torch.Tensor  # [B*Hk, BLOCK_D] fp32 channel balance: Q8 holds q / mig, K8 (k - mean) * mig
    v_range: float  # |stored V| <= v_range; V = stored * sv448 * 448 / v_range + vmean
    pv: str  # "fp16" or "fp8"
    block_m: int
    block_n: int


if triton is not None:

    @triton.jit
    def _to_int8(y):
        # Round half away from zero, then truncate (what both float -> int casts do).
        return (y + tl.where(y >= 0, 0.5, -0.5)).to(tl.int8)

    @triton.jit
    def _int8_finalize_kernel(
        PART_Q, PART_KV, KMEAN, VMEAN, SV, MIG,
        LK, G, NCHQ, NCHK, BHK,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CH: tl.constexpr, BALANCE: tl.constexpr,
    ):
        """Per KV head: K mean, V mean, V's max|v - mean| / 448 and the channel balance
        factor MIG = sqrt(max|q_c| / max|k_c - mean_c|) over the G query heads reading it."""
        bhk = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        cin = cols < HEAD_DIM
        plane = BHK * NCHK * BLOCK_D  # partials are small: int32 is enough
        P = PART_KV + bhk.to(tl.int64) * NCHK * BLOCK_D
        _, k_sum, k_min, k_max, v_sum, v_min, v_max = reduce_stat_partials(P, plane, cols, NCHK, BLOCK_D, CH, False)
        k_mean = tl.where(cin, k_sum / LK, 0.0)
        v_mean = tl.where(cin, v_sum / LK, 0.0)
        v_dev = tl.where(cin, tl.maximum(v_max - v_mean, v_mean - v_min), 0.0)
        tl.store(KMEAN + bhk * BLOCK_D + cols, k_mean)
        tl.store(VMEAN + bhk * BLOCK_D + cols, v_mean)
        tl.store(SV + bhk * BLOCK_D + cols, tl.maximum(v_dev, 1e-30) / 448.0)
        mig = tl.full([BLOCK_D], 1.0, dtype=tl.float32)
        if BALANCE:
            q_amax = tl.zeros([BLOCK_D], dtype=tl.float32)
            PQ = PART_Q + bhk.to(tl.int64) * G * NCHQ * BLOCK_D  # the group's query heads are adjacent
            for c0 in range(0, G * NCHQ, CH):
                ch = c0 + tl.arange(0, CH)
                a = tl.load(PQ + ch[:, None] * BLOCK_D + cols[None, :], mask=(ch < G * NCHQ)[:, None], other=0.0)
                q_amax = tl.maximum(q_amax, tl.max(a, 0))
            k_dev = tl.maximum(k_max - k_mean, k_mean - k_min)
            # Clamped to [1/64, 64]: a channel that is (nearly) zero on one side gives
            # nothing to balance, and the factor must stay finite.
            ratio = tl.maximum(q_amax, 1e-20) / tl.maximum(k_dev, 1e-20)
            mig = tl.where(cin, tl.minimum(tl.maximum(tl.sqrt(ratio), 0.015625), 64.0), 1.0)
        tl.store(MIG + bhk * BLOCK_D + cols, mig)

    @triton.jit
    def _int8_quant_kernel(
        Q, K, V, KMEAN, VMEAN, SV, MIG, Q8, SQ, K8, SK, VQ,
        stride_qb, stride_qh, stride_ql, stride_qd,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_vb, stride_vh, stride_vl, stride_vd,
        q_scale_mul, v_mul,
        H, HK, BHK, LQ, LK, LQ_PAD, LK_PAD, NQB, NKB,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        V_RANGE: tl.constexpr, PV_FP8: tl.constexpr, EXACT_CAST: tl.constexpr,
    ):
        """Program (i, bh, role): block i of Q (role 0, bh over B*H), K (role 1) or V (role 2,
        bh over B*HK). One fp32 tile per program; the roles run side by side."""
        i = tl.program_id(0)
        bh = tl.program_id(1)
        role = tl.program_id(2)
        cols = tl.arange(0, BLOCK_D)
        if (role == 0) & (i < NQB):
            rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
            Xq = Q + (bh // H).to(tl.int64) * stride_qb + (bh % H).to(tl.int64) * stride_qh
            mig = tl.load(MIG + (bh // (H // HK)) * BLOCK_D + cols)
            x = quant_rows(Xq, stride_ql, stride_qd, rows, cols, LQ, HEAD_DIM, 0.0, q_scale_mul / mig[None, :])
            # Floors of 1e-12 (not 1e-30): the kernel multiplies masked -inf scores by sq * sk,
            # which must not underflow to 0 (-inf * 0 = NaN) for a zero row against constant keys.
            s = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / 127.0
            base = bh.to(tl.int64) * LQ_PAD
            tl.store(Q8 + (base + rows[:, None]) * BLOCK_D + cols[None, :], _to_int8(x / s[:, None]))
            tl.store(SQ + base + rows, s)
        if (role == 1) & (i < NKB) & (bh < BHK):
            rows = i * BLOCK_N + tl.arange(0, BLOCK_N)
            Xk = K + (bh // HK).to(tl.int64) * stride_kb + (bh % HK).to(tl.int64) * stride_kh
            k_mean = tl.load(KMEAN + bh * BLOCK_D + cols)
            mig = tl.load(MIG + bh * BLOCK_D + cols)
            x = quant_rows(Xk, stride_kl, stride_kd, rows, cols, LK, HEAD_DIM, k_mean[None, :], mig[None, :])
            s = tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), 1e-12) / 127.0
            base = bh.to(tl.int64) * LK_PAD
            tl.store(K8 + (base + rows[:, None]) * BLOCK_D + cols[None, :], _to_int8(x / s))
            tl.store(SK + bh.to(tl.int64) * NKB + i, s)
        if (role == 2) & (i < NKB) & (bh < BHK):
            rows = i * BLOCK_N + tl.arange(0, BLOCK_N)
            Xv = V + (bh // HK).to(tl.int64) * stride_vb + (bh % HK).to(tl.int64) * stride_vh
            v_mean = tl.load(VMEAN + bh * BLOCK_D + cols)
            inv_sv = v_mul / tl.load(SV + bh * BLOCK_D + cols)
            x = quant_rows(Xv, stride_vl, stride_vd, rows, cols, LK, HEAD_DIM, v_mean[None, :], 1.0)
            # The clamp only matters for a constant channel (deviation ~ fp32 rounding of its
            # mean): there it keeps the tile bound the FP16 accumulator relies on.
            y = tl.minimum(tl.maximum(x * inv_sv[None, :], -V_RANGE), V_RANGE)
            if PV_FP8:
                tl.store(VQ + (bh.to(tl.int64) * BLOCK_D + cols[:, None]) * LK_PAD + rows[None, :],
                         tl.trans(cast_e4m3(y, EXACT_CAST)))
            else:
                tl.store(VQ + (bh.to(tl.int64) * LK_PAD + rows[:, None]) * BLOCK_D + cols[None, :],
                         y.to(tl.float16))


def quantize_qkv_int8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block_m: int,
                      block_n: int, pv: str, v_range: float, balance: bool = True,
                      exact_cast: bool = False) -> QuantizedInt8:
    """q [B, H, Lq, D], k/v [B, HK, Lk, D] (HK divides H; fp16/bf16/fp32, any strides) ->
    QuantizedInt8. `scale` is the softmax scale; block_n must be the attention kernel's key
    tile (one K scale per tile), block_m its query tile (the Q padding). balance=False leaves
    out the Q/K channel balancing (tests show what it is for)."""
    B, H, Lq, D = q.shape
    HK, Lk = k.shape[1], k.shape[2]
    bhq, bhk = B * H, B * HK
    block_d = padded_head_dim(D)
    nchq = max(cdiv(Lq, STATS_ROWS), 1) if balance else 1
    nchk = max(cdiv(Lk, STATS_ROWS), 1)
    nqb, nkb = cdiv(Lq, block_m), cdiv(Lk, block_n)
    lq_pad, lk_pad = nqb * block_m, nkb * block_n
    dev = q.device
    # Pieces in 16-byte multiples except the last (block scales, read as scalars).
    part_q, part_kv, k_mean, v_mean, v_mean_fix, sv, mig, sq, sk = carve(
        torch.empty((bhq * nchq + 7 * bhk * nchk + 5 * bhk) * block_d + bhq * lq_pad + bhk * nkb, device=dev,
                    dtype=torch.float32),
        [(bhq, nchq, block_d), (7, bhk, nchk, block_d), (bhk, block_d), (bhk, block_d), (bhk, block_d),
         (bhk, block_d), (bhk, block_d), (bhq, lq_pad), (bhk, nkb)])
    q8, k8 = carve(torch.empty(bhq * lq_pad * block_d + bhk * lk_pad * block_d, device=dev, dtype=torch.int8),
                    [(bhq, lq_pad, block_d), (bhk, lk_pad, block_d)])
    if pv == "fp8":
        vq = torch.empty(bhk, block_d, lk_pad, device=dev, dtype=torch.float8_e4m3fn)
    else:
        vq = torch.empty(bhk, lk_pad, block_d, device=dev, dtype=torch.float16)

    sub = 32 if block_d >= 128 else 64
    if balance:  # max|q| per channel: role 0 alone writes plane 0 of its partials
        fp8_stats_kernel[(nchq, bhq, 1)](
            q, q, q, part_q, *q.stride(), *q.stride(), *q.stride(), H, Lq, Lq, nchq, bhq,
            HEAD_DIM=D, BLOCK_D=block_d, ROWS=STATS_ROWS, SUB=sub, NEED_Q=True, Q_SAMPLE=1,
            STAGES=QUANT_TUNING["STATS_STAGES"], num_warps=4, **LAUNCH_OPTIONS)
    # K and V (NEED_Q=False: the role axis starts at K).
    fp8_stats_kernel[(nchk, bhk, 2)](
        k, k, v, part_kv, *k.stride(), *k.stride(), *v.stride(), HK, Lk, Lk, nchk, bhk,
        HEAD_DIM=D, BLOCK_D=block_d, ROWS=STATS_ROWS, SUB=sub, NEED_Q=False, Q_SAMPLE=1,
        STAGES=QUANT_TUNING["STATS_STAGES"], num_warps=4, **LAUNCH_OPTIONS)
    _int8_finalize_kernel[(bhk,)](part_q, part_kv, k_mean, v_mean, sv, mig, Lk, H // HK, nchq, nchk, bhk,
                                  HEAD_DIM=D, BLOCK_D=block_d, CH=16, BALANCE=balance, num_warps=4, **LAUNCH_OPTIONS)
    big = max(block_m, block_n) * block_d >= 16384  # 128x128 fp32 tiles want 8 warps
    _int8_quant_kernel[(max(nqb, nkb), bhq, 3)](
        q, k, v, k_mean, v_mean, sv, mig, q8, sq, k8, sk, vq,
        *q.stride(), *k.stride(), *v.stride(), float(scale) * LOG2E, float(v_range) / SV_UNIT,
        H, HK, bhk, Lq, Lk, lq_pad, lk_pad, nqb, nkb,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, V_RANGE=float(v_range),
        PV_FP8=pv == "fp8", EXACT_CAST=exact_cast, num_warps=8 if big else 4, **LAUNCH_OPTIONS)
    if pv == "fp8":  # e4m3's rounding bias per channel, as in the FP8 path (fp16 V's is 2^-7 of it)
        # stored V is (v - mean) * v_mul / sv: one stored unit is sv / v_mul
        v_mean_fix_launch(vq, v_mean, sv, v_mean_fix, SV_UNIT / float(v_range), Lk)
    return QuantizedInt8(q8, sq, k8, sk, vq, sv, v_mean_fix if pv == "fp8" else v_mean, mig, float(v_range), pv,
                         block_m, block_n)


def compile_specs(dtype: str, head_dim: int, block_m: int, block_n: int, pv: str, v_range: float):
    """[(name, kernel, signature, constexprs, attrs, num_warps)] for triton.compile(ASTSource(...)):
    the statistics kernel (the Q launch and the K/V launch differ only in NEED_Q and the grid),
    the finalize kernel and the INT8 quantiser, specialised as launches on contiguous
    [B, H, L, D] inputs specialise them."""
    stats = _fp8_quant_specs(dtype, head_dim, block_m, block_n, n_outlier=0)[0]
    block_d = padded_head_dim(head_dim)
    const = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, CH=16, BALANCE=True)
    f32 = ["PART_Q", "PART_KV", "KMEAN", "VMEAN", "SV", "MIG"]
    sig, attrs = quant_signature([*f32, "LK", "G", "NCHQ", "NCHK", "BHK", *const], {n: "*fp32" for n in f32}, const, f32)
    finalize = ("_int8_finalize_kernel", _int8_finalize_kernel, sig, const, attrs, 4)

    ptr = f"*{dtype}"
    strides = [f"stride_{t}{a}" for t in "qkv" for a in "bhld"]
    const = dict({f"stride_{t}d": 1 for t in "qkv"}, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
                 BLOCK_N=block_n, V_RANGE=float(v_range), PV_FP8=pv == "fp8", EXACT_CAST=False)
    f32 = ["KMEAN", "VMEAN", "SV", "MIG", "SQ", "SK"]
    names = ["Q", "K", "V", "KMEAN", "VMEAN", "SV", "MIG", "Q8", "SQ", "K8", "SK", "VQ", *strides, "q_scale_mul",
             "v_mul", "H", "HK", "BHK", "LQ", "LK", "LQ_PAD", "LK_PAD", "NQB", "NKB", *const]
    types = dict(Q=ptr, K=ptr, V=ptr, Q8="*i8", K8="*i8", VQ="*fp8e4nv" if pv == "fp8" else "*fp16",
                 q_scale_mul="fp32", v_mul="fp32", **{n: "*fp32" for n in f32})
    aligned = ["Q", "K", "V", "Q8", "K8", "VQ", "KMEAN", "VMEAN", "SV", "MIG", "SQ",
               *[f"stride_{t}{a}" for t in "qkv" for a in "bhl"], "LQ_PAD", "LK_PAD"]
    sig, attrs = quant_signature(names, types, const, aligned)
    warps = 8 if max(block_m, block_n) * block_d >= 16384 else 4
    specs = [stats, finalize, ("_int8_quant_kernel", _int8_quant_kernel, sig, const, attrs, warps)]
    return (specs + [v_mean_fix_spec(block_d)]) if pv == "fp8" else specs


__all__ = ["QuantizedInt8", "quantize_qkv_int8", "compile_specs", "INT8_MAX"]
