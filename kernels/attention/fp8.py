"""FP8 attention forward (SageAttention-style) for NVIDIA sm_89+: configs, kernels, launcher.

Q.K^T runs on the FP8 tensor cores (twice the fp16 rate on Ada, Hopper and Blackwell);
P.V stays in fp16/bf16. Choices that matter:
- K is smoothed first: its mean over tokens (per batch, kv head and channel) is subtracted.
  softmax(q.(k - m)) = softmax(q.k - q.m) and q.m is constant along a query row, so the
  result is unchanged, but the large common offset real models put on K (and which would
  otherwise set every block's fp8 scale) is gone before quantising;
- Q and K are quantised to float8 e4m3 with one scale per BLOCK_M rows of Q and per
  BLOCK_N rows of K, by a small kernel in this file. Per-block rather than per-tensor
  scales keep one token's outlier from crushing the resolution of every other block; a
  block scale (not per-channel) is what lets the scores be de-quantised with a single
  multiply per tile: S = dot(q8, k8) * (scale_q * scale_k);
- e4m3 keeps 3 mantissa bits, so every score carries noise of ~4% of the scores' spread
  whatever the scaling. Where a few channels are 20-100x larger than the rest (real DiT and
  UNet Q/K have them) that spread is large and softmax sharp: 12-17% rel. L2 error in
  emulation. So the OUTLIER_CHANNELS channels with the largest max|q|*max|k| per kv head
  are taken out of the fp8 operands and go through a 16-deep fp16/bf16 dot added into the
  same scores (1-2% error on the same inputs). Picking them costs two min/max reductions;
- softmax scale and log2(e) are folded into Q's block scale, so the tile needs one multiply
  and exp2; statistics and accumulators are fp32;
- P.V in the input dtype, not fp8: Q.K^T's quantisation already spends the error budget
  (~3e-2 on Gaussian inputs), e4m3 P would add its own ~2-4% on every weight, and fp8 V
  would need per-channel scales plus a transposed copy (Hopper's fp8 MMA takes K-major
  operands only). Q.K^T is half of the FLOPs, so this keeps a good part of the speed-up;
- the quantised Q/K are written padded (rows to a whole block, head dim to a power of two
  >= 32, the smallest fp8 MMA depth) so the attention kernel loads them with no bounds
  checks; V is read in place through its strides.
Fully masked query rows produce zeros, as PyTorch SDPA does. The softmax scale's sign lives
in Q's block scale, so the running max is that of the scaled scores for any scale. Inputs are
checked by attention_checks.py, the GPU by gpu_rules.py (FP8UnsupportedError carries its
reason); shared helpers come from kernel_common.py.
"""
from __future__ import annotations

import logging
import math

import torch

from ..core.kernel_common import tl, triton  # None, None where Triton does not import

from ..core import cache_registry
from ..core import device as _device
from .checks import check_attention_inputs
from .ref import attention_ref
from ..core.kernel_common import (LAUNCH_OPTIONS, LOG2E, arch_family, cdiv, family_in, fp8_device_refusal,
                            interpreter_upcast, mask_layout, next_pow2, row_alignment, shape_class)
from ..core.registry import BackendUnavailableError

if triton is not None:
    from ..core.kernel_common import masked_softmax_tile, row_offsets

log = logging.getLogger("triton_accel.kernels.attention.fp8")  # not __name__: the clone's folder name

FP8_MAX = 448.0  # largest finite float8 e4m3fn
# Channels per kv head kept out of fp8 (16-bit side dot of this depth; 16 is the smallest
# fp16 MMA depth). Rel L2 vs fp32 in emulation, [1,4,512,128], three outlier recipes (score
# std ~10): 0 -> 0.12-0.17, 8 -> 0.011-0.016, 16 -> 0.010-0.016, 32 -> 0.010-0.015. The
# side dot costs d128: a quarter of the fp8 Q.K^T's tensor-core time, d64: half.
OUTLIER_CHANNELS = 16

# Defaults per arch family (kernel_common.arch_family, through its FAMILY_FALLBACK: sm120 and
# anything unknown take "default", Ada's ~100 KB table) and padded head-dim class. Keys: BLOCK_M, BLOCK_N (also the
# quantisation block sizes of Q and K), num_warps, num_stages, optional N_HI (outlier
# channels, default OUTLIER_CHANNELS). Shared memory as compiled by Triton 3.9 for the
# worst variant (bool mask): sm90 d128 ~176 KB of 227; sm89 d128 78 KB, d256 (160) 76 KB
# of 99. sm89 values are not measured on an Ada GPU; sm90's are starting points that
# benchmarks/check_fp8.py times on the H200 (where this kernel is slower than the FP16/BF16 one).
FP8_ATTENTION_CONFIGS = {
    "sm90": {
        "d64": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
        "d128": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
        "d256": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
    },
    "sm89": {
        "d64": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2),
        "d128": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
        "d256": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    },
}
FP8_ATTENTION_CONFIGS["default"] = FP8_ATTENTION_CONFIGS["sm89"]
# The interpreter runs on numpy: small tiles keep CPU tests fast and exercise the loop.
FP8_ATTENTION_CONFIGS["interpreter"] = {
    c: dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1) for c in ("d64", "d128", "d256")
}

# Candidates the opt-in autotuner (TRITON_ACCEL_AUTOTUNE=1) measures for a shape class.
FP8_AUTOTUNE_SPACE = [
    dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
    for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)
    if not (bm == 64 and w == 8)
]


FP8_DTYPES = frozenset({torch.float16, torch.bfloat16})


class FP8UnsupportedError(BackendUnavailableError):
    """The device cannot run the FP8 kernel (compute capability, vendor, no Triton); `.reason` says why."""

    def __init__(self, reason: str):
        super().__init__("attention", "triton_fp8", reason)


def padded_head_dim(head_dim: int) -> int:
    """Power of two >= 32: fp8 MMAs consume 32 elements of depth per instruction."""
    return next_pow2(head_dim, 32)


def head_dim_class(head_dim: int) -> str:
    d = padded_head_dim(head_dim)
    return "d64" if d <= 64 else ("d128" if d <= 128 else "d256")


def default_config(info, head_dim: int, interpreter: bool) -> dict:
    if interpreter:
        return FP8_ATTENTION_CONFIGS["interpreter"]["d64"]
    return FP8_ATTENTION_CONFIGS[config_family(info.arch)][head_dim_class(head_dim)]


def config_family(arch: str) -> str:
    """The key of FP8_ATTENTION_CONFIGS for a device arch ("sm90", "sm89"...)."""
    return family_in(FP8_ATTENTION_CONFIGS, arch_family(arch))


if triton is not None:

    @triton.jit
    def _quant_fp8(
        X, Y, S, YH, HI, MEAN,
        scale_mul,
        stride_xb, stride_xh, stride_xl, stride_xd,
        H, L, L_PAD, N_BLOCKS,
        HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
        N_HI: tl.constexpr, SUB_MEAN: tl.constexpr, EXACT_CAST: tl.constexpr,
    ):
        """One program: BLOCK rows of one (batch, head) -> fp8 rows + one fp32 scale, and the
        N_HI outlier channels (zeroed in the fp8 rows) in 16-bit beside them."""
        pid = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = off_bh // H
        off_h = off_bh % H
        off_bhkv = off_b * (H // GROUP) + off_h // GROUP  # HI and MEAN are per kv head
        rows = pid * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, BLOCK_D)
        X += off_b.to(tl.int64) * stride_xb + off_h.to(tl.int64) * stride_xh
        inside = (rows[:, None] < L) & (cols[None, :] < HEAD_DIM)
        row_off = rows[:, None].to(tl.int64) * stride_xl
        x = tl.load(X + row_off + cols[None, :] * stride_xd, mask=inside, other=0.0).to(tl.float32)
        if SUB_MEAN:
            mean = tl.load(MEAN + off_bhkv.to(tl.int64) * HEAD_DIM + cols, mask=cols < HEAD_DIM, other=0.0)
            # Padding rows must stay zero: they are read as keys by the attention kernel
            # (and masked there), but a non-zero pad would inflate this block's scale.
            x = tl.where(inside, x - mean[None, :], 0.0)
        x = x * scale_mul
        if N_HI > 0:
            hi = tl.load(HI + off_bhkv.to(tl.int64) * N_HI + tl.arange(0, N_HI))
            is_hi = tl.sum((cols[:, None] == hi[None, :]).to(tl.int32), 1) > 0
            x = tl.where(is_hi[None, :], 0.0, x)
            # Indices >= HEAD_DIM pad the list when HEAD_DIM < N_HI: they read as zeros.
            h_inside = (rows[:, None] < L) & (hi[None, :] < HEAD_DIM)
            xh = tl.load(X + row_off + hi[None, :] * stride_xd, mask=h_inside, other=0.0).to(tl.float32)
            if SUB_MEAN:
                h_mean = tl.load(MEAN + off_bhkv.to(tl.int64) * HEAD_DIM + hi, mask=hi < HEAD_DIM, other=0.0)
                xh = tl.where(h_inside, xh - h_mean[None, :], 0.0)
            xh = xh * scale_mul
            tl.store(YH + off_bh.to(tl.int64) * L_PAD * N_HI + rows[:, None].to(tl.int64) * N_HI
                     + tl.arange(0, N_HI)[None, :], xh.to(YH.dtype.element_ty))
        amax = tl.max(tl.max(tl.abs(x), 1), 0)
        s = tl.maximum(amax, 1e-30) / 448.0
        y = tl.minimum(tl.maximum(x / s, -448.0), 448.0)
        if EXACT_CAST:
            # The Triton interpreter's fp32 -> e4m3 conversion drops the carry when rounding
            # crosses a power of two (31.6 becomes 16). Round to e4m3's grid here (3 mantissa
            # bits, subnormal step 2**-9) so the cast is exact; GPUs convert correctly.
            e = tl.floor(tl.log2(tl.maximum(tl.abs(y), 0.015625)))
            step = tl.exp2(e - 3.0)
            y = ((y / step + 12582912.0) - 12582912.0) * step  # 1.5 * 2**23: round half to even
        base = off_bh.to(tl.int64) * L_PAD * BLOCK_D
        tl.store(Y + base + rows[:, None].to(tl.int64) * BLOCK_D + cols[None, :], y.to(tl.float8e4nv))
        tl.store(S + off_bh.to(tl.int64) * N_BLOCKS + pid, s)

    @triton.jit
    def _fp8_tile(
        acc, l_i, m_i, q8, q_scale, qh,
        K8, SK, KH, V, Mk, start_n,
        offs_m, offs_n, offs_d,
        stride_vn, stride_vd, mask_rows, stride_mn, LK,
        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_CHECK: tl.constexpr,
        MASK_KIND: tl.constexpr, MASK_ROW_BCAST: tl.constexpr, IS_CAUSAL: tl.constexpr,
        BOUNDARY: tl.constexpr, ALIGN: tl.constexpr, N_HI: tl.constexpr,
    ):
        cols = start_n + offs_n
        # The quantised K is padded to whole blocks and a power-of-two head dim: no checks.
        k8 = tl.load(K8 + cols[:, None] * BLOCK_D + offs_d[None, :])
        s = tl.dot(q8, tl.trans(k8)) * (q_scale * tl.load(SK + start_n // BLOCK_N))
        if N_HI > 0:
            # The outlier channels dominate the scores where they exist; e4m3's 3 mantissa bits
            # would perturb every score by ~4% of their size, so they take a 16-bit dot.
            kh = tl.load(KH + cols[:, None] * N_HI + tl.arange(0, N_HI)[None, :])
            s = tl.dot(qh, tl.trans(kh), s)
        if MASK_KIND == 0 and not (IS_CAUSAL or BOUNDARY):  # no A and B and C: Triton <= 3.3 rejects chains
            # Hot path: every score is finite, so no -inf guards are needed.
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)
        else:
            p, alpha, m_ij = masked_softmax_tile(s, m_i, cols, offs_m, Mk, mask_rows, stride_mn, LK,
                                                 MASK_KIND, MASK_ROW_BCAST, IS_CAUSAL, BOUNDARY)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v_ptrs = V + row_offsets(cols, stride_vn, ALIGN)[:, None] + offs_d[None, :] * stride_vd
        if BOUNDARY and D_CHECK:
            v = tl.load(v_ptrs, mask=(cols[:, None] < LK) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        elif BOUNDARY:
            v = tl.load(v_ptrs, mask=cols[:, None] < LK, other=0.0)
        elif D_CHECK:
            v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc)
        return acc, l_i, m_ij

    @triton.jit
    def _attn_fp8_fwd(
        Q8, K8, SQ, SK, QH, KH, V, O, Mk,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        stride_mb, stride_mh, stride_mm, stride_mn,
        H, H_KV, LQ, LK, LQ_PAD, LK_PAD, NQB, NKB,
        HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_CHECK: tl.constexpr,
        MASK_KIND: tl.constexpr, MASK_ROW_BCAST: tl.constexpr, IS_CAUSAL: tl.constexpr,
        ALIGN: tl.constexpr, N_HI: tl.constexpr, WHILE_LOOP: tl.constexpr,
    ):
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = off_bh // H
        off_h = off_bh % H
        off_bhkv = off_b * H_KV + off_h // GROUP
        # int64 bases: batch*heads*length*dim passes 2**31 on video models.
        Q8 += off_bh.to(tl.int64) * LQ_PAD * BLOCK_D
        K8 += off_bhkv.to(tl.int64) * LK_PAD * BLOCK_D
        SK += off_bhkv.to(tl.int64) * NKB
        QH += off_bh.to(tl.int64) * LQ_PAD * N_HI
        KH += off_bhkv.to(tl.int64) * LK_PAD * N_HI
        V += off_b.to(tl.int64) * stride_vb + (off_h // GROUP).to(tl.int64) * stride_vh
        O += off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh

        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)

        mask_rows = offs_m
        if MASK_KIND != 0:
            Mk += off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh
            mask_rows = tl.minimum(offs_m, LQ - 1) * stride_mm

        q8 = tl.load(Q8 + offs_m[:, None] * BLOCK_D + offs_d[None, :])
        q_scale = tl.load(SQ + off_bh.to(tl.int64) * NQB + start_m)
        if N_HI > 0:
            qh = tl.load(QH + offs_m[:, None] * N_HI + tl.arange(0, N_HI)[None, :])
        else:
            qh = q_scale
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

        hi = LK
        if IS_CAUSAL:
            hi = tl.minimum(LK, (start_m + 1) * BLOCK_M)
        n_full = hi - hi % BLOCK_N
        if WHILE_LOOP:
            # Triton 3.5's interpreter turns a tensor loop bound into an int through a
            # 1-element array, an error on newer NumPy; a while test goes through bool().
            # Interpreter only: compiled code keeps range(), which Triton software-pipelines.
            start_n = 0
            while start_n < n_full:
                acc, l_i, m_i = _fp8_tile(
                    acc, l_i, m_i, q8, q_scale, qh, K8, SK, KH, V, Mk, start_n,
                    offs_m, offs_n, offs_d, stride_vn, stride_vd, mask_rows, stride_mn, LK,
                    HEAD_DIM, BLOCK_N, BLOCK_D, D_CHECK, MASK_KIND, MASK_ROW_BCAST, IS_CAUSAL, False, ALIGN, N_HI,
                )
                start_n += BLOCK_N
        else:
            for start_n in range(0, n_full, BLOCK_N):
                start_n = tl.multiple_of(start_n, BLOCK_N)
                acc, l_i, m_i = _fp8_tile(
                    acc, l_i, m_i, q8, q_scale, qh, K8, SK, KH, V, Mk, start_n,
                    offs_m, offs_n, offs_d, stride_vn, stride_vd, mask_rows, stride_mn, LK,
                    HEAD_DIM, BLOCK_N, BLOCK_D, D_CHECK, MASK_KIND, MASK_ROW_BCAST, IS_CAUSAL, False, ALIGN, N_HI,
                )
        if n_full < hi:
            acc, l_i, m_i = _fp8_tile(
                acc, l_i, m_i, q8, q_scale, qh, K8, SK, KH, V, Mk, n_full,
                offs_m, offs_n, offs_d, stride_vn, stride_vd, mask_rows, stride_mn, LK,
                HEAD_DIM, BLOCK_N, BLOCK_D, D_CHECK, MASK_KIND, MASK_ROW_BCAST, IS_CAUSAL, True, ALIGN, N_HI,
            )

        # Rows with every key masked have l = 0: write zeros, as SDPA does.
        inv_l = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
        out = (acc * inv_l[:, None]).to(O.dtype.element_ty)
        o_ptrs = O + row_offsets(offs_m, stride_om, ALIGN)[:, None] + offs_d[None, :] * stride_od
        if D_CHECK:
            tl.store(o_ptrs, out, mask=(offs_m[:, None] < LQ) & (offs_d[None, :] < HEAD_DIM))
        else:
            tl.store(o_ptrs, out, mask=offs_m[:, None] < LQ)


# ---- host side ------------------------------------------------------------------------------

def _check_device(device: torch.device) -> bool:
    """Raise FP8UnsupportedError where the kernel cannot run; True when on the interpreter."""
    reason = fp8_device_refusal(device, "FP8 attention")
    if reason is not None:
        raise FP8UnsupportedError(reason)
    return device.type == "cpu"


def outlier_channels(q, k, k_mean, n: int):
    """The n channels per (batch, kv head) with the largest max|q_c| * max|k_c - mean_c|
    (q's maxima pooled over the heads sharing that kv head): int32 [B, H_kv, n], or None.

    Where a few channels are 20-100x larger than the rest (real DiT/UNet Q/K have such
    channels, often from QK-norm weights), they set the scores' size, and e4m3's relative
    rounding error on them swamps everything else; a product bound picks them up whether
    the outlier is on the q side, the k side or both.
    """
    D = q.shape[-1]
    if n <= 0:
        return None
    B, H, Hkv = q.shape[0], q.shape[1], k.shape[1]
    qmin, qmax = torch.aminmax(q, dim=2)  # no |q| temporary the size of q
    qa = torch.maximum(-qmin.float(), qmax.float()).view(B, Hkv, H // Hkv, D).amax(dim=2)
    kmin, kmax = torch.aminmax(k, dim=2)
    ka = torch.maximum(k_mean - kmin.float(), kmax.float() - k_mean)
    imp = qa * ka
    if n >= D:
        idx = torch.arange(D, device=q.device).expand(B, Hkv, D)
        # pad with channels >= D: zero in the side buffers, never matching a real column
        idx = torch.cat([idx, torch.arange(D, n, device=q.device).expand(B, Hkv, n - D)], dim=-1)
        return idx.to(torch.int32).contiguous()
    return imp.topk(n, dim=-1).indices.to(torch.int32).contiguous()


def _quantise(x, block: int, block_d: int, scale_mul: float, mean, hi, n_hi: int, group: int,
              exact_cast: bool):
    """x [B, H, L, D] (any strides) -> (fp8 [B, H, L_pad, block_d], fp32 scales [B, H, nblk],
    outlier channels [B, H, L_pad, n_hi] in x's dtype); all contiguous, padding zeroed."""
    B, H, L, D = x.shape
    nblk = cdiv(L, block)
    y = torch.empty(B, H, nblk * block, block_d, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(B, H, nblk, device=x.device, dtype=torch.float32)
    yh = torch.empty(B, H, nblk * block, max(n_hi, 1), device=x.device, dtype=x.dtype)
    _quant_fp8[(nblk, B * H)](
        x, y, s, yh, hi if hi is not None else s, mean if mean is not None else s, float(scale_mul),
        *x.stride(), H, L, nblk * block, nblk,
        HEAD_DIM=D, GROUP=group, BLOCK=block, BLOCK_D=block_d, N_HI=n_hi,
        SUB_MEAN=mean is not None, EXACT_CAST=exact_cast,
        num_warps=8 if block * block_d >= 16384 else 4,  # 128x256 fp32 tiles spill at 4 warps
        **LAUNCH_OPTIONS)
    return y, s, yh


def _launch(q, k, v, attn_mask, scale, is_causal, config, interpreter):
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    if Lq == 0 or B == 0 or H == 0:
        return out
    if Lk == 0:
        return out.zero_()  # nothing to attend to: the fully-masked answer
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    block_d = padded_head_dim(D)

    n_hi = int(config.get("N_HI", OUTLIER_CHANNELS))
    # The mean is over all keys, masked or not: any per-(b, h, channel) constant works, and
    # the mean is the one that centres the values the fp8 grid must cover.
    k_mean = k.mean(dim=2, dtype=torch.float32).contiguous()
    hi = outlier_channels(q, k, k_mean, n_hi)
    q8, sq, qh = _quantise(q, block_m, block_d, scale * LOG2E, None, hi, n_hi, H // Hkv, interpreter)
    k8, sk, kh = _quantise(k, block_n, block_d, 1.0, k_mean, hi, n_hi, 1, interpreter)

    mask_kind, mk, mstr, row_bcast = mask_layout(attn_mask, B, H, Lq, Lk, sq)

    grid = (cdiv(Lq, block_m), B * H)
    _attn_fp8_fwd[grid](
        q8, k8, sq, sk, qh, kh, v, out, mk,
        *v.stride(), *out.stride(), *mstr,
        H, Hkv, Lq, Lk, q8.shape[2], k8.shape[2], sq.shape[2], sk.shape[2],
        HEAD_DIM=D, GROUP=H // Hkv,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, D_CHECK=block_d > D,
        MASK_KIND=mask_kind, MASK_ROW_BCAST=row_bcast, IS_CAUSAL=bool(is_causal),
        ALIGN=row_alignment(v, out), N_HI=n_hi, WHILE_LOOP=interpreter,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
        **LAUNCH_OPTIONS)
    return out


_configs: dict = {}  # (device, interpreter, shape class) -> config
cache_registry.register("kernels.attention.fp8.configs", _configs.clear)


def attention_fp8(q, k, v, attn_mask=None, scale=None, is_causal=False, config=None):
    """softmax(q k^T * scale + mask) v with Q.K^T in float8 e4m3; torch SDPA's contract on
    [B, H, L, D] fp16/bf16 tensors (any strides, k/v may have fewer heads). Output in q's
    dtype, laid out like torch.empty_like(q). Raises AttentionInputError for invalid inputs and
    FP8UnsupportedError where the device cannot run it (below sm_89, not NVIDIA)."""
    check_attention_inputs(q, k, v, attn_mask, scale, op="attention_fp8", same_head_dim_v=True,
                           dtypes=FP8_DTYPES)
    if not 1 <= q.shape[-1] <= 256:
        raise FP8UnsupportedError(f"head dim {q.shape[-1]} outside 1..256")
    return _run(q, k, v, attn_mask, scale, is_causal, config)


def _run(q, k, v, attn_mask, scale, is_causal, config):
    interpreter = _check_device(q.device)
    upcast = interpreter_upcast(q, k, v, attn_mask) if interpreter else None
    if upcast is not None:  # V and P in fp32 under the interpreter (its bf16 dots are wrong)
        return _launch(*upcast, scale, is_causal, config or default_config(None, q.shape[-1], True), True).to(q.dtype)
    if config is None:
        D, Lk = q.shape[-1], k.shape[2]
        mask = "none" if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "add")
        cls = ("fp8",) + shape_class(q.dtype, D, Lk, mask, is_causal)
        ckey = (q.device, interpreter, cls)
        config = _configs.get(ckey)
        if config is None:
            info = None if interpreter else _device.describe(q.device)
            config = default_config(info, D, interpreter)
            if not interpreter:
                from ..core import tuning

                def run(cfg):
                    return _launch(q, k, v, attn_mask, scale, is_causal, cfg, False)

                config = tuning.choose("attention_fp8", info, cls, config,
                                       candidates=lambda: list(FP8_AUTOTUNE_SPACE), run=run)
            log.debug("fp8 attention config for %s on %s: %s", cls, q.device, config)
            _configs[ckey] = config
    return _launch(q, k, v, attn_mask, scale, is_causal, config, interpreter)


# ---- registration (kernels/attention/dispatch.py registers it; these keep the facts in one place) ----

def registry_constraints():
    """What the kernel serves, as the registry's Constraints: NVIDIA and AMD GPUs with FP8 (OCP
    e4m3) tensor cores (gpu_rules.capability_refusal decides which; CPU only through the interpreter, for tests),
    fp16/bf16, head dims 1..256, every mask kind, GQA, causal."""
    from ..core.registry import Constraints

    return Constraints(
        device_types=frozenset({"cuda", "cpu"}), vendors=frozenset({"nvidia", "amd", "cpu"}),
        cpu_needs_interpreter=True, fp8=True, dtypes=FP8_DTYPES, head_dims=(1, 256))


def registry_fn(q, k, v, attn_mask=None, scale=None, is_causal=False):
    """The registry's calling convention. Skips the input checks: kernels.attention has made
    them (shapes, masks) and the Constraints the rest (dtype, head dim), and diffusion models
    make thousands of these calls. The device check stays (it is a cached lookup)."""
    return _run(q, k, v, attn_mask, scale, is_causal, None)


# ---- references -----------------------------------------------------------------------------

def attention_fp8_ref(q, k, v, attn_mask=None, scale=None, is_causal=False):
    """The exact float32 answer (kernels.attention_ref), what accuracy is measured against."""
    return attention_ref(q, k, v, attn_mask, scale, is_causal)


def attention_fp8_emulated(q, k, v, attn_mask=None, scale=None, is_causal=False, block_m=16, block_n=16,
                           n_hi=OUTLIER_CHANNELS):
    """The kernel's arithmetic in torch (smoothing, outlier channels kept exact, per-block
    e4m3 quantisation, fp32 softmax, P.V in fp32): kernel vs this isolates kernel bugs
    from quantisation error."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    k_mean = k.mean(dim=2, dtype=torch.float32)
    hi = outlier_channels(q, k, k_mean, n_hi)
    keep = torch.zeros(B, Hkv, max(D, n_hi), dtype=torch.bool, device=q.device)
    if hi is not None:
        keep.scatter_(-1, hi.long(), True)
    keep = keep[..., :D, None].transpose(-1, -2)  # [B, Hkv, 1, D]

    def fake_quant(x, block, keep_x):
        L = x.shape[2]
        pad = (-L) % block
        lo = torch.where(keep_x, 0.0, x)
        xp = torch.nn.functional.pad(lo, (0, 0, 0, pad)).view(B, x.shape[1], -1, block, D)
        s = xp.abs().amax(dim=(-1, -2), keepdim=True).clamp_min(1e-30) / FP8_MAX
        y = (xp / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
        y = y.view(B, x.shape[1], -1, D)[:, :, :L]
        return torch.where(keep_x, x, y)

    kf = k.float() - k_mean[:, :, None, :]
    keep_q = keep.repeat_interleave(H // Hkv, dim=1)
    return attention_ref(fake_quant(q.float(), block_m, keep_q), fake_quant(kf, block_n, keep), v.float(),
                         attn_mask, scale, is_causal)


# ---- compile specs (tests build every shipped config for every target without a GPU) ------

def compile_specs(dtype: str, head_dim: int, config: dict, mask_kind: int = 0, is_causal: bool = False,
                  group: int = 1):
    """[(kernel, signature, constexprs, attrs)] for triton.compile(ASTSource(...)): the
    quantisation kernel (K's launch) and the attention kernel, specialised as a launch on
    contiguous-last-dim inputs specialises them."""
    block_d = padded_head_dim(head_dim)
    n_hi = int(config.get("N_HI", OUTLIER_CHANNELS))
    ptr = f"*{dtype}"
    quant_sig = {"X": ptr, "Y": "*fp8e4nv", "S": "*fp32", "YH": ptr, "HI": "*i32", "MEAN": "*fp32",
                 "scale_mul": "fp32", "stride_xb": "i32", "stride_xh": "i32", "stride_xl": "i32",
                 "stride_xd": "constexpr", "H": "i32", "L": "i32", "L_PAD": "i32", "N_BLOCKS": "i32"}
    quant_const = dict(stride_xd=1, HEAD_DIM=head_dim, GROUP=1, BLOCK=config["BLOCK_N"], BLOCK_D=block_d,
                       N_HI=n_hi, SUB_MEAN=True, EXACT_CAST=False)
    for name in quant_const:
        quant_sig[name] = "constexpr"

    sig = {"Q8": "*fp8e4nv", "K8": "*fp8e4nv", "SQ": "*fp32", "SK": "*fp32", "QH": ptr, "KH": ptr,
           "V": ptr, "O": ptr, "Mk": "*u8" if mask_kind == 1 else "*fp32"}
    names = ["stride_vb", "stride_vh", "stride_vn", "stride_vd",
             "stride_ob", "stride_oh", "stride_om", "stride_od",
             "stride_mb", "stride_mh", "stride_mm", "stride_mn",
             "H", "H_KV", "LQ", "LK", "LQ_PAD", "LK_PAD", "NQB", "NKB"]
    for n in names:
        sig[n] = "i32"
    constexprs = dict(
        stride_vd=1, stride_od=1,
        HEAD_DIM=head_dim, GROUP=group,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_D=block_d, D_CHECK=block_d > head_dim,
        MASK_KIND=mask_kind, MASK_ROW_BCAST=False, IS_CAUSAL=is_causal, ALIGN=8, N_HI=n_hi,
        WHILE_LOOP=False,
    )
    for n in constexprs:
        sig[n] = "constexpr"
    arg_names = list(sig)
    aligned = ["Q8", "K8", "SQ", "SK", "QH", "KH", "V", "O", "Mk", "stride_vb", "stride_vh", "stride_vn",
               "stride_ob", "stride_oh", "stride_om", "LQ_PAD", "LK_PAD"]
    attrs = {(arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    quant_names = list(quant_sig)
    quant_attrs = {(quant_names.index(n),): [["tt.divisibility", 16]]
                   for n in ("X", "Y", "S", "YH", "HI", "MEAN", "stride_xb", "stride_xh", "stride_xl", "L_PAD")}
    return [(_quant_fp8, quant_sig, quant_const, quant_attrs), (_attn_fp8_fwd, sig, constexprs, attrs)]


__all__ = ["attention_fp8", "registry_constraints", "registry_fn", "config_family", "padded_head_dim",
           "attention_fp8_ref", "attention_fp8_emulated", "outlier_channels", "FP8UnsupportedError",
           "FP8_ATTENTION_CONFIGS", "FP8_AUTOTUNE_SPACE", "OUTLIER_CHANNELS", "compile_specs"]
