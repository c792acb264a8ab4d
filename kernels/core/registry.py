"""Implementations with declared constraints, and a selection that explains every refusal.

An implementation declares what it can serve (device types, dtypes, head dims, masks, GQA,
causal, whether it needs FP8 tensor cores) and a priority. select() walks them by priority
and returns the first that accepts the call, or raises with the reason each one refused. The
same checks answer "can Triton serve this call, and if not why" for the ComfyUI nodes, so the
nodes and the dispatch never disagree.

Which GPUs qualify (the oldest NVIDIA capability a Triton version compiles for, bf16 and FP8
tensor cores) is gpu_rules.py's: Constraints carry the numbers it gives and ask it per call,
never their own. A refusal is always one piece of text for people (`str`, None = accepted);
the exceptions below carry it as `.reason`.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import device as _device
from .gpu_rules import capability_refusal, sm

log = logging.getLogger("triton_accel.kernels.core.registry")  # not __name__: the clone's folder name


class NoImplementationError(RuntimeError):
    """No implementation accepted the call; `reasons` maps each name to why it refused and
    `reason` joins them."""

    def __init__(self, op: str, reasons: dict[str, str]):
        self.op = op
        self.reasons = dict(reasons)
        self.reason = "; ".join(f"{k}: {v}" for k, v in reasons.items()) or "nothing registered"
        super().__init__(f"no implementation of {op} can serve this call ({self.reason})")


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name and cannot serve the call; the message says why."""

    def __init__(self, op: str, backend: str, reason: str):
        self.op, self.backend, self.reason = op, backend, reason
        super().__init__(f"{op}: backend {backend!r} cannot serve this call: {reason}")


@dataclass(frozen=True)
class Call:
    """The facts of one attention call that constraints look at (no tensors kept)."""

    device: _device.DeviceInfo
    dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    q_heads: int
    kv_heads: int
    mask: str  # "none", "bool", "additive"
    is_causal: bool


@dataclass(frozen=True)
class Constraints:
    device_types: frozenset[str] = frozenset({"cuda"})
    vendors: frozenset[str] | None = None  # None: any vendor of an allowed device type
    min_capability: tuple[int, int] | None = None  # NVIDIA only; gpu_rules.min_capability_for(triton)
    max_capability: tuple[int, int] | None = None  # NVIDIA only, inclusive (extension packs: kernels/core/extensions.py)
    fp8: bool = False  # needs FP8 (e4m3) tensor cores; gpu_rules decides which GPUs have them
    dtypes: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16, torch.float32})
    head_dims: tuple[int, int] = (1, 256)  # inclusive
    same_head_dim_v: bool = True
    masks: frozenset[str] = frozenset({"none", "bool", "additive"})
    gqa: bool = True
    causal: bool = True
    cpu_needs_interpreter: bool = False  # Triton runs CPU tensors only through TRITON_INTERPRET=1

    def check(self, call: Call) -> str | None:
        """The first reason this call is refused, or None when accepted."""
        dev = call.device
        if dev.type not in self.device_types:
            return f"device type {dev.type!r} not supported (needs {sorted(self.device_types)})"
        if dev.type == "cpu" and self.cpu_needs_interpreter and not _device.interpreter_enabled():
            return "CPU tensors need TRITON_INTERPRET=1 (set before triton is imported)"
        if self.vendors is not None and dev.vendor not in self.vendors:
            return f"vendor {dev.vendor!r} not supported"
        if dev.vendor == "nvidia" and self.min_capability and dev.capability < self.min_capability:
            return (f"compute capability {dev.capability[0]}.{dev.capability[1]} < required "
                    f"{self.min_capability[0]}.{self.min_capability[1]} for the installed Triton "
                    f"({dev.name} is {sm(dev.capability)})")
        if dev.vendor == "nvidia" and self.max_capability and dev.capability > self.max_capability:
            return (f"compute capability {dev.capability[0]}.{dev.capability[1]} > supported "
                    f"{self.max_capability[0]}.{self.max_capability[1]} ({dev.name} is {sm(dev.capability)})")
        if call.dtype not in self.dtypes:
            return f"dtype {call.dtype} not supported"
        refusal = capability_refusal(dev.vendor, dev.capability, dev.name,
                                     dtype=str(call.dtype).replace("torch.", ""), fp8=self.fp8, arch=dev.arch)
        if refusal is not None:
            return refusal.reason
        lo, hi = self.head_dims
        if not lo <= call.head_dim <= hi:
            return f"head dim {call.head_dim} outside {lo}..{hi}"
        if self.same_head_dim_v and call.head_dim_v != call.head_dim:
            return f"value head dim {call.head_dim_v} != query head dim {call.head_dim}"
        if call.mask not in self.masks:
            return f"{call.mask} masks not supported"
        if call.q_heads != call.kv_heads:
            if not self.gqa:
                return "grouped-query attention not supported"
        if call.is_causal and not self.causal:
            return "is_causal not supported"
        return None


@dataclass
class Implementation:
    name: str
    op: str
    fn: Callable
    priority: int
    # Constraints for attention; another op brings its own pair with the same check(call) ->
    # str | None (kernels/linear/dispatch.py: LinearCall / LinearConstraints).
    constraints: Constraints
    unavailable: str | None = None  # set when the implementation cannot run at all here
    # Chosen only when asked for by name, never by priority (another pack's extension: the
    # nodes time it against ComfyUI's attention first, or the user forces it).
    by_name_only: bool = False

    def refusal(self, call: Call) -> str | None:
        if self.unavailable:
            return self.unavailable
        return self.constraints.check(call)


class Registry:
    def __init__(self):
        self._impls: dict[str, dict[str, Implementation]] = {}
        self._lock = threading.Lock()

    def register(self, impl: Implementation) -> None:
        with self._lock:
            self._impls.setdefault(impl.op, {})[impl.name] = impl

    def unregister(self, op: str, name: str) -> bool:
        with self._lock:
            return self._impls.get(op, {}).pop(name, None) is not None

    def implementations(self, op: str) -> list[Implementation]:
        # A copy under the lock: another pack may register or unregister while a sampler thread reads.
        with self._lock:
            impls = list(self._impls.get(op, {}).values())
        return sorted(impls, key=lambda i: -i.priority)

    def get(self, op: str, name: str) -> Implementation | None:
        return self._impls.get(op, {}).get(name)

    def select(self, op: str, call: Call, name: str | None = None) -> Implementation:
        """The implementation for this call; with `name`, exactly that one or an error."""
        if name is not None:
            impl = self.get(op, name)
            if impl is None:
                known = ", ".join(i.name for i in self.implementations(op))
                raise BackendUnavailableError(op, name, f"unknown backend (known: {known})")
            reason = impl.refusal(call)
            if reason:
                raise BackendUnavailableError(op, name, reason)
            return impl
        reasons = {}
        for impl in self.implementations(op):
            if impl.by_name_only:
                continue
            reason = impl.refusal(call)
            if reason is None:
                return impl
            reasons[impl.name] = reason
        raise NoImplementationError(op, reasons)

    def explain(self, op: str, call: Call) -> dict[str, str | None]:
        """Every implementation's answer for this call: None means it would accept it."""
        return {impl.name: impl.refusal(call) for impl in self.implementations(op)}


registry = Registry()
