"""Our attention in any model, through ComfyUI's per-model hook (the Attention and Patch nodes).

ComfyUI's attention backends share `attention_X(q, k, v, heads, mask=None, attn_precision=None,
skip_reshape=False, skip_output_reshape=False, **kwargs)`, and `wrap_attn` hands every call
to `transformer_options["optimized_attention_override"](func, *args, **kwargs)` when a model
carries one. The override below adapts such a call to `kernels.attention` and hands
everything it cannot serve, unchanged, to `func` (or to an override that was there before).

Under torch.compile (ComfyUI's TorchCompileModel) a traced call records one opaque op,
triton_accel::patched_attention (compiled_ops), whose run time is the eager override on the
call restated in [B, H, L, D] form (skip_reshape): auto times and guards there as without
compile, and `func` is found again by its module and name for the calls it hands back.
"""
from __future__ import annotations

import logging
import sys

import torch

from .. import __version__ as PACK_VERSION
from .. import kernels
from ..kernels.core import extensions
from . import call_stats, call_timing, compiled_ops, fused_norms, step_graph
from .device_probe import probe
from ..kernels.core.gpu_rules import BACKEND_OF_PATH, LOSSY_PATHS, PATH_PYTORCH
from ..kernels.core.registry import BackendUnavailableError
from .settings import AccelSettings
from .speed_choice import ORIGINAL, SpeedChoice, note_model_device, shape_class
from .speed_choice import shared as shared_speed_choice

log = logging.getLogger("triton_accel")

OVERRIDE_KEY = "optimized_attention_override"
_PARAMS = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")
# Keywords that do not change what attention computes, or that we honour below. Anything
# else is a request we do not know, so the call goes to the original function.
_KNOWN_KWARGS = {"transformer_options", "_inside_attn_wrapper", "scale", "enable_gqa",
                 "low_precision_attention", "attn_precision"}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

AUTO_CAPTURING = "auto: not measured at this shape before a CUDA graph capture (no timing inside one)"
AUTO_KEPT_ORIGINAL = "auto: ComfyUI's attention measured faster (or not equal) at this shape"


def _speed() -> SpeedChoice:
    return shared_speed_choice()  # the one speed_choice.speed_summary() reports


def head_slices(call: dict):
    """The function splitting this call's output (ComfyUI's layout) into its (batch, head)
    slices, for auto's per-head agreement check."""
    b, h = call["batch"], call["heads"]
    if call["skip_output_reshape"]:  # [B, H, L, D]
        return lambda out: out.reshape(b * h, -1)
    return lambda out: out.reshape(b, out.shape[1], h, -1).transpose(1, 2).reshape(b * h, -1)  # [B, L, H * D]


def timed_on(device: torch.device) -> bool:
    """Whether auto times its candidates here (CUDA events: NVIDIA and ROCm GPUs)."""
    return device.type == "cuda"


class Unsupported(Exception):
    """This call goes to the original function; the message says why (counted per reason)."""


def _is_compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:
        return False


def adapt_call(args: tuple, kwargs: dict) -> dict:
    """ComfyUI's call as [B, H, L, D] tensors, or Unsupported with the reason."""
    if len(args) > len(_PARAMS):
        raise Unsupported("more positional arguments than ComfyUI's attention takes")
    call = dict(zip(_PARAMS, args))
    for name in _PARAMS:
        if name in kwargs:
            if name in call:
                raise Unsupported(f"argument {name} given twice")
            call[name] = kwargs[name]
    unknown = set(kwargs) - set(_PARAMS) - _KNOWN_KWARGS
    if unknown:
        raise Unsupported(f"unknown keyword {sorted(unknown)[0]}")
    q, k, v, heads = call.get("q"), call.get("k"), call.get("v"), call.get("heads")
    if not all(type(t) is torch.Tensor for t in (q, k, v)):
        raise Unsupported("q/k/v are not plain tensors")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise Unsupported(f"dtype {q.dtype}/{k.dtype}/{v.dtype}")
    if q.dtype == torch.float32 and kwargs.get("low_precision_attention", True) is False:
        # Our fp32 path runs its dots in TF32 on GPUs; a full-precision request is not ours to serve.
        raise Unsupported("low_precision_attention=False with float32 inputs")
    enable_gqa = bool(kwargs.get("enable_gqa", False))

    if call.get("skip_reshape", False):
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
            raise Unsupported("skip_reshape with tensors that are not [B, H, L, D]")
        b, dim_head = q.shape[0], q.shape[-1]
        out_heads = q.shape[1]
    else:
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or not isinstance(heads, int) or heads <= 0:
            raise Unsupported("layout is not [B, L, heads * D]")
        b = q.shape[0]
        if q.shape[-1] % heads:
            raise Unsupported("hidden size is not a multiple of heads")
        dim_head = q.shape[-1] // heads
        kv_heads = k.shape[-1] // dim_head if enable_gqa else heads
        if k.shape[-1] != kv_heads * dim_head or v.shape[-1] != kv_heads * dim_head:
            raise Unsupported("key/value hidden size does not match the heads")
        # Views, not copies: the kernel reads through strides.
        q = q.view(b, q.shape[1], heads, dim_head).transpose(1, 2)
        k = k.view(b, k.shape[1], kv_heads, dim_head).transpose(1, 2)
        v = v.view(b, v.shape[1], kv_heads, dim_head).transpose(1, 2)
        out_heads = heads
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise Unsupported("query and key heads differ without enable_gqa")

    mask = call.get("mask")
    if mask is not None:
        if type(mask) is not torch.Tensor:
            raise Unsupported("mask is not a tensor")
        # The same promotions as ComfyUI's attention_pytorch: [Lq, Lk] and [B, Lq, Lk] masks.
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
        if mask.dtype != torch.bool and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)
    return {"q": q, "k": k, "v": v, "mask": mask, "scale": kwargs.get("scale"), "batch": b,
            "heads": out_heads, "dim_head": dim_head, "attn_precision": call.get("attn_precision"),
            "skip_output_reshape": bool(call.get("skip_output_reshape", False))}


def speed_key(facts, usable, cls: str, mode: str = call_timing.MODE_EAGER) -> str:
    """auto's speed-cache key: GPU | arch | torch | Triton | pack | candidate paths | step mode |
    shape class. The step mode: an eager step's call costs host and GPU time, a replayed step
    graph's only GPU time (call_timing)."""
    return "|".join([facts.name, facts.arch, f"torch {facts.torch_version}", f"triton {facts.triton_version}",
                     f"pack {PACK_VERSION}", "+".join(usable), mode, cls])


_PLAIN = (int, float, bool, str, type(None))


def call_signature(args: tuple, kwargs: dict) -> tuple | None:
    """What auto's answer for a call depends on, cheap to build on every call: each tensor
    argument's shape, dtype and device, the plain values, the step mode and the registered
    extensions; None for a call with anything else (it takes the checked path)."""
    parts = []
    for a in args:
        if type(a) is torch.Tensor:
            parts.append((a.shape, a.dtype, a.device))
        elif isinstance(a, _PLAIN):
            parts.append(a)
        else:
            return None
    for name, a in kwargs.items():
        if name == "transformer_options" or name == "_inside_attn_wrapper":
            continue
        if type(a) is torch.Tensor:
            parts.append((name, a.shape, a.dtype, a.device))
        elif isinstance(a, _PLAIN) or isinstance(a, torch.dtype):
            parts.append((name, a))
        else:
            return None
    return (tuple(parts), call_timing.STEP_MODE.get(), extensions.generation())


class AttentionOverride:
    """The callable stored in transformer_options; shared by clones, never copied."""

    def __init__(self, settings: AccelSettings, previous=None, label: str | None = None):
        self.settings = settings
        self.previous = previous
        self.label = label  # call_stats' name for the patched clone ("Flux #1"), per-model counts
        self._usable: dict = {}
        self._extension_paths: dict = {}
        # auto's answer per call signature (call_signature): ORIGINAL, or the path that serves it.
        # ComfyUI's calls then take no adapter, no registry and no speed-cache lookup.
        self._verdicts: dict = {}
        # The step check (step_check) runs a step on ComfyUI's attention: every call goes to it.
        self.force_original = False
        self.token = compiled_ops.register(self)  # what a compiled graph's patched_attention op names it by

    def __deepcopy__(self, memo):
        return self

    def _auto_extensions(self, device: torch.device) -> tuple[str, ...]:
        """Other packs' attention (kernels/core/extensions.py) that auto times here, by priority: only
        in auto, only where auto times (it must prove itself faster and in agreement first), only
        those whose constraints admit the device."""
        if self.settings.mode != "auto" or not timed_on(device):
            return ()
        key = (str(device), extensions.generation())
        paths = self._extension_paths.get(key)
        if paths is None:
            paths = extensions.paths_by_priority(kernels.describe(device))
            self._extension_paths = {key: paths}
        return paths

    def _usable_paths(self, decision, q, k, v, mask, full_precision: bool, extra: tuple = ()):
        """The decision's paths (and `extra`: extensions) that can serve this call, and why the others cannot.

        A model repeats a handful of call signatures thousands of times per image, so the
        registry's answer is remembered per signature instead of re-checked on every call.
        """
        m = None if mask is None else (mask.dtype, tuple(mask.shape), mask.stride())
        key = (decision, extra, extensions.generation(), q.device, q.dtype, tuple(q.shape), tuple(k.shape),
               tuple(v.shape), m, full_precision)
        cached = self._usable.get(key)
        if cached is not None:
            return cached
        usable, refusals = [], []
        for path in decision.candidates + extra:
            if full_precision and (path in LOSSY_PATHS or extensions.is_lossy(path)):
                refusals.append(f"{path}: full precision requested")
                continue
            ok, reason = kernels.attention_support(q, k, v, mask, backend=BACKEND_OF_PATH.get(path, path))
            if ok:
                usable.append(path)
            else:
                refusals.append(f"{path}: {reason}" if extensions.is_extension_path(path) else reason)
        if len(self._usable) > 1024:
            self._usable.clear()
        self._usable[key] = (usable, refusals)
        return usable, refusals

    def _original(self, func, args, kwargs, reason: str):
        call_stats.record("original", reason, model=self.label)
        if self.previous is not None:
            return self.previous(func, *args, **kwargs)
        return func(*args, **kwargs)

    def __call__(self, func, *args, **kwargs):
        if _is_compiling():
            return self._traced(func, args, kwargs)
        return self._eager(func, args, kwargs)

    def _traced(self, func, args, kwargs):
        """What a torch.compile trace records for this call: the patched_attention op, or the
        original call traced as it is where the op could not restate it (settings off, a call
        adapt_call refuses, a `func` not reachable by module and name)."""
        name = _function_name(func)
        call = None
        if self.settings.mode != "off" and name is not None and COMPILED_OP_ERROR is None:
            try:
                call = adapt_call(args, kwargs)
            except Unsupported:
                call = None
        if call is not None and torch.is_grad_enabled() and any(call[t].requires_grad for t in "qkv"):
            call = None  # the op has no backward; the traced function keeps the call differentiable
        if call is None:
            if self.previous is not None:
                return self.previous(func, *args, **kwargs)
            return func(*args, **kwargs)
        q, k = call["q"], call["k"]
        return torch.ops.triton_accel.patched_attention(
            q, k, call["v"], call["mask"], call["scale"], call["attn_precision"], call["skip_output_reshape"],
            kwargs.get("low_precision_attention", True) is False, q.shape[1] != k.shape[1],
            compiled_ops.traced_token(self.token), name)

    def compiled_call(self, q, k, v, mask, scale, attn_precision, skip_output_reshape: bool, full_precision: bool,
                      enable_gqa: bool, function: str) -> torch.Tensor:
        """The run time of a traced call (the patched_attention op): the eager override on the
        same call in [B, H, L, D] form, contiguous as the op's fake promised."""
        # _inside_attn_wrapper: as wrap_attn passes it (our override is not asked again).
        kwargs = {"mask": mask, "attn_precision": attn_precision, "skip_reshape": True,
                  "skip_output_reshape": skip_output_reshape, "_inside_attn_wrapper": True}
        # Only what the traced call passed: ComfyUI's functions default these themselves.
        if scale is not None:
            kwargs["scale"] = scale
        if enable_gqa:
            kwargs["enable_gqa"] = True
        if full_precision:
            kwargs["low_precision_attention"] = False
        return self._eager(_resolve_function(function), (q, k, v, q.shape[1]), kwargs).contiguous()

    def _eager(self, func, args, kwargs):
        # auto's answer for a call signature it decided before: ComfyUI's function straight
        # away, or the chosen path without the registry and speed-cache lookups.
        signature = call_signature(args, kwargs) if self._verdicts else None
        verdict = self._verdicts.get(signature) if signature is not None else None
        if verdict == ORIGINAL or self.force_original:
            if self.previous is not None:
                return self.previous(func, *args, **kwargs)
            return func(*args, **kwargs)
        try:
            call = adapt_call(args, kwargs)
        except Unsupported as e:
            return self._original(func, args, kwargs, str(e))
        if verdict is not None and not compiled_ops.capturing(call["q"]):
            out = self._runner(verdict, call)()
            call_stats.record("triton", path=verdict, model=self.label)
            return out
        q, k, v, mask = call["q"], call["k"], call["v"], call["mask"]
        decision = self.settings.decision_for(q.device)
        extra = self._auto_extensions(q.device)
        if decision.path == PATH_PYTORCH and not extra:
            return self._original(func, args, kwargs, decision.reason)
        full_precision = kwargs.get("low_precision_attention", True) is False
        usable, refusals = self._usable_paths(decision, q, k, v, mask, full_precision, extra)
        if extra or extensions.is_extension_path(decision.path):
            # An extension that failed at this signature before stays with ComfyUI's attention.
            failed = {p: extensions.known_failure(p, q, k, v, mask)
                      for p in usable if extensions.is_extension_path(p)}
            usable = [p for p in usable if not failed.get(p)]
            refusals = refusals + [f"{p} failed: {why}" for p, why in failed.items() if why]
        if not usable:
            return self._original(func, args, kwargs, "; ".join(refusals) or "no candidate path")
        try:
            return self._serve(func, args, kwargs, call, usable, measure=decision.measure or bool(extra))
        except extensions.ExtensionCallError as e:
            return self._original(func, args, kwargs, f"{e.path} failed: {e.reason}")

    @staticmethod
    def _runner(path: str, call: dict):
        """The call on `path`, returned in ComfyUI's layout."""
        q, k, v, mask = call["q"], call["k"], call["v"], call["mask"]
        backend = BACKEND_OF_PATH.get(path, path)

        def run():
            try:
                out = kernels.attention(q, k, v, attn_mask=mask, scale=call["scale"], backend=backend)
            except BackendUnavailableError as e:
                if not extensions.is_extension_path(path):
                    raise
                raise extensions.ExtensionCallError(path, e.reason) from e  # unregistered since
            if call["skip_output_reshape"]:
                return out
            return out.transpose(1, 2).reshape(call["batch"], -1, call["heads"] * call["dim_head"])
        return run

    def _remember(self, args, kwargs, verdict: str) -> None:
        signature = call_signature(args, kwargs)
        if signature is None:
            return
        if len(self._verdicts) > 1024:
            self._verdicts.clear()
        self._verdicts[signature] = verdict

    def _serve(self, func, args, kwargs, call: dict, usable: list, measure: bool):
        """Run the call on the first usable path, or in auto on the one measured fastest."""
        q, k, mask = call["q"], call["k"], call["mask"]

        def runner(path):
            return self._runner(path, call)

        def whole_call(path):
            # What auto times: the call as the step makes it, our adapter included.
            def run():
                return self._runner(path, adapt_call(args, kwargs))()
            return run

        if measure and timed_on(q.device):
            facts = probe(q.device)
            cls = shape_class(q, k, mask)
            key = speed_key(facts, usable, cls, call_timing.STEP_MODE.get())
            if compiled_ops.capturing(q):
                # No timing inside a CUDA graph capture: an earlier measurement, else ComfyUI's.
                known = _speed().known(key)
                if known not in usable:
                    return self._original(func, args, kwargs, AUTO_CAPTURING)
                out = runner(known)()
                call_stats.record("triton", path=known, model=self.label)
                return out
            known = _speed().known(key)
            if known == ORIGINAL:
                # What choose() answers from its cache, without building the candidates first.
                self._remember(args, kwargs, ORIGINAL)
                return self._original(func, args, kwargs, AUTO_KEPT_ORIGINAL)

            def original():
                return (self.previous(func, *args, **kwargs) if self.previous is not None
                        else func(*args, **kwargs))

            candidates = {path: whole_call(path) for path in usable}
            candidates[ORIGINAL] = original
            # A quantized path is kept only where it measured faster and agrees with ComfyUI's
            # output by its bar (speed_choice.agreement_bar: whole-output rel. L2, worst-head cosine).
            about = {"device": str(q.device), "gpu": facts.name, "arch": facts.arch, "shape_class": cls}
            note_model_device(self.label, q.device)  # its node shows this device's measurements
            with call_stats.muted():
                choice, out = _speed().choose(key, candidates, q.device, groups=head_slices(call), about=about)
            self._remember(args, kwargs, choice)
            if choice == ORIGINAL:
                if out is None:
                    return self._original(func, args, kwargs, AUTO_KEPT_ORIGINAL)
                call_stats.record("original", AUTO_KEPT_ORIGINAL, model=self.label)
                return out
            out = out if out is not None else runner(choice)()
            call_stats.record("triton", path=choice, model=self.label)
            return out
        out = runner(usable[0])()
        call_stats.record("triton", path=usable[0], model=self.label)
        return out


def _function_name(func) -> str | None:
    """"module:name" of a module-level function (ComfyUI's attention_* functions, which the
    module holds wrapped by wrap_attn), for a compiled graph's op to find again at run time;
    None for anything that name would not find (closures, lambdas, methods). Traced by dynamo:
    __module__, __name__ and sys.modules it reads; __qualname__ it cannot."""
    module = sys.modules.get(func.__module__) if isinstance(getattr(func, "__module__", None), str) else None
    name = getattr(func, "__name__", None)
    if module is None or not isinstance(name, str):
        return None
    found = getattr(module, name, None)
    if found is not func and getattr(found, "__wrapped__", None) is not func:
        return None
    return func.__module__ + ":" + name


_resolved: dict[str, object] = {}


def _resolve_function(name: str):
    """The function _function_name named: the module's attribute, unwrapped (wrap_attn hands the
    override the function it decorates, so that is what the name was read from)."""
    func = _resolved.get(name)
    if func is None:
        module, attr = name.split(":", 1)
        func = getattr(sys.modules[module], attr)  # checked when the call was traced
        func = _resolved[name] = getattr(func, "__wrapped__", func)
    return func


COMPILED_OP = "patched_attention"


def _register_compiled_op() -> None:
    def patched_attention(q, k, v, mask, scale, attn_precision, skip_output_reshape, full_precision, enable_gqa,
                          override, function):
        return compiled_ops.lookup(override, "attention override").compiled_call(
            q, k, v, mask, scale, attn_precision, skip_output_reshape, full_precision, enable_gqa, function)

    def fake(q, k, v, mask, scale, attn_precision, skip_output_reshape, full_precision, enable_gqa, override, function):
        b, h, lq = q.shape[0], q.shape[1], q.shape[2]
        d = v.shape[-1]
        return q.new_empty((b, h, lq, d) if skip_output_reshape else (b, lq, h * d))

    compiled_ops.define(COMPILED_OP, "(Tensor q, Tensor k, Tensor v, Tensor? mask, float? scale, "
                        "ScalarType? attn_precision, bool skip_output_reshape, bool full_precision, "
                        "bool enable_gqa, int override, str function) -> Tensor", patched_attention, fake)


COMPILED_OP_ERROR = compiled_ops.registration_error(_register_compiled_op, "attention")


def patch_attention(model, settings: AccelSettings | None = None):
    """A clone of `model` whose attention goes through our override (the override alone: the
    fused norm/RoPE passes and the step graphs are installed by their own calls)."""
    settings = settings or AccelSettings("auto")
    patched = model.clone()
    to = patched.model_options.setdefault("transformer_options", {})
    # Wrap, never erase, an override another node installed: calls we hand back go through it.
    label = call_stats.model_label(model)  # one per loaded model: "Flux", "SDXL", "Wan 2.1"
    to[OVERRIDE_KEY] = AttentionOverride(settings, previous=to.get(OVERRIDE_KEY), label=label)
    compiled_ops.add_active_model_wrapper(patched, to[OVERRIDE_KEY].token)
    return patched


def override_of(patched) -> AttentionOverride:
    """The override patch_attention put on a clone (its label names the model in call_stats)."""
    return patched.model_options["transformer_options"][OVERRIDE_KEY]


def fused_norms_wanted(settings: AccelSettings) -> bool:
    """Whether the fused norm/RoPE passes go with our attention: not in mode off, nor with
    TRITON_ACCEL_FUSED_NORMS=off."""
    return settings.mode != "off" and fused_norms.enabled()


def patch_model(model, settings: AccelSettings | None = None):
    """What the Attention node installs, in one call (tests, benchmarks): patch_attention, then
    the step graphs and, where fused_norms_wanted, the fused norm/RoPE passes."""
    settings = settings or AccelSettings("auto")
    patched = patch_attention(model, settings)
    label = override_of(patched).label
    step_graph.install(patched, label)
    if fused_norms_wanted(settings):
        fused_norms.patch_fused_norms(patched, label)
    return patched
