"""Attention implementations from other node packs: the public extension API.

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
publishes it as sys.modules["triton_accel"] when it loads (nodes/extension_hooks.py), and calls
a module-level `register_triton_accel(api)` of every custom-node pack loaded before it.
docs/extension_api.md has the recipe; this file knows nothing of ComfyUI.
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
from .attention import BACKEND_ALIASES, OP, call_facts
from .attention_checks import attention_input_error
from .gpu_rules import MODES, PATHS, Decision, PATH_PYTORCH
from .registry import Call, Constraints, Implementation, registry

log = logging.getLogger("triton_accel.kernels.extensions")  # not __name__: the clone's folder name

API_VERSION = 1
PREFIX = "ext:"
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,47}$")
PRIORITY_RANGE = (-1000, 1000)
# Names that already mean something in the pack (backends, their aliases, paths, modes): an
# extension called "fp8" would read like our FP8 path in every log line and on the node.
RESERVED_NAMES = frozenset({"auto", "off", "original", "bf16", "fp16", "ext", "none", *MODES, *PATHS,
                            *BACKEND_ALIASES, *BACKEND_ALIASES.values(), "triton_attention", "torch_sdpa"})
KNOWN_VENDORS = frozenset({"nvidia", "amd", "intel", "apple", "cpu", "other"})
MASK_KINDS = frozenset({"none", "bool", "additive"})
DTYPE_NAMES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
               "float64": torch.float64, "fp64": torch.float64}
CONSTRAINT_KEYS = ("device_types", "vendors", "min_capability", "max_capability", "fp8", "dtypes", "head_dims",
                   "same_head_dim_v", "masks", "gqa", "causal")
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
    constraints: Constraints
    fn: Callable

    @property
    def path(self) -> str:
        return PREFIX + self.name


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
cache_registry.register("kernels.extensions.failures", _failures.clear)
cache_registry.register("kernels.extensions.checked", _checked.clear)


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


def constraints_from(value) -> Constraints:
    """Our Constraints from a Constraints or a dict of its fields (CONSTRAINT_KEYS), validated."""
    if value is None:
        value = {}
    if isinstance(value, Constraints):
        value = {f.name: getattr(value, f.name) for f in fields(Constraints) if f.name in CONSTRAINT_KEYS}
    if not isinstance(value, dict):
        raise ValueError(f"constraints must be a dict or a Constraints, got {type(value).__name__}")
    unknown = sorted(set(value) - set(CONSTRAINT_KEYS))
    if unknown:
        raise ValueError(f"unknown constraint {unknown[0]!r}; known: {', '.join(CONSTRAINT_KEYS)}")
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
    for key in ("fp8", "same_head_dim_v", "gqa", "causal"):
        if key in value:
            if type(value[key]) is not bool:
                raise ValueError(f"{key} must be True or False, got {value[key]!r}")
            out[key] = value[key]
    return Constraints(**out)


def _check_fn(fn) -> None:
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C extension without a signature: its first call tells
    try:
        signature.bind(None, None, None, attn_mask=None, scale=None, is_causal=False)
    except TypeError as e:
        raise ValueError(f"fn must accept fn(q, k, v, attn_mask=None, scale=None, is_causal=False): {e}") from None


def _caller_pack() -> str:
    """The top-level module of whoever called register_attention (the registering pack)."""
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
    if name in RESERVED_NAMES or registry.get(OP, name) is not None:
        raise ValueError(f"name {name!r} is one of Triton Accel's own backends, paths or modes; choose another")
    return name


# ---- registration ----------------------------------------------------------------------------

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
    name = _checked_name(name)
    _check_fn(fn)
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
    extension = Extension(name, pack, label, priority, lossy, constraints_from(constraints), fn)
    with _lock:
        previous = _registrations.by_name.get(name)
        if previous is not None and previous.pack != pack:
            raise ValueError(f"extension {name!r} is already registered by {previous.pack!r}")
        _registrations.by_name[name] = extension
        _forget(extension.path)
        _generation[0] += 1
        registry.register(Implementation(name=extension.path, op=OP, fn=_trampoline(extension.path),
                                         priority=priority, constraints=extension.constraints, by_name_only=True))
    log.info("Triton Accel: attention extension %s registered by %s (priority %d%s)", extension.path, pack,
             priority, ", lossy" if lossy else "")
    return extension.path


def unregister(name: str) -> bool:
    """Remove an extension ("<name>" or "ext:<name>"); False when none was registered."""
    name = name.removeprefix(PREFIX) if isinstance(name, str) else name
    with _lock:
        extension = _registrations.by_name.pop(name, None)
        if extension is None:
            return False
        registry.unregister(OP, extension.path)
        _forget(extension.path)
        _generation[0] += 1
    return True


def generation() -> int:
    """Changes whenever an extension is registered or removed."""
    return _generation[0]


def _forget(path: str) -> None:
    """Drop what was remembered about an extension's calls (it was replaced or removed), and the
    dispatcher's remembered decisions, which hold its old constraints."""
    from .attention import _decisions

    _decisions.clear()
    for key in [k for k in _failures if k[0] == path]:
        _failures.pop(key, None)
    _checked.difference_update([k for k in _checked if k[0] == path])


def get(path_or_name: str) -> Extension | None:
    return _registrations.by_name.get(path_or_name.removeprefix(PREFIX))


def is_extension_path(path: str) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def is_lossy(path: str) -> bool:
    extension = get(path) if is_extension_path(path) else None
    return extension is not None and extension.lossy


def paths_by_priority(info=None) -> tuple[str, ...]:
    """Every registered extension's "ext:<name>", highest priority first (ties: registration
    order); with a kernels.device.DeviceInfo, only those whose constraints admit that device."""
    with _lock:
        ordered = sorted(_registrations.by_name.values(), key=lambda e: -e.priority)
    return tuple(e.path for e in ordered if info is None or device_refusal(e.path, info) is None)


def constraints_dict(constraints: Constraints) -> dict:
    """The constraints as plain JSON values (for the status route and list_extensions)."""
    out = {}
    for key in CONSTRAINT_KEYS:
        value = getattr(constraints, key)
        if isinstance(value, frozenset):
            value = sorted(str(v).replace("torch.", "") for v in value)
        elif isinstance(value, tuple):
            value = list(value)
        out[key] = value
    return out


def list_extensions() -> list[dict]:
    """Every registered extension: name, path, pack, label, priority, lossy, constraints (plain
    values), calls served and calls handed back (by reason) since the server started."""
    with _lock:
        extensions = sorted(_registrations.by_name.values(), key=lambda e: (-e.priority, e.name))
        served = dict(_served)
        failures = {path: dict(c) for path, c in _failure_counts.items()}
    return [{"name": e.name, "path": e.path, "pack": e.pack, "label": e.label, "priority": e.priority,
             "lossy": e.lossy, "constraints": constraints_dict(e.constraints), "served": served.get(e.path, 0),
             "handed_back": failures.get(e.path, {})} for e in extensions]


def device_refusal(path: str, info) -> str | None:
    """Why the extension cannot run on a device at all (kernels.device.DeviceInfo), or None."""
    extension = get(path)
    if extension is None:
        return f"no extension {path!r} is registered (is its node pack installed and loaded?)"
    c = extension.constraints
    # A call the constraints accept in everything but the device asks them about the device alone.
    # Any one of its dtypes will do: float32 first, which no capability rule refuses.
    dtype = min(c.dtypes, key=lambda d: (d != torch.float32, str(d)))
    return c.check(Call(device=info, dtype=dtype, head_dim=c.head_dims[0], head_dim_v=c.head_dims[0], q_heads=1,
                        kv_heads=1, mask=min(c.masks), is_causal=False))


def forced_decision(mode: str, info) -> Decision:
    """The Settings node's decision for mode "ext:<name>" on one device (kernels.device.DeviceInfo)."""
    extension = get(mode)
    if extension is None:
        return Decision(PATH_PYTORCH, f"{mode} asked, but no extension of that name is registered (is its node "
                                      "pack installed and loaded?); ComfyUI's attention runs", overridden=True)
    refusal = device_refusal(mode, info)
    if refusal is not None:
        return Decision(PATH_PYTORCH, f"{mode} asked, but {extension.label} ({extension.pack}) cannot run on "
                                      f"{info.name or info.type}: {refusal}; ComfyUI's attention runs",
                        overridden=True)
    kind = "lossy" if extension.lossy else "lossless"
    return Decision(extension.path, f"{mode} forced: {extension.label} from {extension.pack} ({kind}, priority "
                                    f"{extension.priority}); calls it cannot serve, or fails on, go to ComfyUI's "
                                    "attention", candidates=(extension.path,))


# ---- the guarded call ------------------------------------------------------------------------

def _signature(q, k, v, attn_mask, is_causal) -> tuple:
    m = None if attn_mask is None else (attn_mask.dtype, tuple(attn_mask.shape))
    return (q.device, q.dtype, tuple(q.shape), tuple(k.shape), tuple(v.shape), m, bool(is_causal))


def _output_refusal(out, q, v, check_values: bool) -> str | None:
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    want = (*q.shape[:-1], v.shape[-1])
    if tuple(out.shape) != want:
        return f"returned shape {list(out.shape)}, expected {list(want)}"
    if out.dtype != q.dtype:
        return f"returned dtype {out.dtype}, expected {q.dtype}"
    if out.device != q.device:
        return f"returned a tensor on {out.device}, expected {q.device}"
    # The first call of each signature only: a check on every call would synchronise the GPU
    # per attention call. auto's agreement check looks at the values of the calls it times too.
    if check_values and not bool(torch.isfinite(out).all()):
        return "returned NaN or Inf"
    return None


def _fail(path: str, key: tuple, reason: str) -> ExtensionCallError:
    with _lock:
        if len(_failures) > MAX_SIGNATURES:
            _failures.clear()
        _failures[key] = reason
        _failure_counts.setdefault(path, Counter())[reason] += 1
    log.warning("Triton Accel: attention extension %s failed (%s); ComfyUI's attention serves these calls", path,
                reason)
    return ExtensionCallError(path, reason)


def _trampoline(path: str) -> Callable:
    """The registry's fn for an extension: finds the current registration by name on every call
    (a re-registered fn takes effect at once) and checks what it returns."""

    def run(q, k, v, attn_mask=None, scale=None, is_causal=False):
        key = (path, *_signature(q, k, v, attn_mask, is_causal))
        known = _failures.get(key)
        if known is not None:
            with _lock:
                _failure_counts.setdefault(path, Counter())[known] += 1
            raise ExtensionCallError(path, known)
        extension = get(path)
        if extension is None:
            raise ExtensionCallError(path, "no longer registered")
        try:
            out = extension.fn(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal)
        except Exception as e:
            first_line = str(e).splitlines()[0][:200] if str(e) else ""
            raise _fail(path, key, f"raised {type(e).__name__}: {first_line}") from e
        reason = _output_refusal(out, q, v, check_values=key not in _checked)
        if reason is not None:
            raise _fail(path, key, reason)
        with _lock:  # _forget() iterates _checked under the lock
            if len(_checked) > MAX_SIGNATURES:
                _checked.clear()
            _checked.add(key)
            _served[path] += 1
        return out

    run.__qualname__ = f"extension[{path}]"
    return run


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
    """Zero the calls served and handed back per extension (also part of kernels.clear_caches())."""
    with _lock:
        _served.clear()
        _failure_counts.clear()


cache_registry.register("kernels.extensions.counts", reset_counts)


def public_module():
    """This module (what sys.modules["triton_accel"] holds for other packs)."""
    return sys.modules[__name__]


__all__ = ["API_VERSION", "Constraints", "ExtensionCallError", "register_attention", "unregister",
           "list_extensions", "constraints_from", "paths_by_priority", "is_extension_path", "is_lossy",
           "forced_decision", "call_refusal", "PREFIX"]
