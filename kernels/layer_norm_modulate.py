"""LayerNorm followed by adaptive modulation (shift + norm(x) * (1 + scale)), in one pass: what
DiT blocks do before their attention and MLP. Wan's block (comfy/ldm/wan/model.py):

    torch.addcmul(repeat_e(e[0], x), self.norm1(x), 1 + repeat_e(e[1], x))

runs there as torch's LayerNorm (0.25 ms a call at Wan 2.1 14B's 32760 x 5120 on the H200)
and a broadcasting addcmul (0.50 ms), each reading and writing the whole activation, twice a
block (benchmarks/results/h200_2026-12-04_s25_run2_kprofile_wan_ours-all.txt: the addcmuls
are 80 ms of a 2081 ms step, half of them these). Here one program reads a row once and
writes the modulated row once.

Numerics follow ComfyUI's ops, rounding where they round: mean and variance in fp32 (two
passes over the row held in registers, as exact as torch's Welford), the normalised row
rounded to x's dtype (LayerNorm's output), `1 + scale` rounded to the modulation's dtype (a
separate op there), then shift + norm * (1 + scale) in fp32, rounded once.

Layout: x [B, L, C] with unit last stride; shift and scale [B or 1, 1, C] or [B or 1, C]
(one modulation vector per batch element, broadcast over its L tokens), in x's dtype. Rows up
to MAX_CHANNELS are held in registers (Wan 1536 / 5120, Flux 3072, HunyuanVideo 3072).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # the registry reports why; importing the pack must still work
    triton = None
    tl = None

from . import direct_launch
from .kernel_common import batch_vector, exact_bf16, layer_norm_inputs, next_pow2, row_kernel_refusal

if triton is not None:
    from .kernel_common import layer_norm_row, to_output_dtype

log = logging.getLogger("triton_accel.kernels.layer_norm_modulate")  # not __name__: the clone's folder name

OP_QUALNAME = "triton_accel::layer_norm_modulate"
MAX_CHANNELS = 16384
# Warps per program by padded row width: 8 warps give a 8192-wide block 32 values a thread.
LAYER_NORM_MODULATE_WARPS = ((2048, 4), (8192, 8), (MAX_CHANNELS, 16))


class LayerNormModulateInputError(ValueError):
    """A call the fused kernel cannot serve; `.reason` says why (callers fall back)."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


if triton is not None:

    @triton.jit
    def _layer_norm_modulate(X, SHIFT, SCALE, W, B, Y, L, C, stride_xm, stride_ym, stride_mb, eps,
                             BLOCK_C: tl.constexpr, HAS_AFFINE: tl.constexpr, EXACT_BF16: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        batch = row // L
        offs = tl.arange(0, BLOCK_C)
        mask = offs < C
        x = tl.load(X + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        y = layer_norm_row(x, mask, C, eps, W, B, offs, HAS_AFFINE)
        # LayerNorm's output is in x's dtype, and so is ComfyUI's `1 + scale`: round as they do.
        y = to_output_dtype(y, Y.dtype.element_ty, EXACT_BF16).to(tl.float32)
        shift = tl.load(SHIFT + batch * stride_mb + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(SCALE + batch * stride_mb + offs, mask=mask, other=0.0).to(tl.float32)
        scale = to_output_dtype(1.0 + scale, Y.dtype.element_ty, EXACT_BF16).to(tl.float32)
        out = shift + y * scale
        tl.store(Y + row * stride_ym + offs, to_output_dtype(out, Y.dtype.element_ty, EXACT_BF16), mask=mask)


def _warps(block_c: int) -> int:
    for width, warps in LAYER_NORM_MODULATE_WARPS:
        if block_c <= width:
            return warps
    return LAYER_NORM_MODULATE_WARPS[-1][1]


def _check(x: torch.Tensor, weight, bias) -> tuple[int, int, int]:
    return layer_norm_inputs(x, weight, bias, LayerNormModulateInputError, MAX_CHANNELS)


def _launch(x, shift, scale, eps: float, weight, bias) -> torch.Tensor:
    batch, tokens, channels = _check(x, weight, bias)
    shift2 = batch_vector(shift, "shift", x, batch, channels, LayerNormModulateInputError)
    scale2 = batch_vector(scale, "scale", x, batch, channels, LayerNormModulateInputError)
    if shift2.shape != scale2.shape or shift2.stride() != scale2.stride():
        shift2, scale2 = (shift2.expand(max(shift2.shape[0], scale2.shape[0]), channels).contiguous(),
                          scale2.expand(max(shift2.shape[0], scale2.shape[0]), channels).contiguous())
    x2d = x.reshape(-1, channels)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x2d.shape[0]
    if rows == 0:
        return out
    block_c = next_pow2(channels, 1)
    stride_mb = shift2.stride(0) if shift2.shape[0] > 1 else 0
    w, b = (weight, bias) if weight is not None else (x2d, x2d)  # never read without HAS_AFFINE
    args = (x2d, shift2, scale2, w, b, out.view(-1, channels), tokens, channels, x2d.stride(0), channels,
            stride_mb, float(eps))
    consts = dict(BLOCK_C=block_c, HAS_AFFINE=weight is not None, EXACT_BF16=exact_bf16(x))
    direct_launch.jit_or_plan(_layer_norm_modulate, (rows,), args, consts, 5, "layer_norm_modulate",
                              num_warps=_warps(block_c))
    return out


refusal = row_kernel_refusal  # why a device cannot run the kernel (None: it can)


def layer_norm_modulate_ref(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                            weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 reference, written as ComfyUI computes it: layer_norm in x's dtype, then
    addcmul(shift, norm, 1 + scale) with `1 + scale` in the modulation's dtype."""
    batch, tokens, channels = _check(x, weight, bias)
    shift2 = batch_vector(shift, "shift", x, batch, channels, LayerNormModulateInputError)
    scale2 = batch_vector(scale, "scale", x, batch, channels, LayerNormModulateInputError)
    norm = torch.nn.functional.layer_norm(x.float(), (channels,), None if weight is None else weight.float(),
                                          None if bias is None else bias.float(), eps).to(x.dtype).float()
    one_plus = (1 + scale2).float()
    if x.dim() == 3:
        shift2, one_plus = shift2[:, None, :], one_plus[:, None, :]
    return torch.addcmul(shift2.float(), norm, one_plus).to(x.dtype)


def _register_op() -> None:
    @torch.library.custom_op(OP_QUALNAME, mutates_args=())
    def layer_norm_modulate_op(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                               weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
        return _launch(x, shift, scale, eps, weight, bias)

    @layer_norm_modulate_op.register_fake
    def _(x, shift, scale, eps, weight, bias):
        return x.new_empty(x.shape)


_REGISTRATION_ERROR: str | None = None
try:
    _register_op()
except Exception as e:  # an older torch without torch.library.custom_op: eager calls still work
    _REGISTRATION_ERROR = f"{type(e).__name__}: {e}"


def layer_norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                        weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """shift + layer_norm(x) * (1 + scale) over x's last dim, one (shift, scale) per batch
    element; same shape and dtype as x. Raises LayerNormModulateInputError for a call it cannot
    serve (checked before anything runs)."""
    reason = refusal(x.device)
    if reason is not None:
        raise LayerNormModulateInputError(reason)
    if _REGISTRATION_ERROR is None and torch.compiler.is_compiling():
        batch, _, channels = _check(x, weight, bias)
        batch_vector(shift, "shift", x, batch, channels, LayerNormModulateInputError)
        batch_vector(scale, "scale", x, batch, channels, LayerNormModulateInputError)
        return torch.ops.triton_accel.layer_norm_modulate(x, shift, scale, float(eps), weight, bias)
    return _launch(x, shift, scale, eps, weight, bias)  # eager: no custom-op dispatch; _launch checks


def compile_specs(dtype: str = "bf16", channels: int = 5120, affine: bool = False):
    """[(kernel, signature, constexprs, attrs, options)] for triton.compile(ASTSource(...)): a
    launch on a contiguous [M, channels] activation."""
    sig = {"X": f"*{dtype}", "SHIFT": f"*{dtype}", "SCALE": f"*{dtype}", "W": f"*{dtype}", "B": f"*{dtype}",
           "Y": f"*{dtype}", "L": "i32", "C": "i32", "stride_xm": "i32", "stride_ym": "i32", "stride_mb": "i32",
           "eps": "fp32", "BLOCK_C": "constexpr", "HAS_AFFINE": "constexpr", "EXACT_BF16": "constexpr"}
    block_c = next_pow2(channels, 1)
    const = dict(BLOCK_C=block_c, HAS_AFFINE=affine, EXACT_BF16=False)
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in ("X", "SHIFT", "SCALE", "W", "B", "Y", "C", "stride_xm", "stride_ym", "stride_mb")}
    return [(_layer_norm_modulate, sig, const, attrs, dict(num_warps=_warps(block_c), num_stages=1))]


__all__ = ["layer_norm_modulate", "layer_norm_modulate_ref", "refusal", "LayerNormModulateInputError",
           "OP_QUALNAME", "MAX_CHANNELS", "compile_specs"]
