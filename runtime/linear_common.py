"""The Linear engine's shared parts: thresholds, hand-back reasons, skip patterns, the kernel
seam (LinearBackend), a layer's prepared weight, and the cheap module reads every call makes.

The engine as a whole is described in linear_patch.py."""
from __future__ import annotations

import fnmatch
import re
import types
from dataclasses import dataclass

import torch

from .. import kernels
from ..kernels.core.gpu_rules import LINEAR_FP8_W8A8, LINEAR_FP8_WEIGHT_ONLY, LINEAR_INT8_W8A8
from ..kernels.linear.dispatch import ACTIVATION_OUT_METHODS, prepare_weight_per_call
from . import call_stats
from .guards import LOSSLESS_BAR

KIND = call_stats.KIND_LINEAR
CALLBACK_KEY = "triton_accel_linear"
# Below this many rows (tokens x batch) a call goes to ComfyUI's Linear. With few rows the
# GEMM is bound by reading the weight, which FP8 halves but the separate activation-
# quantisation launch and the persistent kernel's 128-row tiles give back: on the H200 a
# 512-row text stream (Flux 512x3072->9216) ran at 0.49x cuBLAS, 4096 rows at 1.09-1.61x
# (benchmark node, benchmarks/RESULTS.md). These calls are modulation and
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
# lossless bar (guards.LOSSLESS_BAR, attention's too: rounding only), a lossy one by our
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


MISSING = object()
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
    value = d.get(name, MISSING)
    if value is not MISSING:
        return value
    for store in ("_parameters", "_buffers", "_modules"):
        values = d.get(store)
        if values is not None and name in values:
            return values[name]
    return default


def is_quantized_layer(module, weight) -> bool:
    # QuantizedTensor (and any other tensor subclass) survives nn.Parameter() as its own type.
    return (module_attr(module, "layout_type") is not None or module_attr(module, "quant_format") is not None
            or type(weight) not in (torch.nn.Parameter, torch.Tensor))


def weight_version(weight: torch.Tensor) -> int:
    try:
        return weight._version
    except RuntimeError:  # inference tensors keep no version counter
        return -1


def is_compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:
        return False


def submodule(root: torch.nn.Module, name: str):
    try:
        return root.get_submodule(name)
    except AttributeError:
        return None


def rebound(previous, old_module, new_module):
    """The forward a clone's layer hands back to: ComfyUI's forward bound to the clone's module
    where the original was bound to the original's; another node's patch as it is."""
    if isinstance(previous, types.MethodType) and previous.__self__ is old_module:
        return types.MethodType(previous.__func__, new_module)
    return previous
