"""The diffusion model's Linear layers through kernels.linear (the Linear and Patch nodes).

How, and why this way:
- ComfyUI binds its Linear classes (comfy.ops.*.Linear) into the model when it loads it, and
  clones of a ModelPatcher share that one model. So nothing global is touched: on a clone,
  each layer's `forward` becomes an object patch ("diffusion_model.<name>.forward"), which
  ComfyUI installs when that clone is loaded and restores when it is unloaded. The input model
  and every other clone keep ComfyUI's Linear.
- A call is ours only when the layer's weight is a plain tensor on the input's device with no
  on-the-fly patch, or one ComfyUI's dynamic VRAM streams (below). Everything else (weights offloaded by low-VRAM / partial loading,
  weight_function / bias_function (LoRA applied per call in low-VRAM mode), ComfyUI's own
  QuantizedTensor layers, unsupported dtypes, too few tokens, skip patterns) goes to the
  layer's original forward, counted per reason in call_stats (kind "linear").
- Weights are quantised once per weight version, on the device that runs them, all layers of
  the model together on its first call there (one progress bar, one log line). The version key
  is (id(param), data_ptr, _version, device, dtype) plus the patches_uuid of the weight
  patches ComfyUI loaded last: LoRA merged by replacing the Parameter changes id/data_ptr, but
  an in-place merge goes through `param.data.copy_`, which bumps no version counter.
- FP8 checkpoint weights (float8_e4m3fn, with `scale_weight` when scaled) go to the kernels
  as they are.
- ComfyUI 0.29+'s dynamic VRAM (weights streamed per call from a virtual VRAM buffer): the
  call takes its weight from ComfyUI's own cast, LoRA and weight functions applied there, and
  keeps nothing (section "dynamic VRAM" below; the `dynamic_vram` input chooses per model).
- Quality guard: the first call of each layer on each weight version runs both ways and
  compares; NaN/Inf or a rel. L2 above GUARD_MAX_REL_L2 sends that layer back to ComfyUI's
  Linear for good (per device), shown by the Settings node and the stats route.
- Prepared weights are freed when the clone is unpatched (ComfyUI's ON_DETACH callback with
  unpatch_all) or garbage-collected (weakref.finalize on the clone).
- Fused activations: a Linear whose output feeds nn.GELU(approximate="tanh") alone (an
  nn.Sequential MLP: Flux's double blocks, Wan's FFN) gets the GELU in its GEMM epilogue,
  saving a pass over the output. Flux's single blocks (GELU on the MLP columns of linear1,
  then torch.cat) get it too (patch_linear_model(copy_activations=True), the default), where
  the kernel also writes those columns to a contiguous copy (fusable_with_copy(): the cat keeps
  its vectorised kernel); on the H200 that took a Flux step from 119.6 to 115.4 ms in one
  alternating run (benchmarks/RESULTS.md).
  Our kernel marks the output it activated (ActivationMark on its storage, which its views share,
  under torch.inference_mode too, with the copy); the GELU module's forward becomes an object patch
  (FusedActivation) that passes a marked tensor through (the copy, when it asks for exactly
  the copied columns) and runs the GELU on anything else. So every call ComfyUI's Linear (or
  an extension) serves is activated exactly once, as before, and only ours is fused.
- torch.compile (ComfyUI's TorchCompileModel): a traced call becomes one opaque op,
  triton_accel::patched_linear(x, layer token), whose run time takes the eager path above
  (checks, preparation, guard, hand-back, extensions) with the activation left unfused (the
  traced GELU module runs it). Tracing the eager path instead baked its first answer into the
  graph (weights are prepared on a first call, so every layer was handed back for good) and
  broke the graph at its locks and exceptions. A name-skipped layer, a call with other
  arguments, a call autograd records and a call with a static token count under min_tokens
  (no Linear extension registered or forced) are traced as ComfyUI's own Linear: inductor
  compiles those as it would unpatched, and the stats do not count them.
- Other packs' Linear (kernels/core/extensions.py register_linear): forced by the Settings node's
  `linear` "ext:<name>", or in auto walked by priority with ours where auto runs ours
  (extension_plan). They get the weight in the input's dtype (ComfyUI's cast under dynamic
  VRAM), the same first-call guard (EXT_GUARD_MAX_REL_L2), and every call they refuse or fail on
  goes to ComfyUI's Linear with the reason counted.
"""
from __future__ import annotations

import logging
import sys
import weakref

import torch

from . import call_stats, step_graph
from .fused_activations import install_fused_activations
from .linear_common import (CALLBACK_KEY, DYNAMIC_VRAM_AUTO, DYNAMIC_VRAM_FP8_WEIGHTS, DYNAMIC_VRAM_OFF, MIN_TOKENS,
                            SKIP_AUTO, LinearBackend, SkipPatterns, is_linear_module)
from .dynamic_vram import ComfyWeightCast
from .linear_layer import LinearLayer
from .linear_state import LinearPatchState, extension_plan_text
from .settings import AccelSettings, default_device

log = logging.getLogger("triton_accel")


# ---- patching a ModelPatcher ----------------------------------------------------------------

def _interrupt_check():
    management = sys.modules.get("comfy.model_management")
    return getattr(management, "throw_exception_if_processing_interrupted", None)


def patch_linear_model(model, settings: AccelSettings | None = None, skip: str = SKIP_AUTO,
                       min_tokens: int = MIN_TOKENS, backend: LinearBackend | None = None,
                       label: str | None = None, dynamic_vram: str = DYNAMIC_VRAM_AUTO,
                       weight_cast: ComfyWeightCast | None = None, fuse_activations: bool = True,
                       copy_activations: bool = True):
    """patch_linear_layers, then the step's CUDA graphs (step_graph.install) on the clone: what
    the Linear patch node installs, in one call (tests, benchmarks). Same arguments."""
    patched = patch_linear_layers(model, settings, skip, min_tokens, backend, label, dynamic_vram, weight_cast,
                                  fuse_activations, copy_activations)
    state = patched.triton_accel_linear
    step_graph.install(patched, state.label, state)
    return patched


def patch_linear_layers(model, settings: AccelSettings | None = None, skip: str = SKIP_AUTO,
                        min_tokens: int = MIN_TOKENS, backend: LinearBackend | None = None,
                        label: str | None = None, dynamic_vram: str = DYNAMIC_VRAM_AUTO,
                        weight_cast: ComfyWeightCast | None = None, fuse_activations: bool = True,
                        copy_activations: bool = True):
    """A clone of `model` (a ComfyUI ModelPatcher) whose diffusion model's Linear layers go
    through kernels.linear (no step graphs: step_graph.install adds them). `label`: call_stats'
    name for the clone (a new one when None);
    `dynamic_vram`: one of DYNAMIC_VRAM_MODES (what calls whose weights ComfyUI streams get);
    `fuse_activations`: GELUs fed by a served Linear run in its GEMM epilogue (FusedActivation);
    `copy_activations`: Flux's single blocks too, with the contiguous copy (fusable_with_copy()).
    On by default: 4.2 ms off a 119.6 ms Flux step on the H200, measured in one ABBA run
    (benchmarks/RESULTS.md); peak memory +0.2 GiB.
    Raises ValueError for a skip pattern that does not parse or an unknown dynamic_vram."""
    settings = settings or AccelSettings("auto")
    patterns = SkipPatterns.parse(skip)
    patched = model.clone()
    label = label or call_stats.model_label(model)
    state = LinearPatchState(settings, patterns, min_tokens, backend, label, dynamic_vram, weight_cast)
    state.interrupt_check = _interrupt_check()
    state.weights_token = getattr(patched, "patches_uuid", None)
    diffusion_model = patched.model.diffusion_model
    for name, module in diffusion_model.named_modules():
        if not name or not is_linear_module(module):
            continue
        key = f"diffusion_model.{name}.forward"
        previous = patched.get_model_object(key)
        while isinstance(previous, LinearLayer):  # re-patching one of our clones: wrap ComfyUI's forward
            previous = previous.previous
        layer = LinearLayer(state, name, module, previous)
        state.layers.append(layer)
        patched.add_object_patch(key, layer)
    if fuse_activations:
        install_fused_activations(patched, state, copy_activations)
    _add_callbacks(patched, state)
    weakref.finalize(patched, state.release)
    patched.triton_accel_linear = state  # for the node's text and tests; clones do not copy it
    skipped = sum(1 for layer in state.layers if layer.skip_reason)
    log.info("Triton Accel Linear (%s): %d Linear layers patched (%d skipped by name, fewer than %d tokens "
             "go to ComfyUI's Linear); %d GELU activations fused into their GEMM", label, len(state.layers), skipped,
             state.min_tokens, state.fused_activations)
    return patched


def _add_callbacks(patched, state: LinearPatchState) -> None:
    add = getattr(patched, "add_callback_with_key", None)
    if add is None:
        return
    try:
        from comfy.patcher_extension import CallbacksMP

        on_load, on_detach = CallbacksMP.ON_LOAD, CallbacksMP.ON_DETACH
        # ComfyUI before 0.29 has no MultiGPU work units: the names below are then never called.
        multigpu = (getattr(CallbacksMP, "ON_DEEPCLONE_MULTIGPU", "on_deepclone_multigpu"),
                    getattr(CallbacksMP, "ON_MATCH_MULTIGPU_CLONES", "on_match_multigpu_clones"))
    except ImportError:  # outside ComfyUI (tests): the same names ComfyUI uses
        on_load, on_detach = "on_load_after", "on_detach_after"
        multigpu = ("on_deepclone_multigpu", "on_match_multigpu_clones")
    add(on_load, CALLBACK_KEY, state.on_load)
    add(on_detach, CALLBACK_KEY, state.on_detach)
    for call_type in multigpu:
        add(call_type, CALLBACK_KEY, state.on_multigpu_clone)


# ---- the nodes ------------------------------------------------------------------------------

def patched_linear_text(patched, settings: AccelSettings) -> str:
    """What the Linear patch node shows: layers patched / skipped and the method for the model's
    device. Never raises: a patch node must patch."""
    state = patched.triton_accel_linear
    skipped = sum(1 for layer in state.layers if layer.skip_reason)
    text = (f"{state.label}: {len(state.layers)} Linear layers patched, {skipped} of them skipped by name; "
            f"calls under {state.min_tokens} tokens go to ComfyUI's Linear")
    if state.fused_activations:
        text += (f"; {state.fused_activations} GELU activations run in our GEMM's epilogue (ComfyUI's GELU "
                 "still runs on every call ComfyUI's Linear serves")
        if state.copied_activations:
            text += (f"; {state.copied_activations} of them, whose output is concatenated, only where FP8 W8A8 "
                     "runs them")
        text += ")"
    if _dynamic_vram_enabled():
        text += f"\nComfyUI's dynamic VRAM is on: {DYNAMIC_VRAM_TEXT[state.dynamic_vram]}"
    device = getattr(patched, "load_device", None)
    try:
        device = torch.device(device) if device is not None else default_device()
        text = f"{text}\nLinear on {device}: {settings.linear_decision_for(device).reason}"
        plan = extension_plan_text(settings, device)
        return f"{text}\n{plan}" if plan else text
    except Exception as e:
        log.warning("Triton Accel: could not probe device %r for %s: %s: %s", device, state.label,
                    type(e).__name__, e)
        return f"{text}\nLinear: could not probe device {str(device)!r}; each call is decided when it arrives"


def dynamic_vram_line(state) -> str:
    """What streamed layers get, for the node, while ComfyUI's dynamic VRAM is on; "" otherwise."""
    if state is None or not _dynamic_vram_enabled():
        return ""
    return f"ComfyUI's dynamic VRAM is on: {DYNAMIC_VRAM_TEXT.get(state.dynamic_vram, state.dynamic_vram)}"


def _dynamic_vram_enabled() -> bool:
    """ComfyUI runs with dynamic VRAM (comfy-aimdo): what its main.py sets once aimdo is up."""
    return bool(getattr(sys.modules.get("comfy.memory_management"), "aimdo_enabled", False))


DYNAMIC_VRAM_TEXT = {
    DYNAMIC_VRAM_AUTO: "streamed FP8 weights are used as they are, 16/32-bit ones quantised to FP8 per call",
    DYNAMIC_VRAM_FP8_WEIGHTS: "streamed FP8 weights are used as they are, 16/32-bit ones go to ComfyUI's Linear",
    DYNAMIC_VRAM_OFF: "layers with streamed weights go to ComfyUI's Linear (dynamic_vram off)",
}
