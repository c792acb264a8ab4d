"""The one input check of every attention implementation, and its one error type.

`check_attention_inputs` raises `AttentionInputError` (a ValueError) whose `.reason` says,
for people, what is wrong with the call: a non-tensor, a wrong rank, dtypes or devices that
differ, shapes that do not line up, a mask of the wrong kind or shape, a scale that is not a
finite number. The public op, the FP8 launcher and any later op on [B, H, L, D] tensors
(a Linear family) call it, so the same bad call is refused with the same words everywhere.
What an implementation cannot serve although the call is valid (a head dim over 256, an
old GPU) is not an input error: the registry refuses it with a reason (registry.py).
"""
from __future__ import annotations

import math
import numbers

import torch


class AttentionInputError(ValueError):
    """The call itself is invalid; `reason` says why (also the message, after the op name)."""

    def __init__(self, reason: str, op: str = "attention"):
        self.reason = reason
        self.op = op
        super().__init__(f"{op}: {reason}")


def check_scale(scale, op: str = "attention") -> None:
    """None (1/sqrt(head dim)) or a finite real number; negative and zero scales are valid."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise AttentionInputError(f"scale must be a number or None, got {type(scale).__name__}", op)
    if not math.isfinite(scale):
        raise AttentionInputError(f"scale must be finite, got {scale}", op)


def attention_input_error(q, k, v, attn_mask=None, *, same_head_dim_v: bool = False,
                          dtypes: frozenset | None = None) -> str | None:
    """Why (q, k, v, attn_mask) is not a valid attention call, or None.

    q [B, H, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] with H a multiple of Hkv; the mask
    (bool: True = attend; floating point: added to the scores) broadcasts to [B, H, Lq, Lk].
    `same_head_dim_v` and `dtypes` narrow it for kernels that need Dv == D or certain dtypes.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a [B, H, L, D] tensor, got {type(t).__name__}"
        if t.dim() != 4:
            return f"{name} must be [B, H, L, D], got shape {tuple(t.shape)}"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    if not q.dtype.is_floating_point:
        return f"q, k, v must be floating point, got {q.dtype}"
    if dtypes is not None and q.dtype not in dtypes:
        names = " or ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
        return f"q, k, v must be {names}, got {q.dtype}"
    if not (q.device == k.device == v.device):
        return f"q, k, v are on different devices ({q.device}, {k.device}, {v.device})"
    B, H, Lq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        return f"batch sizes differ (q {B}, k {k.shape[0]}, v {v.shape[0]})"
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree on heads or length"
    if k.shape[3] != D:
        return f"k head dim {k.shape[3]} != q head dim {D}"
    if same_head_dim_v and v.shape[3] != D:
        return f"v head dim {v.shape[3]} != q head dim {D}"
    if k.shape[1] == 0 or H % k.shape[1]:
        return f"q heads {H} are not a multiple of k/v heads {k.shape[1]}"
    if attn_mask is not None:
        return _mask_error(attn_mask, (B, H, Lq, k.shape[2]), q.device)
    return None


def half_precision_refusal(q, k, v) -> str | None:
    """The first checks of every quantized / Gluon kernel's call_refusal: three [B, H, L, D]
    tensors of one dtype, float16 or bfloat16, on one device (None when they are)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return f"{name} must be a [B, H, L, D] tensor"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16):
        return f"q, k, v must all be float16 or bfloat16 (got {q.dtype}, {k.dtype}, {v.dtype})"
    if not (q.device == k.device == v.device):
        return "q, k, v are on different devices"
    return None


def _mask_error(attn_mask, target: tuple, device) -> str | None:
    if not isinstance(attn_mask, torch.Tensor):
        return f"attn_mask must be a tensor or None, got {type(attn_mask).__name__}"
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        return f"attn_mask must be bool or floating point, got {attn_mask.dtype}"
    try:
        ok = torch.broadcast_shapes(attn_mask.shape, target) == target
    except RuntimeError:
        ok = False
    if not ok:
        return f"attn_mask {tuple(attn_mask.shape)} does not broadcast to {target}"
    if attn_mask.device != device:
        return f"attn_mask is on {attn_mask.device}, q on {device}"
    return None


def check_attention_inputs(q, k, v, attn_mask=None, scale=None, *, op: str = "attention",
                           same_head_dim_v: bool = False, dtypes: frozenset | None = None) -> None:
    """Raise AttentionInputError with the reason when the call is invalid."""
    reason = attention_input_error(q, k, v, attn_mask, same_head_dim_v=same_head_dim_v, dtypes=dtypes)
    if reason is not None:
        raise AttentionInputError(reason, op)
    check_scale(scale, op)


__all__ = ["AttentionInputError", "attention_input_error", "check_attention_inputs", "check_scale"]
