"""FP8 (e4m3) quantisation for the FP8 Linear: a weight per output channel, once per layer
(torch ops), and an activation per token on every call (quant_rows_fp8, one program a row:
amax, then e4m3 of x * 448 / amax). linear/fp8.py launches the row kernel and the GEMM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.kernel_common import tl, triton

if triton is not None:
    from ..core.kernel_common import store_fp8_row, to_e4m3

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# A row or channel of zeros gets this amax instead: scale stays finite, the zeros stay zeros.
AMAX_FLOOR = 1e-12
ALIGN_ELEMENTS = 16  # K and N multiple of 16: 16-byte TMA strides for e4m3, whole MMA depths
# Activation quantisation: rows up to this many elements are held in registers in one pass.
QUANT_ONE_PASS_MAX = 16384
QUANT_LOOP_BLOCK = 4096
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Fp8LinearUnsupportedError(RuntimeError):
    """The device or the call cannot run the FP8 Linear kernel; `.reason` says why."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True)
class Fp8LinearWeight:
    """A Linear weight ready for the kernel: e4m3 [N, K] (K contiguous) and fp32 scales [N]."""

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]


def check_features(n: int, k: int) -> None:
    for name, v in (("in_features (K)", k), ("out_features (N)", n)):
        if v % ALIGN_ELEMENTS:
            raise Fp8LinearUnsupportedError(
                f"FP8 Linear needs {name} to be a multiple of {ALIGN_ELEMENTS} (TMA row strides of 16 bytes, "
                f"whole MMA depths); got {v}")


def quantize_weight(weight: torch.Tensor, scale: torch.Tensor | float | None = None) -> Fp8LinearWeight:
    """An nn.Linear weight [N, K] as the kernel wants it; done once per layer.

    float weights: per-output-channel e4m3 (scale = channel amax / 448). float8_e4m3fn
    weights (ComfyUI's FP8 checkpoints) are kept as they are, with `scale` a scalar
    (per-tensor, `scale_weight` in those files; None means 1) or one value per output channel.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features]; got shape {tuple(weight.shape)}")
    n, k = weight.shape
    check_features(n, k)
    if weight.dtype == torch.float8_e4m3fn:
        s = torch.as_tensor(1.0 if scale is None else scale, dtype=torch.float32, device=weight.device)
        s = s.reshape(-1).to(torch.float32)
        if s.numel() not in (1, n):
            raise ValueError(f"an FP8 weight's scale must be a scalar or have {n} values; got {s.numel()}")
        return Fp8LinearWeight(weight.contiguous(), s.expand(n).contiguous())
    if weight.dtype not in IN_DTYPES:
        raise Fp8LinearUnsupportedError(f"FP8 Linear quantises float16/bfloat16/float32 or takes float8_e4m3fn "
                                        f"weights; got {weight.dtype}")
    if scale is not None:
        raise ValueError("scale is only for weights that are already float8_e4m3fn")
    w = weight.float()
    amax = w.abs().amax(dim=1).clamp_min(AMAX_FLOOR)
    s = amax / FP8_MAX
    # Division by the same fp32 scale the epilogue multiplies by: |w / s| <= 448 up to one
    # rounding, and the clamp keeps that rounding from overflowing e4m3 (which has no inf).
    q = (w / s[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8LinearWeight(q.contiguous(), s.contiguous())


if triton is not None:

    @triton.jit
    def quant_rows_fp8(X, Y, S, K, stride_xm, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr,
                        EXACT_CAST: tl.constexpr):
        # One program per row: amax over the row, then e4m3 of x * 448 / amax. Rows that fit
        # (K <= QUANT_ONE_PASS_MAX) stay in registers: one read of x, one write of y.
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_xm
        y_row = Y + row * K
        offs = tl.arange(0, BLOCK_K)
        if ONE_PASS:
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            store_fp8_row(y_row, S + row, x, offs, offs < K, EXACT_CAST)
        else:
            acc = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
                acc = tl.maximum(acc, tl.abs(x))
            amax = tl.maximum(tl.max(acc, 0), 1e-12)
            inv = tl.math.div_rn(448.0, amax)  # correctly rounded: Triton's '/' is approximate
            for k0 in range(0, K, BLOCK_K):
                x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
                y = tl.clamp(x * inv, -448.0, 448.0)
                tl.store(y_row + k0 + offs, to_e4m3(y, EXACT_CAST), mask=k0 + offs < K)
            tl.store(S + row, amax / 448.0)
