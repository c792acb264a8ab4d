"""Float32 reference attention with the same signature as kernels.attention.

Materialises the full score matrix, so it is for tests, small shapes and the op's backward
(it is differentiable, masks included). Fully masked query rows give zeros, the behaviour
PyTorch SDPA has (checked on torch 2.13) and the one our kernel implements. The fuzz tests
run it in float64 (`compute_dtype`). return_lse=True also gives the natural-log logsumexp of
each row's scaled, masked scores ([B, H, Lq], compute_dtype; -inf for a fully masked row),
the exact answer the kernels' LSE is tested against.
"""
from __future__ import annotations

import math

import torch


def attention_ref(q, k, v, attn_mask=None, scale=None, is_causal=False, backend=None, *,
                  compute_dtype=torch.float32, return_lse=False):
    del backend  # same signature as kernels.attention; the reference has one path
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qf, kf, vf = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    if Hkv != H:
        kf = kf.repeat_interleave(H // Hkv, dim=1)
        vf = vf.repeat_interleave(H // Hkv, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    allowed = torch.ones(B, H, Lq, Lk, dtype=torch.bool, device=q.device)
    if is_causal:
        allowed &= torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask.expand(B, H, Lq, Lk)
        else:
            s = s + attn_mask.to(compute_dtype).expand(B, H, Lq, Lk)
    s = s.masked_fill(~allowed, float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True).detach()  # any per-row constant: keep it out of gradients
    dead = torch.isneginf(row_max)
    p = torch.exp(s - torch.where(dead, torch.zeros_like(row_max), row_max))
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p / torch.where(denom == 0, torch.ones_like(denom), denom), vf)
    if return_lse:
        # log(denom) is -inf exactly where the row is fully masked (denom = 0).
        lse = (torch.where(dead, torch.zeros_like(row_max), row_max) + torch.log(denom)).squeeze(-1)
        return out, lse
    return out
