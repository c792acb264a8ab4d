"""TritonAccelPatchLinear / TritonAccelPatch: the diffusion model's Linear layers through kernels.linear.

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
  alternating run (benchmarks/RESULTS.md, session 25).
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

import collections
import contextvars
import fnmatch
import logging
import re
import sys
import threading
import time
import types
import weakref
from dataclasses import dataclass

import torch

from ..kernels.core import extensions
from ..kernels.core.gpu_rules import LINEAR_FP8_W8A8, LINEAR_FP8_WEIGHT_ONLY, LINEAR_INT8_W8A8, PATH_PYTORCH
from ..kernels.linear.dispatch import PRIORITY as OUR_PRIORITY
from ..kernels.core.registry import BackendUnavailableError
from . import call_stats, call_timing, compiled_ops, linear_choice, step_graph
from .settings import SEARCH_ALIASES as ATTENTION_SEARCH_ALIASES
from .settings import SETTINGS_TYPE, AccelSettings, default_device, device_key, patched_model_text
from .speed_choice import LOSSLESS_BAR, comfy_progress_bar, guard_failure

log = logging.getLogger("triton_accel")

KIND = call_stats.KIND_LINEAR
CALLBACK_KEY = "triton_accel_linear"
# Below this many rows (tokens x batch) a call goes to ComfyUI's Linear. With few rows the
# GEMM is bound by reading the weight, which FP8 halves but the separate activation-
# quantisation launch and the persistent kernel's 128-row tiles give back: on the H200 a
# 512-row text stream (Flux 512x3072->9216) ran at 0.49x cuBLAS, 4096 rows at 1.09-1.61x
# (benchmark node, benchmarks/RESULTS.md session 17). These calls are modulation and
# embedding layers (one row per image) and the text streams of Flux / Wan cross-attention.
MIN_TOKENS = 1024
MAX_STEP_SIGNATURES = 8  # recent step signatures whose classes stay decided (begin_step)
# Largest rel. L2 (output vs ComfyUI's Linear on the same input) the quality guard accepts per
# method. e4m3 keeps 3 mantissa bits: rounding one operand per channel/token gives ~0.024 on
# Gaussian data (measured on the CPU: fp8_weight_only of a bf16 weight 0.024; both operands,
# fp8_w8a8, 0.034; on the H200 with outlier channels 0.027-0.029). int8 after rotation is
# coarser on outliers. FP8 checkpoint weights in weight-only mode differ from ComfyUI's
# upcast only by FP16/BF16 rounding (~0.003), so 0.04 still catches a broken kernel.
GUARD_MAX_REL_L2 = {LINEAR_FP8_W8A8: 0.05, LINEAR_INT8_W8A8: 0.06, LINEAR_FP8_WEIGHT_ONLY: 0.04}
# Other packs' Linear (kernels/core/extensions.py) by the same guard: a lossless one by the pack's
# lossless bar (speed_choice.LOSSLESS_BAR, attention's too: rounding only), a lossy one by our
# FP8 W8A8 method's (the quantised attention bar's rel. L2 as well).
EXT_GUARD_MAX_REL_L2 = {False: LOSSLESS_BAR.max_rel_l2, True: GUARD_MAX_REL_L2[LINEAR_FP8_W8A8]}
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
WEIGHT_DTYPES = INPUT_DTYPES + (torch.float8_e4m3fn,)

SKIP_AUTO = "auto"
# Names relative to diffusion_model, matched lower-case with fnmatch (a name must match the
# whole pattern, so "proj_out" is only the top-level layer). "re:<regex>" entries are regexes.
DEFAULT_SKIP_PATTERNS = (
    # embedders: Flux / Chroma / HunyuanVideo (txt_in is Hunyuan's token refiner), Wan
    # (patch_embedding is a Conv3d), SD1.5 / SDXL, SD3 / DiT-style, Qwen-Image
    "img_in", "img_in.*", "txt_in", "txt_in.*", "time_in.*", "vector_in.*", "guidance_in.*",
    "patch_embedding", "text_embedding.*", "time_embedding.*", "time_projection.*", "img_emb.*",
    "time_embed.*", "label_emb.*", "x_embedder*", "t_embedder.*", "y_embedder.*", "context_embedder*",
    "time_text_embed.*",
    # final layers: Flux / HunyuanVideo / SD3 / Lumina final_layer, Wan head, Qwen-Image proj_out / norm_out
    "final_layer.*", "head.*", "proj_out", "norm_out.*",
    # modulation (adaLN: one row per image, and the scale/shift feed every token), SD resblocks' emb_layers
    "*modulation*", "*adaln*", "*_mod.*", "*emb_layers*",
)

REASON_ARGUMENTS = "forward called with more than the input"
REASON_INPUT_TYPE = "input is not a plain tensor (ComfyUI QuantizedTensor input)"
REASON_QUANTIZED = "ComfyUI quantized layer (QuantizedTensor / mixed-precision ops): left to ComfyUI"
REASON_WEIGHT_FUNCTION = "weight patched per call (weight_function / bias_function: LoRA in low-VRAM mode)"
REASON_OFFLOADED = "weights not on the input's device (low-VRAM offload / partial loading)"
# ComfyUI 0.2x+ "dynamic VRAM" (comfy-aimdo, the default on NVIDIA there): a layer whose weights
# live in a virtual buffer (`_v`) keeps its parameters on the CPU and is cast per call.
REASON_DYNAMIC_VRAM = ("weights streamed by ComfyUI's dynamic VRAM (start ComfyUI with --disable-dynamic-vram "
                       "or --highvram to keep them resident)")
REASON_SHAPE = "input features do not match the weight"
# The `dynamic_vram` choice per model: what a call whose weight ComfyUI streams gets.
DYNAMIC_VRAM_AUTO = "auto"  # FP8 weights as they are, 16/32-bit weights quantised per call
DYNAMIC_VRAM_FP8_WEIGHTS = "fp8_weights_only"  # FP8 weights only; the others go to ComfyUI
DYNAMIC_VRAM_OFF = "off"  # every streamed call goes to ComfyUI (the behaviour before 0.29 support)
DYNAMIC_VRAM_MODES = (DYNAMIC_VRAM_AUTO, DYNAMIC_VRAM_FP8_WEIGHTS, DYNAMIC_VRAM_OFF)
REASON_STREAMED_PER_CALL_OFF = ("16/32-bit weights streamed by dynamic VRAM: per-call FP8 quantisation is off for this "
                                "model (dynamic_vram 'fp8_weights_only'; it costs one layer's FP8 copy and a pass "
                                "over the weight per call)")
REASON_DYNAMIC_VRAM_OFF = "weights streamed by ComfyUI's dynamic VRAM: this model's dynamic_vram is 'off'"
REASON_GUARD = "quality guard: this layer's output differed from ComfyUI's (see linear_fallbacks)"
REASON_KERNEL_ERROR = "our kernel raised an error on this layer (see the log)"
REASON_CAPTURING = ("CUDA graph capture: our prepared weights would not follow a later in-place weight change "
                    "(a LoRA re-applied) at replay; ComfyUI's Linear reads the live weights")
REASON_AUTOGRAD = ("autograd is recording this call (our kernels have no backward): ComfyUI's Linear keeps it "
                   "differentiable")
REASON_EXT_GUARD = "quality guard: {path} differed from ComfyUI's Linear on this layer (see linear_fallbacks)"


class HandBack(Exception):
    """This call goes to the layer's original forward; the message is the counted reason."""


class ExtensionHandBack(Exception):
    """A Linear extension failed on this call: it goes to ComfyUI's Linear (`reference`, when
    the guard already computed it); the message is the counted reason."""

    def __init__(self, reason: str, reference=None):
        super().__init__(reason)
        self.reference = reference


# ---- skip patterns --------------------------------------------------------------------------

@dataclass(frozen=True)
class SkipPatterns:
    globs: tuple[str, ...] = ()
    regexes: tuple[tuple[str, re.Pattern], ...] = ()

    @classmethod
    def parse(cls, text: str) -> SkipPatterns:
        """Comma-separated fnmatch patterns, `re:<regex>` entries, and `auto` for the defaults.

        Raises ValueError (with the entry) for a regex that does not compile.
        """
        globs, regexes = [], []
        for entry in (part.strip() for part in (text or "").split(",")):
            if not entry:
                continue
            if entry.lower() == SKIP_AUTO:
                globs.extend(DEFAULT_SKIP_PATTERNS)
            elif entry.startswith("re:"):
                try:
                    regexes.append((entry, re.compile(entry[3:])))
                except re.error as e:
                    raise ValueError(f"skip pattern {entry!r} is not a valid regex: {e}") from None
            else:
                globs.append(entry.lower())
        return cls(tuple(dict.fromkeys(globs)), tuple(regexes))

    def match(self, name: str) -> str | None:
        """The first pattern `name` matches, or None."""
        lowered = name.lower()
        for pattern in self.globs:
            if fnmatch.fnmatchcase(lowered, pattern):
                return pattern
        for entry, regex in self.regexes:
            if regex.fullmatch(name):
                return entry
        return None


# ---- the kernels (a seam: tests pass a deliberately broken backend) -------------------------

@dataclass(frozen=True)
class LinearBackend:
    prepare: object  # prepare_weight(weight, method, weight_scale) -> PreparedLinearWeight
    run: object  # linear(x, prepared, bias, out_dtype) -> Tensor
    refusal: object  # linear_refusal(method, device, dtype) -> str | None
    input_error: type = ValueError  # what `prepare` raises for a weight it cannot take
    # prepare_weight_per_call(weight, method, weight_scale): for a weight used by one call only
    # (dynamic VRAM); None: `prepare` serves those too.
    prepare_per_call: object = None
    # Methods whose `run` takes activation_out (a contiguous copy of the activated columns).
    activation_out_methods: tuple = ()


def default_backend() -> LinearBackend:
    from .. import kernels
    from ..kernels.linear.dispatch import prepare_weight_per_call

    from ..kernels.linear.dispatch import ACTIVATION_OUT_METHODS

    return LinearBackend(kernels.prepare_weight, kernels.linear, kernels.linear_refusal, kernels.LinearInputError,
                         prepare_weight_per_call, ACTIVATION_OUT_METHODS)


# ---- per-layer state ------------------------------------------------------------------------

@dataclass
class PreparedEntry:
    key: tuple
    method: str
    prepared: object = None  # PreparedLinearWeight, or None when `refusal` says why not
    refusal: str | None = None
    guarded: bool = False  # the quality guard ran on this weight version
    shared_bytes: int = 0  # FP8 checkpoint weights used as they are: the model's own storage

    def nbytes(self) -> int:
        """Memory this entry adds to the model's own."""
        return self.prepared.nbytes() - self.shared_bytes if self.prepared is not None else 0


def is_linear_module(module: torch.nn.Module) -> bool:
    """torch.nn.Linear (every comfy.ops Linear but one) or ComfyUI's mixed-precision Linear
    (a plain Module with comfy_cast_weights), with a 2-D weight."""
    if not (isinstance(module, torch.nn.Linear)
            or (type(module).__name__ == "Linear" and hasattr(module, "comfy_cast_weights"))):
        return False
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2


_MISSING = object()
_class_has: dict[tuple[type, str], bool] = {}


def module_attr(module: torch.nn.Module, name: str, default=None):
    """getattr(module, name, default) without nn.Module.__getattr__ raising (and catching) an
    AttributeError for a name the module lacks: the Linear call path probes several such names
    (layout_type, _v, scale_weight...) on every call, microseconds each. Same answer as getattr:
    class attributes and descriptors through the normal lookup, then the instance's own
    attributes, parameters, buffers and submodules."""
    cls = type(module)
    has = _class_has.get((cls, name))
    if has is None:
        has = _class_has[(cls, name)] = any(name in c.__dict__ for c in cls.__mro__)
    if has:
        return getattr(module, name, default)
    d = module.__dict__
    value = d.get(name, _MISSING)
    if value is not _MISSING:
        return value
    for store in ("_parameters", "_buffers", "_modules"):
        values = d.get(store)
        if values is not None and name in values:
            return values[name]
    return default


def _is_quantized_layer(module, weight) -> bool:
    # QuantizedTensor (and any other tensor subclass) survives nn.Parameter() as its own type.
    return (module_attr(module, "layout_type") is not None or module_attr(module, "quant_format") is not None
            or type(weight) not in (torch.nn.Parameter, torch.Tensor))


def _weight_version(weight: torch.Tensor) -> int:
    try:
        return weight._version
    except RuntimeError:  # inference tensors keep no version counter
        return -1


def _is_compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:
        return False


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
        self.companions: list[tuple[torch.nn.Module, _ModulePatch]] = []
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
        if _is_compiling():
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
        self._steady = (x.device, x.dtype, device_key(x.device), weight, weight.data_ptr(), _weight_version(weight),
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
                or _weight_version(weight) != version or module_attr(module, "scale_weight") is not scale
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
                        planned = _streamed_plan(self, x)
                    except HandBack as e:
                        reasons.append(str(e))
                    else:
                        return _streamed_run(self, x, *planned)
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
                weight, _ = _with_stored_scale(module, cast_weight.detach())
                out = self._run_extension(path, x, weight, bias, reasons)
            finally:  # the tensors the cast gave, as ComfyUI's own Linear hands them back
                state.weight_cast.uncast(module, cast_weight, bias, handle)
        else:
            weight, _ = _with_stored_scale(module, module.weight.detach().to(x.dtype))
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
        if self.activation is None or _is_compiling() or _UNFUSED.get() or not storage_marks_work():
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
        if _is_quantized_layer(module, weight):
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
            raise HandBack(REASON_DYNAMIC_VRAM if module_attr(module, "_v", _MISSING) is not _MISSING
                           else REASON_OFFLOADED)
        if x.dtype not in INPUT_DTYPES:
            raise HandBack(f"input dtype {x.dtype} is not float16/bfloat16/float32")
        if weight.dtype not in WEIGHT_DTYPES:
            raise HandBack(f"weight dtype {weight.dtype} is not float16/bfloat16/float32/float8_e4m3fn")
        if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
            raise HandBack(REASON_SHAPE)
        if ours and x.numel() // weight.shape[1] < min_tokens:
            raise HandBack(self.state.few_tokens_reason)


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
        scale_key = None if scale is None else (id(scale), scale.data_ptr(), _weight_version(scale))
        return (id(w), w.data_ptr(), _weight_version(w), device_key(device), w.dtype, self.weights_token, scale_key)

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
                    or _is_quantized_layer(module, weight) or weight.device != device
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
                module = _submodule(getattr(getattr(clone, "model", None), "diffusion_model", None), value.name)
                layer = layers.get(value.layer.name)
                if module is None or layer is None:
                    clone.object_patches[key] = _rebound(value.previous, value.module, module) \
                        if module is not None else value.previous
                else:
                    clone.object_patches[key] = FusedSequential(value.name, module,
                                                                _rebound(value.previous, value.module, module),
                                                                layer, value.index)
            elif isinstance(value, FusedActivation):  # stateless, but its GELU should be the clone's module's
                module = _submodule(getattr(getattr(clone, "model", None), "diffusion_model", None), value.name)
                if module is not None and module is not value.module:
                    clone.object_patches[key] = FusedActivation(value.name, module,
                                                                _rebound(value.previous, value.module, module))
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
        if not self.layers or _submodule(diffusion_model, self.layers[0].name) is self.layers[0].module:
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
            module = _submodule(diffusion_model, layer.name)
            if module is not None and is_linear_module(module):
                copy = LinearLayer(state, layer.name, module, _rebound(layer.previous, layer.module, module))
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
    from ..kernels.core.device import describe

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


def _submodule(root: torch.nn.Module, name: str):
    try:
        return root.get_submodule(name)
    except AttributeError:
        return None


def _rebound(previous, old_module, new_module):
    """The forward a clone's layer hands back to: ComfyUI's forward bound to the clone's module
    where the original was bound to the original's; another node's patch as it is."""
    if isinstance(previous, types.MethodType) and previous.__self__ is old_module:
        return types.MethodType(previous.__func__, new_module)
    return previous


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
        if (module_attr(module, "_v", _MISSING) is _MISSING or not isinstance(x, torch.Tensor)
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


def _streamed_plan(layer: LinearLayer, x: torch.Tensor) -> tuple[str, torch.dtype, StreamedEntry]:
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


def _with_stored_scale(module, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
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


def _run_streamed(layer: LinearLayer, x: torch.Tensor, method: str, weight_dtype, entry: StreamedEntry):
    """Our kernel on the weight ComfyUI's cast hands over (None when the kernels refuse that
    weight: entry.refusal says why). The cast is undone whatever happens."""
    state, module = layer.state, layer.module
    weight, bias, handle = state.weight_cast.cast(module, x, weight_dtype)
    try:
        # uncast gets the cast's own tensors back, not the scaled copy the kernels take.
        scaled, scale = _with_stored_scale(module, weight.detach())
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
        method, weight_dtype, entry = _streamed_plan(layer, x)
    except HandBack as e:
        return layer.handed_back((x,), {}, str(e))
    return _streamed_run(layer, x, method, weight_dtype, entry)


def _streamed_run(layer: LinearLayer, x: torch.Tensor, method: str, weight_dtype, entry: StreamedEntry):
    """Our kernel on a streamed call _streamed_plan accepted, guarded on its weight version's first call."""
    state = layer.state
    # A guarded call may run ours twice: the first cast of a layer with a LoRA can write a
    # rounded copy of the patched weight back into the VBAR (update_weight: stochastic rounding
    # of an FP8 weight, ~5 % per element), which the reference then reads; ours runs again on
    # that weight before a disagreement is held against the kernel.
    reference = failure = None
    for _ in range(1 if entry.guarded else 2):
        try:
            out = _run_streamed(layer, x, method, weight_dtype, entry)
        except Exception as e:  # any kernel failure: ComfyUI's Linear serves the layer from now on
            state.fall_back(layer, x.device, f"kernel error: {type(e).__name__}: {e}")
            return _streamed_hand_back(layer, x, reference, REASON_KERNEL_ERROR)
        if out is None:
            return _streamed_hand_back(layer, x, reference, entry.refusal)
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
        return _streamed_hand_back(layer, x, reference, REASON_GUARD)
    call_stats.record(call_stats.OUTCOME_SERVED, path=f"{method} (dynamic VRAM)", kind=KIND, model=state.label)
    if linear_choice.verdict_key(x) not in layer.verdicts:
        linear_choice.after_served(layer, x, True, method)
    return out


def _streamed_hand_back(layer: LinearLayer, x: torch.Tensor, reference, reason: str):
    """ComfyUI's output for this call: the guard's reference when it ran, else its forward."""
    if reference is None:
        return layer._original((x,), {}, reason)
    call_stats.record(call_stats.OUTCOME_HANDED_BACK, reason, kind=KIND, model=layer.state.label)
    return reference


# ---- fused activations ----------------------------------------------------------------------

ACTIVATION_GELU_TANH = "gelu_tanh"  # kernels.linear.dispatch's activation name for nn.GELU(approximate="tanh")
# The mark lives on the output's storage, which every view of it shares: ComfyUI runs its
# samplers under torch.inference_mode, where a view (torch.split's mlp columns) records no _base,
# so a mark on the output tensor was not found from its views there (the single block's GELU
# then ran a second time on activated columns; tests/integration caught it). torch keeps one
# Python object per storage, as per tensor (checked once: storage_marks_work()).
ACTIVATION_MARK_ATTR = "_triton_accel_activation"


@dataclass(frozen=True)
class ActivationMark:
    """What our kernel wrote into a storage: `rows` x `width` output elements from storage
    offset `offset`, columns >= `first` activated, and `copy` (or None), a contiguous tensor
    holding those same columns."""
    first: int
    offset: int
    rows: int
    width: int
    copy: torch.Tensor | None = None


_storage_marks: list[bool] = []


def storage_marks_work() -> bool:
    """Whether an attribute set on a tensor's untyped_storage() is read back through a view
    made under torch.inference_mode (PyObject preservation of storages). Where it is not,
    nothing is fused: an unmarked activated output would get its GELU twice."""
    if not _storage_marks:
        try:
            with torch.inference_mode():
                probe = torch.zeros(2, 4)
                setattr(probe.untyped_storage(), ACTIVATION_MARK_ATTR, ActivationMark(2, 0, 2, 4))
                view = torch.split(probe, [2, 2], dim=-1)[1]
                del probe
                works = isinstance(getattr(view.untyped_storage(), ACTIVATION_MARK_ATTR, None), ActivationMark)
        except Exception as e:  # a torch without untyped_storage() or attributes on it
            log.debug("Triton Accel Linear: storage marks unavailable: %s", e)
            works = False
        if not works:
            log.info("Triton Accel Linear: this torch keeps no attributes on tensor storages: GELUs are not fused")
        _storage_marks.append(works)
    return _storage_marks[0]


# The storages we marked, held until their activation module has read them (at most
# MAX_HELD_MARKS, oldest dropped first). torch keeps a storage's Python object, and with it the
# mark, while C++ still holds the storage (PyObject preservation), but not always: in a real
# ComfyUI server on the CPU, the second step of the first patched prompt after an unpatched one
# found no mark on the Flux single block's linear1 output (same storage as the mark was set on,
# a moment before), and the block's GELU ran a second time on activated columns (the latent 2.0e-2
# from the unpatched one instead of 1.6e-2; tests/integration caught it as prompts that did not
# repeat). Holding the Python object keeps its attributes, and keeps the storage from being freed
# and its address reused while a mark names it.
MAX_HELD_MARKS = 4
_held_marks: collections.deque = collections.deque(maxlen=MAX_HELD_MARKS)
_held_marks_lock = threading.Lock()


def mark_activated(out: torch.Tensor, first: int, copy: torch.Tensor | None = None) -> None:
    """Mark our kernel's output (contiguous, as the kernel wrote it): columns >= first hold
    GELU(x @ W.T + b), and `copy`, contiguous, holds the same columns."""
    width = out.shape[-1] if out.dim() else 0
    mark = ActivationMark(int(first), out.storage_offset(), out.numel() // max(width, 1), width, copy)
    storage = out.untyped_storage()
    setattr(storage, ACTIVATION_MARK_ATTR, mark)
    with _held_marks_lock:
        _held_marks.append(storage)


def release_mark(x: torch.Tensor) -> None:
    """x's storage is read: no longer held for its mark (the tensors using it keep it alive)."""
    try:
        storage = x.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return
    with _held_marks_lock:
        for i, held in enumerate(_held_marks):
            if held is storage:
                del _held_marks[i]
                return


def held_marks() -> int:
    with _held_marks_lock:
        return len(_held_marks)


def _mark_of(x: torch.Tensor) -> ActivationMark | None:
    try:
        return getattr(x.untyped_storage(), ACTIVATION_MARK_ATTR, None)
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return None


def activated_copy(x: torch.Tensor) -> torch.Tensor | None:
    """The contiguous copy of x when x is exactly the copied columns of a marked output (all
    rows, columns first..end: torch.split's tail), shaped as x; else None."""
    mark = _mark_of(x)
    if mark is None or mark.copy is None or not _within(x, mark):
        return None
    if x.storage_offset() - mark.offset != mark.first or x.numel() != mark.copy.numel():
        return None
    return mark.copy.view(x.shape)


def is_activated(x: torch.Tensor) -> bool:
    """Whether x lies within columns our kernel already activated: the marked output itself
    (activated from column 0), a reshape of it, or a view of whole rows' trailing columns of it
    (split off a fused projection). Anything else (a copy, a cast, other columns) is not."""
    mark = _mark_of(x)
    return mark is not None and _within(x, mark)


def _within(x: torch.Tensor, mark: ActivationMark) -> bool:
    if x.dim() < 1 or x.stride(-1) != 1:
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    if rows != mark.rows or (x.dim() >= 2 and rows > 1 and x.stride(-2) != mark.width):
        return False
    column = x.storage_offset() - mark.offset
    return mark.first <= column and column + x.shape[-1] == mark.width


class _ModulePatch:
    """An object patch of one module's forward: `previous` is the forward it replaces (the
    module's own, or another node's patch). Shared by clones, never copied."""

    def __init__(self, name: str, module: torch.nn.Module, previous):
        self.name = name
        self.module = module
        self.previous = previous

    def __deepcopy__(self, memo):
        return self


class FusedActivation(_ModulePatch):
    """The object patch of an activation module whose Linear our kernel serves with the
    activation fused: a tensor our kernel activated passes through, anything else (every call
    ComfyUI's Linear or an extension served, and everything under torch.compile's tracing) goes
    to the module's own forward."""

    def __call__(self, *args, **kwargs):
        if (len(args) == 1 and not kwargs and type(args[0]) is torch.Tensor and not _is_compiling()
                and is_activated(args[0])):
            copy = activated_copy(args[0])
            release_mark(args[0])
            return args[0] if copy is None else copy
        return self.previous(*args, **kwargs)


class FusedSequential(_ModulePatch):
    """The object patch of an nn.Sequential whose Linear (child `index`) our kernel serves with
    the GELU after it (child `index + 1`) fused. Eager calls run the Sequential's own forward
    (the children's patches fuse through FusedActivation's marks). Under torch.compile's tracing,
    where a traced graph keeps no marks, the pair is recorded as one activated patched_linear
    op (the GELU in our epilogue at run time, as eager) and the other children as they are;
    anything the op could not serve traces the Sequential's own forward."""

    def __init__(self, name: str, module: torch.nn.Module, previous, layer: LinearLayer, index: int):
        super().__init__(name, module, previous)
        self.layer = layer
        self.index = index

    def __call__(self, *args, **kwargs):
        if not _is_compiling() or len(args) != 1 or kwargs or not self.layer.traces_fused(args[0]):
            return self.previous(*args, **kwargs)
        children = list(self.module)
        # Another node's patch installed over ours on either child: trace everything as it is.
        if (len(children) <= self.index + 1 or children[self.index].forward is not self.layer
                or not isinstance(children[self.index + 1].forward, FusedActivation)):
            return self.previous(*args, **kwargs)
        x = args[0]
        for i, child in enumerate(children):
            if i == self.index:
                x = torch.ops.triton_accel.patched_linear(x, self.layer.token, True)
            elif i != self.index + 1:
                x = child(x)
        return x


def _is_gelu_tanh(module) -> bool:
    return type(module) is torch.nn.GELU and module.approximate == "tanh"


def fusable_activations(diffusion_model: torch.nn.Module) -> list[tuple[str, str, int]]:
    """(Linear name, activation module name, first activated column) for each GELU-tanh fed by
    a Linear alone: nn.Sequential(..., Linear, GELU(tanh), ...) (Flux double blocks, Wan FFN,
    Chroma, HunyuanVideo). Flux's single blocks: fusable_with_copy."""
    found = []
    for name, module in diffusion_model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, torch.nn.Sequential):
            children = list(module.named_children())
            for (n1, m1), (n2, m2) in zip(children, children[1:]):
                if is_linear_module(m1) and _is_gelu_tanh(m2):
                    found.append((prefix + n1, prefix + n2, 0))
    return found


def fusable_with_copy(diffusion_model: torch.nn.Module) -> list[tuple[str, str, int]]:
    """(Linear name, activation module name, first activated column) for Flux-style single
    blocks: `qkv, mlp = split(linear1(x), [3 * hidden_size, mlp_hidden_dim])`, then
    `mlp_act(mlp)` (GELU tanh) goes into `torch.cat((attn, ...))`.

    The GELU is fused there only with a contiguous copy of the activated columns
    (kernels.linear.dispatch's activation_out): handed the strided slice of linear1's output instead of
    GELU's contiguous result, that cat runs its non-vectorised kernel, which cost more than the
    GELU pass saved (H200, Flux 12B, one step: 5.9 ms saved, 7.6 ms more in the cat;
    benchmarks/RESULTS.md, session 20). Blocks whose MLP takes another slice (a gated
    `yak_mlp`, SiLU variants) are left alone."""
    found = []
    for name, module in diffusion_model.named_modules():
        if type(module).__name__ != "SingleStreamBlock":
            continue
        linear1, act = getattr(module, "linear1", None), getattr(module, "mlp_act", None)
        hidden, mlp = getattr(module, "hidden_size", None), getattr(module, "mlp_hidden_dim", None)
        if (not is_linear_module(linear1) or not _is_gelu_tanh(act) or not isinstance(hidden, int)
                or not isinstance(mlp, int) or getattr(module, "yak_mlp", False)
                or getattr(module, "mlp_hidden_dim_first", mlp) != mlp
                or linear1.out_features != 3 * hidden + mlp):
            continue
        prefix = f"{name}." if name else ""
        found.append((prefix + "linear1", prefix + "mlp_act", 3 * hidden))
    return found


def _fuse_activations(patched, state: LinearPatchState, with_copies: bool = False) -> None:
    """Give each fusable layer its activation and patch the activation module (`with_copies`:
    the fusable_with_copy() ones too)."""
    layers = {layer.name: layer for layer in state.layers}
    diffusion_model = patched.model.diffusion_model
    fusable = [(*f, False) for f in fusable_activations(diffusion_model)]
    if with_copies:
        fusable += [(*f, True) for f in fusable_with_copy(diffusion_model)]
    for linear_name, act_name, first, with_copy in fusable:
        layer = layers.get(linear_name)
        if layer is None or layer.skip_reason:
            continue
        key = f"diffusion_model.{act_name}.forward"
        previous = patched.get_model_object(key)
        while isinstance(previous, FusedActivation):  # re-patching one of our clones
            previous = previous.previous
        module = _submodule(diffusion_model, act_name)
        layer.activation = (ACTIVATION_GELU_TANH, first)
        layer.activation_copy = with_copy
        layer.activation_forward = previous
        fused = FusedActivation(act_name, module, previous)
        layer.activation_patch = fused
        layer.companions.append((module, fused))
        patched.add_object_patch(key, fused)
        if not with_copy:  # Sequential(..., Linear, GELU, ...): one op for the pair under torch.compile
            _fuse_sequential(patched, diffusion_model, layer, linear_name)


def _fuse_sequential(patched, diffusion_model, layer: LinearLayer, linear_name: str) -> None:
    seq_name, _, child = linear_name.rpartition(".")
    seq = _submodule(diffusion_model, seq_name) if seq_name else None
    if not isinstance(seq, torch.nn.Sequential) or not child.isdigit():
        return
    key = f"diffusion_model.{seq_name}.forward"
    previous = patched.get_model_object(key)
    while isinstance(previous, FusedSequential):  # re-patching one of our clones
        previous = previous.previous
    fused = FusedSequential(seq_name, seq, previous, layer, int(child))
    layer.companions.append((seq, fused))
    patched.add_object_patch(key, fused)


# ---- patching a ModelPatcher ----------------------------------------------------------------

def _interrupt_check():
    management = sys.modules.get("comfy.model_management")
    return getattr(management, "throw_exception_if_processing_interrupted", None)


def patch_linear_model(model, settings: AccelSettings | None = None, skip: str = SKIP_AUTO,
                       min_tokens: int = MIN_TOKENS, backend: LinearBackend | None = None,
                       label: str | None = None, dynamic_vram: str = DYNAMIC_VRAM_AUTO,
                       weight_cast: ComfyWeightCast | None = None, fuse_activations: bool = True,
                       copy_activations: bool = True):
    """A clone of `model` (a ComfyUI ModelPatcher) whose diffusion model's Linear layers go
    through kernels.linear. `label`: call_stats' name for the clone (a new one when None);
    `dynamic_vram`: one of DYNAMIC_VRAM_MODES (what calls whose weights ComfyUI streams get);
    `fuse_activations`: GELUs fed by a served Linear run in its GEMM epilogue (FusedActivation);
    `copy_activations`: Flux's single blocks too, with the contiguous copy (fusable_with_copy()).
    On by default: 4.2 ms off a 119.6 ms Flux step on the H200, measured in one ABBA run
    (benchmarks/RESULTS.md, session 25); peak memory +0.2 GiB.
    Raises ValueError for a skip pattern that does not parse or an unknown dynamic_vram."""
    settings = settings or AccelSettings("auto")
    patterns = SkipPatterns.parse(skip)
    patched = model.clone()
    label = label or call_stats.new_model_label(type(getattr(model, "model", model)).__name__)
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
        _fuse_activations(patched, state, copy_activations)
    _add_callbacks(patched, state)
    step_graph.install(patched, label, state)
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


def _dynamic_vram_enabled() -> bool:
    """ComfyUI runs with dynamic VRAM (comfy-aimdo): what its main.py sets once aimdo is up."""
    return bool(getattr(sys.modules.get("comfy.memory_management"), "aimdo_enabled", False))


DYNAMIC_VRAM_TEXT = {
    DYNAMIC_VRAM_AUTO: "streamed FP8 weights are used as they are, 16/32-bit ones quantised to FP8 per call",
    DYNAMIC_VRAM_FP8_WEIGHTS: "streamed FP8 weights are used as they are, 16/32-bit ones go to ComfyUI's Linear",
    DYNAMIC_VRAM_OFF: "layers with streamed weights go to ComfyUI's Linear (dynamic_vram off)",
}


def _dynamic_vram_input() -> dict:
    return {"dynamic_vram": (list(DYNAMIC_VRAM_MODES), {
        "default": DYNAMIC_VRAM_AUTO,
        "tooltip": "ComfyUI 0.29+ dynamic VRAM streams each layer's weight per call. auto: FP8 weights feed our "
                   "FP8 matmul as they are; BF16/FP16 weights are quantised to FP8 on every call (one layer's "
                   "FP8 copy of memory, freed after the call; a pass over the weight that large calls repay). "
                   "fp8_weights_only: only FP8 weights; off: ComfyUI's Linear for every streamed layer.",
    })}


def _linear_inputs() -> dict:
    return {
        "skip": ("STRING", {
            "default": SKIP_AUTO,
            "tooltip": "Layers left to ComfyUI's Linear, by name (comma-separated fnmatch patterns such as "
                       "'double_blocks.0.*', or 're:<regex>'). 'auto': embedders, final layers and modulation "
                       "layers of every family; 'auto, single_blocks.3?.*' adds to them; empty: none.",
        }),
        "min_tokens": ("INT", {
            "default": MIN_TOKENS, "min": 1, "max": 1 << 20,
            "tooltip": "Calls with fewer rows (tokens x batch) go to ComfyUI's Linear: quantising cannot pay.",
        }),
    }


# What users type into the node search to find the Linear nodes (the frontend matches these too).
LINEAR_SEARCH_ALIASES = ["linear", "matmul", "gemm", "quantize", "w8a8", "fp8", "int8", "speed", "fast", "triton",
                         "accelerate", "optimize"]


class TritonAccelPatchLinear:
    CATEGORY = "Triton Accel"
    DESCRIPTION = ("Runs the diffusion model's Linear layers through Triton Accel's quantised matmul (FP8 W8A8 on "
                   "sm_89+, INT8 W8A8 on sm_75-sm_86, FP8 weight-only for FP8 checkpoints on sm_80/86). The first "
                   "call checks each layer against ComfyUI's Linear; calls it cannot serve go to ComfyUI's Linear.")
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The same model with Triton Accel Linear layers (the input model is left untouched).",)
    FUNCTION = "patch"
    SEARCH_ALIASES = LINEAR_SEARCH_ALIASES

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"model": ("MODEL", {"tooltip": "The diffusion model (from a loader or a LoRA node)."}),
                         **_linear_inputs()},
            "optional": {"settings": (SETTINGS_TYPE, {
                "tooltip": "From Triton Accel Settings (its 'linear' mode). Not connected: auto."}),
                **_dynamic_vram_input()},
        }

    def patch(self, model, skip: str = SKIP_AUTO, min_tokens: int = MIN_TOKENS, settings: AccelSettings | None = None,
              dynamic_vram: str = DYNAMIC_VRAM_AUTO):
        settings = settings or AccelSettings("auto")
        patched = patch_linear_model(model, settings, skip, min_tokens, dynamic_vram=dynamic_vram)
        return {"ui": {"text": [patched_linear_text(patched, settings)]}, "result": (patched,)}


class TritonAccelPatch:
    CATEGORY = "Triton Accel"
    DESCRIPTION = ("Triton Accel Patch Attention and Patch Linear in one node: our attention and our quantised "
                   "Linear layers, each decided per GPU by the Settings node (or auto).")
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = (("The same model with Triton Accel attention and Linear layers (the input model is left "
                        "untouched)."),)
    FUNCTION = "patch"
    SEARCH_ALIASES = ATTENTION_SEARCH_ALIASES + [a for a in LINEAR_SEARCH_ALIASES if a not in ATTENTION_SEARCH_ALIASES]

    @classmethod
    def INPUT_TYPES(cls):
        return TritonAccelPatchLinear.INPUT_TYPES()

    def patch(self, model, skip: str = SKIP_AUTO, min_tokens: int = MIN_TOKENS, settings: AccelSettings | None = None,
              dynamic_vram: str = DYNAMIC_VRAM_AUTO):
        from .patch_attention import OVERRIDE_KEY
        from .patch_attention import patch_model as patch_attention_model

        settings = settings or AccelSettings("auto")
        with_attention = patch_attention_model(model, settings)
        label = with_attention.model_options["transformer_options"][OVERRIDE_KEY].label
        patched = patch_linear_model(with_attention, settings, skip, min_tokens, label=label, dynamic_vram=dynamic_vram)
        text = f"{patched_model_text(patched, label, settings)}\n{patched_linear_text(patched, settings)}"
        return {"ui": {"text": [text]}, "result": (patched,)}
