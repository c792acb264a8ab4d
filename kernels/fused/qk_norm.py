"""Per-head RMSNorm of q and k in one launch, read through any strides: Flux's QKNorm.

Flux (and every model built from comfy/ldm/flux/layers.py: Chroma, HunyuanVideo...) splits
its fused qkv Linear output with `view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)` and normalises
q and k per head (RMSNorm over D with a learned scale). torch's rms_norm wants a contiguous
input, so ComfyUI's step copies each permuted q / k first and then normalises it with a kernel
written for long rows, at D = 128: on the H200 those were 8.7 ms (RMSNorm) and part of 6.6 ms
(copies) of a 116 ms Flux step with our attention and Linear
(benchmarks/RESULTS.md). Here one program
reads BLOCK_R head rows of q and of k through their strides, normalises them and writes them
contiguous, [B, H, L, D]: one read and one write of q and k for the whole QKNorm.

Numerics: as torch's rms_norm in the input dtype: mean of squares, rsqrt, times the weight
(already in the input dtype, as ComfyUI casts it) in fp32, rounded once.
"""
from __future__ import annotations

import torch

from ..core.kernel_common import tl, triton  # None, None where Triton does not import

from ..core import direct_launch
from ..core.kernel_common import cdiv, exact_bf16, next_pow2, row_kernel_refusal
from ..core.kernel_common import RowKernelInputError, raise_if_refused, register_custom_ops

if triton is not None:
    from ..core.kernel_common import to_output_dtype

OP_QUALNAME = "triton_accel::qk_rms_norm"
MAX_HEAD_DIM = 512
# Head rows per program: 8 KB of bf16 at D = 128, enough bytes in flight per program, and
# Flux's 4608 x 24 rows still make ~7000 programs.
ROWS_PER_PROGRAM = 32
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class QKNormInputError(RowKernelInputError):
    """A call the fused QK norm cannot serve; `.reason` says why (callers fall back)."""


if triton is not None:

    @triton.jit
    def _rms_rows(X, W, Y, r64, row_ok, cols, col_ok, H, L, sb, sh, sl, eps, D: tl.constexpr,
                  ALIGN: tl.constexpr, EXACT_BF16: tl.constexpr):
        b = r64 // (H * L)
        h = (r64 // L) % H
        pos = r64 % L
        row_off = b * sb + h * sh + pos * sl
        if ALIGN > 1:
            # Launch hints do not reach a product of strides: say the rows start 16-byte
            # aligned (checked by the launcher) so the loads stay 16-byte vectors.
            row_off = tl.multiple_of(row_off, ALIGN)
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + row_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, 1) / D + eps)
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        tl.store(Y + r64[:, None] * D + cols[None, :], to_output_dtype(y, Y.dtype.element_ty, EXACT_BF16), mask=mask)

    @triton.jit
    def _qk_rms_norm(Q, K, WQ, WK, QO, KO, H, L, rows, sqb, sqh, sql, skb, skh, skl, eps,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, ALIGN_Q: tl.constexpr,
                     ALIGN_K: tl.constexpr, EXACT_BF16: tl.constexpr):
        # One program normalises the same BLOCK_R head rows of q and of k: one launch for both,
        # no branch between them (a branch would merge the two pointers and lose their alignment).
        r64 = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        row_ok = r64 < rows
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D
        _rms_rows(Q, WQ, QO, r64, row_ok, cols, col_ok, H, L, sqb, sqh, sql, eps, D, ALIGN_Q, EXACT_BF16)
        _rms_rows(K, WK, KO, r64, row_ok, cols, col_ok, H, L, skb, skh, skl, eps, D, ALIGN_K, EXACT_BF16)


def check_inputs(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor) -> None:
    """Raises QKNormInputError (with the reason) unless q, k [B, H, L, D] and their weights are a
    call the QK norm kernels serve (this file's and qk_norm_rope.py's)."""
    if q.dtype not in DTYPES or k.dtype != q.dtype:
        raise QKNormInputError(f"q and k must share a float16/bfloat16/float32 dtype (got {q.dtype}, {k.dtype})")
    if q.dim() != 4 or k.shape != q.shape:
        raise QKNormInputError(f"q and k must be [B, H, L, D] of one shape (got {tuple(q.shape)}, {tuple(k.shape)})")
    d = q.shape[-1]
    if d > MAX_HEAD_DIM or d == 0:
        raise QKNormInputError(f"head dim {d}: the kernel takes 1 to {MAX_HEAD_DIM}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise QKNormInputError("q and k need a contiguous head dim")
    device = q.device
    for w, name in ((q_weight, "q"), (k_weight, "k")):
        if w is None or w.shape != (d,) or w.device != device or w.dtype != q.dtype:
            raise QKNormInputError(f"the {name} norm weight must be [{d}] {q.dtype} on {device}")
    if k.device != device:
        raise QKNormInputError("q and k on different devices")


_memo = direct_launch.SiteMemo("qk_rms_norm")


def _launch(q, k, q_weight, k_weight, eps: float):
    fingerprint = None
    if q.is_cuda:
        # Everything the checks and the JIT's specialisation read (direct_launch.SiteMemo).
        fingerprint = (q.device, q.dtype, q.shape, q.stride(), q.data_ptr() % 16, k.device, k.dtype, k.shape,
                       k.stride(), k.data_ptr() % 16, q_weight.device, q_weight.dtype, q_weight.shape,
                       q_weight.data_ptr() % 16, k_weight.device, k_weight.dtype, k_weight.shape,
                       k_weight.data_ptr() % 16)
        hit = _memo.get(fingerprint)
        if hit is not None:
            plan, index, rows, heads, length = hit
            qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            ko = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            sq, sk = q.stride(), k.stride()
            direct_launch.launch(plan, index, (q, k, q_weight, k_weight, qo, ko, heads, length, rows, sq[0], sq[1],
                                               sq[2], sk[0], sk[1], sk[2], float(eps)))
            return qo, ko
    check_inputs(q, k, q_weight, k_weight)
    bsz, heads, length, d = q.shape
    qo = torch.empty((bsz, heads, length, d), dtype=q.dtype, device=q.device)
    ko = torch.empty_like(qo)
    rows = bsz * heads * length
    if rows == 0:
        return qo, ko
    sq, sk = q.stride(), k.stride()
    args = (q, k, q_weight, k_weight, qo, ko, heads, length, rows, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2],
            float(eps))
    consts = dict(D=d, BLOCK_D=next_pow2(d, 1), BLOCK_R=ROWS_PER_PROGRAM, ALIGN_Q=row_alignment(q),
                  ALIGN_K=row_alignment(k), EXACT_BF16=exact_bf16(q))
    plan = direct_launch.jit_or_plan(_qk_rms_norm, (cdiv(rows, ROWS_PER_PROGRAM),), args, consts, 4, "qk_rms_norm",
                                     num_warps=4)
    if plan is not None and fingerprint is not None:
        _memo.put(fingerprint, (plan, q.device.index, rows, heads, length))
    return qo, ko


def row_alignment(x: torch.Tensor) -> int:
    """Elements every head row's start of [B, H, L, D] x is a multiple of (up to 16 bytes'
    worth): the ALIGN hint. 1 when the base pointer or a stride breaks 16-byte alignment."""
    vector = 16 // x.element_size()
    ok = x.data_ptr() % 16 == 0 and all(s % vector == 0 for s in x.stride()[:3])
    return vector if ok else 1


refusal = row_kernel_refusal  # why a device cannot run the kernel (None: it can)


def qk_rms_norm_ref(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 reference, as ComfyUI computes it: torch's rms_norm over the head dim in the
    input dtype (one rounding)."""
    check_inputs(q, k, q_weight, k_weight)
    d = q.shape[-1]
    return tuple(torch.nn.functional.rms_norm(x.float(), (d,), w.float(), eps).to(q.dtype)
                 for x, w in ((q, q_weight), (k, k_weight)))


def _register_op() -> None:
    @torch.library.custom_op(OP_QUALNAME, mutates_args=())
    def qk_rms_norm_op(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return _launch(q, k, q_weight, k_weight, eps)

    @qk_rms_norm_op.register_fake
    def _(q, k, q_weight, k_weight, eps):
        return q.new_empty(q.shape), q.new_empty(q.shape)


_REGISTRATION_ERROR = register_custom_ops(_register_op)  # None: registered


def qk_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(q) * q_weight, rms_norm(k) * k_weight) over the head dim of [B, H, L, D] q and k
    (any strides with a contiguous head dim), returned contiguous in their dtype. Raises
    QKNormInputError for a call it cannot serve (checked before anything runs)."""
    raise_if_refused(q.device, QKNormInputError)
    if _REGISTRATION_ERROR is None and torch.compiler.is_compiling():
        check_inputs(q, k, q_weight, k_weight)
        return tuple(torch.ops.triton_accel.qk_rms_norm(q, k, q_weight, k_weight, float(eps)))
    # Eager calls skip the custom op's dispatch (tens of host microseconds: Flux makes ~76 of
    # these calls a step, and its step is host-bound); _launch checks the inputs.
    return _launch(q, k, q_weight, k_weight, eps)


def compile_specs(dtype: str = "bf16", head_dim: int = 128):
    """[(kernel, signature, constexprs, attrs, options)] for triton.compile(ASTSource(...)): q
    and k as Flux's permuted views of one qkv tensor."""
    sig = {"Q": f"*{dtype}", "K": f"*{dtype}", "WQ": f"*{dtype}", "WK": f"*{dtype}", "QO": f"*{dtype}",
           "KO": f"*{dtype}", "H": "i32", "L": "i32", "rows": "i32",
           "sqb": "i32", "sqh": "i32", "sql": "i32", "skb": "i32", "skh": "i32", "skl": "i32", "eps": "fp32",
           "D": "constexpr", "BLOCK_D": "constexpr", "BLOCK_R": "constexpr", "ALIGN_Q": "constexpr",
           "ALIGN_K": "constexpr", "EXACT_BF16": "constexpr"}
    vector = 8 if dtype in ("bf16", "fp16") else 4
    const = dict(D=head_dim, BLOCK_D=next_pow2(head_dim, 1), BLOCK_R=ROWS_PER_PROGRAM, ALIGN_Q=vector,
                 ALIGN_K=vector, EXACT_BF16=False)
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in ("Q", "K", "WQ", "WK", "QO", "KO", "sqb", "sqh", "sql", "skb", "skh", "skl")}
    return [(_qk_rms_norm, sig, const, attrs, dict(num_warps=4, num_stages=1))]


__all__ = ["qk_rms_norm", "qk_rms_norm_ref", "refusal", "QKNormInputError", "OP_QUALNAME", "MAX_HEAD_DIM",
           "compile_specs"]
