"""RMSNorm over a whole row followed by rotary embedding, in one pass: what Wan's attention
does to q and k between their Linear and the attention call,

    q = apply_rope1(norm_q(self.q(x)).view(b, s, n, d), freqs)

in ComfyUI's model code (comfy/ldm/wan/model.py), as two kernels there: torch's fused RMSNorm
(0.30 ms a call at Wan 2.1 14B's 32760 x 5120 on the H200) and comfy-kitchen's RoPE (0.54 ms),
each reading and writing the whole activation (benchmarks/
RESULTS.md: 68 ms of a 2081 ms step). Here one
program reads a row once, normalises it, rotates each (even, odd) channel pair of each head by
that token's 2x2 matrix and writes it once.

Numerics follow ComfyUI's two ops, rounding where they round, so a patched model's output
stays within a bf16 rounding of the unpatched one:
- the mean of squares, rsqrt and the weight multiply in fp32, the normalised value rounded to
  the input dtype (rms_norm's output);
- the rotation out[2i + a] = f[i, a, 0] * y[2i] + f[i, a, 1] * y[2i + 1] in fp32 with ComfyUI's
  float32 freqs (shape [B or 1, L, 1, d/2, 2, 2], the layout comfy.ldm.flux.math.rope builds),
  rounded once to the output dtype.

Layout: x is [B, L, C] (or [B*L, C]) with unit last stride, C = heads * head_dim, one norm
over all C channels (Wan's norm_q is RMSNorm(dim), not per head). Rows up to MAX_CHANNELS
channels are held in registers: Wan's 1536 (1.3B) and 5120 (14B) fit.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..core.kernel_common import tl, triton  # None, None where Triton does not import

from ..core import direct_launch
from ..core.kernel_common import exact_bf16, next_pow2, row_kernel_refusal
from ..core.kernel_common import RowKernelInputError, raise_if_refused, register_custom_ops

if triton is not None:
    from ..core.kernel_common import to_output_dtype

OP_QUALNAME = "triton_accel::rms_norm_rope"
MAX_CHANNELS = 16384  # one row in registers: 8192 pairs x 2 fp32 values spread over 16 warps
# Warps per program by the row's first block (pairs of channels): a 5120-wide row is blocks of
# 4096 + 1024 channels, 8 warps give each thread 8 + 2 pairs, enough loads in flight per row.
NORM_ROPE_WARPS = ((1024, 4), (4096, 8), (MAX_CHANNELS // 2, 16))
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class NormRopeInputError(RowKernelInputError):
    """A call the fused RMSNorm + RoPE cannot serve; `.reason` says why (callers fall back)."""


if triton is not None:

    @triton.jit
    def _rotate_store(x, rstd, W, F_tok, y_row, start, C, BLOCK: tl.constexpr, HALF_D: tl.constexpr,
                      HAS_WEIGHT: tl.constexpr, EXACT_BF16: tl.constexpr):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < C
        y = x * rstd
        if HAS_WEIGHT:
            y = y * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        # rms_norm's output is in the input dtype: round here as it does.
        y = to_output_dtype(y, y_row.dtype.element_ty, EXACT_BF16).to(tl.float32)
        # Channel pairs (2i, 2i + 1) of each head: split the row into its even and odd lanes.
        y_even, y_odd = tl.split(tl.reshape(y, (BLOCK // 2, 2)))
        # The token's table holds f[i, a, b] at (2i + a) * 2 + b, i.e. channel c's two
        # coefficients at 2 * (c % head_dim): the block's 2 * BLOCK floats are one contiguous run
        # modulo the table (every head repeats it), so they load as wide vectors, not gathers.
        f_idx = 2 * start + tl.arange(0, 2 * BLOCK)
        f = tl.load(F_tok + f_idx % (4 * HALF_D), mask=f_idx < 2 * C, other=0.0)
        f_b0, f_b1 = tl.split(tl.reshape(f, (BLOCK // 2, 2, 2)))  # [pair, a]: f[i, a, 0], f[i, a, 1]
        f00, f10 = tl.split(f_b0)
        f01, f11 = tl.split(f_b1)
        out = tl.reshape(tl.join(f00 * y_even + f01 * y_odd, f10 * y_even + f11 * y_odd), (BLOCK,))
        tl.store(y_row + offs, to_output_dtype(out, y_row.dtype.element_ty, EXACT_BF16), mask=mask)

    @triton.jit
    def _rms_norm_rope(X, W, F, Y, L, C, stride_xm, stride_ym, stride_fb, stride_fl, eps,
                       HALF_D: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
                       HAS_WEIGHT: tl.constexpr, EXACT_BF16: tl.constexpr):
        # The row is held in registers as two power-of-two blocks, BLOCK_A channels from 0 and
        # BLOCK_B (0: none) from BLOCK_A: 5120 = 4096 + 1024 and 1536 = 1024 + 512 need no
        # padded lanes, where one power-of-two block would be 37.5 % / 25 % padding.
        row = tl.program_id(0).to(tl.int64)
        batch = row // L
        token = row - batch * L
        x_row = X + row * stride_xm
        y_row = Y + row * stride_ym
        f_tok = F + batch * stride_fb + token * stride_fl
        offs_a = tl.arange(0, BLOCK_A)
        x_a = tl.load(x_row + offs_a, mask=offs_a < C, other=0.0).to(tl.float32)
        # Padded channels load 0 and add nothing to the sum; the divisor is the true width.
        sum_sq = tl.sum(x_a * x_a, 0)
        if BLOCK_B > 0:
            offs_b = BLOCK_A + tl.arange(0, BLOCK_B)
            x_b = tl.load(x_row + offs_b, mask=offs_b < C, other=0.0).to(tl.float32)
            sum_sq += tl.sum(x_b * x_b, 0)
        rstd = tl.math.rsqrt(sum_sq / C + eps)
        _rotate_store(x_a, rstd, W, f_tok, y_row, 0, C, BLOCK_A, HALF_D, HAS_WEIGHT, EXACT_BF16)
        if BLOCK_B > 0:
            _rotate_store(x_b, rstd, W, f_tok, y_row, BLOCK_A, C, BLOCK_B, HALF_D, HAS_WEIGHT, EXACT_BF16)


def row_blocks(channels: int, split: bool = True) -> tuple[int, int]:
    """(BLOCK_A, BLOCK_B) for a row of `channels` (even): the largest power of two that fits and
    the remainder padded to a power of two, or (next power of two, 0) when not `split`."""
    if not split:
        return next_pow2(channels, 2), 0
    block_a = 1 << (channels.bit_length() - 1)
    rest = channels - block_a
    return block_a, (next_pow2(rest, 2) if rest else 0)


def _warps(block_a: int) -> int:
    for pairs, warps in NORM_ROPE_WARPS:
        if block_a // 2 <= pairs:
            return warps
    return NORM_ROPE_WARPS[-1][1]


def freqs_table(freqs: torch.Tensor, batch: int, tokens: int, head_dim: int) -> torch.Tensor:
    """ComfyUI's rope freqs as [Bf, L, head_dim/2, 4] float32 (Bf 1 or `batch`), the rows of
    each 2x2 matrix in order; raises NormRopeInputError for any other layout."""
    if freqs.dtype != torch.float32:
        raise NormRopeInputError(f"rope freqs must be float32 (got {freqs.dtype})")
    half = head_dim // 2
    shape = tuple(freqs.shape)
    # [B, L, 1, d/2, 2, 2] (Wan, after movedim) or [B, L, d/2, 2, 2]
    if len(shape) == 6 and shape[2] == 1:
        shape = shape[:2] + shape[3:]
    if len(shape) != 5 or shape[2:] != (half, 2, 2) or shape[0] not in (1, batch) or shape[1] != tokens:
        raise NormRopeInputError(
            f"rope freqs of shape {tuple(freqs.shape)} do not match [{batch} or 1, {tokens}, 1, {half}, 2, 2]")
    table = freqs.reshape(shape[0], tokens, half, 4)
    if table.stride(-1) != 1 or table.stride(-2) != 4:
        table = table.contiguous()
    return table


def _check(x: torch.Tensor, weight, freqs: torch.Tensor, head_dim: int) -> tuple[int, int, int]:
    if x.dtype not in DTYPES:
        raise NormRopeInputError(f"dtype {x.dtype} is not float16/bfloat16/float32")
    if x.dim() not in (2, 3):
        raise NormRopeInputError(f"x must be [B, L, C] or [M, C] (got {x.dim()} dims)")
    channels = x.shape[-1]
    if head_dim <= 0 or head_dim % 2 or channels % head_dim:
        raise NormRopeInputError(f"{channels} channels are not whole heads of head_dim {head_dim} (even)")
    if channels > MAX_CHANNELS:
        raise NormRopeInputError(f"rows of {channels} channels exceed the kernel's {MAX_CHANNELS}")
    if x.stride(-1) != 1:
        raise NormRopeInputError("x's last dim must be contiguous")
    if weight is not None and (weight.shape != (channels,) or weight.device != x.device):
        raise NormRopeInputError(f"norm weight must be [{channels}] on {x.device}")
    if freqs.device != x.device:
        raise NormRopeInputError(f"rope freqs on {freqs.device}, x on {x.device}")
    batch, tokens = (x.shape[0], x.shape[1]) if x.dim() == 3 else (1, x.shape[0])
    return batch, tokens, channels


def _launch(x: torch.Tensor, weight, freqs: torch.Tensor, eps: float, head_dim: int,
            split: bool = True) -> torch.Tensor:
    batch, tokens, channels = _check(x, weight, freqs, head_dim)
    table = freqs_table(freqs, batch, tokens, head_dim)
    x2d = x.reshape(-1, channels)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x2d.shape[0]
    if rows == 0:
        return out
    block_a, block_b = row_blocks(channels, split)
    stride_fb = table.stride(0) if table.shape[0] > 1 else 0
    w = weight if weight is not None else x2d  # never read without HAS_WEIGHT
    args = (x2d, w, table, out.view(-1, channels), tokens, channels, x2d.stride(0), channels, stride_fb,
            table.stride(1), float(eps))
    consts = dict(HALF_D=head_dim // 2, BLOCK_A=block_a, BLOCK_B=block_b, HAS_WEIGHT=weight is not None,
                  EXACT_BF16=exact_bf16(x))
    direct_launch.jit_or_plan(_rms_norm_rope, (rows,), args, consts, 3, "rms_norm_rope", num_warps=_warps(block_a))
    return out


refusal = row_kernel_refusal  # why a device cannot run the kernel (None: it can)


def rms_norm_rope_ref(x: torch.Tensor, weight, freqs: torch.Tensor, eps: float, head_dim: int) -> torch.Tensor:
    """The float32 reference, written as ComfyUI computes it: torch's rms_norm in x's dtype,
    then comfy.ldm.flux.math._apply_rope1 on the [.., heads, head_dim] view."""
    batch, tokens, channels = _check(x, weight, freqs, head_dim)
    table = freqs_table(freqs, batch, tokens, head_dim)
    y = torch.nn.functional.rms_norm(x.float(), (channels,), None if weight is None else weight.float(), eps)
    y = y.to(x.dtype).float().reshape(batch, tokens, channels // head_dim, head_dim // 2, 1, 2)
    f = table.reshape(table.shape[0], tokens, 1, head_dim // 2, 2, 2)
    out = f[..., 0] * y[..., 0] + f[..., 1] * y[..., 1]
    return out.reshape(x.shape).to(x.dtype)


def _register_op() -> None:
    @torch.library.custom_op(OP_QUALNAME, mutates_args=())
    def rms_norm_rope_op(x: torch.Tensor, weight: Optional[torch.Tensor], freqs: torch.Tensor, eps: float,
                         head_dim: int) -> torch.Tensor:
        return _launch(x, weight, freqs, eps, head_dim)

    @rms_norm_rope_op.register_fake
    def _(x, weight, freqs, eps, head_dim):
        return x.new_empty(x.shape)


_REGISTRATION_ERROR = register_custom_ops(_register_op)  # None: registered


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, freqs: torch.Tensor, eps: float,
                  head_dim: int) -> torch.Tensor:
    """RMSNorm over x's last dim (optionally times `weight`), then RoPE per head of `head_dim`
    channels with ComfyUI's float32 freqs; same shape and dtype as x. Raises NormRopeInputError
    for a call it cannot serve (checked before anything runs)."""
    raise_if_refused(x.device, NormRopeInputError)
    if _REGISTRATION_ERROR is None and torch.compiler.is_compiling():
        _check(x, weight, freqs, head_dim)
        return torch.ops.triton_accel.rms_norm_rope(x, weight, freqs, float(eps), int(head_dim))
    return _launch(x, weight, freqs, eps, head_dim)  # eager: no custom-op dispatch; _launch checks


def compile_specs(dtype: str = "bf16", channels: int = 5120, head_dim: int = 128, has_weight: bool = True):
    """[(kernel, signature, constexprs, attrs, options)] for triton.compile(ASTSource(...)): a
    launch on a contiguous [M, channels] activation."""
    sig = {"X": f"*{dtype}", "W": f"*{dtype}", "F": "*fp32", "Y": f"*{dtype}", "L": "i32", "C": "i32",
           "stride_xm": "i32", "stride_ym": "i32", "stride_fb": "i32", "stride_fl": "i32", "eps": "fp32",
           "HALF_D": "constexpr", "BLOCK_A": "constexpr", "BLOCK_B": "constexpr", "HAS_WEIGHT": "constexpr",
           "EXACT_BF16": "constexpr"}
    block_a, block_b = row_blocks(channels)
    const = dict(HALF_D=head_dim // 2, BLOCK_A=block_a, BLOCK_B=block_b, HAS_WEIGHT=has_weight, EXACT_BF16=False)
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("X", "W", "F", "Y", "C", "stride_xm", "stride_ym",
                                                                          "stride_fb", "stride_fl")}
    return [(_rms_norm_rope, sig, const, attrs, dict(num_warps=_warps(block_a), num_stages=1))]


__all__ = ["rms_norm_rope", "rms_norm_rope_ref", "freqs_table", "refusal", "NormRopeInputError", "OP_QUALNAME",
           "MAX_CHANNELS", "compile_specs"]
