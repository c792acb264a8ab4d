"""auto's choice per Linear layer: ours where it measured faster on the call's real path,
ComfyUI's own forward everywhere else, with no call of ours left in between.

A layer's first served call of each call class (input shape and dtype, the step's mode) is
timed ours against ComfyUI's (call_timing: the whole call as the step issues it, the dynamic-
VRAM cast and the fused GELU included on both sides). The answer is per class and shared by
every layer of that class (LinearSpeedChoice). A class where ComfyUI's Linear is as fast, or
where our rules can never serve it (too few tokens, a name skip pattern, ComfyUI's quantized
layers), is handed back for good: the layer's module gets its own forward back in place of
our object patch (and its GELU module, where ours fused one), so those calls run exactly
ComfyUI's code. A new step signature (another resolution, batch or mode) puts the handed-back
layers' patches back once, so their new classes are decided in turn; ComfyUI reloading the
model re-applies them too, and the first call puts ComfyUI's forward back at once.

Where nothing is timed (forced modes, CPUs, other packs' Linear in the plan, timing turned
off, inside a CUDA graph capture) every call goes through the layer as before.
"""
from __future__ import annotations

import contextvars
import logging
import threading
from collections import Counter

import torch

from .. import __version__ as PACK_VERSION
from . import call_stats, call_timing, compiled_ops
from .device_probe import probe

log = logging.getLogger("triton_accel")

# Set while a class is being timed: the timed repeats of a call must not start a timing of their own.
_MEASURING: contextvars.ContextVar[bool] = contextvars.ContextVar("triton_accel_linear_measuring", default=False)

WHY_MEASURED = "auto measured ComfyUI's Linear as fast or faster at this call class"

_models_lock = threading.Lock()
# label -> Counter of what auto did with that model's layers ("ours", "measured", reason...)
_model_choices: dict[str, Counter] = {}


def verdict_key(x: torch.Tensor) -> tuple:
    return (x.shape, x.dtype, call_timing.STEP_MODE.get())


def timing_applies(state, x: torch.Tensor) -> bool:
    """Whether auto decides this layer's calls by measurement here."""
    return (state.settings.linear_mode == "auto" and not _MEASURING.get() and state.speed.supports(x.device)
            and call_timing.timing_enabled() and not compiled_ops.STEP_CAPTURE
            and not compiled_ops.capturing(x) and state.extension_plan(x.device, state_weight(state, x)) is None)


def state_weight(state, x):
    """Any Linear weight of the model: extension_plan only reads its dtype's FP8-ness, and a
    model's weights share one kind."""
    return state.layers[0].module.weight if state.layers else x


def _note(label: str | None, what: str) -> None:
    if label is None:
        return
    with _models_lock:
        _model_choices.setdefault(label, Counter())[what] += 1


def after_served(layer, x: torch.Tensor, streamed: bool, method: str) -> None:
    """Called after our kernel served a call of a class not decided yet for this layer: time
    the class (once, for every layer of it) and keep or hand back this layer."""
    state = layer.state
    if not timing_applies(state, x):
        return
    key = verdict_key(x)
    entry = measure(layer, x, streamed, method)
    if entry is None:
        return
    layer.verdicts[key] = entry["ours"]
    _note(state.label, "ours" if entry["ours"] else "measured")
    if entry["ours"]:
        layer.won.add(key)  # the layer keeps its patch for good: one of its classes is ours
    else:
        hand_back(layer)


def settle(layer, x: torch.Tensor, reason: str) -> None:
    """A call our rules refuse for a reason that holds for its whole class (too few tokens, a
    skip pattern, ComfyUI's quantized layer): the class is ComfyUI's, and so the layer where
    it serves no other class."""
    if not isinstance(x, torch.Tensor) or not timing_applies(layer.state, x):
        return
    key = verdict_key(x)
    if key in layer.verdicts:
        return
    layer.verdicts[key] = False
    _note(layer.state.label, reason)
    hand_back(layer)


def hand_back(layer) -> None:
    """ComfyUI's forward in place of our patch, unless the layer serves another class of this step."""
    if layer.won:
        return
    with layer.state._lock:
        if put_back(layer):
            layer.uninstalled = True


def put_back(layer) -> bool:
    """The module's own forward (and its companions') in our patch's place; False where another
    node patched over ours (its forward stays as it is). Under the state's lock."""
    module = layer.module
    if module.__dict__.get("forward") is not layer:
        return False
    module.__dict__["forward"] = layer.previous
    for companion, patch in layer.companions:
        if companion.__dict__.get("forward") is patch:
            companion.__dict__["forward"] = patch.previous
    layer.state.changes += 1  # a step graph recorded with our patch in place is stale
    return True


def reinstall(layer) -> None:
    """Our patch back on a handed-back layer (a new step signature: its new classes get decided)."""
    module = layer.module
    if module.__dict__.get("forward") is layer.previous:
        module.__dict__["forward"] = layer
        for companion, patch in layer.companions:
            if companion.__dict__.get("forward") is patch.previous:
                companion.__dict__["forward"] = patch
    layer.uninstalled = layer.forced_out = False


def new_step(state) -> None:
    """A step with a new signature: every handed-back layer gets its patch back for one call
    (a class it already decided goes straight back to ComfyUI's forward)."""
    with state._lock:
        state.forced = False
        for layer in state.layers:
            if layer.uninstalled or layer.forced_out:
                reinstall(layer)
        state.changes += 1


def force_comfyui(state, on: bool) -> None:
    """The step check's ComfyUI configuration (on): every layer of the model on its own forward,
    whatever its classes measured; off: the layers it moved get our patch back."""
    if state.forced == on:
        return
    with state._lock:
        state.forced = on
        for layer in state.layers:
            if on:
                if put_back(layer):
                    layer.forced_out = True
            elif layer.forced_out:
                reinstall(layer)
        state.changes += 1


def class_parts(layer, x: torch.Tensor, streamed: bool, method: str) -> tuple:
    """What decides a call's speed, ours against ComfyUI's: the step's mode, where the weight
    comes from, dtypes, the GEMM's shape, bias, the fused activation, our method, versions."""
    module = layer.module
    weight = module.weight
    k = x.shape[-1]
    rows = x.numel() // max(k, 1)
    scaled = getattr(module, "scale_weight", None) is not None and weight.dtype == torch.float8_e4m3fn
    activation = f"{layer.activation[0]}@{layer.activation[1]}{'+copy' if layer.activation_copy else ''}" \
        if layer.activation is not None else "none"
    return (call_timing.STEP_MODE.get(), "streamed" if streamed else "resident", str(x.dtype).replace("torch.", ""),
            str(weight.dtype).replace("torch.", "") + ("-scaled" if scaled else ""), f"m{rows}",
            f"k{k}", f"n{weight.shape[0]}", "bias" if getattr(module, "bias", None) is not None else "nobias",
            activation, method, f"torch {torch.__version__}", f"pack {PACK_VERSION}")


def measure(layer, x: torch.Tensor, streamed: bool, method: str) -> dict | None:
    """The class's entry ({"ours": bool, "ours_ms", "theirs_ms", ...}), timed now if new."""
    state = layer.state
    facts = probe(x.device)
    parts = class_parts(layer, x, streamed, method)
    key = state.speed.key(f"{facts.name}|triton {facts.triton_version}", parts)
    known = state.speed.known(key)
    if known:
        return known
    patch = layer.activation_patch
    first = layer.activation[1] if layer.activation is not None else 0

    def ours():
        out = layer._eager((x,), {})
        if patch is not None:
            patch(out[..., first:] if first else out)
        return out

    def theirs():
        out = layer.previous(x)
        if patch is not None:
            patch.previous(out[..., first:] if first else out)
        return out

    about = {"mode": parts[0], "shape_class": " ".join(parts[1:10]), "layer": layer.name,
             "device": str(x.device), "gpu": facts.name}
    token = _MEASURING.set(True)
    try:
        with call_stats.muted(), torch.inference_mode():
            return state.speed.decide(key, ours, theirs, x.device, about)
    except Exception as e:  # a timing that fails must not fail the step: our kernel served this call
        log.warning("Triton Accel Linear: could not time %s (%s): %s: %s", layer.name, about["shape_class"],
                    type(e).__name__, e)
        return None
    finally:
        _MEASURING.reset(token)


def model_lines(label: str) -> list[str]:
    """What auto did with a model's Linear layers and, in eager steps, what the step check found,
    for its node: a line each, none where nothing was decided."""
    with _models_lock:
        counts = Counter(_model_choices.get(label, ()))
    lines = []
    if counts:
        ours, measured = counts.pop("ours", 0), counts.pop("measured", 0)
        parts = []
        if ours:
            parts.append(f"{ours} on ours (measured faster)")
        if measured:
            parts.append(f"{measured} on ComfyUI's (measured as fast or faster)")
        if counts:
            parts.append(f"{sum(counts.values())} on ComfyUI's by rule ({counts.most_common(1)[0][0]}...)")
        lines.append(f"Linear auto, per layer and call class: {'; '.join(parts)}")
    check = call_timing.step_check_of(label)
    if check:
        lines.append(f"Whole eager step: {check['ours_ms']} ms with auto's choices, {check['comfyui_ms']} ms on "
                     f"ComfyUI's -> {'ours kept' if check['kept'] == 'ours' else 'ComfyUI kept'}")
    return lines


def measured_rows(limit: int = 64) -> list[dict]:
    """The Linear classes auto timed (this process's and the cache file's), for the status panel."""
    rows = []
    for key, entry in list(call_timing.shared_linear().snapshot().items())[:limit]:
        rows.append({"shape_class": entry.get("shape_class", key.split("|")[-1]), "mode": entry.get("mode"),
                     "gpu": entry.get("gpu"), "ours": entry.get("ours"), "ours_ms": entry.get("ours_ms"),
                     "theirs_ms": entry.get("theirs_ms")})
    return rows
