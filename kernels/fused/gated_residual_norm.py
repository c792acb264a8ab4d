"""The gated residual of a DiT block, x + y * gate, optionally followed by the LayerNorm of the
result, in one pass: what Wan's block (comfy/ldm/wan/model.py) does after its self-attention,

    x = torch.addcmul(x, y, repeat_e(e[2], x))
    x = x + self.cross_attn(self.norm3(x), context, ...)

and at its end (addcmul(x, y, e[5]), no norm). There each addcmul broadcasts a [B, 1, C] gate
over the tokens, which sends torch to its non-vectorised elementwise kernel (0.50 ms a call at
Wan 2.1 14B's 32760 x 5120 on the H200, benchmarks/
RESULTS.md), and norm3 is torch's affine LayerNorm
(0.61 ms), reading back what the addcmul just wrote. Here one program reads a row of x and y
once and writes the new x and, when asked, its LayerNorm.

Numerics follow ComfyUI's ops, rounding where they round: x + y * gate in fp32, rounded to x's
dtype (addcmul's output, the residual stream), or with round_product the product rounded first
(Flux's blocks, comfy/ldm/flux/layers.py: `x += apply_mod(y, gate)`, a product tensor then an
in-place add, two roundings); the LayerNorm of that rounded row with mean and
variance in fp32 (two passes over the row held in registers), times weight plus bias in fp32,
rounded once (LayerNorm's output).

gated_residual_layer_norm_rows also writes the norm as the FP8 Linear's e4m3 activation rows
(layer_norm_modulate.py says why): Wan's norm3 output feeds the cross-attention's q Linear.

Layout: x and y [B, L, C] or [M, C] with unit last stride, in one dtype; gate [B or 1, 1, C]
or [B or 1, C] in that dtype (one vector per batch element), or None for a plain x + y.
Rows up to MAX_CHANNELS are held in registers (Wan 1536 / 5120).
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

OP_QUALNAME = "triton_accel::gated_residual_norm"
MAX_CHANNELS = 16384


class GatedResidualInputError(RowKernelInputError):
    """A call the fused kernel cannot serve; `.reason` says why (callers fall back)."""


if triton is not None:

    @triton.jit
    def _gated_residual_norm(X, R, G, W, B, XO, NO, Q, QS, L, C, stride_xm, stride_rm, stride_om, stride_gb, eps,
                             BLOCK_C: tl.constexpr, HAS_GATE: tl.constexpr, NORM: tl.constexpr,
                             HAS_AFFINE: tl.constexpr, FP8_ROWS: tl.constexpr, EXACT_BF16: tl.constexpr,
                             EXACT_CAST: tl.constexpr, ROUND_PRODUCT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_C)
        mask = offs < C
        x = tl.load(X + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(R + row * stride_rm + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            g = tl.load(G + (row // L) * stride_gb + offs, mask=mask, other=0.0).to(tl.float32)
            r = r * g
            if ROUND_PRODUCT:
                # Flux's `x += y * gate`: the product is a tensor of x's dtype before the add.
                r = round_unfused(r, XO.dtype.element_ty)
            h = x + r
        else:
            h = x + r
        # The residual stream is in x's dtype (addcmul's output); the norm reads it rounded.
        h = to_output_dtype(h, XO.dtype.element_ty, EXACT_BF16)
        tl.store(XO + row * stride_om + offs, h, mask=mask)
        if NORM:
            n = to_output_dtype(layer_norm_row(h.to(tl.float32), mask, C, eps, W, B, offs, HAS_AFFINE),
                                NO.dtype.element_ty, EXACT_BF16)
            tl.store(NO + row * stride_om + offs, n, mask=mask)
            if FP8_ROWS:
                # The next Linear's e4m3 rows, from the values just stored (masked lanes are 0).
                store_fp8_row(Q + row * C, QS + row, n.to(tl.float32), offs, mask, EXACT_CAST)


def _check(x: torch.Tensor, y: torch.Tensor, weight, bias) -> tuple[int, int, int]:
    dims = layer_norm_inputs(x, weight, bias, GatedResidualInputError, MAX_CHANNELS)
    if y.shape != x.shape or y.dtype != x.dtype or y.device != x.device:
        raise GatedResidualInputError(
            f"y ({tuple(y.shape)}, {y.dtype}, {y.device}) must match x ({tuple(x.shape)}, {x.dtype}, {x.device})")
    if y.stride(-1) != 1:
        raise GatedResidualInputError("y's last dim must be contiguous")
    return dims


_memo = direct_launch.SiteMemo("gated_residual_norm")


def _launch(x, y, gate, eps: float, weight, bias, norm: bool, fp8_rows: bool = False,
            round_product: bool = False) -> list[torch.Tensor]:
    """[x + y * gate, then its norm where asked, then the norm's e4m3 rows and their scales
    where fp8_rows]."""
    fp8_rows = fp8_rows and norm
    fingerprint = None
    if weight is None and x.is_cuda:
        # Everything the checks and the JIT's specialisation read (direct_launch.SiteMemo).
        fingerprint = (x.device, x.dtype, x.shape, x.stride(), x.data_ptr() % 16, y.dtype, y.shape, y.stride(),
                       y.data_ptr() % 16,
                       None if gate is None else (gate.dtype, gate.shape, gate.stride(), gate.data_ptr() % 16),
                       norm, fp8_rows, round_product)
        hit = _memo.get(fingerprint)
        if hit is not None:
            return _launch_remembered(hit, x, y, gate, eps, norm, fp8_rows)
    batch, tokens, channels = _check(x, y, weight, bias)
    gate2 = None if gate is None else batch_vector(gate, "gate", x, batch, channels, GatedResidualInputError)
    x2d, y2d = rows_2d(x, channels), rows_2d(y, channels)
    rows = x2d.shape[0]
    outs = _outputs(x, norm, fp8_rows, rows, channels)
    out, normed = outs[0], (outs[1] if norm else None)
    if rows == 0:
        return outs
    block_c = next_pow2(channels, 1)
    stride_gb = gate2.stride(0) if gate2 is not None and gate2.shape[0] > 1 else 0
    out2d = out.view(-1, channels)
    w, b = (weight, bias) if weight is not None else (x2d, x2d)  # never read without HAS_AFFINE
    q, qs = (outs[-2], outs[-1]) if fp8_rows else (out2d, out2d)  # never written without FP8_ROWS
    args = (x2d, y2d, x2d if gate2 is None else gate2, w, b, out2d, out2d if normed is None else normed.view(-1, channels),
            q, qs, tokens, channels, x2d.stride(0), y2d.stride(0), channels, stride_gb, float(eps))
    consts = dict(BLOCK_C=block_c, HAS_GATE=gate2 is not None, NORM=norm, HAS_AFFINE=weight is not None,
                  FP8_ROWS=fp8_rows, EXACT_BF16=exact_bf16(x), EXACT_CAST=x.device.type == "cpu",
                  ROUND_PRODUCT=round_product and gate2 is not None)
    # The plan check compares the norm where there is one (it depends on the residual too).
    plan = direct_launch.jit_or_plan(_gated_residual_norm, (rows,), args, consts, 6 if norm else 5,
                                     "gated_residual_norm", num_warps=row_warps(block_c))
    if plan is not None and fingerprint is not None and all(
            a.data_ptr() == b.data_ptr() for a, b in ((x2d, x), (y2d, y), (x2d if gate2 is None else gate2,
                                                                          x if gate is None else gate))):
        _memo.put(fingerprint, (plan, x.device.index, tokens, channels, rows, x2d.stride(0), y2d.stride(0), stride_gb))
    return outs


def _outputs(x, norm: bool, fp8_rows: bool, rows: int, channels: int) -> list[torch.Tensor]:
    """The kernel's outputs, as _launch returns them: [x + y * gate, its norm where asked, then
    the norm's e4m3 rows and scales where fp8_rows (only with the norm)]."""
    outs = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(2 if norm else 1)]
    return outs + fp8_row_outputs(rows, channels, x.device) if fp8_rows else outs


def _launch_remembered(hit: tuple, x, y, gate, eps: float, norm: bool, fp8_rows: bool) -> list[torch.Tensor]:
    """_launch for a fingerprint it served before: the same arguments, read off the remembered
    layout (x, y and the gate are the tensors the kernel read then, taken by data pointer)."""
    plan, index, tokens, channels, rows, stride_xm, stride_ym, stride_gb = hit
    outs = _outputs(x, norm, fp8_rows, rows, channels)
    out, normed = outs[0], (outs[1] if norm else None)
    q, qs = (outs[-2], outs[-1]) if fp8_rows else (out, out)
    direct_launch.launch(plan, index, (x, y, x if gate is None else gate, x, x, out, out if normed is None else normed,
                                       q, qs, tokens, channels, stride_xm, stride_ym, channels, stride_gb, float(eps)))
    return outs


refusal = row_kernel_refusal  # why a device cannot run the kernel (None: it can)


def gated_residual_norm_ref(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None, eps: float,
                            weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                            norm: bool = True, round_product: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float32 reference, written as ComfyUI computes it: addcmul (or add) in x's dtype, or
    with round_product the product in x's dtype then the add (Flux's `x += y * gate`), then
    layer_norm of that in x's dtype."""
    batch, tokens, channels = _check(x, y, weight, bias)
    product = y.float() * (1.0 if gate is None else _broadcast(gate, x, batch, channels).float())
    if round_product:
        product = product.to(x.dtype).float()
    h = (x.float() + product).to(x.dtype)
    if not norm:
        return h, None
    n = torch.nn.functional.layer_norm(h.float(), (channels,), None if weight is None else weight.float(),
                                       None if bias is None else bias.float(), eps)
    return h, n.to(x.dtype)


def _broadcast(gate: torch.Tensor, x: torch.Tensor, batch: int, channels: int) -> torch.Tensor:
    g = batch_vector(gate, "gate", x, batch, channels, GatedResidualInputError)
    return g[:, None, :] if x.dim() == 3 else g


def _register_op() -> None:
    @torch.library.custom_op(OP_QUALNAME, mutates_args=())
    def gated_residual_norm_op(x: torch.Tensor, y: torch.Tensor, gate: Optional[torch.Tensor], eps: float,
                               weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                               norm: bool, fp8_rows: bool = False, round_product: bool = False) -> list[torch.Tensor]:
        return _launch(x, y, gate, eps, weight, bias, norm, fp8_rows, round_product)

    @gated_residual_norm_op.register_fake
    def _(x, y, gate, eps, weight, bias, norm, fp8_rows=False, round_product=False):
        outs = [x.new_empty(x.shape) for _ in range(2 if norm else 1)]
        if fp8_rows and norm:
            rows = x.numel() // x.shape[-1]
            outs += [x.new_empty((rows, x.shape[-1]), dtype=torch.float8_e4m3fn),
                     x.new_empty((rows,), dtype=torch.float32)]
        return outs


_REGISTRATION_ERROR = register_custom_ops(_register_op)  # None: registered


def _call(x, y, gate, eps, weight, bias, norm: bool, fp8_rows: bool = False,
          round_product: bool = False) -> list[torch.Tensor]:
    raise_if_refused(x.device, GatedResidualInputError)
    if _REGISTRATION_ERROR is None and torch.compiler.is_compiling():
        batch, _, channels = _check(x, y, weight, bias)
        if gate is not None:
            batch_vector(gate, "gate", x, batch, channels, GatedResidualInputError)
        return torch.ops.triton_accel.gated_residual_norm(x, y, gate, float(eps), weight, bias, norm, fp8_rows,
                                                          round_product)
    return _launch(x, y, gate, eps, weight, bias, norm, fp8_rows, round_product)  # eager: no custom-op dispatch; _launch checks


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None,
                   round_product: bool = False) -> torch.Tensor:
    """x + y * gate (x + y without a gate), one gate vector per batch element, in x's dtype;
    round_product: y * gate rounded to x's dtype before the add (Flux's `x += y * gate`).
    Raises GatedResidualInputError for a call it cannot serve (checked before anything runs)."""
    return _call(x, y, gate, 0.0, None, None, False, round_product=round_product)[0]


def gated_residual_layer_norm(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None, eps: float,
                              weight: torch.Tensor | None = None,
                              bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, layer_norm(h)) for h = x + y * gate (x + y without a gate), the norm over the last dim,
    affine when weight and bias are given. Raises GatedResidualInputError for a call it cannot
    serve (checked before anything runs)."""
    h, normed = _call(x, y, gate, eps, weight, bias, True)
    return h, normed


def gated_residual_layer_norm_rows(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None, eps: float,
                                   weight: torch.Tensor | None = None, bias: torch.Tensor | None = None):
    """gated_residual_layer_norm's (h, norm) and the norm as the FP8 Linear's e4m3 activation rows,
    ((e4m3 [M, C], fp32 scales [M])), bit for bit what linear_fp8.quantize_activation makes of
    it, for linear_fp8.quantize_once: the Linear that reads the norm skips its own pass over it."""
    h, normed, q, scales = _call(x, y, gate, eps, weight, bias, True, True)
    return h, normed, (q, scales)


def compile_specs(dtype: str = "bf16", channels: int = 5120, norm: bool = True, affine: bool = True,
                  fp8_rows: bool = False, round_product: bool = False):
    """[(kernel, signature, constexprs, attrs, options)] for triton.compile(ASTSource(...)): a
    launch on contiguous [M, channels] activations with a per-batch gate."""
    # Without rows the launcher passes the output as a placeholder for Q and QS (never written):
    # an fp8 pointer type would not compile below sm_89.
    rows = fp8_rows and norm
    q_type, qs_type = ("*fp8e4nv", "*fp32") if rows else (f"*{dtype}", f"*{dtype}")
    sig = {"X": f"*{dtype}", "R": f"*{dtype}", "G": f"*{dtype}", "W": f"*{dtype}", "B": f"*{dtype}",
           "XO": f"*{dtype}", "NO": f"*{dtype}", "Q": q_type, "QS": qs_type, "L": "i32", "C": "i32",
           "stride_xm": "i32", "stride_rm": "i32", "stride_om": "i32", "stride_gb": "i32", "eps": "fp32",
           "BLOCK_C": "constexpr", "HAS_GATE": "constexpr", "NORM": "constexpr", "HAS_AFFINE": "constexpr",
           "FP8_ROWS": "constexpr", "EXACT_BF16": "constexpr", "EXACT_CAST": "constexpr",
           "ROUND_PRODUCT": "constexpr"}
    block_c = next_pow2(channels, 1)
    const = dict(BLOCK_C=block_c, HAS_GATE=True, NORM=norm, HAS_AFFINE=norm and affine, FP8_ROWS=rows,
                 EXACT_BF16=False, EXACT_CAST=False, ROUND_PRODUCT=round_product)
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in ("X", "R", "G", "W", "B", "XO", "NO", "Q", "QS", "C", "stride_xm", "stride_rm", "stride_om",
                       "stride_gb")}
    return [(_gated_residual_norm, sig, const, attrs, dict(num_warps=row_warps(block_c), num_stages=1))]


__all__ = ["gated_residual", "gated_residual_layer_norm", "gated_residual_layer_norm_rows", "gated_residual_norm_ref",
           "refusal", "GatedResidualInputError", "OP_QUALNAME", "MAX_CHANNELS", "compile_specs"]
