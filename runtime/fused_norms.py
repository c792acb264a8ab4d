"""Fused norms: the elementwise work around attention and the MLP in one pass each, through
kernels/fused/layer_norm_modulate.py, kernels/fused/norm_rope.py, kernels/fused/gated_residual_norm.py (Wan's
attention blocks) and kernels/fused/qk_norm.py (the QKNorm of every model built from
comfy/ldm/flux/layers.py: Flux, Chroma, HunyuanVideo...: q and k normalised per head in one
launch, read through the permuted views ComfyUI hands it, instead of a copy and an RMSNorm
each).

What it replaces, per WanAttentionBlock call (comfy/ldm/wan/model.py), everything else staying
ComfyUI's own modules (Linear layers, attention, cross-attention, FFN, so our Linear and
attention patches still serve those calls):
- norm1(x) then addcmul(e[0], ., 1 + e[1]): one layer_norm_modulate pass;
- in the self-attention, norm_q(q(x)) then apply_rope1 (and the same for k): one
  rms_norm_rope pass each, instead of torch's RMSNorm plus comfy-kitchen's RoPE; the q, k and
  v Linears inside linear_fp8.quantize_once, so our FP8 Linear quantises their input once;
- addcmul(x, y, e[2]) then norm3 (the cross-attention's LayerNorm): one gated_residual_layer_norm
  pass, instead of torch's broadcasting addcmul (its non-vectorised kernel) and LayerNorm;
- x + cross_attn(...) then norm2 and addcmul(e[3], ., 1 + e[4]): one pass (the residual input
  of residual_layer_norm_modulate), and the block's last addcmul(x, y, e[5]) as gated_residual;
- on sm_89+, the norm1, norm3 and norm2 passes also write their output as the FP8 Linear's
  e4m3 rows (bit for bit its own quantisation), handed to the Linears that read it (q/k/v,
  the cross-attention's q, the FFN's first Linear) through quantize_once(x, rows): those skip
  their quantisation pass. A site whose Linear never reads them (not our FP8 Linear) stops
  getting them after FP8_ROWS_MISSES calls.
Measured at Wan 2.1 14B on an H100 (benchmarks/RESULTS.md): the fused passes
take 0.24 (LayerNorm + modulation) and 0.29 (RMSNorm + RoPE) ms against ComfyUI's 0.76 and 0.81
(benchmarks/fused_norms_bench.py); the Wan step without any of this is 1997 ms against 1892-1895
with it (same call), and the e4m3 rows with the residual + norm2 pass took the
activation quantisation from 50.4 to 30.6 ms a step and the residual add's 13.1 ms away.
Flux's QKNorms are fused too (10-11 ms less GPU time a Flux 1024² step);
TRITON_ACCEL_FUSED_NORMS=blocks keeps them ComfyUI's (docs/settings.md).

Flux's DoubleStreamBlock / SingleStreamBlock (comfy/ldm/flux/layers.py: Flux, HunyuanVideo),
with TRITON_ACCEL_FUSED_NORMS=all (the default; =qk keeps them ComfyUI's), per stream:
- norm1(x) then apply_mod's addcmul(shift, ., 1 + scale): one layer_norm_modulate pass, with
  the e4m3 rows of the qkv Linear (linear1 in the single block);
- `x += proj(attn) * gate1`, then norm2 and its modulation: one residual_layer_norm_modulate
  pass with a gate, the product rounded before the add as ComfyUI's two ops round it, with the
  rows of the MLP's first Linear;
- `x += mlp(.) * gate2` (the single block's `x += linear2(.) * gate`): one gated_residual pass.
The blocks return new tensors where ComfyUI's add into their inputs (their callers use the
returned ones); the checked first call runs ours before ComfyUI's forward for that reason. No
rows for a stream the Linear hands back for its token count (the 512-token text stream).
Measured on an H100: 96.8 ms of kernels a Flux step against 104.5, 456 fewer
launches. Refused per call (ComfyUI's forward): per-token modulation (modulation_dims), attn1
patches, flipped_img_txt blocks.

How, and why this way:
- Each block's `forward` becomes an object patch on the patched clone (as the Linear patch
  does for each Linear), installed when ComfyUI loads that clone and removed when it unloads
  it. Only blocks whose class is ComfyUI's WanAttentionBlock with its own forward and a
  WanSelfAttention with RMSNorm q/k norms are patched; subclasses (VACE, S2V...) keep theirs.
- A call goes to the block's original forward when anything is unusual: torch.compile tracing
  (inductor fuses these ops itself), per-frame modulation (Wan 2.2 TI2V's timesteps), modulation in
  another dtype than x (ComfyUI would then promote the block's output), attn1/attn2 patches
  of other nodes, rope freqs of another layout, a device the kernels cannot run on. Counted
  per reason in call_stats (kind "norms").
- Quality guard: the first call of each block on each device runs the original forward too
  and compares; a rel. L2 above GUARD_MAX_REL_L2 or a NaN/Inf sends that block to ComfyUI's
  forward for good. The kernels round where ComfyUI's ops round, so the two agree to a bf16
  rounding (bit for bit under the interpreter at the tests' shapes).
"""
from __future__ import annotations

import logging
import types

import torch

from ..kernels.core import env_settings
from .fused_block_patch import CALLBACK_KEY, Guard
from .fused_wan import FusedWanBlock, fusable_block
from .fused_flux import (FusedFluxBlock, FusedFluxDoubleBlock, FusedFluxSingleBlock, FusedQKNorm, fusable_flux_block,
                         fusable_qk_norm)

log = logging.getLogger("triton_accel.nodes.patch_fused_norms")  # not __name__: the clone's folder name


def enabled() -> bool:
    return env_settings.fused_norms() != "off"


def patch_fused_norms(patched, label: str) -> int:
    """Put the fused-norm object patches (Wan blocks, Flux-layer QKNorms and blocks, by
    TRITON_ACCEL_FUSED_NORMS) on every fusable module of `patched` (a ModelPatcher clone,
    changed in place); returns how many. Modules already patched are left as they are."""
    diffusion_model = getattr(getattr(patched, "model", None), "diffusion_model", None)
    if not isinstance(diffusion_model, torch.nn.Module):
        return 0
    mode = env_settings.fused_norms()
    # Flux's QKNorms unless TRITON_ACCEL_FUSED_NORMS=blocks: 10-11 ms less GPU time in a Flux
    # 1024² step (profiles on an H100: 105.0 / 106.6 against 116.2 / 116.5 ms).
    count = _patch_qk_norms(patched, diffusion_model, label) if mode in ("all", "qk") else 0
    if mode == "all":
        count += _patch_blocks(patched, diffusion_model, "double_blocks", FusedFluxDoubleBlock, fusable_flux_block,
                               label)
        count += _patch_blocks(patched, diffusion_model, "single_blocks", FusedFluxSingleBlock, fusable_flux_block,
                               label)
    count += _patch_blocks(patched, diffusion_model, "blocks", FusedWanBlock, fusable_block, label)
    if count:
        _add_multigpu_callbacks(patched)
        log.info("Triton Accel fused norms (%s): %d blocks / QKNorms patched", label, count)
    return count


def _patch_blocks(patched, diffusion_model: torch.nn.Module, attr: str, cls, fusable, label: str) -> int:
    """Object patches of class `cls` on the blocks of diffusion_model.<attr> that `fusable`
    accepts, one Guard for them all; how many were added."""
    count = 0
    blocks = getattr(diffusion_model, attr, None)
    guard = Guard()
    for i, block in enumerate(blocks if isinstance(blocks, torch.nn.ModuleList) else ()):
        if fusable(block) is not None:
            continue
        key = f"diffusion_model.{attr}.{i}.forward"
        previous = patched.get_model_object(key)
        if not (isinstance(previous, types.MethodType) and previous.__self__ is block):
            continue  # ours already, or another node's patch: left alone
        patched.add_object_patch(key, cls(label, f"{attr}.{i}", block, previous, guard))
        count += 1
    return count


def _patch_qk_norms(patched, diffusion_model: torch.nn.Module, label: str) -> int:
    count = 0
    guard = Guard()
    for name, module in diffusion_model.named_modules():
        if not name or fusable_qk_norm(module) is not None:
            continue
        key = f"diffusion_model.{name}.forward"
        previous = patched.get_model_object(key)
        if not (isinstance(previous, types.MethodType) and previous.__self__ is module):
            continue  # ours already, or another node's patch: left alone
        patched.add_object_patch(key, FusedQKNorm(label, name, module, previous, guard))
        count += 1
    return count


def _add_multigpu_callbacks(patched) -> None:
    add = getattr(patched, "add_callback_with_key", None)
    if add is None:
        return
    try:
        from comfy.patcher_extension import CallbacksMP

        names = (getattr(CallbacksMP, "ON_DEEPCLONE_MULTIGPU", "on_deepclone_multigpu"),
                 getattr(CallbacksMP, "ON_MATCH_MULTIGPU_CLONES", "on_match_multigpu_clones"))
    except ImportError:  # outside ComfyUI (tests): the names ComfyUI uses
        names = ("on_deepclone_multigpu", "on_match_multigpu_clones")
    for name in names:
        if CALLBACK_KEY not in getattr(patched, "callbacks", {}).get(name, {}):
            add(name, CALLBACK_KEY, on_multigpu_clone)


def on_multigpu_clone(source, clone) -> None:
    """ComfyUI's MultiGPU clone callbacks: the clone carries its own copy of the model on
    another GPU, but copies of `source`'s object patches, which wrap `source`'s blocks. Point
    each at the clone's own block (and its own forward), with a guard of its own."""
    diffusion_model = getattr(getattr(clone, "model", None), "diffusion_model", None)
    for key, value in list(clone.object_patches.items()):
        if not isinstance(value, (FusedWanBlock, FusedQKNorm, FusedFluxBlock)):
            continue
        try:
            module = diffusion_model.get_submodule(value.name)
        except AttributeError:
            module = None
        if module is value.module:
            continue
        fusable = (fusable_block if isinstance(value, FusedWanBlock)
                   else fusable_flux_block if isinstance(value, FusedFluxBlock) else fusable_qk_norm)
        if module is None or fusable(module) is not None:
            del clone.object_patches[key]
            continue
        clone.object_patches[key] = type(value)(value.label, value.name, module,
                                                types.MethodType(type(module).forward, module), value.guard)
