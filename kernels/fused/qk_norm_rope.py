"""Flux's per-head QK RMSNorm and its rotary embedding in one pass, written where the
attention reads them: what a Flux-layer block does to q and k between its qkv Linear and the
attention call,

    q, k = self.norm(q, k, v)                       # QKNorm: RMSNorm over each head's D
    q, k = apply_rope(q, k, pe)                     # inside comfy.ldm.flux.math.attention

(and, in a double block, `torch.cat((txt_q, img_q), dim=2)` between the two). In ComfyUI's
model code these are three passes over q and k: the norm (kernels/fused/qk_norm.py already reads the
permuted views in place), the concatenation of the text and image streams, and comfy-kitchen's
RoPE kernel; an H100 profile of a Flux 1024² step with the pack spent 2.3 ms in the norm,
1.6 ms in the concatenations and 3.9 ms in RoPE (benchmarks/
RESULTS.md). Here one program reads BLOCK_R head
rows of q and of k once, normalises, rotates and writes them once, at row `offset` of an
output of any strides: a double block writes the text stream's rows and the image stream's
rows into one [B, H, L_txt + L_img, D] tensor, no concatenation left.

The output's strides are the caller's: the Flux blocks allocate it as [B, L, H, D] memory
viewed as [B, H, L, D], the layout of q in the attention call whose output torch's SDPA and
the pack's kernels then allocate alike, so ComfyUI's `transpose(1, 2).reshape(B, L, H * D)` of
the output is a view instead of a copy.

Numerics follow ComfyUI's two ops, rounding where they round:
- the norm as torch's rms_norm in the input dtype: mean of squares, rsqrt and the weight
  multiply in fp32, the normalised value rounded to the input dtype;
- the rotation out[2i + a] = f[i, a, 0] * y[2i] + f[i, a, 1] * y[2i + 1] in fp32 with
  ComfyUI's float32 freqs (comfy.ldm.flux.math.rope's [B, 1, L, D/2, 2, 2]), of the token at
  the row's position in the whole sequence (`offset` + its row), rounded once to the output
  dtype.
"""
from __future__ import annotations

import torch

from ..core.kernel_common import tl, triton  # None, None where Triton does not import

from ..core import direct_launch

from . import qk_norm
from ..core.kernel_common import cdiv, exact_bf16, row_kernel_refusal
from ..core.kernel_common import raise_if_refused, register_custom_ops
from .norm_rope import NormRopeInputError, freqs_table

if triton is not None:
    from ..core.kernel_common import to_output_dtype

OP_QUALNAME = "triton_accel::qk_rms_norm_rope"
# Head dims the kernel holds as one power-of-two block of channel pairs (Flux, Chroma,
# HunyuanVideo: 128). Anything else stays with the separate norm and ComfyUI's RoPE.
HEAD_DIMS = (32, 64, 128, 256)
# Head rows per program, as kernels/fused/qk_norm.py: 8 KB of bf16 q and k at D = 128 and each row's
# 1 KB of fp32 rope coefficients in flight per program.
ROWS_PER_PROGRAM = 32


class QKNormRopeInputError(NormRopeInputError):
    """A call the fused QK norm + RoPE cannot serve; `.reason` says why (callers fall back)."""


if triton is not None:

    @triton.jit
    def _norm_rope_rows(X, W, Y, F, r64, row_ok, cols, H, L, sb, sh, sl, ob, oh, ol, sfb, sfl, offset, eps,
                        D: tl.constexpr, BLOCK_R: tl.constexpr, ALIGN: tl.constexpr, EXACT_BF16: tl.constexpr):
        b = r64 // (H * L)
        h = (r64 // L) % H
        pos = r64 % L
        row_off = b * sb + h * sh + pos * sl
        if ALIGN > 1:
            # Launch hints do not reach a product of strides: the launcher checked that every
            # row starts 16-byte aligned, so the loads stay 16-byte vectors.
            row_off = tl.multiple_of(row_off, ALIGN)
        x = tl.load(X + row_off[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, 1) / D + eps)
        w = tl.load(W + cols).to(tl.float32)
        # rms_norm's output is in the input dtype: round here as it does.
        y = to_output_dtype(x * rstd[:, None] * w[None, :], Y.dtype.element_ty, EXACT_BF16).to(tl.float32)
        y_even, y_odd = tl.split(tl.reshape(y, (BLOCK_R, D // 2, 2)))
        tok = pos + offset
        # The token's 2x2 matrices, f[i, a, b] at (2i + a) * 2 + b: 2 * D contiguous floats.
        f_cols = tl.arange(0, 2 * D)
        f = tl.load(F + (b * sfb + tok * sfl)[:, None] + f_cols[None, :], mask=row_ok[:, None], other=0.0)
        f_b0, f_b1 = tl.split(tl.reshape(f, (BLOCK_R, D // 2, 2, 2)))  # [row, pair, a]: f[i, a, 0], f[i, a, 1]
        f00, f10 = tl.split(f_b0)
        f01, f11 = tl.split(f_b1)
        out = tl.reshape(tl.join(f00 * y_even + f01 * y_odd, f10 * y_even + f11 * y_odd), (BLOCK_R, D))
        out_off = b * ob + h * oh + tok * ol
        tl.store(Y + out_off[:, None] + cols[None, :], to_output_dtype(out, Y.dtype.element_ty, EXACT_BF16),
                 mask=row_ok[:, None])

    @triton.jit
    def _qk_rms_norm_rope(Q, K, WQ, WK, QO, KO, F, H, L, rows, sqb, sqh, sql, skb, skh, skl, ob, oh, ol,
                          sfb, sfl, offset, eps, D: tl.constexpr, BLOCK_R: tl.constexpr, ALIGN_Q: tl.constexpr,
                          ALIGN_K: tl.constexpr, EXACT_BF16: tl.constexpr):
        # One program handles the same BLOCK_R head rows of q and of k (qk_norm.py's layout):
        # one launch for both, and each row's rope coefficients read twice from L1/L2.
        r64 = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        row_ok = r64 < rows
        cols = tl.arange(0, D)
        _norm_rope_rows(Q, WQ, QO, F, r64, row_ok, cols, H, L, sqb, sqh, sql, ob, oh, ol, sfb, sfl, offset, eps,
                        D, BLOCK_R, ALIGN_Q, EXACT_BF16)
        _norm_rope_rows(K, WK, KO, F, r64, row_ok, cols, H, L, skb, skh, skl, ob, oh, ol, sfb, sfl, offset, eps,
                        D, BLOCK_R, ALIGN_K, EXACT_BF16)


def rope_table(freqs: torch.Tensor, batch: int, tokens: int, head_dim: int) -> torch.Tensor:
    """Flux's pe ([B or 1, 1, L, D/2, 2, 2] float32, as comfy.ldm.flux.math.rope and EmbedND build
    it) as norm_rope.freqs_table's [B or 1, L, D/2, 4]; raises QKNormRopeInputError otherwise."""
    if freqs.dim() == 6 and freqs.shape[1] == 1:
        freqs = freqs.squeeze(1)
    try:
        return freqs_table(freqs, batch, tokens, head_dim)
    except NormRopeInputError as e:
        raise QKNormRopeInputError(e.reason) from None


def _check(q, k, q_weight, k_weight, q_out, k_out, offset: int) -> None:
    # q, k and the weights as the QK norm takes them (its checks and reasons), then what the
    # rotation and the written-into outputs add.
    try:
        qk_norm.check_inputs(q, k, q_weight, k_weight)
    except qk_norm.QKNormInputError as e:
        raise QKNormRopeInputError(e.reason) from None
    bsz, heads, length, d = q.shape
    if d not in HEAD_DIMS:
        raise QKNormRopeInputError(f"head dim {d}: the kernel takes {', '.join(map(str, HEAD_DIMS))}")
    for t, name in ((q_out, "q_out"), (k_out, "k_out")):
        if t.stride(-1) != 1:
            raise QKNormRopeInputError(f"{name} needs a contiguous head dim")
        if t.device != q.device:
            raise QKNormRopeInputError(f"{name} on {t.device}, q on {q.device}")
    for t, name in ((q_out, "q_out"), (k_out, "k_out")):
        if t.dtype != q.dtype or t.dim() != 4 or t.shape[:2] != (bsz, heads) or t.shape[3] != d:
            raise QKNormRopeInputError(f"{name} must be [{bsz}, {heads}, L, {d}] {q.dtype}")
    if q_out.stride() != k_out.stride() or q_out.shape != k_out.shape:
        raise QKNormRopeInputError("q_out and k_out must share one shape and one layout")
    if not 0 <= offset <= q_out.shape[2] - length:
        raise QKNormRopeInputError(f"rows {offset}..{offset + length} do not fit the output's {q_out.shape[2]}")


def _launch(q, k, q_weight, k_weight, eps: float, freqs, q_out, k_out, offset: int) -> None:
    _check(q, k, q_weight, k_weight, q_out, k_out, offset)
    bsz, heads, length, d = q.shape
    table = rope_table(freqs, bsz, q_out.shape[2], d)
    rows = bsz * heads * length
    if rows == 0:
        return
    if qk_norm.row_alignment(q_out) == 1 or qk_norm.row_alignment(k_out) == 1:
        raise QKNormRopeInputError("q_out / k_out rows must start 16-byte aligned")
    sq, sk, so = q.stride(), k.stride(), q_out.stride()
    stride_fb = table.stride(0) if table.shape[0] > 1 else 0
    args = (q, k, q_weight, k_weight, q_out, k_out, table, heads, length, rows, sq[0], sq[1], sq[2], sk[0], sk[1],
            sk[2], so[0], so[1], so[2], stride_fb, table.stride(1), int(offset), float(eps))
    consts = dict(D=d, BLOCK_R=ROWS_PER_PROGRAM, ALIGN_Q=qk_norm.row_alignment(q), ALIGN_K=qk_norm.row_alignment(k),
                  EXACT_BF16=exact_bf16(q))
    # The kernel writes rows offset..offset + L of q_out (a double block's other stream fills
    # the rest): the direct launch's verification compares those rows only.
    direct_launch.jit_or_plan(_qk_rms_norm_rope, (cdiv(rows, ROWS_PER_PROGRAM),), args, consts, 4,
                              "qk_rms_norm_rope", written=lambda t: t[:, :, offset:offset + length], num_warps=4)


refusal = row_kernel_refusal  # why a device cannot run the kernel (None: it can)


def qk_rms_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                         eps: float, freqs: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 reference, as ComfyUI computes it: torch's rms_norm over the head dim in the
    input dtype, then comfy.ldm.flux.math._apply_rope1 with the freqs of rows offset.. of the
    sequence; [B, H, L, D] each, contiguous."""
    bsz, heads, length, d = q.shape
    table = rope_table(freqs, bsz, freqs.shape[-4], d)[:, offset:offset + length]
    f = table.reshape(table.shape[0], 1, length, d // 2, 2, 2)
    outs = []
    for x, w in ((q, q_weight), (k, k_weight)):
        y = torch.nn.functional.rms_norm(x.float(), (d,), w.float(), eps).to(x.dtype).float()
        y = y.reshape(bsz, heads, length, d // 2, 1, 2)
        outs.append((f[..., 0] * y[..., 0] + f[..., 1] * y[..., 1]).reshape(q.shape).to(q.dtype))
    return outs[0], outs[1]


def _register_op() -> None:
    @torch.library.custom_op(OP_QUALNAME, mutates_args=("q_out", "k_out"))
    def qk_rms_norm_rope_op(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                            eps: float, freqs: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor,
                            offset: int) -> None:
        _launch(q, k, q_weight, k_weight, eps, freqs, q_out, k_out, offset)

    @qk_rms_norm_rope_op.register_fake
    def _(q, k, q_weight, k_weight, eps, freqs, q_out, k_out, offset):
        return None


_REGISTRATION_ERROR = register_custom_ops(_register_op)  # None: registered


def qk_rms_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                     freqs: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, offset: int = 0) -> None:
    """rope(rms_norm(q) * q_weight) into q_out[:, :, offset:offset + L] and the same of k into
    k_out, for [B, H, L, D] q and k (any strides with a contiguous head dim), Flux's float32 pe
    `freqs` over the whole output sequence and [B, H, L_out, D] outputs of any strides (a
    contiguous head dim, 16-byte aligned rows). Raises QKNormRopeInputError for a call it cannot
    serve, before anything is written."""
    raise_if_refused(q.device, QKNormRopeInputError)
    if _REGISTRATION_ERROR is None and torch.compiler.is_compiling():
        _check(q, k, q_weight, k_weight, q_out, k_out, offset)
        torch.ops.triton_accel.qk_rms_norm_rope(q, k, q_weight, k_weight, float(eps), freqs, q_out, k_out,
                                                int(offset))
        return
    # Eager calls skip the custom op's dispatch (host time: a Flux step makes ~76 of them).
    _launch(q, k, q_weight, k_weight, eps, freqs, q_out, k_out, offset)


def compile_specs(dtype: str = "bf16", head_dim: int = 128):
    """[(kernel, signature, constexprs, attrs, options)] for triton.compile(ASTSource(...)): q
    and k as Flux's permuted views of one qkv tensor, the outputs [B, L, H, D] memory."""
    names = ["Q", "K", "WQ", "WK", "QO", "KO", "F", "H", "L", "rows", "sqb", "sqh", "sql", "skb", "skh", "skl",
             "ob", "oh", "ol", "sfb", "sfl", "offset", "eps"]
    types = dict(Q=f"*{dtype}", K=f"*{dtype}", WQ=f"*{dtype}", WK=f"*{dtype}", QO=f"*{dtype}", KO=f"*{dtype}",
                 F="*fp32", eps="fp32")
    sig = {n: types.get(n, "i32") for n in names}
    vector = 8 if dtype in ("bf16", "fp16") else 4
    const = dict(D=head_dim, BLOCK_R=ROWS_PER_PROGRAM, ALIGN_Q=vector, ALIGN_K=vector, EXACT_BF16=False)
    for n in const:
        sig[n] = "constexpr"
    order = list(sig)
    attrs = {(order.index(n),): [["tt.divisibility", 16]]
             for n in ("Q", "K", "WQ", "WK", "QO", "KO", "F", "sqb", "sqh", "sql", "skb", "skh", "skl", "ob", "oh",
                       "ol", "sfb", "sfl")}
    return [(_qk_rms_norm_rope, sig, const, attrs, dict(num_warps=4, num_stages=1))]


__all__ = ["qk_rms_norm_rope", "qk_rms_norm_rope_ref", "rope_table", "refusal", "QKNormRopeInputError",
           "OP_QUALNAME", "HEAD_DIMS", "compile_specs"]
