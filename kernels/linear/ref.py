"""Float32 references for the W8A8 Linear kernels (kernels/linear/fp8.py, kernels/linear/int8.py).

`linear_reference` is the unquantised Linear in fp32: what the FP8 kernel approximates.
`linear_fp8_reference` replays the kernel's arithmetic in torch (per-token e4m3 activations,
the same weight scales, fp32 products and sums): it isolates the GEMM's own error from the
quantisation's, so tests can hold the kernel to a much tighter tolerance against it. `linear_int8_reference`
does the same for the INT8 kernel (its Hadamard rotation, per-token int8, exact int products).
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
AMAX_FLOOR = 1e-12


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ weight.T + bias in fp32 (weight [N, K] of any float dtype, e4m3 included)."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def quantize_rows_reference(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 as the kernel does it: (x_fp8, scale = amax / 448)."""
    xf = x2d.float()
    amax = xf.abs().amax(dim=1).clamp_min(AMAX_FLOOR)
    # 448 / amax correctly rounded to fp32 (through float64), as the kernel's fp32 division
    # gives; torch's own fp32 scalar division can be one ulp off, which moves ties.
    inv = (FP8_MAX / amax.double()).float()
    q = (xf * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, amax / FP8_MAX


def linear_fp8_reference(x: torch.Tensor, fp8_weight, bias: torch.Tensor | None = None,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """What kernels.linear.fp8.fp8_linear computes, in fp32 torch (fp8_weight: an Fp8LinearWeight)."""
    k = fp8_weight.weight.shape[1]
    q, s = quantize_rows_reference(x.reshape(-1, k))
    y = (q.float() @ fp8_weight.weight.float().T) * s[:, None] * fp8_weight.scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).reshape(*x.shape[:-1], fp8_weight.weight.shape[0])


def quantize_rows_int8_reference(x2d: torch.Tensor, rotation: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 as kernels/linear/int8.py does it: rows rotated by the block-diagonal +-1
    Hadamard matrix (`rotation` wide; 0 = none), scale = amax / 127, round half away from zero."""
    xf = x2d.float()
    if rotation:
        h = torch.ones(1, 1)
        while h.shape[0] < rotation:  # Sylvester's construction, as the kernel builds it
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        xf = (xf.reshape(xf.shape[0], -1, rotation) @ h.to(xf.device)).reshape(xf.shape)
    amax = xf.abs().amax(dim=1).clamp_min(AMAX_FLOOR)
    inv = (127.0 / amax.double()).float()  # correctly rounded, as the kernel's div_rn
    v = xf * inv[:, None]
    q = torch.trunc(v + torch.where(v >= 0, 0.5, -0.5)).clamp(-127.0, 127.0).to(torch.int8)
    return q, amax / 127.0


def linear_int8_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, rotation: int,
                          bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """What kernels.linear.int8.run_linear computes, in torch: int8 products summed exactly
    (int64 here, int32 in the kernel: equal below 2^31), then row scale x channel scale + bias."""
    k = weight.shape[1]
    q, s = quantize_rows_int8_reference(x.reshape(-1, k), rotation)
    acc = (q.long() @ weight.long().T).float()
    y = acc * s[:, None] * scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).reshape(*x.shape[:-1], weight.shape[0])
