"""LinearLayer: the object patch that replaces one Linear layer's forward (the call path: checks,
prepared weight, quality guard, extensions, dynamic VRAM, fused activation, hand-back), and
the opaque op a torch.compile trace records for it."""
from __future__ import annotations

import contextvars
import logging
from typing import TYPE_CHECKING

import torch

from ..kernels.core import extensions
from ..kernels.core.registry import BackendUnavailableError
from . import call_stats, compiled_ops, linear_choice
from .activation_marks import is_activated, mark_activated, storage_marks_work
from .dynamic_vram import streamed_call, streamed_plan, streamed_run, with_stored_scale
from .guards import guard_failure
from .linear_common import (EXT_GUARD_MAX_REL_L2, INPUT_DTYPES, KIND, MISSING, REASON_ARGUMENTS, REASON_AUTOGRAD,
                            REASON_CAPTURING, REASON_DYNAMIC_VRAM, REASON_EXT_GUARD, REASON_GUARD,
                            REASON_INPUT_TYPE, REASON_KERNEL_ERROR, REASON_OFFLOADED, REASON_QUANTIZED,
                            REASON_SHAPE, REASON_WEIGHT_FUNCTION, WEIGHT_DTYPES, ExtensionHandBack, HandBack,
                            PreparedEntry, is_compiling, is_quantized_layer, module_attr, weight_version)
from .settings import device_key

if TYPE_CHECKING:
    from .dynamic_vram import StreamedEntry
    from .fused_activations import FusedActivation, ModulePatch
    from .linear_state import LinearPatchState

log = logging.getLogger("triton_accel")


# ---- torch.compile: one opaque op per traced call (compiled_ops) -------------------------------

# Set while a compiled graph's patched_linear op runs a layer's eager path: the GELU module
# after it was traced as ComfyUI's and applies the activation itself.
_UNFUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("triton_accel_linear_unfused", default=False)
COMPILED_OP = "patched_linear"


def _layer(token: int):
    return compiled_ops.lookup(token, "Linear layer")


def _register_compiled_op() -> None:
    def patched_linear(x: torch.Tensor, layer: int, activated: bool = False) -> torch.Tensor:
        return _layer(layer).compiled_call(x, activated)

    def fake(x, layer, activated=False):
        return x.new_empty((*x.shape[:-1], _layer(layer).out_features()))

    # activated: the layer's GELU is part of the op (FusedSequential), applied in our GEMM's
    # epilogue where our kernel serves the call and after ComfyUI's Linear where it does not.
    compiled_ops.define(COMPILED_OP, "(Tensor x, int layer, bool activated=False) -> Tensor", patched_linear, fake)


def _compiled_op_error() -> str | None:
    return compiled_ops.registration_error(lambda: _register_compiled_op(), "Linear")


COMPILED_OP_ERROR = _compiled_op_error()


class LinearLayer:
    """The object patch that replaces one layer's forward; shared by clones, never copied."""

    def __init__(self, state: LinearPatchState, name: str, module: torch.nn.Module, previous):
        self.state = state
        self.name = name
        self.module = module
        self.previous = previous  # the forward it replaces (ComfyUI's, or another node's patch)
        pattern = state.skip.match(name)
        self.skip_reason = f"name matches skip pattern {pattern!r}" if pattern else None
        self.entries: dict[str, PreparedEntry] = {}  # per device
        # (activation, first column) our kernel applies in its epilogue (FusedActivation), or None
        self.activation: tuple[str, int] | None = None
        # The activated columns also go to a contiguous copy (fusable_with_copy: their consumer
        # concatenates them), where the method's kernel writes one.
        self.activation_copy = False
        # The activation module's own forward (FusedActivation.previous): what applies the GELU
        # to a compiled fused call our kernel did not serve.
        self.activation_forward = None
        self.streamed: dict[str, StreamedEntry] = {}  # per device: guard state of calls under dynamic VRAM
        self.fallbacks: dict[str, str] = {}  # device -> why this layer runs ComfyUI's Linear for good
        # Other packs' Linear on this layer, per (device, "ext:<name>"): the weight version its
        # guard passed on, and (extension generation, reason) where it failed the guard.
        self.ext_guarded: dict[tuple[str, str], tuple] = {}
        self.ext_fallbacks: dict[tuple[str, str], tuple[int, str]] = {}
        self.token = compiled_ops.register(self)  # what a compiled graph's patched_linear op names it by
        # The facts the checked path read on this layer's last served call (_steady_entry).
        self._steady: tuple | None = None
        # auto's measured choice (linear_choice): per call class (input shape, dtype, step mode),
        # True where ours serves it, False where ComfyUI's forward does; the classes ours won
        # (a layer with one keeps its patch); whether ComfyUI's forward is back in our place; and
        # the (module, patch) pairs that go with this layer's patch (the GELU our kernel fuses,
        # the Sequential traced as one op), handed back with it.
        self.verdicts: dict[tuple, bool] = {}
        self.won: set[tuple] = set()
        self.uninstalled = False
        self.forced_out = False  # moved aside by the step check's ComfyUI configuration (step_check)
        self.companions: list[tuple[torch.nn.Module, ModulePatch]] = []
        self.activation_patch: FusedActivation | None = None

    def __deepcopy__(self, memo):
        return self

    def _original(self, args, kwargs, reason: str):
        call_stats.record(call_stats.OUTCOME_HANDED_BACK, reason, kind=KIND, model=self.state.label)
        return self.previous(*args, **kwargs)

    def handed_back(self, args, kwargs, reason: str):
        """_original, and where the reason holds for the call's whole class, that class decided
        for ComfyUI's Linear (linear_choice.settle)."""
        if reason in self.state.class_reasons and len(args) == 1 and not kwargs:
            linear_choice.settle(self, args[0], reason)
        return self._original(args, kwargs, reason)

    def __call__(self, *args, **kwargs):
        if is_compiling():
            return self._traced(args, kwargs)
        return self._eager(args, kwargs)

    def _traced(self, args, kwargs):
        """What a torch.compile trace records for this call: the opaque op (its run time is
        _eager, unfused), or ComfyUI's Linear traced as it is where our path could never serve."""
        if (COMPILED_OP_ERROR is not None or self.skip_reason is not None or len(args) != 1 or kwargs
                or not isinstance(args[0], torch.Tensor) or torch.is_grad_enabled()
                or self.too_few_tokens_to_trace(args[0])):
            return self.previous(*args, **kwargs)
        return torch.ops.triton_accel.patched_linear(args[0], self.token)

    def too_few_tokens_to_trace(self, x) -> bool:
        """Whether a traced call is one _eager hands back whatever happens at run time: a static
        token count under min_tokens (check_call's last test, which every path of ours applies,
        dynamic VRAM's included), with no Linear extension that might take it (they bring their
        own minimum) registered or forced. Traced as ComfyUI's Linear, such a call costs no op
        dispatch or hand-back at run time (Flux's 512-row text stream: 76 calls a step) and
        inductor fuses around it. Read under tracing: torch.compile guards on min_tokens, the
        mode, extensions.linear_count() and, for symbolic shapes (dynamic=True), on the count's
        side of min_tokens, so a change there re-traces."""
        if extensions.linear_count() or extensions.is_extension_path(self.state.settings.linear_mode):
            return False
        if x.dim() < 1:
            return False
        numel, features = x.numel(), x.shape[-1]
        if type(numel) is not int or type(features) is not int or features <= 0:
            return False
        return numel // features < self.state.min_tokens

    def traces_fused(self, x) -> bool:
        """Whether a trace of this layer followed by its activation module may record one
        activated op (FusedSequential): the same conditions as _traced's op, and an activation
        applied to all output columns (the in-place kind, no contiguous copy)."""
        return (COMPILED_OP_ERROR is None and self.skip_reason is None and isinstance(x, torch.Tensor)
                and not torch.is_grad_enabled() and self.activation is not None and not self.activation_copy
                and self.activation[1] == 0 and self.activation_forward is not None
                and not self.too_few_tokens_to_trace(x))

    def compiled_call(self, x: torch.Tensor, activated: bool = False) -> torch.Tensor:
        """The run time of a traced call (the patched_linear op), in x's dtype as the op's fake
        promised: the eager path without the fused activation, or (activated) with it, the
        activation module's forward applying it where our kernel did not."""
        if activated:
            out = self._eager((x,), {})
            if not is_activated(out):  # ComfyUI's Linear (or an extension) served the call
                out = self.activation_forward(out)
        else:
            unfused = _UNFUSED.set(True)
            try:
                out = self._eager((x,), {})
            finally:
                _UNFUSED.reset(unfused)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def out_features(self) -> int:
        return int(self.module.weight.shape[0])

    def _eager(self, args, kwargs):
        # Called while marked handed back: ComfyUI re-applied our patch (a reload); a decided
        # class puts its forward back below.
        self.uninstalled = False
        if self.state.forced:  # the step check runs this step on ComfyUI's Linear
            with self.state._lock:
                self.forced_out = linear_choice.put_back(self) or self.forced_out
            return self.previous(*args, **kwargs)
        if self.state.interrupt_check is not None:
            self.state.interrupt_check()  # what ComfyUI's Linear.forward does first (Cancel)
        if self.skip_reason is not None:
            # Every path below hands a name-skipped layer back first thing; a Flux step makes
            # ~300 such calls (modulation, embedders), each worth its host time: where auto
            # decides, the layer's own forward takes our place after this call.
            if len(args) == 1 and not kwargs:
                linear_choice.settle(self, args[0], self.skip_reason)
            return self._original(args, kwargs, self.skip_reason)
        if self.verdicts and len(args) == 1 and not kwargs and type(args[0]) is torch.Tensor:
            if self.verdicts.get(linear_choice.verdict_key(args[0])) is False:
                linear_choice.hand_back(self)
                return self.previous(args[0])
        if self._steady is not None and len(args) == 1 and not kwargs:
            entry = self._steady_entry(args[0])
            if entry is not None:
                return self._run_ours(args[0], entry)
        weight = module_attr(self.module, "weight")  # read once: every check below needs it
        if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            plan = self.state.extension_plan(args[0].device, weight)
            if plan is not None:
                return self._call_with_extensions(args[0], plan)
        if len(args) == 1 and not kwargs and self.state.weight_cast.streams(self.module, args[0]):
            return streamed_call(self, args[0])
        try:
            if len(args) != 1 or kwargs:
                raise HandBack(REASON_ARGUMENTS)
            x = args[0]
            entry = self.state.entry_for(self, x, weight)
        except HandBack as e:
            return self.handed_back(args, kwargs, str(e))
        if entry.guarded:
            self._remember_steady(x, weight, entry)
        return self._run_ours(x, entry)

    def _remember_steady(self, x: torch.Tensor, weight: torch.Tensor, entry: PreparedEntry) -> None:
        """What entry_for read to serve x with `entry`, for _steady_entry (a guarded entry only:
        the first call of a weight version still runs the guard)."""
        state = self.state
        self._steady = (x.device, x.dtype, device_key(x.device), weight, weight.data_ptr(), weight_version(weight),
                        module_attr(self.module, "scale_weight"), state.weights_token, extensions.generation(),
                        entry)

    def _steady_entry(self, x) -> PreparedEntry | None:
        """The entry that served this layer's last call, where this call is one entry_for would
        give it to again (and the extension plan and dynamic-VRAM streaming would not take):
        same device, dtype, weight (object, storage, version, scale, ComfyUI's weight patches),
        no extension registered since, no weight or bias function, no fallback, no autograd or
        stream capture, enough tokens. Else None, and the checked path decides. About half the
        node path's host time on a served call (Flux makes 152 a step, host-bound)."""
        device, dtype, where, weight, ptr, version, scale, token, generation, entry = self._steady
        state, module = self.state, self.module
        if (type(x) is not torch.Tensor or x.dtype != dtype or x.device != device or self.fallbacks
                or x.dim() < 1 or x.shape[-1] != weight.shape[1] or x.numel() // weight.shape[1] < state.min_tokens
                or module_attr(module, "weight") is not weight or weight.data_ptr() != ptr
                or weight_version(weight) != version or module_attr(module, "scale_weight") is not scale
                or state.weights_token != token or extensions.generation() != generation
                or self.entries.get(where) is not entry or not entry.guarded or entry.refusal
                or len(module_attr(module, "weight_function", ())) or len(module_attr(module, "bias_function", ()))
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
                or compiled_ops.capturing(x)):
            return None
        bias = module_attr(module, "bias")
        if bias is not None and bias.device != device:
            return None
        return entry

    def _run_ours(self, x, entry: PreparedEntry):
        if not entry.guarded:
            return self.state.guarded_call(self, x, entry)
        try:
            out = self.run_kernel(x, entry.prepared, self.bias_for(x))
        except Exception as e:  # any kernel failure (compile, launch, memory): ComfyUI's Linear serves the layer
            self.state.fall_back(self, x.device, f"kernel error: {type(e).__name__}: {e}")
            return self._original((x,), {}, REASON_KERNEL_ERROR)
        call_stats.record(call_stats.OUTCOME_SERVED, path=entry.method, kind=KIND, model=self.state.label)
        if linear_choice.verdict_key(x) not in self.verdicts:
            linear_choice.after_served(self, x, False, entry.method)
        return out

    # -- other packs' Linear (kernels/core/extensions.py)
    def _call_with_extensions(self, x, plan: tuple):
        """Walk the plan (extensions above ours, ours, extensions below) in priority order: the
        first that accepts the call serves it. A failure (an extension's or ours) sends this call
        to ComfyUI's Linear; refusals move on, and with none left ComfyUI's Linear serves, every
        candidate's reason counted."""
        before, ours, after = plan
        streamed = self.state.weight_cast.streams(self.module, x)
        try:
            self.check_call(x, 1, streamed=streamed, ours=False)
        except HandBack as e:
            return self._original((x,), {}, str(e))
        reasons: list[str] = []
        try:
            for path in before:
                out = self._try_extension(path, x, streamed, reasons)
                if out is not None:
                    return out
            if ours:
                if streamed:
                    try:
                        planned = streamed_plan(self, x)
                    except HandBack as e:
                        reasons.append(str(e))
                    else:
                        return streamed_run(self, x, *planned)
                else:
                    try:
                        entry = self.state.entry_for(self, x)
                    except HandBack as e:
                        reasons.append(str(e))
                    else:
                        return self._run_ours(x, entry)
            for path in after:
                out = self._try_extension(path, x, streamed, reasons)
                if out is not None:
                    return out
        except ExtensionHandBack as e:
            if e.reference is None:
                return self._original((x,), {}, str(e))
            call_stats.record(call_stats.OUTCOME_HANDED_BACK, str(e), kind=KIND, model=self.state.label)
            return e.reference
        return self._original((x,), {}, "; ".join(dict.fromkeys(reasons)) or "no Linear candidate")

    def _try_extension(self, path: str, x, streamed: bool, reasons: list):
        """The extension's output for this call, or None with the reason appended (it refuses);
        raises ExtensionHandBack when it fails (the call goes to ComfyUI's Linear)."""
        state, module, where = self.state, self.module, str(x.device)
        dropped = self.ext_fallbacks.get((where, path))
        if dropped is not None and dropped[0] == extensions.generation():
            reasons.append(REASON_EXT_GUARD.format(path=path))
            return None
        refusal = extensions.linear_shape_refusal(path, x, tuple(module.weight.shape), module.bias is not None)
        if refusal:
            reasons.append(f"{path}: {refusal}")
            return None
        version = (state.weights_token, module.weight.dtype) if streamed else state.weight_key(module, x.device)
        guarded = self.ext_guarded.get((where, path)) == (extensions.generation(), version)
        if streamed:  # ComfyUI's cast hands the weight over (LoRA applied) and takes it back after
            cast_weight, bias, handle = state.weight_cast.cast(module, x, x.dtype)
            try:
                weight, _ = with_stored_scale(module, cast_weight.detach())
                out = self._run_extension(path, x, weight, bias, reasons)
            finally:  # the tensors the cast gave, as ComfyUI's own Linear hands them back
                state.weight_cast.uncast(module, cast_weight, bias, handle)
        else:
            weight, _ = with_stored_scale(module, module.weight.detach().to(x.dtype))
            out = self._run_extension(path, x, weight, self.bias_for(x), reasons)
        if out is None:
            return None
        if guarded:
            call_stats.record(call_stats.OUTCOME_SERVED, path=path, kind=KIND, model=state.label)
            return out
        # The first call of each weight version runs ComfyUI's Linear too (after the cast above
        # is undone: one layer is never cast twice at once) and keeps the extension only if it agrees.
        reference = self.previous(x)
        failure = guard_failure(out, reference, EXT_GUARD_MAX_REL_L2[extensions.is_lossy(path)])
        with state._lock:
            state.changes += 1
            if failure is None:
                self.ext_guarded[(where, path)] = (extensions.generation(), version)
            else:
                self.ext_fallbacks[(where, path)] = (extensions.generation(), f"quality guard ({path}): {failure}")
        if failure is not None:
            log.warning("Triton Accel Linear: %s on %s goes back to ComfyUI's Linear for %s: %s", self.name,
                        x.device, path, failure)
            raise ExtensionHandBack(REASON_EXT_GUARD.format(path=path), reference)
        call_stats.record(call_stats.OUTCOME_SERVED, path=path, kind=KIND, model=state.label)
        return out

    def _run_extension(self, path: str, x, weight, bias, reasons: list):
        try:
            out = extensions.run_linear(path, x, weight, bias)
        except extensions.ExtensionCallError as e:
            raise ExtensionHandBack(f"{path} failed: {e.reason}") from e
        except BackendUnavailableError as e:  # unregistered, or re-registered narrower, since the plan
            reasons.append(f"{path}: {e.reason}")
            return None
        return out

    def run_kernel(self, x: torch.Tensor, prepared, bias):
        """Our kernel on a prepared weight, with this layer's activation fused (and its output
        marked for FusedActivation) outside torch.compile's tracing (a traced graph keeps no
        marks: there the activation module runs the GELU itself)."""
        backend = self.state.backend
        if not self.fuses(getattr(prepared, "method", None)):
            return backend.run(x, prepared, bias, x.dtype)
        activation, first = self.activation
        if self.activation_copy:
            copy = torch.empty((*x.shape[:-1], prepared.out_features - first), dtype=x.dtype, device=x.device)
            out = backend.run(x, prepared, bias, x.dtype, activation=activation, activation_from=first,
                              activation_out=copy)
            mark_activated(out, first, copy)
            return out
        out = backend.run(x, prepared, bias, x.dtype, activation=activation, activation_from=first)
        mark_activated(out, first)
        return out

    def fuses(self, method: str | None) -> bool:
        """Whether our kernel applies this layer's activation on this call: outside torch.compile's
        tracing (a traced graph keeps no marks), and for a layer whose activated columns need a
        contiguous copy only where `method`'s kernel writes one (else the consumer would get a
        strided slice: ComfyUI's GELU runs instead)."""
        if self.activation is None or is_compiling() or _UNFUSED.get() or not storage_marks_work():
            return False
        return not self.activation_copy or method in self.state.backend.activation_out_methods

    def activated_reference(self, reference: torch.Tensor, method: str | None) -> torch.Tensor:
        """ComfyUI's output with the activation our kernel fuses on this call applied (a copy),
        to compare ours with."""
        if not self.fuses(method):
            return reference
        first = self.activation[1]
        out = reference.clone()
        out[..., first:] = torch.nn.functional.gelu(out[..., first:], approximate="tanh")
        return out

    def bias_for(self, x: torch.Tensor):
        bias = module_attr(self.module, "bias")
        # ComfyUI casts the bias to the input's dtype (cast_bias_weight's bias_dtype) too; the
        # same dtype skips the dispatcher (host time on every served call).
        return bias if bias is None or bias.dtype == x.dtype else bias.to(x.dtype)

    def check_call(self, x, min_tokens: int, streamed: bool = False, ours: bool = True, weight=None) -> None:
        """HandBack unless this call's input and weights are ours to serve (cheap checks only).
        streamed: the weight comes from ComfyUI's dynamic-VRAM cast, not from module.weight.
        ours=False: only what every candidate needs (extensions bring their own fallbacks and
        minimum tokens). weight: the module's weight where the caller read it already."""
        if self.skip_reason:
            raise HandBack(self.skip_reason)
        if type(x) is not torch.Tensor:
            raise HandBack(REASON_INPUT_TYPE)
        module = self.module
        # module_attr: nn.Module.__getattr__ costs ~1.5 us a read, and this runs on every call
        if weight is None:
            weight = module_attr(module, "weight")
        # First among the checks that read x: Flux's text stream (512 tokens, 76 calls a step)
        # is handed back here without the rest.
        if (ours and x.dim() >= 1 and isinstance(weight, torch.Tensor) and weight.dim() == 2
                and x.shape[-1] == weight.shape[1] and x.numel() // weight.shape[1] < min_tokens):
            raise HandBack(self.state.few_tokens_reason)
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            raise HandBack(REASON_AUTOGRAD)
        if compiled_ops.capturing(x):
            raise HandBack(REASON_CAPTURING)
        if is_quantized_layer(module, weight):
            raise HandBack(REASON_QUANTIZED)
        # A streamed weight has its _function lists applied by ComfyUI's cast (post_cast in
        # resolve_cast_module_with_vbar) when asked for in the compute dtype; asked for as FP8
        # they would run on e4m3 values, so FP8 weights with them go back (ComfyUI's own FP8
        # Linear does the same).
        if ((len(module_attr(module, "weight_function", ())) or len(module_attr(module, "bias_function", ())))
                and (not streamed or weight.dtype == torch.float8_e4m3fn)):
            raise HandBack(REASON_WEIGHT_FUNCTION)
        fallback = self.fallbacks.get(device_key(x.device)) if ours and self.fallbacks else None
        if fallback is not None:
            raise HandBack(REASON_GUARD if fallback.startswith("quality guard") else REASON_KERNEL_ERROR)
        bias = module_attr(module, "bias")
        if not streamed and (weight.device != x.device or (bias is not None and bias.device != x.device)):
            raise HandBack(REASON_DYNAMIC_VRAM if module_attr(module, "_v", MISSING) is not MISSING
                           else REASON_OFFLOADED)
        if x.dtype not in INPUT_DTYPES:
            raise HandBack(f"input dtype {x.dtype} is not float16/bfloat16/float32")
        if weight.dtype not in WEIGHT_DTYPES:
            raise HandBack(f"weight dtype {weight.dtype} is not float16/bfloat16/float32/float8_e4m3fn")
        if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
            raise HandBack(REASON_SHAPE)
        if ours and x.numel() // weight.shape[1] < min_tokens:
            raise HandBack(self.state.few_tokens_reason)
