"""Dynamic VRAM (ComfyUI 0.29+): Linear calls whose weight ComfyUI streams per call, served
from ComfyUI's own cast and keeping nothing between calls."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..kernels.core.gpu_rules import LINEAR_FP8_W8A8, LINEAR_FP8_WEIGHT_ONLY
from . import call_stats, linear_choice
from .guards import guard_failure
from .linear_common import (DYNAMIC_VRAM_FP8_WEIGHTS, DYNAMIC_VRAM_OFF, GUARD_MAX_REL_L2, KIND, MISSING,
                            REASON_DYNAMIC_VRAM_OFF, REASON_GUARD, REASON_KERNEL_ERROR,
                            REASON_STREAMED_PER_CALL_OFF, HandBack, module_attr)
from .settings import device_key

if TYPE_CHECKING:
    from .linear_layer import LinearLayer


# ---- dynamic VRAM: weights ComfyUI streams per call ------------------------------------------
#
# ComfyUI 0.29+ with comfy-aimdo (its default on NVIDIA) keeps a layer's parameters on the CPU
# and hands each call its weight through comfy.ops.cast_bias_weight: a view of the layer's slot
# in a virtual VRAM buffer (VBAR, `module._v`), resident while VRAM allows, else a transient cast
# buffer. LoRA is applied there (weight_lowvram_function, then written back into the VBAR:
# update_weight) and so are the weight_function / bias_function lists (post_cast). So a
# streamed call takes its weight from that cast exactly as ComfyUI's Linear does
# (offloadable=True, and uncast_bias_weight after the kernel, which unpins the VBAR slot and
# makes the offload stream wait for the kernel), and keeps nothing between calls:
# - float8_e4m3fn weights are asked for in their stored dtype: the VBAR view feeds the FP8 GEMM
#   with no upcast and no copy. With a LoRA the cast that applies it (the first after a load,
#   or every one when the VBAR has no room) returns the patched weight in the input's dtype, as
#   ComfyUI's own Linear gets it (want_requant off: its requantisation is stochastic, per
#   tensor), and writes the rounded FP8 copy into the VBAR for the calls after; that call is
#   quantised per channel like a 16-bit weight. A `scale_weight` (scaled FP8) is applied either way;
# - 16/32-bit weights come in the input's dtype and are quantised per call into a transient
#   buffer: one layer's FP8 weight of memory, and about 3 bytes of traffic per weight element
#   against the GEMM's 2 x rows flops per element; on the H200 (4 TB/s; FP8 ~1100 against BF16
#   ~690 TFLOP/s) that is paid back from about 700 rows, below min_tokens' 1024.
# The quality guard runs on the first call of each weight version (LoRA: patches_uuid), with
# ComfyUI's forward (its own cast and uncast) as the reference, run after ours has uncast: one
# layer is never cast twice at once.

class ComfyWeightCast:
    """The ComfyUI calls of a streamed layer (a seam: tests hand LinearPatchState a fake)."""

    def streams(self, module, x) -> bool:
        """ComfyUI streams this layer's weight for this call (cast_bias_weight's VBAR branch:
        a VBAR slot, a CUDA input and the parameters elsewhere)."""
        if (module_attr(module, "_v", MISSING) is MISSING or not isinstance(x, torch.Tensor)
                or x.device.type != "cuda"):
            return False
        weight = getattr(module, "weight", None)
        return isinstance(weight, torch.Tensor) and weight.device != x.device

    def cast(self, module, x: torch.Tensor, weight_dtype: torch.dtype):
        """(weight in weight_dtype, bias in x's dtype, handle for uncast), on x's device."""
        import comfy.ops

        if weight_dtype == x.dtype:  # exactly ComfyUI's Linear.forward_comfy_cast_weights
            return comfy.ops.cast_bias_weight(module, x, offloadable=True)
        # A LoRA is applied in x's dtype, as for ComfyUI's Linear, and the weight written back
        # into the VBAR is the one ComfyUI's Linear would write (same rounding, same seed).
        return comfy.ops.cast_bias_weight(module, x, dtype=weight_dtype, device=x.device, bias_dtype=x.dtype,
                                          offloadable=True, compute_dtype=x.dtype)

    def uncast(self, module, weight, bias, handle) -> None:
        import comfy.ops

        comfy.ops.uncast_bias_weight(module, weight, bias, handle)


@dataclass
class StreamedEntry:
    key: tuple  # (method, weights_token, stored weight dtype): a new key runs the guard again
    guarded: bool = False
    refusal: str | None = None  # the kernels cannot take this weight (its shape): ComfyUI serves it


FP8_METHODS = (LINEAR_FP8_W8A8, LINEAR_FP8_WEIGHT_ONLY)


def streamed_plan(layer: LinearLayer, x: torch.Tensor) -> tuple[str, torch.dtype, StreamedEntry]:
    """(method, dtype to ask ComfyUI's cast for, guard entry), or HandBack: every check that
    needs no cast."""
    state = layer.state
    if state.dynamic_vram == DYNAMIC_VRAM_OFF:
        raise HandBack(REASON_DYNAMIC_VRAM_OFF)
    weight = module_attr(layer.module, "weight")
    layer.check_call(x, state.min_tokens, streamed=True, weight=weight)
    stored_fp8 = weight.dtype == torch.float8_e4m3fn
    if not stored_fp8 and state.dynamic_vram == DYNAMIC_VRAM_FP8_WEIGHTS:
        raise HandBack(REASON_STREAMED_PER_CALL_OFF)
    method = state.method_for(x.device, weight)
    refusal = state.refusal(method, x.device, x.dtype)
    if refusal:
        raise HandBack(refusal)
    key = (method, state.weights_token, weight.dtype)
    where = device_key(x.device)
    entry = layer.streamed.get(where)
    if entry is None or entry.key != key:
        with state._lock:
            entry = layer.streamed.get(where)
            if entry is None or entry.key != key:
                entry = layer.streamed[where] = StreamedEntry(key)
    if entry.refusal:
        raise HandBack(entry.refusal)
    return method, weight.dtype if stored_fp8 and method in FP8_METHODS else x.dtype, entry


def with_stored_scale(module, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, scale for the kernels): a scaled-FP8 layer's `scale_weight` goes with an e4m3
    weight as it is, and is applied, as ComfyUI's scaled layers apply it, to one the cast
    returned in a float dtype (in stored units: upcast, or LoRA'd)."""
    scale = getattr(module, "scale_weight", None) if module.weight.dtype == torch.float8_e4m3fn else None
    if scale is None:
        return weight, None
    scale = scale.detach().to(weight.device)
    if weight.dtype == torch.float8_e4m3fn:
        return weight, scale
    per_channel = scale.numel() > 1
    return weight * (scale.reshape(-1, 1) if per_channel else scale.reshape(())).to(weight.dtype), None


def run_streamed(layer: LinearLayer, x: torch.Tensor, method: str, weight_dtype, entry: StreamedEntry):
    """Our kernel on the weight ComfyUI's cast hands over (None when the kernels refuse that
    weight: entry.refusal says why). The cast is undone whatever happens."""
    state, module = layer.state, layer.module
    weight, bias, handle = state.weight_cast.cast(module, x, weight_dtype)
    try:
        # uncast gets the cast's own tensors back, not the scaled copy the kernels take.
        scaled, scale = with_stored_scale(module, weight.detach())
        prepare = state.backend.prepare_per_call or state.backend.prepare
        try:
            prepared = prepare(scaled.detach(), method, scale)
        except state.backend.input_error as e:
            entry.refusal = str(getattr(e, "reason", e))
            return None
        return layer.run_kernel(x, prepared, bias)
    finally:
        state.weight_cast.uncast(module, weight, bias, handle)


def streamed_call(layer: LinearLayer, x: torch.Tensor):
    """One call of a layer whose weight ComfyUI's dynamic VRAM streams."""
    try:
        method, weight_dtype, entry = streamed_plan(layer, x)
    except HandBack as e:
        return layer.handed_back((x,), {}, str(e))
    return streamed_run(layer, x, method, weight_dtype, entry)


def streamed_run(layer: LinearLayer, x: torch.Tensor, method: str, weight_dtype, entry: StreamedEntry):
    """Our kernel on a streamed call streamed_plan accepted, guarded on its weight version's first call."""
    state = layer.state
    # A guarded call may run ours twice: the first cast of a layer with a LoRA can write a
    # rounded copy of the patched weight back into the VBAR (update_weight: stochastic rounding
    # of an FP8 weight, ~5 % per element), which the reference then reads; ours runs again on
    # that weight before a disagreement is held against the kernel.
    reference = failure = None
    for _ in range(1 if entry.guarded else 2):
        try:
            out = run_streamed(layer, x, method, weight_dtype, entry)
        except Exception as e:  # any kernel failure: ComfyUI's Linear serves the layer from now on
            state.fall_back(layer, x.device, f"kernel error: {type(e).__name__}: {e}")
            return streamed_hand_back(layer, x, reference, REASON_KERNEL_ERROR)
        if out is None:
            return streamed_hand_back(layer, x, reference, entry.refusal)
        if entry.guarded:
            break
        reference = layer.previous(x) if reference is None else reference
        failure = guard_failure(out, layer.activated_reference(reference, method), GUARD_MAX_REL_L2[method])
        if failure is None:
            entry.guarded = True
            break
    else:
        entry.guarded = True
        state.fall_back(layer, x.device, f"quality guard ({method}): {failure}")
        return streamed_hand_back(layer, x, reference, REASON_GUARD)
    call_stats.record(call_stats.OUTCOME_SERVED, path=f"{method} (dynamic VRAM)", kind=KIND, model=state.label)
    if linear_choice.verdict_key(x) not in layer.verdicts:
        linear_choice.after_served(layer, x, True, method)
    return out


def streamed_hand_back(layer: LinearLayer, x: torch.Tensor, reference, reason: str):
    """ComfyUI's output for this call: the guard's reference when it ran, else its forward."""
    if reference is None:
        return layer._original((x,), {}, reason)
    call_stats.record(call_stats.OUTCOME_HANDED_BACK, reason, kind=KIND, model=layer.state.label)
    return reference
