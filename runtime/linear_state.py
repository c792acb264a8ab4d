"""LinearPatchState: everything one patched model shares (settings, layers, prepared weights,
guard results, MultiGPU copies), the Linear extension plan, and the fallback report."""
from __future__ import annotations

import collections
import logging
import threading
import time
import weakref

import torch

from ..kernels.core import extensions
from ..kernels.core.device import describe
from ..kernels.core.gpu_rules import PATH_PYTORCH
from ..kernels.linear.dispatch import PRIORITY as OUR_PRIORITY
from . import call_stats, call_timing, linear_choice
from .dynamic_vram import ComfyWeightCast
from .fused_activations import FusedActivation, FusedSequential
from .guards import guard_failure
from .linear_common import (CALLBACK_KEY, DYNAMIC_VRAM_AUTO, DYNAMIC_VRAM_MODES, GUARD_MAX_REL_L2, KIND,
                            MAX_STEP_SIGNATURES, MIN_TOKENS, REASON_DYNAMIC_VRAM_OFF, REASON_GUARD,
                            REASON_KERNEL_ERROR, REASON_OFFLOADED, REASON_QUANTIZED, REASON_SHAPE,
                            REASON_STREAMED_PER_CALL_OFF, WEIGHT_DTYPES, HandBack, LinearBackend, PreparedEntry,
                            SkipPatterns, default_backend, is_linear_module, is_quantized_layer, module_attr,
                            rebound, submodule, weight_version)
from .linear_layer import LinearLayer
from .progress import comfy_progress_bar
from .settings import AccelSettings, device_key

log = logging.getLogger("triton_accel")


# ---- per-model state ------------------------------------------------------------------------

_live_states: weakref.WeakSet[LinearPatchState] = weakref.WeakSet()
# Iterating a WeakSet runs Python code: a state made on one thread (a patch node, a MultiGPU
# clone's state) while another lists the states (the Settings node, the stats route) raises
# "Set changed size during iteration" without this lock.
_live_states_lock = threading.Lock()
# A model's attribute holding, per patch state, that state's copy for this model (MultiGPU
# clones): kept on the model so the copy, whose layers hold the model's modules, dies with it.
_MODEL_STATES_ATTR = "_triton_accel_linear_states"
_model_states_lock = threading.Lock()


_NO_PLAN = object()  # "not decided yet" in LinearPatchState._plans, where None means "no extension"


class LinearPatchState:
    """Everything one patched model shares: settings, layers, prepared weights, guard results."""

    def __init__(self, settings: AccelSettings, skip: SkipPatterns, min_tokens: int = MIN_TOKENS,
                 backend: LinearBackend | None = None, label: str | None = None,
                 dynamic_vram: str = DYNAMIC_VRAM_AUTO, weight_cast: ComfyWeightCast | None = None,
                 speed: call_timing.LinearSpeedChoice | None = None):
        if dynamic_vram not in DYNAMIC_VRAM_MODES:
            raise ValueError(f"dynamic_vram must be one of {DYNAMIC_VRAM_MODES}; got {dynamic_vram!r}")
        self.settings = settings
        self.dynamic_vram = dynamic_vram
        self.weight_cast = weight_cast or ComfyWeightCast()
        self.skip = skip
        self.min_tokens = int(min_tokens)
        self.few_tokens_reason = f"fewer than {self.min_tokens} tokens: quantising cannot pay"
        # Hand-back reasons that hold for every call of a class: where auto decides, the class
        # goes to ComfyUI's Linear for good (linear_choice.settle), with nothing of ours per call.
        self.class_reasons = frozenset({self.few_tokens_reason, REASON_QUANTIZED, REASON_SHAPE,
                                        REASON_STREAMED_PER_CALL_OFF, REASON_DYNAMIC_VRAM_OFF})
        self.speed = speed or call_timing.shared_linear()  # auto's call timing (a seam for tests)
        self._step_signatures: collections.OrderedDict = collections.OrderedDict()  # recent, newest last
        self.forced = False  # the step check runs the step on ComfyUI's Linear (step_check)
        self.backend = backend or default_backend()
        self.label = label
        self.layers: list[LinearLayer] = []
        self.weights_token = None  # patches_uuid of the weight patches ComfyUI loaded last
        # Bumped whenever a layer's prepared entry, guard result or fallback changes: a CUDA graph
        # of the step (step_graph) recorded before is stale.
        self.changes = 0
        self.interrupt_check = None
        self._refusals: dict[tuple, str | None] = {}
        self._plans: dict[tuple, tuple | None] = {}
        self._lock = threading.RLock()
        with _live_states_lock:
            _live_states.add(self)

    @property
    def fused_activations(self) -> int:
        """GELUs our kernels apply in their epilogue (FusedActivation)."""
        return sum(layer.activation is not None for layer in self.layers)

    @property
    def copied_activations(self) -> int:
        """Of those, the ones fused only where the method's kernel writes the contiguous copy."""
        return sum(layer.activation is not None and layer.activation_copy for layer in self.layers)

    # Prepared weights are GPU memory: a deep copy of whatever holds this state (a callback
    # list, say) must share it, never copy it. MultiGPU clones get their own state through
    # on_multigpu_clone instead.
    def __deepcopy__(self, memo):
        return self

    # -- what serves a call
    def method_for(self, device: torch.device, weight: torch.Tensor) -> str:
        decision = self.settings.linear_decision_for(device, weight.dtype == torch.float8_e4m3fn)
        if decision.path == PATH_PYTORCH or extensions.is_extension_path(decision.path):
            raise HandBack(decision.reason)  # an extension's calls never reach our methods
        return decision.path

    def extension_plan(self, device: torch.device, weight: torch.Tensor) -> tuple | None:
        """(extensions tried before ours, whether ours is tried, extensions after) for calls on
        `device`, or None when no extension is involved (the calls take our path alone)."""
        is_fp8 = weight.dtype == torch.float8_e4m3fn
        key = (device_key(device), is_fp8, extensions.generation())
        plan = self._plans.get(key, _NO_PLAN)
        if plan is _NO_PLAN:
            plan = extension_plan(self.settings, device, is_fp8)
            with self._lock:  # another thread may clear the dict meanwhile: return our own answer
                if len(self._plans) > 64:
                    self._plans.clear()
                self._plans[key] = plan
        return plan

    def refusal(self, method: str, device: torch.device, dtype) -> str | None:
        key = (method, device_key(device), dtype)
        if key not in self._refusals:
            self._refusals[key] = self.backend.refusal(method, device, dtype)
        return self._refusals[key]

    def weight_key(self, module, device: torch.device, w=None) -> tuple:
        if w is None:
            w = module_attr(module, "weight")
        scale = module_attr(module, "scale_weight")
        scale_key = None if scale is None else (id(scale), scale.data_ptr(), weight_version(scale))
        return (id(w), w.data_ptr(), weight_version(w), device_key(device), w.dtype, self.weights_token, scale_key)

    def entry_for(self, layer: LinearLayer, x, weight=None) -> PreparedEntry:
        """The prepared weight that serves this call (preparing the model's layers if it is
        stale), or HandBack with the reason. weight: the module's weight, where already read."""
        if weight is None:
            weight = module_attr(layer.module, "weight")
        layer.check_call(x, self.min_tokens, weight=weight)
        device = x.device
        method = self.method_for(device, weight)
        refusal = self.refusal(method, device, x.dtype)
        if refusal:
            raise HandBack(refusal)
        where = device_key(device)
        entry = layer.entries.get(where)
        if entry is None or entry.method != method or entry.key != self.weight_key(layer.module, device, weight):
            self.prepare_all(device)
            entry = layer.entries.get(where)
            if entry is None:  # prepare_all found the layer unusable on this device after all
                raise HandBack(REASON_OFFLOADED)
        if entry.refusal:
            raise HandBack(entry.refusal)
        return entry

    # -- preparing weights
    def _stale_layers(self, device: torch.device) -> list[tuple[LinearLayer, str, tuple]]:
        stale = []
        for layer in self.layers:
            module = layer.module
            weight = getattr(module, "weight", None)
            if (layer.skip_reason or str(device) in layer.fallbacks or weight is None
                    or is_quantized_layer(module, weight) or weight.device != device
                    or weight.dtype not in WEIGHT_DTYPES
                    or len(getattr(module, "weight_function", ())) or len(getattr(module, "bias_function", ()))):
                continue
            try:
                method = self.method_for(device, weight)
            except HandBack:
                continue
            key = self.weight_key(module, device)
            entry = layer.entries.get(str(device))
            if entry is None or entry.key != key or entry.method != method:
                stale.append((layer, method, key))
        return stale

    def _prepare_one(self, layer: LinearLayer, method: str, key: tuple) -> PreparedEntry:
        module = layer.module
        weight = module.weight.detach()
        scale = getattr(module, "scale_weight", None) if weight.dtype == torch.float8_e4m3fn else None
        try:
            with torch.no_grad():
                prepared = self.backend.prepare(weight, method, None if scale is None else scale.detach())
            q = getattr(prepared, "weight", None)
            shared = weight.numel() * weight.element_size() \
                if isinstance(q, torch.Tensor) and q.data_ptr() == weight.data_ptr() else 0
            return PreparedEntry(key, method, prepared, shared_bytes=shared)
        except self.backend.input_error as e:
            return PreparedEntry(key, method, refusal=str(getattr(e, "reason", e)))
        except Exception as e:  # out of memory, a kernel that cannot compile: ComfyUI's Linear serves it
            log.warning("Triton Accel Linear: could not prepare %s for %s: %s: %s", layer.name, method,
                        type(e).__name__, e)
            return PreparedEntry(key, method, refusal=f"could not prepare the weight: {type(e).__name__}")

    def prepare_all(self, device: torch.device) -> None:
        """Quantise every stale layer whose weights are on `device`, with one progress bar and one log line."""
        with self._lock:
            stale = self._stale_layers(device)
            if not stale:
                return
            started = time.perf_counter()
            bar = comfy_progress_bar(len(stale))
            self.changes += 1
            for done, (layer, method, key) in enumerate(stale, 1):
                layer.entries[str(device)] = self._prepare_one(layer, method, key)
                if bar is not None:
                    bar.update_absolute(done)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - started
            entries = [layer.entries[str(device)] for layer, _, _ in stale]
            refused = [e.refusal for e in entries if e.refusal]
            methods = sorted({e.method for e in entries if e.prepared is not None})
            total = sum(e.nbytes() for layer in self.layers for e in [layer.entries.get(str(device))] if e)
            log.info("Triton Accel Linear%s: prepared %d layers (%s) on %s in %.2f s; %.1f MiB of prepared "
                     "weights on %s%s", f" ({self.label})" if self.label else "", len(stale) - len(refused),
                     ", ".join(methods) or "none", device, seconds, total / 2**20, device,
                     f"; {len(refused)} left to ComfyUI's Linear (e.g. {refused[0]})" if refused else "")

    # -- the quality guard
    def guarded_call(self, layer: LinearLayer, x: torch.Tensor, entry: PreparedEntry):
        """Run ComfyUI's Linear and ours on the same input once; keep ours only if it agrees."""
        reference = layer.previous(x)
        try:
            ours = layer.run_kernel(x, entry.prepared, layer.bias_for(x))
        except Exception as e:
            self.fall_back(layer, x.device, f"kernel error: {type(e).__name__}: {e}")
            call_stats.record(call_stats.OUTCOME_HANDED_BACK, REASON_KERNEL_ERROR, kind=KIND, model=self.label)
            return reference
        entry.guarded = True
        self.changes += 1
        failure = guard_failure(ours, layer.activated_reference(reference, entry.method),
                                GUARD_MAX_REL_L2[entry.method])
        if failure is not None:
            self.fall_back(layer, x.device, f"quality guard ({entry.method}): {failure}")
            call_stats.record(call_stats.OUTCOME_HANDED_BACK, REASON_GUARD, kind=KIND, model=self.label)
            return reference
        call_stats.record(call_stats.OUTCOME_SERVED, path=entry.method, kind=KIND, model=self.label)
        return ours

    def fall_back(self, layer: LinearLayer, device: torch.device, reason: str) -> None:
        with self._lock:
            self.changes += 1
            layer.fallbacks[str(device)] = reason
            layer.entries.pop(str(device), None)
        log.warning("Triton Accel Linear: %s on %s goes back to ComfyUI's Linear for good: %s",
                    layer.name, device, reason)

    # -- ComfyUI's MultiGPU work units (MultiGPU CFG Split, ComfyUI 0.29+)
    def on_multigpu_clone(self, source, clone) -> None:
        """ComfyUI's ON_DEEPCLONE_MULTIGPU and ON_MATCH_MULTIGPU_CLONES callbacks.

        `clone` carries another copy of the model, loaded on another GPU, but its object patches
        and callbacks are copies of `source`'s: this state's layers, which wrap `source`'s
        modules. Left so, the other GPU's calls would run the first GPU's weights (handed back
        as offloaded, or copied over per call). They are pointed at a state of the clone's own
        model instead: its own modules, prepared weights on its own device, its own guard."""
        state = self.state_for_model(getattr(clone, "model", None))
        if state is self:
            return
        layers = {layer.name: layer for layer in state.layers} if state is not None else {}
        for key, value in list(clone.object_patches.items()):
            if isinstance(value, LinearLayer) and value.state is self:
                if value.name in layers:
                    clone.object_patches[key] = layers[value.name]
                else:  # not a Linear layer in the clone's model: ComfyUI's own forward serves it
                    del clone.object_patches[key]
            elif isinstance(value, FusedSequential) and value.layer.state is self:  # the clone's own
                module = submodule(getattr(getattr(clone, "model", None), "diffusion_model", None), value.name)
                layer = layers.get(value.layer.name)
                if module is None or layer is None:
                    clone.object_patches[key] = rebound(value.previous, value.module, module) \
                        if module is not None else value.previous
                else:
                    clone.object_patches[key] = FusedSequential(value.name, module,
                                                                rebound(value.previous, value.module, module),
                                                                layer, value.index)
            elif isinstance(value, FusedActivation):  # stateless, but its GELU should be the clone's module's
                module = submodule(getattr(getattr(clone, "model", None), "diffusion_model", None), value.name)
                if module is not None and module is not value.module:
                    clone.object_patches[key] = FusedActivation(value.name, module,
                                                                rebound(value.previous, value.module, module))
        for by_key in getattr(clone, "callbacks", {}).values():
            callbacks = by_key.get(CALLBACK_KEY, [])
            for i, callback in enumerate(callbacks):
                if getattr(callback, "__self__", None) is self:
                    callbacks[i] = getattr(state, callback.__name__) if state is not None else _no_callback
        if state is not None:
            state.weights_token = getattr(clone, "patches_uuid", None)
            clone.triton_accel_linear = state

    def state_for_model(self, base_model) -> LinearPatchState | None:
        """This patch's state for `base_model` (self for the model it was made on), made once per
        model and kept on it: a MultiGPU clone's model is reused from one sampling run to the next,
        and so are its prepared weights. None when the model has no diffusion_model."""
        diffusion_model = getattr(base_model, "diffusion_model", None)
        if diffusion_model is None:
            return None
        if not self.layers or submodule(diffusion_model, self.layers[0].name) is self.layers[0].module:
            return self
        with _model_states_lock:
            states = base_model.__dict__.get(_MODEL_STATES_ATTR)
            if states is None:
                states = base_model.__dict__[_MODEL_STATES_ATTR] = weakref.WeakKeyDictionary()
            state = states.get(self)
            if state is None:
                state = states[self] = self._copy_for(diffusion_model)
            return state

    def _copy_for(self, diffusion_model) -> LinearPatchState:
        state = LinearPatchState(self.settings, self.skip, self.min_tokens, self.backend, self.label,
                                 self.dynamic_vram, self.weight_cast, self.speed)
        state.interrupt_check = self.interrupt_check
        for layer in self.layers:
            module = submodule(diffusion_model, layer.name)
            if module is not None and is_linear_module(module):
                copy = LinearLayer(state, layer.name, module, rebound(layer.previous, layer.module, module))
                copy.activation, copy.activation_copy = layer.activation, layer.activation_copy
                # a GELU module's forward is stateless: the original's serves the copy's calls
                copy.activation_forward = layer.activation_forward
                state.layers.append(copy)
        log.info("Triton Accel Linear (%s): %d Linear layers of a MultiGPU clone patched", self.label,
                 len(state.layers))
        return state

    def begin_step(self, signature) -> None:
        """step_graph's hook at each diffusion-model call: a signature not seen lately
        (resolution, batch, step mode; cond and uncond of different shapes alternate two) puts
        handed-back layers' patches back, so their new classes are decided."""
        if signature in self._step_signatures:
            return
        self._step_signatures[signature] = True
        while len(self._step_signatures) > MAX_STEP_SIGNATURES:
            self._step_signatures.popitem(last=False)
        linear_choice.new_step(self)

    # -- lifetime
    def on_load(self, patcher, *args, **kwargs) -> None:
        """ComfyUI's ON_LOAD callback: weights may have been re-patched (a LoRA, in place)."""
        self.weights_token = getattr(patcher, "patches_uuid", None)

    def on_detach(self, patcher, unpatch_all: bool = True) -> None:
        """ComfyUI's ON_DETACH callback. Only a real unpatch frees the prepared weights: a clone
        deleted while another one runs also detaches (unpatch_all=False) and must not."""
        if unpatch_all:
            self.release()

    def release(self) -> None:
        with self._lock:
            self.changes += 1
            for layer in self.layers:
                layer.entries.clear()

    def prepared_bytes(self) -> int:
        return sum(e.nbytes() for layer in self.layers for e in layer.entries.values())

    def fallback_report(self) -> list[dict]:
        rows = [{"model": self.label, "layer": layer.name, "device": device, "reason": reason}
                for layer in self.layers for device, reason in layer.fallbacks.items()]
        current = extensions.generation()
        return rows + [{"model": self.label, "layer": layer.name, "device": device, "reason": reason}
                       for layer in self.layers for (device, _path), (gen, reason) in list(layer.ext_fallbacks.items())
                       if gen == current]


def extension_plan(settings: AccelSettings, device, weight_is_fp8: bool = False) -> tuple | None:
    """Where other packs' Linear (kernels/core/extensions.py) stands for calls on `device`:
    (extensions before ours, whether ours is tried, extensions after ours), or None when none is.

    - mode "ext:<name>" that the device admits: that extension alone;
    - auto where auto runs one of our methods (gpu_rules.select_linear_method: NVIDIA GPUs),
      every Linear extension whose constraints admit the device joins ours in the registry's
      priority order (ours: kernels.linear.PRIORITY; a tie goes to ours). auto times no Linear
      method, so none is timed: each is judged by the quality guard, as ours is;
    - anything else (the CPU, AMD in auto, forced fp8/int8/fp8_weight_only, off): none.
    """
    decision = settings.linear_decision_for(device, weight_is_fp8)
    if extensions.is_extension_path(decision.path):
        return (decision.path,), False, ()
    if settings.linear_mode != "auto" or decision.path == PATH_PYTORCH:
        return None
    paths = extensions.paths_by_priority(describe(device), kind=extensions.KIND_LINEAR)
    if not paths:
        return None
    ranks = {p: getattr(extensions.get(p), "priority", -(1 << 30)) for p in paths}
    return (tuple(p for p in paths if ranks[p] > OUR_PRIORITY), True,
            tuple(p for p in paths if ranks[p] <= OUR_PRIORITY))


def extension_plan_text(settings: AccelSettings, device) -> str:
    """One line on the Linear extensions auto considers on `device` ("" when none)."""
    try:
        plan = extension_plan(settings, device)
    except Exception as e:  # text for a node: never raises
        log.debug("Triton Accel Linear: no extension plan for %s: %s", device, e)
        return ""
    if plan is None or not plan[1]:
        return ""
    before, _, after = plan
    order = [*before, "ours", *after]
    return (f"Linear extensions auto considers on {device} (by priority, each checked against ComfyUI's Linear on "
            f"its first call per layer): {' > '.join(order)}")


def _no_callback(*args, **kwargs) -> None:
    """Stands in for a callback of a state that has no copy for a clone's model."""


def fallback_report() -> list[dict]:
    """Every layer the quality guard (or a kernel error) sent back, in every live patched model."""
    with _live_states_lock:
        states = list(_live_states)
    return [row for state in states for row in state.fallback_report()]


def fallback_summary(limit: int = 5) -> str:
    """One line per sent-back layer (at most `limit`) for the Settings node; "" when none."""
    rows = fallback_report()
    if not rows:
        return ""
    lines = [f"Linear layers on ComfyUI's Linear after the quality guard: {len(rows)}"]
    lines += [f"  {r['model'] or ''} {r['layer']} ({r['device']}): {r['reason']}".replace("   ", " ")
              for r in rows[:limit]]
    if len(rows) > limit:
        lines.append(f"  ... and {len(rows) - limit} more (GET /triton_accel/stats: linear_fallbacks)")
    return "\n".join(lines)
