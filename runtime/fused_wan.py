"""Wan's attention block (comfy/ldm/wan/model.py WanAttentionBlock) in fused norm passes:
LayerNorm + modulation, RMSNorm + RoPE, gated residual + LayerNorm (fused_norms.py says what
and why)."""
from __future__ import annotations

import logging

import torch

from ..kernels.fused.gated_residual_norm import (gated_residual, gated_residual_layer_norm,
                                           gated_residual_layer_norm_rows)
from ..kernels.fused.layer_norm_modulate import residual_layer_norm_modulate
from ..kernels.fused.layer_norm_modulate import refusal as layer_norm_modulate_refusal
from ..kernels.linear.fp8 import quantize_once
from ..kernels.fused.norm_rope import freqs_table, rms_norm_rope
from ..kernels.fused.norm_rope import refusal as norm_rope_refusal
from .fused_block_patch import (INPUT_ERRORS, PATH, REASON_PATCHES, RowsSites, bind_names, block_guard_failure,
                                fp8_rows_refusal, is_own_forward, norm_params, rows_scope)

log = logging.getLogger("triton_accel.nodes.patch_fused_norms")  # not __name__: the clone's folder name


class FusedWanBlock(RowsSites):
    """The object patch of one WanAttentionBlock's forward."""

    PATH = PATH

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.previous(*args, **kwargs)  # traced as ComfyUI's: not counted, like the Linear patch
        try:
            call = _bind(args, kwargs)
            reason = self._refusal(call)
        except (TypeError, *INPUT_ERRORS) as e:
            reason = getattr(e, "reason", None) or f"arguments: {e}"
        if reason is not None:
            return self._original(args, kwargs, reason)
        return self._serve(args, kwargs, str(call["x"].device), lambda: self._fused(**call), block_guard_failure)

    def _refusal(self, call: dict) -> str | None:
        x, e, freqs = call["x"], call["e"], call["freqs"]
        block = self.module
        patches = call["transformer_options"].get("patches", {})
        if "attn1_patch" in patches or "attn2_patch" in patches:
            return REASON_PATCHES
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != block.dim:
            return f"x is not [B, L, {block.dim}]"
        if not isinstance(e, torch.Tensor) or not _one_modulation(e, x):
            return "modulation is not one [6, C] per batch element (per-frame timesteps stay ComfyUI's)"
        if e.dtype != x.dtype:
            return f"modulation in {e.dtype}, x in {x.dtype}"
        if torch.is_grad_enabled() and (x.requires_grad or e.requires_grad):
            return "autograd records this call"
        for why in (layer_norm_modulate_refusal(x.device), norm_rope_refusal(x.device)):
            if why is not None:
                return why
        if not isinstance(freqs, torch.Tensor):
            return "no rope freqs tensor"
        freqs_table(freqs, x.shape[0], x.shape[1], block.self_attn.head_dim)  # raises with the reason
        return None

    def _fused(self, x, e, freqs, context, context_img_len=257, transformer_options={}):
        block = self.module
        model_management = _wan_globals(block)["comfy"].model_management
        modulation = model_management.cast_to(block.modulation, dtype=x.dtype, device=x.device)
        # ComfyUI 0.3.x hands [B, 6, C]; 0.4+ [B, T, 6, C] with T = 1 here (_one_modulation).
        e = (modulation + e).chunk(6, dim=1) if e.dim() == 3 else (modulation.unsqueeze(0) + e).unbind(2)
        x = x.contiguous()
        rows_ok = fp8_rows_refusal(x.device) is None
        _, h, rows = residual_layer_norm_modulate(x, e[0], e[1], block.norm1.eps,
                                                  fp8_rows=self._wants_rows("qkv", rows_ok))
        y = _self_attention(block.self_attn, h, freqs, transformer_options, rows, self._rows_read("qkv"))
        x, normed, rows = _gated_residual_norm3(block.norm3, x, y, e[2], self._wants_rows("cross_q", rows_ok))
        del y, h
        with rows_scope(normed, rows, self._rows_read("cross_q")):
            y = block.cross_attn(normed, context, context_img_len=context_img_len,
                                 transformer_options=transformer_options)
        del normed
        # x + cross-attention, then norm2 and its modulation, in one pass.
        x, h, rows = residual_layer_norm_modulate(x, e[3], e[4], block.norm2.eps, residual=y,
                                                  fp8_rows=self._wants_rows("ffn", rows_ok))
        with rows_scope(h, rows, self._rows_read("ffn")):
            y = block.ffn(h)
        return gated_residual(x, y, e[5])


def _one_modulation(e: torch.Tensor, x: torch.Tensor) -> bool:
    """e is one set of 6 modulation vectors per batch element: [B, 6, C] (ComfyUI 0.3.x) or
    [B, 1, 6, C] (0.4+, whose per-frame timesteps make that 1 the frame count), B 1 or x's."""
    shape = tuple(e.shape)
    if len(shape) == 4 and shape[1] == 1:
        shape = (shape[0], shape[2], shape[3])
    return len(shape) == 3 and shape[1] == 6 and shape[2] == x.shape[-1] and shape[0] in (1, x.shape[0])


def _bind(args, kwargs) -> dict:
    """WanAttentionBlock.forward's arguments by name (raises TypeError for any other call)."""
    call = bind_names(("x", "e", "freqs", "context", "context_img_len", "transformer_options"), 4, args, kwargs)
    call.setdefault("context_img_len", 257)
    call.setdefault("transformer_options", {})
    return call


def _wan_globals(block) -> dict:
    """The namespace ComfyUI's Wan module code runs in: what it calls optimized_attention and
    comfy.model_management, so ours calls the very same functions."""
    return type(block).forward.__globals__


def _norm_rope(norm, x: torch.Tensor, freqs: torch.Tensor, head_dim: int) -> torch.Tensor:
    weight, _, release = norm_params(norm, x)
    try:
        return rms_norm_rope(x, weight, freqs, norm.eps, head_dim)
    finally:
        if release is not None:
            release()


def _gated_residual_norm3(norm, x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, fp8_rows: bool = False):
    """(x + y * gate, norm3 of it, the norm's e4m3 rows or None) in one pass where norm3 is
    ComfyUI's LayerNorm over the channels (Wan's cross_attn_norm) or an Identity; any other norm
    runs as it is on the fused residual. Rows only where asked and the norm is fused."""
    if isinstance(norm, torch.nn.LayerNorm) and tuple(norm.normalized_shape) == (x.shape[-1],):
        weight, bias, release = norm_params(norm, x)
        try:
            if (weight is None) == (bias is None):
                if fp8_rows:
                    return gated_residual_layer_norm_rows(x, y, gate, norm.eps, weight, bias)
                return (*gated_residual_layer_norm(x, y, gate, norm.eps, weight, bias), None)
        finally:
            if release is not None:
                release()
    h = gated_residual(x, y, gate)
    return h, (h if isinstance(norm, torch.nn.Identity) else norm(h)), None


def _self_attention(attn, x: torch.Tensor, freqs: torch.Tensor, transformer_options: dict, rows=None,
                    note=None) -> torch.Tensor:
    """WanSelfAttention.forward with each of q and k normalised and rotated in one pass (calls
    with attn1 patches never get here). x is the fused LayerNorm's fresh output, read by the q,
    k and v Linears and written by nobody: our FP8 Linear quantises it once for the three, or
    reads `rows` (x's e4m3 rows from the norm kernel, then note(whether a GEMM did))."""
    b, s, n, d = *x.shape[:2], attn.num_heads, attn.head_dim
    with quantize_once(x, rows) as scope:
        q = _norm_rope(attn.norm_q, attn.q(x), freqs, d)
        k = _norm_rope(attn.norm_k, attn.k(x), freqs, d)
        v = attn.v(x)
    if rows is not None and note is not None:
        note(scope.used > 0)
    out = _wan_globals(attn)["optimized_attention"](q.view(b, s, n * d), k.view(b, s, n * d), v.view(b, s, n * d),
                                                     heads=n, transformer_options=transformer_options)
    return attn.o(out)


def fusable_block(block: torch.nn.Module) -> str | None:
    """Why `block` is not a Wan attention block this patch knows (None: it is)."""
    if not is_own_forward(block, "WanAttentionBlock"):
        return f"{type(block).__name__} is not ComfyUI's WanAttentionBlock"
    attn = getattr(block, "self_attn", None)
    if attn is None or not is_own_forward(attn, "WanSelfAttention"):
        return "self-attention is not ComfyUI's WanSelfAttention"
    for name in ("norm_q", "norm_k"):
        norm = getattr(attn, name, None)
        if not isinstance(norm, torch.nn.RMSNorm) or getattr(norm, "eps", None) is None \
                or tuple(norm.normalized_shape) != (block.dim,):
            return f"{name} is not an RMSNorm over {block.dim} channels with eps"
    for name in ("norm1", "norm2"):
        norm = getattr(block, name, None)
        if not isinstance(norm, torch.nn.LayerNorm) or norm.weight is not None \
                or tuple(norm.normalized_shape) != (block.dim,):
            return f"{name} is not a LayerNorm over {block.dim} channels without affine"
    if attn.head_dim % 2 or block.dim != attn.num_heads * attn.head_dim:
        return "heads do not tile the channels in even head dims"
    return None
