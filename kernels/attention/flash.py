"""Flash-attention forward in Triton: configs per arch, the kernel, and its launcher.

One program owns BLOCK_M query rows of one (batch, head) and streams the keys in BLOCK_N
tiles with an online softmax (FlashAttention-2). Choices that matter:
- exp2 with scale*log2(e) folded into one multiply of the scores: one FMA per score instead
  of a multiply and a base-e exp;
- fp32 accumulators and softmax statistics whatever the input dtype;
- full key tiles run a loop body with no bounds checks and, without mask or causal, no
  -inf bookkeeping; only the last partial tile pays for them;
- head dims that are not a power of two are padded to one (masked loads, zeros);
- the running max is taken of the scaled scores: for a negative scale (a constexpr variant)
  the row minimum of the unscaled ones, so the hot path keeps one FMA per score;
- masks are read through their broadcast strides (stride 0 for broadcast dims), a row
  broadcast mask ([B,1,1,Lk], the usual padding mask) as one vector per tile;
- on Hopper, K/V can come through TMA tensor descriptors (zero-filled out of bounds).
Fully masked query rows produce zeros, as PyTorch SDPA does. Shared helpers (jit loads,
mask layout, arch family, padding) live in kernel_common.py.
"""
from __future__ import annotations

import logging
import math

import torch

from ..core.kernel_common import tl, triton  # None, None where Triton does not import

from ..core import cache_registry, direct_launch
from ..core import device as _device
from ..core.kernel_common import (LAUNCH_OPTIONS, LOG2E, arch_family, dot_input_precision, family_in, is_hip,
                            is_out_of_resources, mask_layout, next_pow2, row_alignment, sm_count)

if triton is not None:
    from ..core.kernel_common import load_2d, masked_softmax_tile, row_offsets

log = logging.getLogger("triton_accel.kernels.attention.flash")  # not __name__: the clone's folder name

# Tuned defaults per arch family (kernel_common.arch_family; a family without its own table
# takes its FAMILY_FALLBACK) and head-dim class. Classes: "d<P>" for head dims that are the
# power of two P, "d<P>p" for head dims padded up to P, either with an "m" suffix for calls
# over <= 1024 keys, "short" for cross-attention over <= 128 keys (when the short-key kernel,
# attention_short_kv.py, does not take it: masked calls, small GPUs). Keys: BLOCK_M, BLOCK_N,
# num_warps, num_stages, TMA (K/V through tensor descriptors, sm90+), WS (tl.range
# warp_specialize), LAZY (lazy rescale).
# sm90 values are the winners of benchmarks/run.py --sweep (numbers in benchmarks/RESULTS.md).
# TMA, WS and LAZY never won there, so they stay off. The other archs are conservative choices
# from their shared-memory and register budgets (sm86/89/120: ~100 KB shared memory per SM;
# sm80: 164 KB) until measured; the launcher steps a config down if it still does not fit.
_SM90 = {
    "d16": dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3),
    "d32": dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3),
    "d64": dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3),
    "d64p": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    "d128": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    "d128p": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    "d256": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    "d256p": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    "short": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
    # <= 1024 keys: the key loop is short, so smaller tiles (more programs to overlap each
    # other's prologue and epilogue) win (SDXL 1024 tokens, Wan's 512-key cross-attention).
    "d64m": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    "d128m": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
}
_SM80 = {
    "d64": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    "d128": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    "d128p": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    "d256": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    "short": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
}
_SM86 = {  # also sm89 and consumer Blackwell sm120 (their fallback): ~100 KB of shared memory
    "d64": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2),
    "d128": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    "d256": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
    "short": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
}
_DEFAULT = {  # sm75 and anything unknown: small tiles that fit 64 KB of shared memory
    "d64": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    "d128": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
    "d256": dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1),
    "short": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
}
_HIP = {  # CDNA3 / RDNA3: 64 KB LDS, one software-pipeline stage as AMD's own kernels use
    "d64": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=1),
    "d128": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=1),
    "d256": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1),
    "short": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1),
}
ATTENTION_CONFIGS = {
    "sm90": _SM90, "sm80": _SM80, "sm86": _SM86, "default": _DEFAULT, "hip": _HIP,
    # The interpreter runs on numpy: small tiles keep CPU tests fast and exercise the loop.
    "interpreter": {"d64": dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)},
}
CONFIG_DEFAULTS = dict(TMA=False, WS=False, LAZY=False)


def lookup_config(family: str, cls: str) -> dict:
    """The table entry for a class, falling back dXp -> dX -> d64 (smaller tiles for more
    shared-memory hungry classes are handled by the launcher's step-down)."""
    table = ATTENTION_CONFIGS[family_in(ATTENTION_CONFIGS, family)]
    base = cls[:-1] if cls.endswith("m") else cls
    for key in (cls, base, base.rstrip("p"), "d64"):
        if key in table:
            return {**CONFIG_DEFAULTS, **table[key]}
    return {**CONFIG_DEFAULTS, **next(iter(table.values()))}


# Candidates the opt-in autotuner (TRITON_ACCEL_AUTOTUNE=1) measures for a shape class.
AUTOTUNE_SPACE = [
    dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, TMA=False, WS=False, LAZY=False)
    for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)
    if not (bm == 64 and w == 8)
]


def head_dim_class(head_dim: int, kv_len: int) -> str:
    if kv_len <= 128 and head_dim <= 128:
        return "short"
    padded = next_pow2(head_dim)
    return f"d{padded}" + ("p" if padded != head_dim else "") + ("m" if kv_len <= 1024 else "")


if triton is not None:

    @triton.jit
    def _attn_tile(
        acc, l_i, m_i, q,
        K, V, Mk, Kd, Vd, off_b, off_hkv, start_n,
        offs_m, offs_n, offs_d,
        stride_kn, stride_kd, stride_vn, stride_vd, mask_rows, stride_mn,
        qk_scale, LK,
        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_CHECK: tl.constexpr,
        MASK_KIND: tl.constexpr, MASK_ROW_BCAST: tl.constexpr, IS_CAUSAL: tl.constexpr,
        BOUNDARY: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
        LAZY_RESCALE: tl.constexpr, ALIGN: tl.constexpr, NEGATIVE_SCALE: tl.constexpr,
    ):
        cols = start_n + offs_n
        rk = row_offsets(cols, stride_kn, ALIGN)[:, None]
        rv = row_offsets(cols, stride_vn, ALIGN)[:, None]
        if USE_TMA:
            k = Kd.load([off_b, off_hkv, start_n, 0]).reshape([BLOCK_N, BLOCK_D])
        else:
            k = load_2d(K + rk + offs_d[None, :] * stride_kd, cols, LK, offs_d, HEAD_DIM, BOUNDARY, D_CHECK)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)

        if MASK_KIND == 0 and not (IS_CAUSAL or BOUNDARY):  # no A and B and C: Triton <= 3.3 rejects chains
            # Hot path: every score is finite, so no -inf guards are needed. The running max
            # must be that of the scaled scores: for a negative scale, the unscaled row
            # minimum. Taking it before scaling keeps qk*scale - m one FMA per score.
            if NEGATIVE_SCALE:
                row_max = tl.min(qk, 1) * qk_scale
            else:
                row_max = tl.max(qk, 1) * qk_scale
            if LAZY_RESCALE:
                # Rescale only when some row's max grew by more than 2**8: until then the stale
                # max keeps p <= 256, harmless in fp32 sums and bf16/fp16 p. Saves the acc
                # multiply on most tiles, which matters where softmax, not the MMA, bounds.
                m_new = tl.maximum(m_i, row_max)
                if tl.max(m_new - m_i, 0) > 8.0:
                    alpha = tl.math.exp2(m_i - m_new)
                    acc = acc * alpha[:, None]
                    l_i = l_i * alpha
                    m_i = m_new
                p = tl.math.exp2(qk * qk_scale - m_i[:, None])
                m_ij = m_i
                l_i = l_i + tl.sum(p, 1)
            else:
                m_ij = tl.maximum(m_i, row_max)
                p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
                alpha = tl.math.exp2(m_i - m_ij)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None]
        else:
            p, alpha, m_ij = masked_softmax_tile(qk * qk_scale, m_i, cols, offs_m, Mk, mask_rows, stride_mn, LK,
                                                 MASK_KIND, MASK_ROW_BCAST, IS_CAUSAL, BOUNDARY)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
        if USE_TMA:
            v = Vd.load([off_b, off_hkv, start_n, 0]).reshape([BLOCK_N, BLOCK_D])
        else:
            v = load_2d(V + rv + offs_d[None, :] * stride_vd, cols, LK, offs_d, HEAD_DIM, BOUNDARY, D_CHECK)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        return acc, l_i, m_ij

    @triton.jit
    def _attn_fwd(
        Q, K, V, O, Mk, Kd, Vd, Lse,
        qk_scale,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        stride_mb, stride_mh, stride_mm, stride_mn,
        H, H_KV, LQ, LK,
        HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_CHECK: tl.constexpr,
        MASK_KIND: tl.constexpr, MASK_ROW_BCAST: tl.constexpr, IS_CAUSAL: tl.constexpr,
        USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, WARP_SPEC: tl.constexpr,
        ALIGN: tl.constexpr, LAZY_RESCALE: tl.constexpr, NEGATIVE_SCALE: tl.constexpr,
        WHILE_LOOP: tl.constexpr, RETURN_LSE: tl.constexpr,
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
        offs_d = tl.arange(0, BLOCK_D)

        mask_rows = offs_m
        if MASK_KIND != 0:
            Mk += off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh
            mask_rows = tl.minimum(offs_m, LQ - 1) * stride_mm

        rq = row_offsets(offs_m, stride_qm, ALIGN)[:, None]
        ro = row_offsets(offs_m, stride_om, ALIGN)[:, None]
        q = load_2d(Q + rq + offs_d[None, :] * stride_qd, offs_m, LQ, offs_d, HEAD_DIM, True, D_CHECK)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

        hi = LK
        if IS_CAUSAL:
            hi = tl.minimum(LK, (start_m + 1) * BLOCK_M)
        n_full = (hi // BLOCK_N) * BLOCK_N
        if WARP_SPEC:
            for start_n in tl.range(0, n_full, BLOCK_N, warp_specialize=True):
                start_n = tl.multiple_of(start_n, BLOCK_N)
                acc, l_i, m_i = _attn_tile(
                    acc, l_i, m_i, q, K, V, Mk, Kd, Vd, off_b, off_hkv, start_n,
                    offs_m, offs_n, offs_d,
                    stride_kn, stride_kd, stride_vn, stride_vd, mask_rows, stride_mn,
                    qk_scale, LK,
                    HEAD_DIM, BLOCK_N, BLOCK_D, D_CHECK, MASK_KIND, MASK_ROW_BCAST, IS_CAUSAL, False,
                    USE_TMA, DOT_PRECISION, LAZY_RESCALE, ALIGN, NEGATIVE_SCALE,
                )
        elif WHILE_LOOP:
            # Triton <= 3.6's interpreter turns a tensor loop bound into an int through a
            # 1-element array, an error on NumPy >= 2.4; a while test goes through bool().
            # Interpreter only: compiled code keeps range(), which Triton software-pipelines.
            start_n = 0
            while start_n < n_full:
                acc, l_i, m_i = _attn_tile(
                    acc, l_i, m_i, q, K, V, Mk, Kd, Vd, off_b, off_hkv, start_n,
                    offs_m, offs_n, offs_d,
                    stride_kn, stride_kd, stride_vn, stride_vd, mask_rows, stride_mn,
                    qk_scale, LK,
                    HEAD_DIM, BLOCK_N, BLOCK_D, D_CHECK, MASK_KIND, MASK_ROW_BCAST, IS_CAUSAL, False,
                    USE_TMA, DOT_PRECISION, LAZY_RESCALE, ALIGN, NEGATIVE_SCALE,
                )
                start_n += BLOCK_N
        else:
            for start_n in range(0, n_full, BLOCK_N):
                start_n = tl.multiple_of(start_n, BLOCK_N)
                acc, l_i, m_i = _attn_tile(
                    acc, l_i, m_i, q, K, V, Mk, Kd, Vd, off_b, off_hkv, start_n,
                    offs_m, offs_n, offs_d,
                    stride_kn, stride_kd, stride_vn, stride_vd, mask_rows, stride_mn,
                    qk_scale, LK,
                    HEAD_DIM, BLOCK_N, BLOCK_D, D_CHECK, MASK_KIND, MASK_ROW_BCAST, IS_CAUSAL, False,
                    USE_TMA, DOT_PRECISION, LAZY_RESCALE, ALIGN, NEGATIVE_SCALE,
                )
        if n_full < hi:
            acc, l_i, m_i = _attn_tile(
                acc, l_i, m_i, q, K, V, Mk, Kd, Vd, off_b, off_hkv, n_full,
                offs_m, offs_n, offs_d,
                stride_kn, stride_kd, stride_vn, stride_vd, mask_rows, stride_mn,
                qk_scale, LK,
                HEAD_DIM, BLOCK_N, BLOCK_D, D_CHECK, MASK_KIND, MASK_ROW_BCAST, IS_CAUSAL, True,
                USE_TMA, DOT_PRECISION, False, ALIGN, NEGATIVE_SCALE,
            )

        # Rows with every key masked have l = 0: write zeros, as SDPA does.
        inv_l = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
        out = (acc * inv_l[:, None]).to(O.dtype.element_ty)
        o_rows = offs_m[:, None] < LQ
        if D_CHECK:
            tl.store(O + ro + offs_d[None, :] * stride_od, out, mask=o_rows & (offs_d[None, :] < HEAD_DIM))
        else:
            tl.store(O + ro + offs_d[None, :] * stride_od, out, mask=o_rows)
        if RETURN_LSE:
            # m and l live in log2 units (the scores were scaled by scale*log2(e) for exp2), and
            # l is the sum of exp2(s - m) with the same (possibly lazily stale) m, so
            # (m + log2 l) * ln 2 is the natural-log logsumexp of the scaled scores. Rows with
            # every key masked (l = 0) get -inf, which merges as a zero weight.
            lse = tl.where(l_i == 0.0, float("-inf"),
                           (m_i + tl.math.log2(tl.where(l_i == 0.0, 1.0, l_i))) * 0.6931471805599453)
            tl.store(Lse + off_bh.to(tl.int64) * LQ + offs_m, lse, mask=offs_m < LQ)


def _tma_ok(t: torch.Tensor) -> bool:
    """Host TMA descriptors need a unit last stride and 16-byte aligned base and strides."""
    if t.device.type != "cuda" or t.stride(-1) != 1:
        return False
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in t.stride()[:-1])


def _descriptor(t: torch.Tensor, block_n: int, block_d: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_n, block_d])


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
cache_registry.register("kernels.attention.flash.fitted", _fitted.clear)


def attention_triton(q, k, v, attn_mask=None, scale=None, is_causal=False, config=None, return_lse=False):
    """Launch the kernel. Inputs are [B, H, L, D] with any strides; k/v may have fewer heads.

    The caller (kernels.attention) has checked the inputs (attention_checks.py); this checks
    only what the kernel itself needs. Returns a tensor laid out like torch.empty_like(q);
    with return_lse, (out, lse): lse float32 [B, H, Lq], the natural-log logsumexp of each
    query row's scaled, masked scores (-inf for a row whose keys are all masked).
    """
    if triton is None:
        raise RuntimeError("Triton is not installed")
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device) if return_lse else None
    if Lq == 0 or B == 0 or H == 0:
        return (out, lse) if return_lse else out
    if Lk == 0:  # nothing to attend to: the fully-masked answer
        return (out.zero_(), lse.fill_(float("-inf"))) if return_lse else out.zero_()
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    mask_kind, mk, mstr, row_bcast = mask_layout(attn_mask, B, H, Lq, Lk, q)
    negative = scale < 0

    plan_key = None
    # LSE calls take the JIT launch: the direct-launch plans serve the default variant only.
    if not return_lse and direct_launch.usable(q):
        # Everything the JIT specialises on (shapes, strides, dtypes, 16-byte alignment of the
        # pointers, the scale's sign) plus the config: same key, same compiled kernel and grid.
        plan_key = ("attn", q.device, q.dtype, q.shape, q.stride(), k.shape, k.stride(), v.stride(), out.stride(),
                    mask_kind, mk.dtype, mstr, bool(is_causal), None if config is None else tuple(config.items()),
                    q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, out.data_ptr() % 16,
                    mk.data_ptr() % 16, negative)
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
        if -(-Lq // cfg["BLOCK_M"]) * B * H < sm_count(q.device.index or 0):
            cfg["BLOCK_M"] = 64

    block_d = next_pow2(D)
    fixed = dict(HEAD_DIM=D, GROUP=H // Hkv, BLOCK_D=block_d, D_CHECK=block_d > D,
                 MASK_KIND=mask_kind, MASK_ROW_BCAST=row_bcast, IS_CAUSAL=bool(is_causal))
    dot_precision = dot_input_precision(q.dtype == torch.float32, is_hip())
    align = row_alignment(q, k, v, out)

    def launch(c, dst):
        block_m, block_n = c["BLOCK_M"], c["BLOCK_N"]
        use_tma = bool(c.get("TMA")) and not interpreter and _tma_ok(k) and _tma_ok(v)
        kd = _descriptor(k, block_n, block_d) if use_tma else None
        vd = _descriptor(v, block_n, block_d) if use_tma else None
        grid = (-(-Lq // block_m), B * H)  # triton.cdiv is a jit function: microseconds per call
        consts = dict(
            fixed, BLOCK_M=block_m, BLOCK_N=block_n,
            USE_TMA=use_tma, DOT_PRECISION=dot_precision, WARP_SPEC=bool(c.get("WS")) and not interpreter,
            ALIGN=align, LAZY_RESCALE=bool(c.get("LAZY")), NEGATIVE_SCALE=negative,
            WHILE_LOOP=interpreter, RETURN_LSE=return_lse,
        )
        kernel = _attn_fwd[grid](
            q, k, v, dst, mk, kd, vd, lse,
            scale * LOG2E,
            *q.stride(), *k.stride(), *v.stride(), *dst.stride(), *mstr,
            H, Hkv, Lq, Lk,
            **consts,
            num_warps=c["num_warps"], num_stages=c["num_stages"],
            **LAUNCH_OPTIONS)
        return kernel, grid, tuple(consts[n] for n in _CONSTEXPR_ORDER), use_tma

    fit_key = (tuple(sorted(cfg.items())), q.device, q.dtype, D, mask_kind, row_bcast, bool(is_causal))
    cfg = _fitted.get(fit_key, cfg)
    while True:
        try:
            kernel, grid, consts, used_tma = launch(cfg, out)
            break
        except Exception as e:
            # Shared memory differs per GPU and per mask layout; a config that does not fit
            # steps down instead of failing the call. Anything else is a real error.
            smaller = _step_down(cfg) if is_out_of_resources(e) else None
            if smaller is None:
                raise
            log.info("attention config %s does not fit (%s); trying %s", cfg, str(e).splitlines()[0], smaller)
            cfg = smaller
    _fitted[fit_key] = cfg
    if plan_key is not None and not used_tma and not interpreter:
        direct_launch.record(plan_key, kernel, grid, consts,
                             _runtime_args(q, k, v, out, mk, scale, mstr, H, Hkv, Lq, Lk), out_index=3)
    return (out, lse) if return_lse else out


# _attn_fwd's constexprs in signature order, read from the kernel itself: the direct launch
# appends their values to the runtime args, so a constexpr added to the kernel cannot be missed.
_CONSTEXPR_ORDER = direct_launch.constexpr_order(_attn_fwd) if triton is not None else ()


def _runtime_args(q, k, v, out, mk, scale, mstr, H, Hkv, Lq, Lk):
    """_attn_fwd's non-constexpr arguments in signature order (the descriptors and Lse are None)."""
    return (q, k, v, out, mk, None, None, None, scale * LOG2E,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *mstr, H, Hkv, Lq, Lk)


def compile_spec(dtype: str, head_dim: int, config: dict, mask_kind: int = 0, is_causal: bool = False,
                 group: int = 1, hip: bool = False, mask_row_bcast: bool = False, negative_scale: bool = False,
                 return_lse: bool = False):
    """(kernel, signature, constexprs, attrs) for triton.compile(ASTSource(...)): the compile tests
    build every shipped config for every target without a GPU."""
    block_d = next_pow2(head_dim)
    ptr = f"*{dtype}"
    sig = {"Q": ptr, "K": ptr, "V": ptr, "O": ptr,
           "Mk": "*u8" if mask_kind == 1 else ("*fp32" if mask_kind == 2 else ptr),
           "Kd": "constexpr", "Vd": "constexpr", "Lse": "*fp32" if return_lse else "constexpr",
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
        Kd=None, Vd=None,
        HEAD_DIM=head_dim, GROUP=group,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_D=block_d, D_CHECK=block_d > head_dim,
        MASK_KIND=mask_kind, MASK_ROW_BCAST=mask_row_bcast, IS_CAUSAL=is_causal,
        USE_TMA=False, DOT_PRECISION=dot_input_precision(dtype == "fp32", hip), WARP_SPEC=bool(config.get("WS")),
        ALIGN=8 if dtype != "fp32" else 4, LAZY_RESCALE=bool(config.get("LAZY")), NEGATIVE_SCALE=negative_scale,
        WHILE_LOOP=False, RETURN_LSE=return_lse,
    )
    if not return_lse:
        constexprs["Lse"] = None
    constexprs.update(unit)
    for k_ in constexprs:
        sig[k_] = "constexpr"
    arg_names = list(sig)
    aligned = ["Q", "K", "V", "O", "Mk", "stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh",
               "stride_kn", "stride_vb", "stride_vh", "stride_vn", "stride_ob", "stride_oh", "stride_om"]
    attrs = {(arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return _attn_fwd, sig, constexprs, attrs
