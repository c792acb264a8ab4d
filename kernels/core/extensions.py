"""Attention and Linear implementations from other node packs: the public extension API.

Another pack registers fn(q, k, v, attn_mask=None, scale=None, is_causal=False) on [B, H, L, D]
tensors under a name; it joins the kernel registry as backend "ext:<name>" with the Constraints
it declares (device types, vendors, compute capability range, dtypes, head dims, masks, GQA,
causal) and a priority. It is never chosen by priority alone (registry.Implementation
.by_name_only): the nodes time it against ComfyUI's attention in `auto` and keep it only where it
is faster and agrees (a lossy one by the quantized bar), or the user forces it ("ext:<name>" in
the Settings node's mode). Every call goes through a guard: an implementation that raises, or
returns a tensor of the wrong shape, dtype or device, or NaN/Inf, raises ExtensionCallError with
the reason, remembered per call signature, so the node hands that call (and the next ones of
the signature) to ComfyUI's attention instead of failing the sampler.

How another pack reaches this module whatever its folder name and load order: the pack
publishes it as sys.modules["triton_accel"] when it loads (runtime/extension_hooks.py), and calls
a module-level `register_triton_accel(api)` of every custom-node pack loaded before it.
docs/extension_api.md has the recipe; this file knows nothing of ComfyUI.

Linear (register_linear): fn(x, weight, bias) -> y, with LinearConstraints (device, capability,
dtypes, feature ranges and multiples, min tokens). It joins the registry's "linear" op by name
only, next to our quantised methods; the Linear patch node forces it ("ext:<name>" in the
Settings node's `linear`) or, in auto, walks it by priority with ours (runtime/linear_state.py).
Its calls go through the same guard (run_linear): failures raise ExtensionCallError, remembered
per call signature. One name space for both kinds, so unregister(name) is never ambiguous.
"""
from __future__ import annotations

import inspect
import logging
import os
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from . import cache_registry
from ..attention.dispatch import BACKEND_ALIASES, OP, call_facts
from ..attention.checks import attention_input_error
from .gpu_rules import LINEAR_METHODS, LINEAR_MODES, MODES, PATHS, Decision, PATH_PYTORCH
from .registry import BackendUnavailableError, Call, Constraints, Implementation, registry

log = logging.getLogger("triton_accel.kernels.core.extensions")  # not __name__: the clone's folder name

API_VERSION = 1
PREFIX = "ext:"
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,47}$")
PRIORITY_RANGE = (-1000, 1000)
# Names that already mean something in the pack (backends, their aliases, paths, modes): an
# extension called "fp8" would read like our FP8 path in every log line and on the node.
RESERVED_NAMES = frozenset({"auto", "off", "original", "bf16", "fp16", "ext", "none", *MODES, *PATHS,
                            *BACKEND_ALIASES, *BACKEND_ALIASES.values(), "triton_attention", "torch_sdpa",
                            *LINEAR_MODES, *LINEAR_METHODS, "linear"})
KIND_ATTENTION = "attention"
KIND_LINEAR = "linear"
KINDS = (KIND_ATTENTION, KIND_LINEAR)
LINEAR_OP = "linear"  # kernels/linear/dispatch.py's registry op (not imported: linear.py pulls in the Triton kernels)
KNOWN_VENDORS = frozenset({"nvidia", "amd", "intel", "apple", "cpu", "other"})
MASK_KINDS = frozenset({"none", "bool", "additive"})
DTYPE_NAMES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
               "float64": torch.float64, "fp64": torch.float64}
DEVICE_KEYS = ("device_types", "vendors", "min_capability", "max_capability", "fp8", "dtypes")
CONSTRAINT_KEYS = (*DEVICE_KEYS, "head_dims", "same_head_dim_v", "masks", "gqa", "causal")
LINEAR_CONSTRAINT_KEYS = (*DEVICE_KEYS, "in_features", "out_features", "in_features_multiple_of",
                          "out_features_multiple_of", "min_tokens")
MAX_FEATURES = 1 << 20
MAX_SIGNATURES = 4096


class ExtensionCallError(RuntimeError):
    """An extension could not serve this call (it raised, or its output was wrong); `reason` says why."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


@dataclass(frozen=True)
class Extension:
    name: str
    pack: str
    label: str
    priority: int
    lossy: bool
    constraints: Constraints  # LinearConstraints for kind "linear"
    fn: Callable
    kind: str = KIND_ATTENTION

    @property
    def path(self) -> str:
        return PREFIX + self.name


@dataclass(frozen=True)
class LinearCall:
    """The facts of one Linear call that a Linear extension's constraints look at (no tensors)."""

    device: object  # kernels.core.device.DeviceInfo
    dtype: torch.dtype  # x's dtype, which the weight is cast to (the layer's compute dtype)
    in_features: int
    out_features: int
    tokens: int  # rows: x.numel() // in_features


@dataclass(frozen=True)
class LinearConstraints:
    """What a Linear extension serves. The device part (device types, vendors, capability range,
    FP8 tensor cores, dtypes and our bf16 rule) is registry.Constraints' own check, so both kinds
    refuse a device with the same words."""

    device_types: frozenset[str] = frozenset({"cuda"})
    vendors: frozenset[str] | None = None
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None
    fp8: bool = False
    dtypes: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16, torch.float32})
    in_features: tuple[int, int] = (1, MAX_FEATURES)  # inclusive
    out_features: tuple[int, int] = (1, MAX_FEATURES)
    in_features_multiple_of: int = 1
    out_features_multiple_of: int = 1
    min_tokens: int = 1

    def device_part(self) -> Constraints:
        return Constraints(**{key: getattr(self, key) for key in DEVICE_KEYS})

    def check(self, call) -> str | None:
        """The first reason this call is refused, or None. A call without feature facts (our own
        methods' kernels.linear.LinearCall) is asked about its device and dtype only."""
        dtype = call.dtype if call.dtype is not None else min(self.dtypes, key=lambda d: (d != torch.float32, str(d)))
        refusal = self.device_part().check(Call(device=call.device, dtype=dtype, head_dim=1, head_dim_v=1, q_heads=1,
                                                kv_heads=1, mask="none", is_causal=False))
        if refusal is not None or not isinstance(call, LinearCall):
            return refusal
        for what, value, (lo, hi), multiple in (
                ("in_features", call.in_features, self.in_features, self.in_features_multiple_of),
                ("out_features", call.out_features, self.out_features, self.out_features_multiple_of)):
            if not lo <= value <= hi:
                return f"{what} {value} outside {lo}..{hi}"
            if value % multiple:
                return f"{what} {value} is not a multiple of {multiple}"
        if call.tokens < self.min_tokens:
            return f"{call.tokens} tokens < min_tokens {self.min_tokens}"
        return None


_lock = threading.Lock()


class _Registrations:
    """name -> Extension. State, not a cache: kernels.clear_caches() must not drop another pack's
    registration (module-level dicts are caches by the pack's rule, test_attention_contract)."""

    def __init__(self):
        self.by_name: dict[str, Extension] = {}


_registrations = _Registrations()
_failures: dict[tuple, str] = {}  # (path, call signature) -> why that call went back
_checked: set = set()  # (path, call signature) whose output passed the NaN/Inf check once
_served: Counter = Counter()  # path -> calls served
_failure_counts: dict[str, Counter] = {}  # path -> {reason: calls handed back}
_generation = [0]  # bumped by every register/unregister: callers key their caches on it
# How many Linear extensions are registered. A list item, read by linear_count(): torch.compile
# guards on it where a traced patch reads it, so registering one re-traces (runtime/linear_layer.py).
_linear_count = [0]
cache_registry.register("kernels.core.extensions.failures", _failures.clear)
cache_registry.register("kernels.core.extensions.checked", _checked.clear)


# ---- validation ------------------------------------------------------------------------------

def _pair(value, what: str, lo: int, hi: int) -> tuple[int, int]:
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or not all(type(x) is int and lo <= x <= hi for x in value)):
        raise ValueError(f"{what} must be a pair of integers in {lo}..{hi}, got {value!r}")
    return int(value[0]), int(value[1])


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPE_NAMES.values():
        return value
    if isinstance(value, str) and value.replace("torch.", "") in DTYPE_NAMES:
        return DTYPE_NAMES[value.replace("torch.", "")]
    raise ValueError(f"dtype {value!r} not supported; use torch.float16/bfloat16/float32/float64 or "
                     f"{sorted(DTYPE_NAMES)}")


def _device_type(value) -> str:
    try:
        device = torch.device(value) if isinstance(value, str) else None
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type != value:
        raise ValueError(f"device type {value!r} is not a torch device type (e.g. 'cuda', 'cpu', 'xpu', 'mps')")
    return value


def _names(value, what: str) -> frozenset:
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise ValueError(f"{what} must be a collection (set, list, tuple), got {value!r}")
    items = list(value)
    if not items:
        raise ValueError(f"{what} must not be empty")
    return frozenset(items)


def _device_constraints(value: dict) -> dict:
    """The validated DEVICE_KEYS of a constraints dict (both kinds)."""
    out = {}
    if "device_types" in value:
        out["device_types"] = frozenset(_device_type(t) for t in _names(value["device_types"], "device_types"))
    if value.get("vendors") is not None:
        vendors = _names(value["vendors"], "vendors")
        if not vendors <= KNOWN_VENDORS:
            raise ValueError(f"vendors {sorted(vendors - KNOWN_VENDORS)} unknown; known: {sorted(KNOWN_VENDORS)}")
        out["vendors"] = vendors
    for key in ("min_capability", "max_capability"):
        if value.get(key) is not None:
            out[key] = _pair(value[key], key, 0, 99)
    if "min_capability" in out and "max_capability" in out and out["min_capability"] > out["max_capability"]:
        raise ValueError(f"min_capability {out['min_capability']} > max_capability {out['max_capability']}")
    if "dtypes" in value:
        out["dtypes"] = frozenset(_dtype(d) for d in _names(value["dtypes"], "dtypes"))
    if "fp8" in value:
        out["fp8"] = _flag(value, "fp8")
    return out


def _flag(value: dict, key: str) -> bool:
    if type(value[key]) is not bool:
        raise ValueError(f"{key} must be True or False, got {value[key]!r}")
    return value[key]


def _as_dict(value, cls, keys: tuple) -> dict:
    if value is None:
        return {}
    if isinstance(value, cls):
        return {f.name: getattr(value, f.name) for f in fields(cls) if f.name in keys}
    if not isinstance(value, dict):
        raise ValueError(f"constraints must be a dict or a {cls.__name__}, got {type(value).__name__}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ValueError(f"unknown constraint {unknown[0]!r}; known: {', '.join(keys)}")
    return value


def constraints_from(value) -> Constraints:
    """Our Constraints from a Constraints or a dict of its fields (CONSTRAINT_KEYS), validated."""
    value = _as_dict(value, Constraints, CONSTRAINT_KEYS)
    out = _device_constraints(value)
    if "head_dims" in value:
        lo, hi = _pair(value["head_dims"], "head_dims", 1, 1 << 20)
        if lo > hi:
            raise ValueError(f"head_dims {value['head_dims']!r}: the first must not exceed the second")
        out["head_dims"] = (lo, hi)
    if "masks" in value:
        masks = _names(value["masks"], "masks")
        if not masks <= MASK_KINDS:
            raise ValueError(f"masks {sorted(masks - MASK_KINDS)} unknown; known: {sorted(MASK_KINDS)}")
        out["masks"] = masks
    for key in ("same_head_dim_v", "gqa", "causal"):
        if key in value:
            out[key] = _flag(value, key)
    return Constraints(**out)


def linear_constraints_from(value) -> LinearConstraints:
    """LinearConstraints from a LinearConstraints or a dict of its fields (LINEAR_CONSTRAINT_KEYS), validated."""
    value = _as_dict(value, LinearConstraints, LINEAR_CONSTRAINT_KEYS)
    out = _device_constraints(value)
    for key in ("in_features", "out_features"):
        if key in value:
            lo, hi = _pair(value[key], key, 1, MAX_FEATURES)
            if lo > hi:
                raise ValueError(f"{key} {value[key]!r}: the first must not exceed the second")
            out[key] = (lo, hi)
    for key, hi in (("in_features_multiple_of", 1 << 16), ("out_features_multiple_of", 1 << 16),
                    ("min_tokens", 1 << 30)):
        if key in value:
            if type(value[key]) is not int or not 1 <= value[key] <= hi:
                raise ValueError(f"{key} must be an int in 1..{hi}, got {value[key]!r}")
            out[key] = value[key]
    return LinearConstraints(**out)


def _check_fn(fn, kind: str = KIND_ATTENTION) -> None:
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C extension without a signature: its first call tells
    try:
        if kind == KIND_LINEAR:
            signature.bind(None, None, None)
        else:
            signature.bind(None, None, None, attn_mask=None, scale=None, is_causal=False)
    except TypeError as e:
        wanted = ("fn(x, weight, bias)" if kind == KIND_LINEAR
                  else "fn(q, k, v, attn_mask=None, scale=None, is_causal=False)")
        raise ValueError(f"fn must accept {wanted}: {e}") from None


def _caller_pack() -> str:
    """The top-level module of whoever called register_attention / register_linear (the registering pack)."""
    frame = inspect.currentframe()
    here = frame.f_globals.get("__name__") if frame else None
    while frame is not None and frame.f_globals.get("__name__") == here:
        frame = frame.f_back
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    # ComfyUI 0.29 names a custom-node package by its path ("/x/custom_nodes/my_pack"), older ones by its folder.
    return os.path.basename(name.rstrip("/\\")).split(".")[0] or "unknown"


def _checked_name(name) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"name {name!r}: 1-48 characters of a-z, 0-9, '_', '-', '.', starting with a letter "
                         "or digit (it is shown as 'ext:<name>')")
    if name in RESERVED_NAMES or registry.get(OP, name) is not None or registry.get(LINEAR_OP, name) is not None:
        raise ValueError(f"name {name!r} is one of Triton Accel's own backends, paths or modes; choose another")
    return name


# ---- registration ----------------------------------------------------------------------------

def _register(kind: str, name, fn, constraints, priority, lossy, label, pack) -> str:
    """register_attention / register_linear: validate, then replace or add under the lock."""
    name = _checked_name(name)
    _check_fn(fn, kind)
    if type(priority) is not int or not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise ValueError(f"priority must be an int in {PRIORITY_RANGE[0]}..{PRIORITY_RANGE[1]}, got {priority!r}")
    if type(lossy) is not bool:
        raise ValueError(f"lossy must be True or False, got {lossy!r}")
    label = name if label is None else label
    if not isinstance(label, str) or not label.strip() or len(label) > 80 or "\n" in label:
        raise ValueError(f"label must be one line of 1-80 characters, got {label!r}")
    pack = _caller_pack() if pack is None else pack
    if not isinstance(pack, str) or not pack:
        raise ValueError(f"pack must be a non-empty string, got {pack!r}")
    checked = linear_constraints_from(constraints) if kind == KIND_LINEAR else constraints_from(constraints)
    extension = Extension(name, pack, label, priority, lossy, checked, fn, kind)
    op = LINEAR_OP if kind == KIND_LINEAR else OP
    with _lock:
        previous = _registrations.by_name.get(name)
        if previous is not None and previous.pack != pack:
            raise ValueError(f"extension {name!r} is already registered by {previous.pack!r}")
        if previous is not None and previous.kind != kind:
            # One name space for both kinds: "ext:<name>" and unregister(name) must name one thing.
            raise ValueError(f"extension {name!r} is already registered as {previous.kind}; unregister it first or "
                             "choose another name")
        _registrations.by_name[name] = extension
        _forget(extension.path)
        _generation[0] += 1
        if kind == KIND_LINEAR and previous is None:
            _linear_count[0] += 1
        trampoline = _linear_trampoline(extension.path) if kind == KIND_LINEAR else _trampoline(extension.path)
        registry.register(Implementation(name=extension.path, op=op, fn=trampoline, priority=priority,
                                         constraints=extension.constraints, by_name_only=True))
    log.info("Triton Accel: %s extension %s registered by %s (priority %d%s)", kind, extension.path, pack,
             priority, ", lossy" if lossy else "")
    return extension.path


def register_attention(name: str, fn: Callable, constraints=None, priority: int = 0, lossy: bool = False,
                       label: str | None = None, pack: str | None = None) -> str:
    """Register fn(q, k, v, attn_mask=None, scale=None, is_causal=False) -> [B, H, Lq, Dv] as
    attention backend "ext:<name>"; returns that name. See docs/extension_api.md.

    constraints: a registry.Constraints or a dict of its fields (CONSTRAINT_KEYS); default: CUDA,
    float16/bfloat16/float32, head dims 1..256, every mask kind, GQA, causal. priority: an int in
    PRIORITY_RANGE; among the candidates auto times, higher first (ties go to the earlier).
    lossy: its output differs from exact attention beyond rounding (quantized): auto keeps it
    only by the quantized agreement bar. Registering a name again from the same pack replaces
    it; from another pack raises ValueError.
    """
    return _register(KIND_ATTENTION, name, fn, constraints, priority, lossy, label, pack)


def register_linear(name: str, fn: Callable, constraints=None, priority: int = 0, lossy: bool = False,
                    label: str | None = None, pack: str | None = None) -> str:
    """Register fn(x, weight, bias) -> y as Linear implementation "ext:<name>"; returns that name.

    x is [..., in_features] (float16/bfloat16/float32), weight [out_features, in_features] in x's
    dtype (the layer's compute dtype, FP8 checkpoints upcast and scaled as ComfyUI does), bias
    [out_features] in x's dtype or None; y must be [..., out_features] of x's dtype on x's device.
    constraints: a LinearConstraints or a dict of its fields (LINEAR_CONSTRAINT_KEYS); default:
    CUDA, float16/bfloat16/float32, any feature counts, any number of tokens. priority, lossy,
    label, pack: as register_attention (lossy: judged by the quantised agreement bar). The name
    space is shared with attention extensions. See docs/extension_api.md.
    """
    return _register(KIND_LINEAR, name, fn, constraints, priority, lossy, label, pack)


def unregister(name: str) -> bool:
    """Remove an extension of either kind ("<name>" or "ext:<name>"); False when none was registered."""
    name = name.removeprefix(PREFIX) if isinstance(name, str) else name
    with _lock:
        extension = _registrations.by_name.pop(name, None)
        if extension is None:
            return False
        registry.unregister(LINEAR_OP if extension.kind == KIND_LINEAR else OP, extension.path)
        _forget(extension.path)
        _generation[0] += 1
        if extension.kind == KIND_LINEAR:
            _linear_count[0] -= 1
    return True


def linear_count() -> int:
    """How many Linear extensions are registered (plain reads: torch.compile traces this)."""
    return _linear_count[0]


def generation() -> int:
    """Changes whenever an extension is registered or removed."""
    return _generation[0]


def _forget(path: str) -> None:
    """Drop what was remembered about an extension's calls (it was replaced or removed), and the
    dispatcher's remembered decisions, which hold its old constraints."""
    from ..attention.dispatch import forget_decisions

    forget_decisions()
    for key in [k for k in _failures if k[0] == path]:
        _failures.pop(key, None)
    _checked.difference_update([k for k in _checked if k[0] == path])


def get(path_or_name: str, kind: str | None = None) -> Extension | None:
    """The extension of that name (of that kind, when given), or None."""
    if not isinstance(path_or_name, str):
        return None
    extension = _registrations.by_name.get(path_or_name.removeprefix(PREFIX))
    return extension if extension is not None and kind in (None, extension.kind) else None


def is_extension_path(path: str) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def is_lossy(path: str) -> bool:
    extension = get(path) if is_extension_path(path) else None
    return extension is not None and extension.lossy


def paths_by_priority(info=None, kind: str = KIND_ATTENTION) -> tuple[str, ...]:
    """Every registered extension of `kind`'s "ext:<name>", highest priority first (ties:
    registration order); with a kernels.core.device.DeviceInfo, only those whose constraints admit that device."""
    with _lock:
        ordered = sorted((e for e in _registrations.by_name.values() if e.kind == kind), key=lambda e: -e.priority)
    return tuple(e.path for e in ordered if info is None or device_refusal(e.path, info) is None)


def constraints_dict(constraints) -> dict:
    """The constraints (either kind) as plain JSON values (for the status route and list_extensions)."""
    keys = LINEAR_CONSTRAINT_KEYS if isinstance(constraints, LinearConstraints) else CONSTRAINT_KEYS
    out = {}
    for key in keys:
        value = getattr(constraints, key)
        if isinstance(value, frozenset):
            value = sorted(str(v).replace("torch.", "") for v in value)
        elif isinstance(value, tuple):
            value = list(value)
        out[key] = value
    return out


def list_extensions(kind: str | None = None) -> list[dict]:
    """Every registered extension (of `kind`, when given): kind, name, path, pack, label, priority,
    lossy, constraints (plain values), calls served and calls handed back (by reason) since the
    server started (or the last reset_counts())."""
    with _lock:
        extensions = sorted((e for e in _registrations.by_name.values() if kind in (None, e.kind)),
                            key=lambda e: (-e.priority, e.name))
        served = dict(_served)
        failures = {path: dict(c) for path, c in _failure_counts.items()}
    return [{"kind": e.kind, "name": e.name, "path": e.path, "pack": e.pack, "label": e.label,
             "priority": e.priority, "lossy": e.lossy, "constraints": constraints_dict(e.constraints),
             "served": served.get(e.path, 0), "handed_back": failures.get(e.path, {})} for e in extensions]


def device_refusal(path: str, info) -> str | None:
    """Why the extension cannot run on a device at all (kernels.core.device.DeviceInfo), or None."""
    extension = get(path)
    if extension is None:
        return f"no extension {path!r} is registered (is its node pack installed and loaded?)"
    c = extension.constraints
    # A call the constraints accept in everything but the device asks them about the device alone.
    # Any one of its dtypes will do: float32 first, which no capability rule refuses.
    dtype = min(c.dtypes, key=lambda d: (d != torch.float32, str(d)))
    if extension.kind == KIND_LINEAR:
        return c.check(LinearCall(device=info, dtype=dtype, in_features=c.in_features[1] // c.in_features_multiple_of
                                  * c.in_features_multiple_of, out_features=c.out_features[1]
                                  // c.out_features_multiple_of * c.out_features_multiple_of,
                                  tokens=c.min_tokens))
    return c.check(Call(device=info, dtype=dtype, head_dim=c.head_dims[0], head_dim_v=c.head_dims[0], q_heads=1,
                        kv_heads=1, mask=min(c.masks), is_causal=False))


def forced_decision(mode: str, info, kind: str = KIND_ATTENTION) -> Decision:
    """The Settings node's decision for mode "ext:<name>" on one device (kernels.core.device.DeviceInfo);
    kind "linear" for its `linear` input."""
    comfy = "ComfyUI's Linear" if kind == KIND_LINEAR else "ComfyUI's attention"
    extension = get(mode, kind)
    if extension is None:
        other = get(mode)
        why = (f"{mode} is a{'n' if other.kind == KIND_ATTENTION else ''} {other.kind} extension, not {kind}"
               if other is not None else f"no {'Linear ' if kind == KIND_LINEAR else ''}extension of that name is "
                                         "registered (is its node pack installed and loaded?)")
        return Decision(PATH_PYTORCH, f"{mode} asked, but {why}; {comfy} runs", overridden=True)
    refusal = device_refusal(mode, info)
    if refusal is not None:
        return Decision(PATH_PYTORCH, f"{mode} asked, but {extension.label} ({extension.pack}) cannot run on "
                                      f"{info.name or info.type}: {refusal}; {comfy} runs",
                        overridden=True)
    lossy = "lossy" if extension.lossy else "lossless"
    return Decision(extension.path, f"{mode} forced: {extension.label} from {extension.pack} ({lossy}, priority "
                                    f"{extension.priority}); calls it cannot serve, or fails on, go to {comfy}",
                    candidates=(extension.path,))


# ---- the guarded call ------------------------------------------------------------------------

def _signature(q, k, v, attn_mask, is_causal) -> tuple:
    m = None if attn_mask is None else (attn_mask.dtype, tuple(attn_mask.shape))
    return (q.device, q.dtype, tuple(q.shape), tuple(k.shape), tuple(v.shape), m, bool(is_causal))


def _output_refusal(out, want: tuple, like: torch.Tensor, check_values: bool) -> str | None:
    """Why `out` is not a result of shape `want` in `like`'s dtype and device (None: it is)."""
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    if tuple(out.shape) != want:
        return f"returned shape {list(out.shape)}, expected {list(want)}"
    if out.dtype != like.dtype:
        return f"returned dtype {out.dtype}, expected {like.dtype}"
    if out.device != like.device:
        return f"returned a tensor on {out.device}, expected {like.device}"
    # The first call of each signature only: a check on every call would synchronise the GPU
    # per call. auto's agreement check (attention) and the Linear guard look at values too.
    if check_values and not bool(torch.isfinite(out).all()):
        return "returned NaN or Inf"
    return None


def _fail(path: str, key: tuple, reason: str, kind: str = KIND_ATTENTION) -> ExtensionCallError:
    with _lock:
        if len(_failures) > MAX_SIGNATURES:
            _failures.clear()
        _failures[key] = reason
        _failure_counts.setdefault(path, Counter())[reason] += 1
    log.warning("Triton Accel: %s extension %s failed (%s); ComfyUI's %s serves these calls", kind, path, reason,
                "Linear" if kind == KIND_LINEAR else "attention")
    return ExtensionCallError(path, reason)


def _guarded(path: str, key: tuple, kind: str, call: Callable, want: tuple, like: torch.Tensor):
    """Run `call(extension.fn)` for the extension at `path` and check its output; the one guard
    of both kinds. Raises ExtensionCallError (remembered per signature `key`) on any failure."""
    known = _failures.get(key)
    if known is not None:
        with _lock:
            _failure_counts.setdefault(path, Counter())[known] += 1
        raise ExtensionCallError(path, known)
    extension = get(path, kind)
    if extension is None:
        raise ExtensionCallError(path, "no longer registered")
    try:
        out = call(extension.fn)
    except Exception as e:
        first_line = str(e).splitlines()[0][:200] if str(e) else ""
        raise _fail(path, key, f"raised {type(e).__name__}: {first_line}", kind) from e
    reason = _output_refusal(out, want, like, check_values=key not in _checked)
    if reason is not None:
        raise _fail(path, key, reason, kind)
    with _lock:  # _forget() iterates _checked under the lock
        if len(_checked) > MAX_SIGNATURES:
            _checked.clear()
        _checked.add(key)
        _served[path] += 1
    return out


def _trampoline(path: str) -> Callable:
    """The registry's fn for an attention extension: finds the current registration by name on
    every call (a re-registered fn takes effect at once) and checks what it returns."""

    def run(q, k, v, attn_mask=None, scale=None, is_causal=False):
        key = (path, *_signature(q, k, v, attn_mask, is_causal))
        return _guarded(path, key, KIND_ATTENTION,
                        lambda fn: fn(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal),
                        (*q.shape[:-1], v.shape[-1]), q)

    run.__qualname__ = f"extension[{path}]"
    return run


def _linear_signature(x, weight, bias) -> tuple:
    return (x.device, x.dtype, tuple(x.shape), tuple(weight.shape), weight.dtype, bias is None)


def _linear_trampoline(path: str) -> Callable:
    """The registry's fn for a Linear extension (the same guard as attention's)."""

    def run(x, weight, bias=None):
        key = (path, *_linear_signature(x, weight, bias))
        return _guarded(path, key, KIND_LINEAR, lambda fn: fn(x, weight, bias), (*x.shape[:-1], weight.shape[0]), x)

    run.__qualname__ = f"linear_extension[{path}]"
    return run


def linear_facts(x: torch.Tensor, weight: torch.Tensor) -> LinearCall:
    from .device import describe

    return LinearCall(device=describe(x.device), dtype=x.dtype, in_features=weight.shape[1],
                      out_features=weight.shape[0], tokens=x.numel() // max(1, weight.shape[1]))


def linear_input_error(x, weight, bias) -> str | None:
    """Why (x, weight, bias) is not a Linear call an extension may be offered, or None."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return "x and weight must be tensors"
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        return f"x {list(x.shape)} and weight {list(weight.shape)} do not make a Linear call"
    if weight.dtype != x.dtype or weight.device != x.device:
        return (f"the weight must be in x's dtype and on its device ({weight.dtype} on {weight.device}, x "
                f"{x.dtype} on {x.device})")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)
                             or bias.dtype != x.dtype or bias.device != x.device):
        return f"bias must be [{weight.shape[0]}] in x's dtype and on its device"
    return None


def linear_call_refusal(path: str, x, weight, bias=None) -> str | None:
    """Why the Linear extension will not serve this call: invalid inputs, its constraints, or a
    failure remembered for this signature (None: it will be tried)."""
    err = linear_input_error(x, weight, bias)
    if err:
        return err
    return linear_shape_refusal(path, x, tuple(weight.shape), bias is not None)


def linear_shape_refusal(path: str, x: torch.Tensor, weight_shape: tuple, has_bias: bool, info=None) -> str | None:
    """linear_call_refusal before the weight exists in x's dtype (a layer whose weight ComfyUI
    casts per call): the constraints and remembered failures for x and a weight of that shape.
    `info`: x's kernels.core.device.DeviceInfo when the caller has it."""
    extension = get(path, KIND_LINEAR)
    if extension is None:
        return f"no Linear extension {path!r} is registered"
    if info is None:
        from .device import describe

        info = describe(x.device)
    out_features, in_features = weight_shape
    refusal = extension.constraints.check(LinearCall(device=info, dtype=x.dtype, in_features=in_features,
                                                     out_features=out_features,
                                                     tokens=x.numel() // max(1, in_features)))
    if refusal:
        return refusal
    key = (path, x.device, x.dtype, tuple(x.shape), tuple(weight_shape), x.dtype, not has_bias)
    return _failures.get(key)


def run_linear(path: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = the Linear extension at `path` on (x, weight, bias), guarded: raises
    BackendUnavailableError (registry) when its constraints refuse the call or it is not
    registered, ExtensionCallError when it fails (raised, wrong output, NaN/Inf on the first
    call of a signature). The same call outside ComfyUI as inside the Linear patch node."""
    err = linear_input_error(x, weight, bias)
    if err:
        raise BackendUnavailableError(LINEAR_OP, path, err)
    impl = registry.get(LINEAR_OP, path)
    if impl is None or get(path, KIND_LINEAR) is None:
        raise BackendUnavailableError(LINEAR_OP, path, "unknown Linear extension (is its node pack installed?)")
    refusal = impl.refusal(linear_facts(x, weight))
    if refusal:
        raise BackendUnavailableError(LINEAR_OP, path, refusal)
    return impl.fn(x, weight, bias)


def known_failure(path: str, q, k, v, attn_mask=None, is_causal=False) -> str | None:
    """Why this call's signature already failed on the extension (None: it has not)."""
    return _failures.get((path, *_signature(q, k, v, attn_mask, is_causal)))


def call_refusal(path: str, q, k, v, attn_mask=None, is_causal=False) -> str | None:
    """Why the extension will not serve this call: invalid inputs, its constraints, or a
    failure remembered for this signature (None: it will be tried)."""
    err = attention_input_error(q, k, v, attn_mask)
    if err:
        return err
    impl = registry.get(OP, path)
    if impl is None:
        return f"no extension {path!r} is registered"
    return impl.refusal(call_facts(q, k, v, attn_mask, is_causal)) or known_failure(path, q, k, v, attn_mask,
                                                                                    is_causal)


def reset_counts() -> None:
    """Zero the calls served and handed back per extension, both kinds (also part of
    kernels.clear_caches() and of the stats reset route)."""
    with _lock:
        _served.clear()
        _failure_counts.clear()


cache_registry.register("kernels.core.extensions.counts", reset_counts)


def public_module():
    """This module (what sys.modules["triton_accel"] holds for other packs)."""
    return sys.modules[__name__]


__all__ = ["API_VERSION", "Constraints", "LinearConstraints", "ExtensionCallError", "register_attention",
           "register_linear", "unregister", "list_extensions", "reset_counts", "constraints_from",
           "linear_constraints_from", "paths_by_priority", "is_extension_path", "is_lossy", "forced_decision",
           "call_refusal", "linear_call_refusal", "run_linear", "PREFIX", "KIND_ATTENTION", "KIND_LINEAR"]
