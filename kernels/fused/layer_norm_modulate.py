"""LayerNorm followed by adaptive modulation (shift + norm(x) * (1 + scale)), in one pass: what
DiT blocks do before their attention and MLP. Wan's block (comfy/ldm/wan/model.py):

    torch.addcmul(repeat_e(e[0], x), self.norm1(x), 1 + repeat_e(e[1], x))

runs there as torch's LayerNorm (0.25 ms a call at Wan 2.1 14B's 32760 x 5120 on the H200)
and a broadcasting addcmul (0.50 ms), each reading and writing the whole activation, twice a
block (benchmarks/RESULTS.md: the addcmuls
are 80 ms of a 2081 ms step, half of them these). Here one program reads a row once and
writes the modulated row once.

Numerics follow ComfyUI's ops, rounding where they round: mean and variance in fp32 (two
passes over the row held in registers, as exact as torch's Welford), the normalised row
rounded to x's dtype (LayerNorm's output), `1 + scale` rounded to the modulation's dtype (a
separate op there), then shift + norm * (1 + scale) in fp32, rounded once.

residual_layer_norm_modulate adds two options to the same pass (Wan's norm2):
- a residual input: h = x + r rounded to x's dtype (ComfyUI's `x = x + cross_attn(...)`) is
  written as the new residual stream and normalised, instead of a separate add reading x and r
  and writing h for the norm to read back (0.33 ms a call at Wan 14B on an H100);
- e4m3 rows: the modulated output also as the FP8 Linear's activation format (per-row amax
  scale, kernel_common.store_fp8_row, the very code of linear_fp8's quantisation, so the bits
  are equal), for the Linear that reads it (linear_fp8.quantize_once(x, rows)): 0.05 ms of
  extra writes instead of that Linear's 0.16 ms quantisation pass over the output.

Layout: x [B, L, C] with unit last stride; shift and scale [B or 1, 1, C] or [B or 1, C]
(one modulation vector per batch element, broadcast over its L tokens), in x's dtype. Rows up
to MAX_CHANNELS are held in registers (Wan 1536 / 5120, Flux 3072, HunyuanVideo 3072).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..core.kernel_common import tl, triton  # None, None where Triton does not import

from ..core import direct_launch
from ..core.kernel_common import (batch_vector, exact_bf16, fp8_row_outputs, layer_norm_inputs, next_pow2,
                            row_kernel_refusal, row_warps, rows_2d)
from ..core.kernel_common import RowKernelInputError, raise_if_refused, register_custom_ops

if triton is not None:
    from ..core.kernel_common import layer_norm_row, round_unfused, store_fp8_row, to_output_dtype

OP_QUALNAME = "triton_accel::layer_norm_modulate"
ROWS_OP_QUALNAME = "triton_accel::residual_layer_norm_modulate"
MAX_CHANNELS = 16384


class LayerNormModulateInputError(RowKernelInputError):
    """A call the fused kernel cannot serve; `.reason` says why (callers fall back)."""


if triton is not None:

    @triton.jit
    def _layer_norm_modulate(X, R, G, SHIFT, SCALE, W, B, HO, Y, Q, QS, L, C, stride_xm, stride_rm, stride_ym,
                             stride_mb, stride_gb, eps, BLOCK_C: tl.constexpr, HAS_AFFINE: tl.constexpr,
                             HAS_RESIDUAL: tl.constexpr, FP8_ROWS: tl.constexpr, EXACT_BF16: tl.constexpr,
                             EXACT_CAST: tl.constexpr, HAS_GATE: tl.constexpr, ROUND_PRODUCT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        batch = row // L
        offs = tl.arange(0, BLOCK_C)
        mask = offs < C
        x = tl.load(X + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            # x + r (* gate) is the residual stream, in x's dtype (ComfyUI's `x = x + ...`): the
            # norm reads it rounded.
            r = tl.load(R + row * stride_rm + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_GATE:
                r = r * tl.load(G + batch * stride_gb + offs, mask=mask, other=0.0).to(tl.float32)
                if ROUND_PRODUCT:
                    # Flux's `x += y * gate`: the product is a tensor of x's dtype before the add.
                    r = round_unfused(r, HO.dtype.element_ty)
            h = to_output_dtype(x + r, HO.dtype.element_ty, EXACT_BF16)
            tl.store(HO + row * stride_ym + offs, h, mask=mask)
            x = h.to(tl.float32)
        y = layer_norm_row(x, mask, C, eps, W, B, offs, HAS_AFFINE)
        # LayerNorm's output is in x's dtype, and so is ComfyUI's `1 + scale`: round as they do.
        y = to_output_dtype(y, Y.dtype.element_ty, EXACT_BF16).to(tl.float32)
        shift = tl.load(SHIFT + batch * stride_mb + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(SCALE + batch * stride_mb + offs, mask=mask, other=0.0).to(tl.float32)
        scale = to_output_dtype(1.0 + scale, Y.dtype.element_ty, EXACT_BF16).to(tl.float32)
        out = to_output_dtype(shift + y * scale, Y.dtype.element_ty, EXACT_BF16)
        tl.store(Y + row * stride_ym + offs, out, mask=mask)
        if FP8_ROWS:
            # The next Linear's e4m3 rows, from the values just stored (masked lanes are 0).
            store_fp8_row(Q + row * C, QS + row, out.to(tl.float32), offs, mask, EXACT_CAST)


def _check(x: torch.Tensor, weight, bias) -> tuple[int, int, int]:
    return layer_norm_inputs(x, weight, bias, LayerNormModulateInputError, MAX_CHANNELS)


_memo = direct_launch.SiteMemo("layer_norm_modulate")


def _fingerprint(x, shift, scale, residual, gate, fp8_rows: bool, round_product: bool) -> tuple:
    """Everything _launch's checks and the JIT's specialisation read off a call without an affine
    weight (direct_launch.SiteMemo)."""
    return (x.device, x.dtype, x.shape, x.stride(), x.data_ptr() % 16, shift.dtype, shift.shape, shift.stride(),
            shift.data_ptr() % 16, scale.dtype, scale.shape, scale.stride(), scale.data_ptr() % 16,
            None if residual is None else (residual.dtype, residual.shape, residual.stride(), residual.data_ptr() % 16),
            None if gate is None else (gate.dtype, gate.shape, gate.stride(), gate.data_ptr() % 16),
            fp8_rows, round_product)


def _launch(x, shift, scale, eps: float, weight, bias, residual=None, fp8_rows: bool = False, gate=None,
            round_product: bool = False) -> list[torch.Tensor]:
    """[x + residual (* gate) where given, the modulated norm, then its e4m3 rows and their
    scales where fp8_rows]."""
    fingerprint = None
    if weight is None and x.is_cuda:
        fingerprint = _fingerprint(x, shift, scale, residual, gate, fp8_rows, round_product)
        hit = _memo.get(fingerprint)
        if hit is not None:
            return _launch_remembered(hit, x, shift, scale, eps, residual, fp8_rows, gate)
    batch, tokens, channels = _check(x, weight, bias)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device or residual.stride(-1) != 1):
        raise LayerNormModulateInputError(
            f"residual ({tuple(residual.shape)}, {residual.dtype}) must match x ({tuple(x.shape)}, {x.dtype}) "
            "with a contiguous last dim")
    if gate is not None and residual is None:
        raise LayerNormModulateInputError("a gate needs a residual")
    gate2 = None if gate is None else batch_vector(gate, "gate", x, batch, channels, LayerNormModulateInputError)
    shift2 = batch_vector(shift, "shift", x, batch, channels, LayerNormModulateInputError)
    scale2 = batch_vector(scale, "scale", x, batch, channels, LayerNormModulateInputError)
    if shift2.shape != scale2.shape or shift2.stride() != scale2.stride():
        shift2, scale2 = (shift2.expand(max(shift2.shape[0], scale2.shape[0]), channels).contiguous(),
                          scale2.expand(max(shift2.shape[0], scale2.shape[0]), channels).contiguous())
    x2d = rows_2d(x, channels)
    r2d = x2d if residual is None else rows_2d(residual, channels)  # never read without HAS_RESIDUAL
    rows = x2d.shape[0]
    outs = _outputs(x, residual is not None, fp8_rows, rows, channels)
    out = outs[1 if residual is not None else 0]
    if rows == 0:
        return outs
    block_c = next_pow2(channels, 1)
    stride_mb = shift2.stride(0) if shift2.shape[0] > 1 else 0
    stride_gb = gate2.stride(0) if gate2 is not None and gate2.shape[0] > 1 else 0
    w, b = (weight, bias) if weight is not None else (x2d, x2d)  # never read without HAS_AFFINE
    out2d = out.view(-1, channels)
    q, qs = (outs[-2], outs[-1]) if fp8_rows else (out2d, out2d)  # never written without FP8_ROWS
    args = (x2d, r2d, shift2 if gate2 is None else gate2, shift2, scale2, w, b, outs[0].view(-1, channels), out2d,
            q, qs, tokens, channels, x2d.stride(0), r2d.stride(0), channels, stride_mb, stride_gb, float(eps))
    consts = dict(BLOCK_C=block_c, HAS_AFFINE=weight is not None, HAS_RESIDUAL=residual is not None,
                  FP8_ROWS=fp8_rows, EXACT_BF16=exact_bf16(x), EXACT_CAST=x.device.type == "cpu",
                  HAS_GATE=gate2 is not None, ROUND_PRODUCT=round_product and gate2 is not None)
    plan = direct_launch.jit_or_plan(_layer_norm_modulate, (rows,), args, consts, 8, "layer_norm_modulate",
                                     num_warps=row_warps(block_c))
    if plan is not None and fingerprint is not None and all(
            a.data_ptr() == b.data_ptr() for a, b in ((x2d, x), (r2d, x if residual is None else residual),
                                                      (shift2, shift), (scale2, scale),
                                                      (shift2 if gate2 is None else gate2,
                                                       shift if gate is None else gate))):
        _memo.put(fingerprint, (plan, x.device.index, tokens, channels, rows, x2d.stride(0), r2d.stride(0), stride_mb,
                                stride_gb))
    return outs


def _outputs(x, residual: bool, fp8_rows: bool, rows: int, channels: int) -> list[torch.Tensor]:
    """The kernel's outputs, as _launch returns them: [the residual stream where there is a
    residual, the modulated norm, then its e4m3 rows and scales where fp8_rows]."""
    outs = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(2 if residual else 1)]
    return outs + fp8_row_outputs(rows, channels, x.device) if fp8_rows else outs


def _launch_remembered(hit: tuple, x, shift, scale, eps: float, residual, fp8_rows: bool, gate) -> list[torch.Tensor]:
    """_launch for a fingerprint it served before: the same arguments, read off the remembered
    layout (x, the residual, shift, scale and gate are the tensors the kernel read then; the
    kernel takes any tensor by its data pointer)."""
    plan, index, tokens, channels, rows, stride_xm, stride_rm, stride_mb, stride_gb = hit
    outs = _outputs(x, residual is not None, fp8_rows, rows, channels)
    out = outs[1 if residual is not None else 0]
    q, qs = (outs[-2], outs[-1]) if fp8_rows else (out, out)
    direct_launch.launch(plan, index, (x, x if residual is None else residual, shift if gate is None else gate, shift,
                                       scale, x, x, outs[0], out, q, qs, tokens, channels, stride_xm, stride_rm,
                                       channels, stride_mb, stride_gb, float(eps)))
    return outs


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
        return _launch(x, shift, scale, eps, weight, bias)[0]

    @layer_norm_modulate_op.register_fake
    def _(x, shift, scale, eps, weight, bias):
        return x.new_empty(x.shape)

    @torch.library.custom_op(ROWS_OP_QUALNAME, mutates_args=())
    def residual_layer_norm_modulate_op(x: torch.Tensor, residual: Optional[torch.Tensor], shift: torch.Tensor,
                                        scale: torch.Tensor, eps: float, fp8_rows: bool,
                                        gate: Optional[torch.Tensor] = None,
                                        round_product: bool = False) -> list[torch.Tensor]:
        return _launch(x, shift, scale, eps, None, None, residual, fp8_rows, gate, round_product)

    @residual_layer_norm_modulate_op.register_fake
    def _(x, residual, shift, scale, eps, fp8_rows, gate=None, round_product=False):
        outs = [x.new_empty(x.shape) for _ in range(1 if residual is None else 2)]
        if fp8_rows:
            rows = x.numel() // x.shape[-1]
            outs += [x.new_empty((rows, x.shape[-1]), dtype=torch.float8_e4m3fn),
                     x.new_empty((rows,), dtype=torch.float32)]
        return outs


_REGISTRATION_ERROR = register_custom_ops(_register_op)  # None: registered


def layer_norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                        weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """shift + layer_norm(x) * (1 + scale) over x's last dim, one (shift, scale) per batch
    element; same shape and dtype as x. Raises LayerNormModulateInputError for a call it cannot
    serve (checked before anything runs)."""
    if _traced(x, shift, scale, weight, bias):
        return torch.ops.triton_accel.layer_norm_modulate(x, shift, scale, float(eps), weight, bias)
    return _launch(x, shift, scale, eps, weight, bias)[0]  # eager: no custom-op dispatch; _launch checks


def _traced(x, shift, scale, weight, bias) -> bool:
    """Whether the call goes through the custom op (torch.compile tracing: the op's inputs are
    checked here, the fake cannot). Raises LayerNormModulateInputError where the device cannot
    run the kernel."""
    raise_if_refused(x.device, LayerNormModulateInputError)
    if _REGISTRATION_ERROR is not None or not torch.compiler.is_compiling():
        return False
    batch, _, channels = _check(x, weight, bias)
    batch_vector(shift, "shift", x, batch, channels, LayerNormModulateInputError)
    batch_vector(scale, "scale", x, batch, channels, LayerNormModulateInputError)
    return True


def residual_layer_norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                                 residual: torch.Tensor | None = None, fp8_rows: bool = False,
                                 gate: torch.Tensor | None = None, round_product: bool = False):
    """(h, shift + layer_norm(h) * (1 + scale), rows) in one pass, h = x + residual in x's
    dtype (x itself, returned as it is, without a residual), or h = x + residual * gate with a
    gate (one vector per batch element, like shift), the product rounded to x's dtype first
    with round_product (Flux's `x += y * gate`, gated_residual_norm.py). rows: None, or with fp8_rows the
    modulated norm as the FP8 Linear's e4m3 activation rows, (e4m3 [M, C], fp32 scales [M]),
    bit for bit what linear_fp8.quantize_activation makes of it, for linear_fp8.quantize_once:
    the Linear that reads the norm then skips its own pass over it. No affine norm (Wan's
    norm2, Flux's). Raises LayerNormModulateInputError for a call it cannot serve."""
    if _traced(x, shift, scale, None, None):
        if gate is not None:
            batch_vector(gate, "gate", x, *_check(x, None, None)[::2], LayerNormModulateInputError)
        outs = torch.ops.triton_accel.residual_layer_norm_modulate(x, residual, shift, scale, float(eps), fp8_rows,
                                                                   gate, round_product)
    else:
        outs = _launch(x, shift, scale, eps, None, None, residual, fp8_rows, gate, round_product)
    first = 0 if residual is None else 1  # no list.pop: torch.compile traces this
    h = x if residual is None else outs[0]
    return h, outs[first], ((outs[first + 1], outs[first + 2]) if fp8_rows else None)


def compile_specs(dtype: str = "bf16", channels: int = 5120, affine: bool = False, residual: bool = False,
                  fp8_rows: bool = False, gate: bool = False, round_product: bool = False):
    """[(kernel, signature, constexprs, attrs, options)] for triton.compile(ASTSource(...)): a
    launch on a contiguous [M, channels] activation (with a residual input, e4m3 rows out)."""
    # Without rows the launcher passes the output as a placeholder for Q and QS (never written):
    # an fp8 pointer type would not compile below sm_89.
    rows = fp8_rows
    q_type, qs_type = ("*fp8e4nv", "*fp32") if rows else (f"*{dtype}", f"*{dtype}")
    sig = {"X": f"*{dtype}", "R": f"*{dtype}", "G": f"*{dtype}", "SHIFT": f"*{dtype}", "SCALE": f"*{dtype}", "W": f"*{dtype}",
           "B": f"*{dtype}", "HO": f"*{dtype}", "Y": f"*{dtype}", "Q": q_type, "QS": qs_type, "L": "i32",
           "C": "i32", "stride_xm": "i32", "stride_rm": "i32", "stride_ym": "i32", "stride_mb": "i32", "stride_gb": "i32", "eps": "fp32",
           "BLOCK_C": "constexpr", "HAS_AFFINE": "constexpr", "HAS_RESIDUAL": "constexpr", "FP8_ROWS": "constexpr",
           "EXACT_BF16": "constexpr", "EXACT_CAST": "constexpr", "HAS_GATE": "constexpr", "ROUND_PRODUCT": "constexpr"}
    block_c = next_pow2(channels, 1)
    const = dict(BLOCK_C=block_c, HAS_AFFINE=affine, HAS_RESIDUAL=residual, FP8_ROWS=rows, EXACT_BF16=False,
                 EXACT_CAST=False, HAS_GATE=residual and gate, ROUND_PRODUCT=residual and gate and round_product)
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in ("X", "R", "G", "SHIFT", "SCALE", "W", "B", "HO", "Y", "Q", "QS", "C", "stride_xm", "stride_rm",
                       "stride_ym", "stride_mb", "stride_gb")}
    return [(_layer_norm_modulate, sig, const, attrs, dict(num_warps=row_warps(block_c), num_stages=1))]


__all__ = ["layer_norm_modulate", "residual_layer_norm_modulate", "layer_norm_modulate_ref", "refusal",
           "LayerNormModulateInputError", "OP_QUALNAME", "ROWS_OP_QUALNAME", "MAX_CHANNELS", "compile_specs"]
