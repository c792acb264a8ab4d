"""Flash-attention forward in Triton: configs per arch, the kernel, and its launcher.

One program owns BLOCK_M query rows of one (batch, head) and streams the keys in BLOCK_N
tiles with an online softmax (FlashAttention-2). Choices that matter:
- exp2 with scale*log2(e) folded into one multiply of the scores: one FMA per score instead
  of a multiply and a base-e exp;
- fp32 accumulators and softmax statistics whatever the input dtype;
- full key tiles run a loop body with no bounds checks and, without mask or causal, no
  -inf bookkeeping; only the last partial tile pays for them;
- head dims that are not a power of two are either padded (masked loads, zeros) or split in
  two power-of-two chunks (80 = 64+16, 96 = 64+32, 160 = 128+32) so the dots waste less;
- masks are read through their broadcast strides (stride 0 for broadcast dims), a row
  broadcast mask ([B,1,1,Lk], the usual padding mask) as one vector per tile;
- on Hopper, K/V can come through TMA tensor descriptors (zero-filled out of bounds).
Fully masked query rows produce zeros, as PyTorch SDPA does.
"""
from __future__ import annotations

import logging
import math
from functools import lru_cache

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # the registry reports why; importing the pack must still work
    triton = None
    tl = None

from . import device as _device
from . import direct_launch

log = logging.getLogger(__name__)

LOG2E = 1.4426950408889634

# Tuned defaults per arch and head-dim class. Classes: "d<P>" for head dims that are the
# power of two P, "d<P>p" for head dims padded (or split) up to P, either with an "m" suffix
# for calls over <= 1024 keys, "short" for cross-attention over <= 128 keys (when the
# short-key kernel, attention_short_kv.py, does not take it: masked calls, small GPUs). Keys: BLOCK_M, BLOCK_N, num_warps, num_stages, SPLIT_D
# (split an odd head dim in two power-of-two chunks rather than pad; only done with a
# 128-wide first chunk, see split_head_dim), TMA (K/V through tensor descriptors, sm90+),
# WS (tl.range warp_specialize), LAZY (lazy rescale).
# sm90 values are the winners of benchmarks/run.py --sweep on an H200 (Triton 3.6, bf16,
# 2026-12-02; numbers in benchmarks/RESULTS.md). TMA, WS and LAZY never won there, so they
# stay off. The other archs are conservative choices from their shared-memory and register
# budgets (sm86/89/120: ~100 KB shared memory per SM; sm80: 164 KB) until measured; the
# launcher steps a config down if it still does not fit.
_SM90 = {
    "d16": dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3),
    "d32": dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3),
    "d64": dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3),   # SDXL 4096: 391 TF/s
    "d64p": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),   # SD1.5 d40: 252 TF/s
    "d128": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),  # Flux 4608: 491 TF/s
    "d128p": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),   # SD1.5 d80: 218, Lumina d96: 374
    "d256": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    "d256p": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, SPLIT_D=True),  # d160 = 128+32
    "short": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),  # 4096 x 77 keys: 71 TF/s
    # <= 1024 keys: the key loop is short, so smaller tiles (more programs to overlap each
    # other's prologue and epilogue) win: SDXL 1024 tokens 285 vs 244 TF/s (128x128), Wan
    # cross-attention 32760 x 512 keys d128 405 vs 352 (128x128, 8 warps).
    "d64m": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    "d128m": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
}
_SM80 = {
    "d64": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    "d128": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    "d128p": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    "d256": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, SPLIT_D=True),
    "short": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
}
_SM86 = {  # also sm89 and consumer Blackwell sm120: ~100 KB of shared memory
    "d64": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2),
    "d128": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    "d256": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2, SPLIT_D=True),
    "short": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
}
_DEFAULT = {  # sm75 and anything unknown: small tiles that fit 64 KB of shared memory
    "d64": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    "d128": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
    "d256": dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1, SPLIT_D=True),
    "short": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
}
_HIP = {  # CDNA3 / RDNA3: 64 KB LDS, one software-pipeline stage as AMD's own kernels use
    "d64": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=1),
    "d128": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=1),
    "d256": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1, SPLIT_D=True),
    "short": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1),
}
ATTENTION_CONFIGS = {
    "sm90": _SM90, "sm80": _SM80, "sm86": _SM86, "sm89": _SM86, "sm120": _SM86,
    "sm75": _DEFAULT, "default": _DEFAULT, "hip": _HIP,
    # The interpreter runs on numpy: small tiles keep CPU tests fast and exercise the loop.
    "interpreter": {"d64": dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, SPLIT_D=True)},
}
CONFIG_DEFAULTS = dict(SPLIT_D=False, TMA=False, WS=False, LAZY=False)


def lookup_config(family: str, cls: str) -> dict:
    """The table entry for a class, falling back dXp -> dX -> d64 (smaller tiles for more
    shared-memory hungry classes are handled by the launcher's step-down)."""
    table = ATTENTION_CONFIGS[family]
    base = cls[:-1] if cls.endswith("m") else cls
    for key in (cls, base, base.rstrip("p"), "d64"):
        if key in table:
            return {**CONFIG_DEFAULTS, **table[key]}
    return {**CONFIG_DEFAULTS, **next(iter(table.values()))}


# Candidates the opt-in autotuner (TRITON_ACCEL_AUTOTUNE=1) measures for a shape class.
AUTOTUNE_SPACE = [
    dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, SPLIT_D=True, TMA=False, WS=False, LAZY=False)
    for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)
    if not (bm == 64 and w == 8)
]


def arch_family(arch: str) -> str:
    if arch in ATTENTION_CONFIGS:
        return arch
    if arch.startswith("gfx"):
        return "hip"
    if arch.startswith("sm"):
        major = int(arch[2:-1] or 0)
        if major >= 10:
            return "sm120" if major >= 12 else "sm90"  # datacenter Blackwell runs Hopper-style tiles
        if major == 9:
            return "sm90"
        if major == 8:
            return "sm86"
    return "default"


# Splitting odd head dims (80 = 64+16, 96 = 64+32, 160 = 128+32) measured faster on an H200
# (Lumina d96 at 4096 tokens: 462 vs 374 TF/s padded) but gave wrong results on partial
# tiles (lengths not multiples of the block) with Triton 3.6 on sm_90 for several configs
# (benchmarks/gpu_check.py, 2026-12-02), while the interpreter computes them correctly:
# a miscompile we have not isolated. Off until it is; head dims are padded instead.
SPLIT_ENABLED = False


def split_head_dim(head_dim: int, split: bool) -> tuple[int, int]:
    """Two power-of-two chunks (each >= 16, the smallest dot) covering head_dim.

    Without split, one chunk padded to the next power of two. With split, the largest power
    of two not above head_dim plus the smallest power of two covering the rest, when that
    wastes less than padding.
    """
    padded = max(16, 1 << (head_dim - 1).bit_length())
    if not split or head_dim <= 16 or padded == head_dim:
        return padded, 0
    d0 = 1 << (head_dim.bit_length() - 1)
    if not SPLIT_ENABLED:
        return padded, 0
    rest = head_dim - d0
    d1 = max(16, 1 << (rest - 1).bit_length())
    if d0 + d1 >= padded:
        return padded, 0
    return d0, d1


def head_dim_class(head_dim: int, kv_len: int) -> str:
    if kv_len <= 128 and head_dim <= 128:
        return "short"
    padded = max(16, 1 << (head_dim - 1).bit_length())
    return f"d{padded}" + ("p" if padded != head_dim else "") + ("m" if kv_len <= 1024 else "")


if triton is not None:

    @triton.jit
    def _load_2d(ptrs, rows, row_limit, cols, col_limit, ROW_CHECK: tl.constexpr, COL_CHECK: tl.constexpr):
        if ROW_CHECK and COL_CHECK:
            x = tl.load(ptrs, mask=(rows[:, None] < row_limit) & (cols[None, :] < col_limit), other=0.0)
        elif ROW_CHECK:
            x = tl.load(ptrs, mask=rows[:, None] < row_limit, other=0.0)
        elif COL_CHECK:
            x = tl.load(ptrs, mask=cols[None, :] < col_limit, other=0.0)
        else:
            x = tl.load(ptrs)
        return x

    @triton.jit
    def _row_offsets(idx, stride, ALIGN: tl.constexpr):
        # Triton learns only divisibility by 16 from a launch; head dim 40 gives row strides
        # of 40 elements, still 16-byte aligned. Saying so restores 16-byte vector loads and
        # cp.async pipelining (a hint on the scalar stride argument is not propagated).
        off = idx * stride
        if ALIGN > 1:
            off = tl.multiple_of(off, ALIGN)
        return off

    @triton.jit
    def _attn_tile(
        acc0, acc1, l_i, m_i, q0, q1,
        K, V, Mk, Kd0, Kd1, Vd0, Vd1, off_b, off_hkv, start_n,
        offs_m, offs_n, offs_d0, offs_d1,
        stride_kn, stride_kd, stride_vn, stride_vd, mask_rows, stride_mn,
        qk_scale, LK,
        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
        D0_CHECK: tl.constexpr, D1_CHECK: tl.constexpr,
        MASK_KIND: tl.constexpr, MASK_ROW_BCAST: tl.constexpr, IS_CAUSAL: tl.constexpr,
        BOUNDARY: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
        LAZY_RESCALE: tl.constexpr, ALIGN: tl.constexpr,
    ):
        cols = start_n + offs_n
        rk = _row_offsets(cols, stride_kn, ALIGN)[:, None]
        rv = _row_offsets(cols, stride_vn, ALIGN)[:, None]
        if USE_TMA:
            k0 = Kd0.load([off_b, off_hkv, start_n, 0]).reshape([BLOCK_N, BLOCK_D0])
        else:
            k0 = _load_2d(K + rk + offs_d0[None, :] * stride_kd,
                          cols, LK, offs_d0, HEAD_DIM, BOUNDARY, D0_CHECK)
        qk = tl.dot(q0, tl.trans(k0), input_precision=DOT_PRECISION)
        if BLOCK_D1 > 0:
            if USE_TMA:
                k1 = Kd1.load([off_b, off_hkv, start_n, BLOCK_D0]).reshape([BLOCK_N, BLOCK_D1])
            else:
                k1 = _load_2d(K + rk + offs_d1[None, :] * stride_kd,
                              cols, LK, offs_d1, HEAD_DIM, BOUNDARY, D1_CHECK)
            qk = tl.dot(q1, tl.trans(k1), qk, input_precision=DOT_PRECISION)

        if MASK_KIND == 0 and not IS_CAUSAL and not BOUNDARY and LAZY_RESCALE:
            # Rescale only when some row's max grew by more than 2**8: until then the stale
            # max keeps p <= 256, harmless in fp32 sums and bf16/fp16 p. Saves the acc
            # multiply on most tiles, which matters where softmax, not the MMA, bounds.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            if tl.max(m_new - m_i, 0) > 8.0:
                alpha = tl.math.exp2(m_i - m_new)
                acc0 = acc0 * alpha[:, None]
                if BLOCK_D1 > 0:
                    acc1 = acc1 * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            p = tl.math.exp2(qk * qk_scale - m_i[:, None])
            alpha = tl.full([1], 1.0, dtype=tl.float32)
            m_ij = m_i
        elif MASK_KIND == 0 and not IS_CAUSAL and not BOUNDARY:
            # Hot path: every score is finite, so no -inf guards are needed.
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)
        else:
            s = qk * qk_scale
            if MASK_KIND != 0:
                if BOUNDARY:
                    mcols = tl.minimum(cols, LK - 1)  # clamped reads stay in bounds; masked below
                else:
                    mcols = cols
                if MASK_ROW_BCAST:
                    mval = tl.load(Mk + mcols * stride_mn)[None, :]
                else:
                    mval = tl.load(Mk + mask_rows[:, None] + mcols[None, :] * stride_mn)
                if MASK_KIND == 1:
                    s = tl.where(mval != 0, s, float("-inf"))
                else:
                    s = s + mval.to(tl.float32) * 1.4426950408889634
            if BOUNDARY:
                s = tl.where(cols[None, :] < LK, s, float("-inf"))
            if IS_CAUSAL:
                s = tl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            # A row with nothing allowed yet keeps m = -inf; subtract 0 instead so p = 0, not NaN.
            m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
        if LAZY_RESCALE and MASK_KIND == 0 and not IS_CAUSAL and not BOUNDARY:
            l_i = l_i + tl.sum(p, 1)
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
            acc0 = acc0 * alpha[:, None]
        if USE_TMA:
            v0 = Vd0.load([off_b, off_hkv, start_n, 0]).reshape([BLOCK_N, BLOCK_D0])
        else:
            v0 = _load_2d(V + rv + offs_d0[None, :] * stride_vd,
                          cols, LK, offs_d0, HEAD_DIM, BOUNDARY, D0_CHECK)
        pc = p.to(v0.dtype)
        acc0 = tl.dot(pc, v0, acc0, input_precision=DOT_PRECISION)
        if BLOCK_D1 > 0:
            if not (LAZY_RESCALE and MASK_KIND == 0 and not IS_CAUSAL and not BOUNDARY):
                acc1 = acc1 * alpha[:, None]
            if USE_TMA:
                v1 = Vd1.load([off_b, off_hkv, start_n, BLOCK_D0]).reshape([BLOCK_N, BLOCK_D1])
            else:
                v1 = _load_2d(V + rv + offs_d1[None, :] * stride_vd,
                              cols, LK, offs_d1, HEAD_DIM, BOUNDARY, D1_CHECK)
            acc1 = tl.dot(pc, v1, acc1, input_precision=DOT_PRECISION)
        return acc0, acc1, l_i, m_ij

    @triton.jit
    def _attn_fwd(
        Q, K, V, O, Mk, Kd0, Kd1, Vd0, Vd1,
        qk_scale,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        stride_mb, stride_mh, stride_mm, stride_mn,
        H, H_KV, LQ, LK,
        HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
        D0_CHECK: tl.constexpr, D1_CHECK: tl.constexpr,
        MASK_KIND: tl.constexpr, MASK_ROW_BCAST: tl.constexpr, IS_CAUSAL: tl.constexpr,
        USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, WARP_SPEC: tl.constexpr,
        ALIGN: tl.constexpr, LAZY_RESCALE: tl.constexpr,
    ):
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = off_bh // H
        off_h = off_bh % H
        off_hkv = off_h // GROUP
        # int64 bases: batch*heads*length*dim passes 2**31 on video models.
        Q += off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        K += off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
        V += off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
        O += off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh

        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d0 = tl.arange(0, BLOCK_D0)
        offs_d1 = BLOCK_D0 + tl.arange(0, BLOCK_D1 if BLOCK_D1 > 0 else 16)

        mask_rows = offs_m
        if MASK_KIND != 0:
            Mk += off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh
            mask_rows = tl.minimum(offs_m, LQ - 1) * stride_mm

        rq = _row_offsets(offs_m, stride_qm, ALIGN)[:, None]
        ro = _row_offsets(offs_m, stride_om, ALIGN)[:, None]
        q0 = _load_2d(Q + rq + offs_d0[None, :] * stride_qd,
                      offs_m, LQ, offs_d0, HEAD_DIM, True, D0_CHECK)
        acc0 = tl.zeros([BLOCK_M, BLOCK_D0], dtype=tl.float32)
        if BLOCK_D1 > 0:
            q1 = _load_2d(Q + rq + offs_d1[None, :] * stride_qd,
                          offs_m, LQ, offs_d1, HEAD_DIM, True, D1_CHECK)
            acc1 = tl.zeros([BLOCK_M, BLOCK_D1], dtype=tl.float32)
        else:
            q1 = q0
            acc1 = tl.zeros([1, 1], dtype=tl.float32)  # unused; small so the loop carries no dead tile
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

        hi = LK
        if IS_CAUSAL:
            hi = tl.minimum(LK, (start_m + 1) * BLOCK_M)
        n_full = (hi // BLOCK_N) * BLOCK_N
        if WARP_SPEC:
            for start_n in tl.range(0, n_full, BLOCK_N, warp_specialize=True):
                start_n = tl.multiple_of(start_n, BLOCK_N)
                acc0, acc1, l_i, m_i = _attn_tile(
                    acc0, acc1, l_i, m_i, q0, q1, K, V,
                    Mk, Kd0, Kd1, Vd0, Vd1, off_b, off_hkv, start_n,
                    offs_m, offs_n, offs_d0, offs_d1,
                    stride_kn, stride_kd, stride_vn, stride_vd, mask_rows, stride_mn,
                    qk_scale, LK,
                    HEAD_DIM, BLOCK_N, BLOCK_D0, BLOCK_D1, D0_CHECK, D1_CHECK,
                    MASK_KIND, MASK_ROW_BCAST, IS_CAUSAL, False, USE_TMA, DOT_PRECISION, LAZY_RESCALE, ALIGN,
                )
        else:
            for start_n in range(0, n_full, BLOCK_N):
                start_n = tl.multiple_of(start_n, BLOCK_N)
                acc0, acc1, l_i, m_i = _attn_tile(
                    acc0, acc1, l_i, m_i, q0, q1, K, V,
                    Mk, Kd0, Kd1, Vd0, Vd1, off_b, off_hkv, start_n,
                    offs_m, offs_n, offs_d0, offs_d1,
                    stride_kn, stride_kd, stride_vn, stride_vd, mask_rows, stride_mn,
                    qk_scale, LK,
                    HEAD_DIM, BLOCK_N, BLOCK_D0, BLOCK_D1, D0_CHECK, D1_CHECK,
                    MASK_KIND, MASK_ROW_BCAST, IS_CAUSAL, False, USE_TMA, DOT_PRECISION, LAZY_RESCALE, ALIGN,
                )
        if n_full < hi:
            acc0, acc1, l_i, m_i = _attn_tile(
                acc0, acc1, l_i, m_i, q0, q1, K, V,
                Mk, Kd0, Kd1, Vd0, Vd1, off_b, off_hkv, n_full,
                offs_m, offs_n, offs_d0, offs_d1,
                stride_kn, stride_kd, stride_vn, stride_vd, mask_rows, stride_mn,
                qk_scale, LK,
                HEAD_DIM, BLOCK_N, BLOCK_D0, BLOCK_D1, D0_CHECK, D1_CHECK,
                MASK_KIND, MASK_ROW_BCAST, IS_CAUSAL, True, USE_TMA, DOT_PRECISION, False, ALIGN,
            )

        # Rows with every key masked have l = 0: write zeros, as SDPA does.
        inv_l = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
        out0 = (acc0 * inv_l[:, None]).to(O.dtype.element_ty)
        o_rows = offs_m[:, None] < LQ
        if D0_CHECK:
            tl.store(O + ro + offs_d0[None, :] * stride_od, out0,
                     mask=o_rows & (offs_d0[None, :] < HEAD_DIM))
        else:
            tl.store(O + ro + offs_d0[None, :] * stride_od, out0, mask=o_rows)
        if BLOCK_D1 > 0:
            out1 = (acc1 * inv_l[:, None]).to(O.dtype.element_ty)
            if D1_CHECK:
                tl.store(O + ro + offs_d1[None, :] * stride_od, out1,
                         mask=o_rows & (offs_d1[None, :] < HEAD_DIM))
            else:
                tl.store(O + ro + offs_d1[None, :] * stride_od, out1, mask=o_rows)


def _tma_ok(t: torch.Tensor) -> bool:
    """Host TMA descriptors need a unit last stride and 16-byte aligned base and strides."""
    if t.device.type != "cuda" or t.stride(-1) != 1:
        return False
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in t.stride()[:-1])


def _descriptors(t: torch.Tensor, block_n: int, d0: int, d1: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    shape, strides = list(t.shape), list(t.stride())
    first = TensorDescriptor(t, shape, strides, [1, 1, block_n, d0])
    second = TensorDescriptor(t, shape, strides, [1, 1, block_n, d1]) if d1 else None
    return first, second


def default_config(info, head_dim: int, kv_len: int, interpreter: bool) -> dict:
    if interpreter:
        return lookup_config("interpreter", "d64")
    return lookup_config(arch_family(info.arch), head_dim_class(head_dim, kv_len))


def _step_down(cfg: dict) -> dict | None:
    """A smaller config after an out-of-resources failure: fewer stages, then narrower tiles."""
    c = dict(cfg)
    if c["num_stages"] > 2:
        c["num_stages"] -= 1
    elif c["BLOCK_N"] > 32:
        c["BLOCK_N"] //= 2
    elif c["BLOCK_M"] > 32:
        c["BLOCK_M"] //= 2
    elif c["num_stages"] > 1:
        c["num_stages"] -= 1
    else:
        return None
    return c


_fitted: dict = {}  # (config, static launch facts) -> config that fits this GPU


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def attention_triton(q, k, v, attn_mask=None, scale=None, is_causal=False, config=None):
    """Launch the kernel. Inputs are [B, H, L, D] with any strides; k/v may have fewer heads.

    The caller (kernels.attention) has checked shapes and dtypes; this checks only what the
    kernel itself needs. Returns a tensor laid out like torch.empty_like(q).
    """
    if triton is None:
        raise RuntimeError("Triton is not installed")
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    if Lq == 0 or B == 0 or H == 0:
        return out
    if Lk == 0:
        return out.zero_()  # nothing to attend to: the fully-masked answer
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)

    if attn_mask is None:
        mask_kind, mk, mstr, row_bcast = 0, q, (0, 0, 0, 0), False
    else:
        mk = attn_mask.expand(B, H, Lq, Lk)  # stride-0 view: never materialised
        if mk.dtype == torch.bool:
            mask_kind, mk = 1, mk.view(torch.uint8)
        else:
            mask_kind = 2
        mstr = mk.stride()
        row_bcast = mstr[2] == 0

    plan_key = None
    if direct_launch.usable(q):
        # Everything the JIT specialises on (shapes, strides, dtypes, 16-byte alignment of the
        # pointers) plus the config: same key, same compiled kernel and grid.
        plan_key = ("attn", q.device, q.dtype, q.shape, q.stride(), k.shape, k.stride(), v.stride(), out.stride(),
                    mask_kind, mk.dtype, mstr, bool(is_causal), None if config is None else tuple(config.items()),
                    q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, out.data_ptr() % 16,
                    mk.data_ptr() % 16)
        plan = direct_launch.lookup(plan_key)
        if plan is not None:
            direct_launch.launch(plan, q.device.index, _runtime_args(q, k, v, out, mk, scale, mstr, H, Hkv, Lq, Lk))
            return out

    interpreter = _device.interpreter_enabled() and q.device.type == "cpu"
    if config is None:
        config = default_config(_device.describe(q.device), D, Lk, interpreter)
    cfg = {**CONFIG_DEFAULTS, **config}
    if q.dtype == torch.float32 and not interpreter:
        # fp32 tiles take twice the shared memory of the tuned 16-bit ones.
        cfg["BLOCK_N"] = min(cfg["BLOCK_N"], 64)
        cfg["num_stages"] = min(cfg["num_stages"], 2)
    if q.device.type == "cuda" and cfg["BLOCK_M"] > 64:
        # Fewer programs than multiprocessors leaves the GPU idle: trade tile size for programs.
        if -(-Lq // cfg["BLOCK_M"]) * B * H < _sm_count(q.device.index or 0):
            cfg["BLOCK_M"] = 64

    dot_precision = dot_input_precision(q.dtype == torch.float32, bool(getattr(torch.version, "hip", None)))
    align = row_alignment(q, k, v, out)

    def launch(c, dst):
        block_m, block_n = c["BLOCK_M"], c["BLOCK_N"]
        d0, d1 = split_head_dim(D, c.get("SPLIT_D", False))
        use_tma = bool(c.get("TMA")) and not interpreter and _tma_ok(k) and _tma_ok(v)
        kd0 = kd1 = vd0 = vd1 = None
        if use_tma:
            kd0, kd1 = _descriptors(k, block_n, d0, d1)
            vd0, vd1 = _descriptors(v, block_n, d0, d1)
        grid = (-(-Lq // block_m), B * H)  # triton.cdiv is a jit function: microseconds per call
        consts = dict(
            HEAD_DIM=D, GROUP=H // Hkv,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D0=d0, BLOCK_D1=d1,
            D0_CHECK=d0 > D, D1_CHECK=d1 > 0 and d0 + d1 > D,
            MASK_KIND=mask_kind, MASK_ROW_BCAST=row_bcast, IS_CAUSAL=bool(is_causal),
            USE_TMA=use_tma, DOT_PRECISION=dot_precision, WARP_SPEC=bool(c.get("WS")) and not interpreter,
            ALIGN=align, LAZY_RESCALE=bool(c.get("LAZY")),
        )
        kernel = _attn_fwd[grid](
            q, k, v, dst, mk, kd0, kd1, vd0, vd1,
            scale * LOG2E,
            *q.stride(), *k.stride(), *v.stride(), *dst.stride(), *mstr,
            H, Hkv, Lq, Lk,
            **consts,
            num_warps=c["num_warps"], num_stages=c["num_stages"],
        )
        return kernel, grid, tuple(consts.values()), use_tma

    fit_key = (tuple(sorted(cfg.items())), q.device, q.dtype, D, mask_kind, row_bcast, bool(is_causal))
    cfg = _fitted.get(fit_key, cfg)
    while True:
        try:
            kernel, grid, consts, used_tma = launch(cfg, out)
            break
        except Exception as e:
            # Shared memory differs per GPU and per mask layout; a config that does not fit
            # steps down instead of failing the call. Anything else is a real error.
            if "OutOfResources" not in type(e).__name__ and "out of resource" not in str(e):
                raise
            smaller = _step_down(cfg)
            if smaller is None:
                raise
            log.info("attention config %s does not fit (%s); trying %s", cfg, str(e).splitlines()[0], smaller)
            cfg = smaller
    _fitted[fit_key] = cfg
    if plan_key is not None and not used_tma and not interpreter:
        direct_launch.record(plan_key, kernel, grid, consts,
                             _runtime_args(q, k, v, out, mk, scale, mstr, H, Hkv, Lq, Lk), out_index=3)
    return out


def _runtime_args(q, k, v, out, mk, scale, mstr, H, Hkv, Lq, Lk):
    """_attn_fwd's non-constexpr arguments in signature order (the descriptors are None)."""
    return (q, k, v, out, mk, None, None, None, None, scale * LOG2E,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *mstr, H, Hkv, Lq, Lk)


def row_alignment(*tensors) -> int:
    """Largest power of two (<= 16 elements) dividing every row/head/batch stride, or 1 when a
    last dim is strided: the divisibility the kernels may promise Triton for row offsets."""
    if any(t.stride(-1) != 1 for t in tensors):
        return 1
    g = 0
    for t in tensors:
        for st in t.stride()[:-1]:
            g = math.gcd(g, st)
    align = min(16, g & -g) if g else 16
    return align if align >= 2 else 1


def dot_input_precision(fp32: bool, hip: bool) -> str:
    # fp32 inputs keep fp32 accuracy ("ieee"), as SDPA gives; 16-bit inputs ignore the
    # setting on NVIDIA, but AMD's Triton rejects "tf32" outright.
    return "ieee" if fp32 or hip else "tf32"


def compile_spec(dtype: str, head_dim: int, config: dict, mask_kind: int = 0, is_causal: bool = False,
                 group: int = 1, hip: bool = False, mask_row_bcast: bool = False):
    """(kernel, signature, constexprs, attrs) for triton.compile(ASTSource(...)): the compile tests
    build every shipped config for every target without a GPU."""
    d0, d1 = split_head_dim(head_dim, config.get("SPLIT_D", True))
    ptr = f"*{dtype}"
    sig = {"Q": ptr, "K": ptr, "V": ptr, "O": ptr,
           "Mk": "*u8" if mask_kind == 1 else ("*fp32" if mask_kind == 2 else ptr),
           "Kd0": "constexpr", "Kd1": "constexpr", "Vd0": "constexpr", "Vd1": "constexpr",
           "qk_scale": "fp32"}
    names = ["stride_qb", "stride_qh", "stride_qm", "stride_qd",
             "stride_kb", "stride_kh", "stride_kn", "stride_kd",
             "stride_vb", "stride_vh", "stride_vn", "stride_vd",
             "stride_ob", "stride_oh", "stride_om", "stride_od",
             "stride_mb", "stride_mh", "stride_mm", "stride_mn",
             "H", "H_KV", "LQ", "LK"]
    for n in names:
        sig[n] = "i32"
    # What a JIT launch on contiguous-last-dim inputs specialises: unit head-dim strides
    # (16-byte vector loads, cp.async pipelining) and 16-divisible pointers and strides.
    unit = {"stride_qd": 1, "stride_kd": 1, "stride_vd": 1, "stride_od": 1}
    constexprs = dict(
        Kd0=None, Kd1=None, Vd0=None, Vd1=None,
        HEAD_DIM=head_dim, GROUP=group,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_D0=d0, BLOCK_D1=d1,
        D0_CHECK=d0 > head_dim, D1_CHECK=d1 > 0 and d0 + d1 > head_dim,
        MASK_KIND=mask_kind, MASK_ROW_BCAST=mask_row_bcast, IS_CAUSAL=is_causal,
        USE_TMA=False, DOT_PRECISION=dot_input_precision(dtype == "fp32", hip), WARP_SPEC=bool(config.get("WS")),
        ALIGN=8 if dtype != "fp32" else 4, LAZY_RESCALE=bool(config.get("LAZY")),
    )
    constexprs.update(unit)
    for k_ in constexprs:
        sig[k_] = "constexpr"
    arg_names = list(sig)
    aligned = ["Q", "K", "V", "O", "Mk", "stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh",
               "stride_kn", "stride_vb", "stride_vh", "stride_vn", "stride_ob", "stride_oh", "stride_om"]
    attrs = {(arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return _attn_fwd, sig, constexprs, attrs
