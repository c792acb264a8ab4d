"""Sequence-parallel attention over torch.distributed: one long sequence split across ranks.

Every rank holds an equal, contiguous shard of the sequence of q, k and v ([B, H, L/W, D],
rank r holding positions r*L/W .. (r+1)*L/W - 1) and gets back the attention output of its
own query shard over the whole sequence. Two schemes, both on kernels.attention (so our FP16
/ BF16 kernel and, with precision="fp8" / "int8", the quantized ones):
- ulysses_attention (DeepSpeed-Ulysses): an all-to-all trades the sequence shard for a head
  shard (H/W heads, the full sequence), each rank runs ordinary attention on its heads, and a
  second all-to-all trades back. Needs H % W == 0; moves q, k, v and out once each.
- ring_attention: each rank keeps its query shard while the K/V shards travel around the
  ring; at each of the W steps the next shard's transfer (dist.batch_isend_irecv) is posted
  before the current block's attention runs, so on GPUs (NCCL runs P2P on its own stream) it
  overlaps the compute. The W partial outputs merge exactly through their log-sum-exps
  (kernels.attention(..., return_lse=True), merge_partials).
Transport is torch.distributed only (NCCL on GPUs, gloo on CPUs). Equal shards are required
and checked once per call (one tiny all_gather): a rank whose shapes differ raises ValueError
on every rank, so a mismatch fails instead of hanging.
Quantized paths: the fp8 / int8 kernels quantize per call, so with ring their statistics
(K's mean, V's scales) are per K/V shard; ulysses quantizes over the whole sequence as the
single-GPU call does.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .dispatch import attention

log = logging.getLogger("triton_accel.kernels.attention.sequence_parallel")  # not __name__: the clone's folder name

ALL_TO_ALL_METHODS = ("auto", "collective", "p2p")
# Process groups (by id) whose backend has no all_to_all_single (some gloo builds): they take
# the point-to-point fallback from the first failure on.
_no_collective_all_to_all: set = set()


# ---- merging partial attentions -----------------------------------------------------------

def merge_partials(outs, lses):
    """The attention over the union of disjoint key sets from the attentions over each set.

    outs: [B, H, L, Dv] tensors (any dtype), lses: their float32 [B, H, L] log-sum-exps (as
    kernels.attention(..., return_lse=True) gives). Returns (out in outs[0]'s dtype, lse).
    Each part weighs exp(lse_i - lse): the max is subtracted first so nothing overflows, and
    a part whose row saw only masked keys (lse = -inf) weighs zero; a row masked in every
    part keeps out = 0 and lse = -inf.
    """
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"merge_partials needs as many outputs as lses, at least one (got {len(outs)}, {len(lses)})")
    lse_all = torch.stack([x.float() for x in lses])  # [P, B, H, L]
    top = lse_all.amax(dim=0)
    top_safe = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    weights = torch.exp(lse_all - top_safe)  # exp(-inf) = 0 for masked parts
    total = weights.sum(dim=0)
    dead = total == 0
    lse = torch.where(dead, torch.full_like(top, float("-inf")), top_safe + torch.log(total))
    inv_total = 1.0 / torch.where(dead, torch.ones_like(total), total)
    out = torch.zeros(outs[0].shape, dtype=torch.float32, device=outs[0].device)
    for part, w in zip(outs, weights):
        out.add_(part.float() * (w * inv_total).unsqueeze(-1))
    return out.to(outs[0].dtype), lse


def _merge_into(acc, acc_lse, part, part_lse):
    """merge_partials of a float32 running result and one part, in place on acc (ring steps)."""
    top = torch.maximum(acc_lse, part_lse)
    top_safe = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    w_acc, w_part = torch.exp(acc_lse - top_safe), torch.exp(part_lse - top_safe)
    total = w_acc + w_part
    dead = total == 0
    inv_total = 1.0 / torch.where(dead, torch.ones_like(total), total)
    acc.mul_((w_acc * inv_total).unsqueeze(-1)).add_(part.float() * (w_part * inv_total).unsqueeze(-1))
    new_lse = torch.where(dead, torch.full_like(top, float("-inf")), top_safe + torch.log(total))
    return acc, new_lse


# ---- communication helpers ----------------------------------------------------------------

def _world(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sequence-parallel attention needs torch.distributed initialised (init_process_group)")
    return dist.get_world_size(group), dist.get_rank(group)


def _global_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _meta_device(x: torch.Tensor, group) -> torch.device:
    # NCCL moves CUDA tensors only; gloo moves CPU tensors.
    return x.device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def check_equal_shards(q, k, v, group=None) -> None:
    """Raise ValueError on every rank unless all ranks hold q, k, v of the same shapes (equal
    sequence shards; one all_gather of 12 integers)."""
    world, _ = _world(group)
    facts = torch.tensor([*q.shape, *k.shape, *v.shape], dtype=torch.int64, device=_meta_device(q, group))
    gathered = [torch.empty_like(facts) for _ in range(world)]
    dist.all_gather(gathered, facts, group=group)
    shapes = [tuple(int(x) for x in g.tolist()) for g in gathered]
    if any(s != shapes[0] for s in shapes):
        per_rank = "; ".join(f"rank {r}: q {s[0:4]} k {s[4:8]} v {s[8:12]}" for r, s in enumerate(shapes))
        raise ValueError("sequence-parallel attention needs equal sequence shards on every rank (pad the "
                         f"sequence to a multiple of the world size): {per_rank}")


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group=None, method: str = "auto") -> torch.Tensor:
    """out[j] = rank j's inp[me] along dim 0 (equal splits of W): all_to_all_single, or, where
    the backend lacks it (some gloo builds) or method="p2p", one batch of isend/irecv."""
    if method not in ALL_TO_ALL_METHODS:
        raise ValueError(f"method must be one of {ALL_TO_ALL_METHODS} (got {method!r})")
    world, rank = _world(group)
    key = id(group)
    if method == "collective" or (method == "auto" and key not in _no_collective_all_to_all):
        try:
            dist.all_to_all_single(out, inp, group=group)
            return out
        except (RuntimeError, NotImplementedError) as e:
            text = str(e).lower()
            if method == "collective" or not ("support" in text or "implement" in text):
                raise  # a real failure (timeout, shapes), not a missing collective
            log.info("all_to_all_single unavailable on %s (%s); using isend/irecv", dist.get_backend(group), e)
            _no_collective_all_to_all.add(key)
    ops = []
    for peer in range(world):
        if peer == rank:
            continue
        ops.append(dist.P2POp(dist.isend, inp[peer].contiguous(), _global_rank(group, peer), group))
        ops.append(dist.P2POp(dist.irecv, out[peer], _global_rank(group, peer), group))
    out[rank].copy_(inp[rank])
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return out


def _seq_to_heads(x: torch.Tensor, world: int, group, method: str) -> torch.Tensor:
    """[B, H, L/W, D] sequence shard -> [B, H/W, L, D] head shard (rank r gets heads r*H/W...)."""
    B, H, Ls, D = x.shape
    send = x.reshape(B, world, H // world, Ls, D).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    all_to_all(recv, send, group, method)  # recv[j]: my heads over rank j's positions
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // world, world * Ls, D)


def _heads_to_seq(x: torch.Tensor, world: int, group, method: str) -> torch.Tensor:
    """[B, H/W, L, D] head shard -> [B, H, L/W, D] sequence shard (the inverse of _seq_to_heads)."""
    B, Hs, L, D = x.shape
    send = x.reshape(B, Hs, world, L // world, D).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    all_to_all(recv, send, group, method)  # recv[j]: rank j's heads over my positions
    return recv.permute(1, 0, 2, 3, 4).reshape(B, world * Hs, L // world, D)


# ---- Ulysses ------------------------------------------------------------------------------

def ulysses_attention(q, k, v, group=None, attn_mask=None, is_causal=False, all_to_all_method="auto",
                      check_shapes=True, **attention_kwargs):
    """Attention of this rank's query shard over the whole sequence, by head sharding.

    q [B, H, L/W, D], k/v [B, HK, L/W, D(v)] on every rank (equal shards, rank order = sequence
    order). Needs H % W == 0 (ValueError otherwise); k/v with HK % W != 0 (GQA) are expanded
    to H heads first. attn_mask, when given, is over the full sequence ([.., L, L], heads 1 or
    H) and is_causal is taken over the full sequence. attention_kwargs (scale, backend,
    precision) go to kernels.attention. Returns [B, H, L/W, Dv] in q's dtype.
    """
    world, rank = _world(group)
    H, HK = q.shape[1], k.shape[1]
    if H % world:
        raise ValueError(f"ulysses_attention needs the query heads ({H}) to be a multiple of the world size ({world})")
    if check_shapes:
        check_equal_shards(q, k, v, group)
    if world == 1:
        return attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **attention_kwargs)
    if HK % world:
        k, v = (t.repeat_interleave(H // HK, dim=1) for t in (k, v))
    if attn_mask is not None and attn_mask.dim() >= 3 and attn_mask.shape[-3] == H > 1:
        per = H // world  # a mask per head: this rank's heads only (the head dim is -3)
        attn_mask = attn_mask[..., rank * per:(rank + 1) * per, :, :]
    qh, kh, vh = (_seq_to_heads(t, world, group, all_to_all_method) for t in (q, k, v))
    out = attention(qh, kh, vh, attn_mask=attn_mask, is_causal=is_causal, **attention_kwargs)
    return _heads_to_seq(out, world, group, all_to_all_method)


# ---- ring ---------------------------------------------------------------------------------

def _ring_exchange(k, v, world: int, rank: int, group):
    """Post this step's transfers: send the held K/V shard to rank+1, receive rank-1's.
    Returns (new k, new v, requests); the buffers are fresh, so compute on k, v goes on."""
    nxt, prv = _global_rank(group, (rank + 1) % world), _global_rank(group, (rank - 1) % world)
    k_next, v_next = torch.empty_like(k), torch.empty_like(v)
    ops = [dist.P2POp(dist.isend, k, nxt, group), dist.P2POp(dist.isend, v, nxt, group),
           dist.P2POp(dist.irecv, k_next, prv, group), dist.P2POp(dist.irecv, v_next, prv, group)]
    return k_next, v_next, dist.batch_isend_irecv(ops)


def ring_attention(q, k, v, group=None, attn_mask=None, is_causal=False, check_shapes=True, **attention_kwargs):
    """Attention of this rank's query shard over the whole sequence, K/V passed around the ring.

    q [B, H, L/W, D], k/v [B, HK, L/W, D(v)] on every rank (equal shards). At step s the rank
    attends to the K/V shard of rank (r - s) mod W while the next one is in flight, and merges
    the W partial outputs through their log-sum-exps. No attn_mask and no is_causal (ValueError):
    a mask per K/V shard and causal block skipping are not implemented. attention_kwargs
    (scale, backend, precision) go to kernels.attention; the backend must return the LSE
    (kernels.attention.dispatch's return_lse). Returns [B, H, L/W, Dv] in q's dtype.
    """
    if attn_mask is not None or is_causal:
        raise ValueError("ring_attention supports neither attn_mask nor is_causal (use ulysses_attention)")
    world, rank = _world(group)
    if check_shapes:
        check_equal_shards(q, k, v, group)
    if world == 1:
        return attention(q, k, v, **attention_kwargs)
    k, v = k.contiguous(), v.contiguous()
    acc = acc_lse = None
    for step in range(world):
        pending = None
        if step + 1 < world:
            k_next, v_next, pending = _ring_exchange(k, v, world, rank, group)
        out, lse = attention(q, k, v, return_lse=True, **attention_kwargs)
        if acc is None:
            acc, acc_lse = out.float(), lse
        else:
            acc, acc_lse = _merge_into(acc, acc_lse, out, lse)
        if pending is not None:
            for req in pending:
                req.wait()
            k, v = k_next, v_next
    return acc.to(q.dtype)


__all__ = ["merge_partials", "ulysses_attention", "ring_attention", "all_to_all", "check_equal_shards",
           "ALL_TO_ALL_METHODS"]
