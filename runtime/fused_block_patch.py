"""The fused norm passes' shared patch machinery: the first-call guard shared by a model's
patches of one kind, the e4m3 rows handed to the FP8 Linear after a norm pass, and the
checks every block patch makes. The passes themselves: fused_wan.py, fused_flux.py."""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys

import torch

from ..kernels.fused.gated_residual_norm import (GatedResidualInputError)
from ..kernels.core.kernel_common import fp8_device_refusal
from ..kernels.fused.layer_norm_modulate import LayerNormModulateInputError
from ..kernels.linear.fp8 import quantize_once
from ..kernels.fused.norm_rope import NormRopeInputError
from ..kernels.fused.qk_norm import QKNormInputError
from . import call_stats
from .guards import guard_failure
from .linear_common import module_attr
from .linear_layer import LinearLayer


log = logging.getLogger("triton_accel.nodes.patch_fused_norms")  # not __name__: the clone's folder name

KIND = "norms"
PATH = "fused_norms"
PATH_QK = "fused_qk_norm"
PATH_FLUX = "fused_flux_block"
FLUX_MODULE = "comfy.ldm.flux.layers"
FLUX_MATH_MODULE = "comfy.ldm.flux.math"
CALLBACK_KEY = "triton_accel_fused_norms"
# The fused passes reproduce ComfyUI's roundings; what is left is the order of fp32 sums and
# rsqrt's last bits (a bf16 ulp on a few values). A block differing by more is not the block
# this module was written for.
GUARD_MAX_REL_L2 = 0.01
WAN_MODULE = "comfy.ldm.wan.model"

# A site (the Linear after one of the block's norms) stops getting e4m3 rows from the norm
# kernel after this many calls in a row in which no GEMM read them: its Linear is not our FP8
# one (another mode, LoRA, dynamic VRAM...), and the rows would be 0.05 ms of writes a call
# for nothing. Our FP8 Linear reads them from its third call on (DirectCall), so this is more
# than the calls before that.
FP8_ROWS_MISSES = 4

REASON_PATCHES = "attn1/attn2 patches of another node"
REASON_FALLBACK = "block failed the first-call check"
# What a fused kernel raises for a call it cannot serve (checked before anything runs).
INPUT_ERRORS = (NormRopeInputError, LayerNormModulateInputError, QKNormInputError, GatedResidualInputError)


class Guard:
    """The first-call check's outcome per device, shared by every patch of one kind that one
    patch_fused_norms call put into one model: its blocks are one class running one forward,
    so the first block called on a device is compared with ComfyUI's forward for all of them
    (a whole-block reference costs a block's attention and MLP again: checking each of Wan
    14B's 40 blocks would add about a step to the first one)."""

    def __init__(self):
        self.guarded: set[str] = set()  # devices whose first call agreed with the original
        self.fallbacks: dict[str, str] = {}  # device -> why these run ComfyUI's forward for good


class GuardedPatch:
    """An object patch of one module's forward whose first call on each device (first among
    the patches sharing its Guard) also runs the forward it replaces and compares; shared by
    clones, never copied. Subclasses give PATH and __call__, which hands back what it refuses
    and passes the rest to _serve."""

    PATH = ""

    def __init__(self, label: str, name: str, module: torch.nn.Module, previous, guard: Guard | None = None):
        self.label = label
        self.name = name
        self.module = module
        self.previous = previous  # the module's own forward (bound method)
        self.guard = guard if guard is not None else Guard()

    @property
    def guarded(self) -> set[str]:
        return self.guard.guarded

    @property
    def fallbacks(self) -> dict[str, str]:
        return self.guard.fallbacks

    def __deepcopy__(self, memo):
        return self

    def _original(self, args, kwargs, reason: str):
        call_stats.record(call_stats.OUTCOME_HANDED_BACK, reason, kind=KIND, model=self.label)
        return self.previous(*args, **kwargs)

    def _serve(self, args, kwargs, device: str, fused, compare, ours_first: bool = False):
        """fused(): our output; compare(ours, reference): why they disagree, or None. ours_first:
        on the checked call ours runs before the original forward, which writes into its inputs
        (Flux's blocks: `x += ...`)."""
        if device in self.fallbacks:
            return self._original(args, kwargs, REASON_FALLBACK)
        if device in self.guarded:
            try:
                out = fused()
            except INPUT_ERRORS as e:
                return self._original(args, kwargs, e.reason)
            call_stats.record(call_stats.OUTCOME_SERVED, path=self.PATH, kind=KIND, model=self.label)
            return out
        ours = failure = None
        if ours_first:
            try:
                ours = fused()
            except INPUT_ERRORS as e:  # this call only: the next one is guarded again
                return self._original(args, kwargs, e.reason)
            except Exception as e:  # a kernel that fails here fails for good on this device
                failure = f"kernel error: {type(e).__name__}: {e}"
        reference = self.previous(*args, **kwargs)
        try:
            if failure is None:
                failure = compare(ours if ours_first else fused(), reference)
        except INPUT_ERRORS as e:  # this call only: the next one is guarded again
            call_stats.record(call_stats.OUTCOME_HANDED_BACK, e.reason, kind=KIND, model=self.label)
            return reference
        except Exception as e:  # a kernel that fails here fails for good on this device
            failure = f"kernel error: {type(e).__name__}: {e}"
        if failure is not None:
            self.fallbacks[device] = failure
            log.warning("Triton Accel fused norms: %s's %s (checked at %s) go to ComfyUI's forward on %s: %s",
                        self.label, type(self.module).__name__, self.name, device, failure)
            call_stats.record(call_stats.OUTCOME_HANDED_BACK, REASON_FALLBACK, kind=KIND, model=self.label)
        else:
            self.guarded.add(device)
            call_stats.record(call_stats.OUTCOME_SERVED, path=self.PATH, kind=KIND, model=self.label)
        return reference


class RowsSites(GuardedPatch):
    """A block patch whose norm passes hand e4m3 rows to the Linear after them, per site (the
    Linear's name in the block), until FP8_ROWS_MISSES calls in a row found no GEMM reading them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # site -> calls in a row whose e4m3 rows no GEMM read (FP8_ROWS_MISSES)
        self.fp8_rows_misses: dict[str, int] = {}

    def _wants_rows(self, site: str, rows_ok: bool, linear=None, x: torch.Tensor | None = None) -> bool:
        """Whether the norm pass before `site` writes e4m3 rows; `linear`, the Linear that reads
        its output x, where known."""
        return (rows_ok and self.fp8_rows_misses.get(site, 0) < FP8_ROWS_MISSES
                and (linear is None or may_read_rows(linear, x)))

    def _rows_read(self, site: str):
        """What a rows_scope reports to: whether a GEMM read the site's rows this call."""
        def note(read: bool) -> None:
            misses = 0 if read else self.fp8_rows_misses.get(site, 0) + 1
            self.fp8_rows_misses[site] = misses
            if misses == FP8_ROWS_MISSES:
                log.debug("Triton Accel fused norms: %s's %s Linear does not read FP8 rows; not made any more",
                          self.name, site)
        return note


def may_read_rows(linear, x: torch.Tensor) -> bool:
    """False where `linear` carries our Linear patch (ComfyUI installs object patches as the
    module's own `forward`) and hands x back for its token count (Flux's 512-token text
    stream): its rows would go unread, and the rowless kernel variant FP8_ROWS_MISSES calls
    later would compile in the middle of sampling."""
    forward = getattr(linear, "__dict__", {}).get("forward")
    if not isinstance(forward, LinearLayer):
        return True
    return x.numel() // max(x.shape[-1], 1) >= forward.state.min_tokens


@functools.lru_cache(maxsize=16)
def fp8_rows_refusal(device: torch.device) -> str | None:
    """Why the norm kernels cannot emit e4m3 rows on `device` (sm_89+, the FP8 Linear's rule)."""
    return fp8_device_refusal(device, "FP8 activation rows")


@contextlib.contextmanager
def rows_scope(x: torch.Tensor, rows, note):
    """quantize_once(x, rows) where the norm kernel made rows (the Linear that reads x reads them
    instead of quantising x), then note(whether a GEMM did); nothing where it made none."""
    if rows is None:
        yield
        return
    with quantize_once(x, rows) as scope:
        yield
    note(scope.used > 0)


def bind_names(names: tuple, required: int, args, kwargs) -> dict:
    """A forward's arguments by name, `names` its parameters in order, the first `required` of
    them without defaults (raises TypeError for any other call)."""
    if len(args) > len(names) or set(kwargs) - set(names):
        raise TypeError("not the block's forward arguments")
    call = dict(zip(names, args))
    for key, value in kwargs.items():
        if key in call:
            raise TypeError(f"{key} given twice")
        call[key] = value
    if any(n not in call for n in names[:required]):
        raise TypeError(f"{', '.join(names[:required])} are required")
    return call


def norm_params(norm, x: torch.Tensor):
    """(weight, bias, release), each in x's dtype on x's device (None where the norm has none),
    the way ComfyUI's norms get them: cast by comfy.ops (LoRA weight functions, offloading,
    dynamic VRAM) where the module casts, its own parameters otherwise."""
    weight = module_attr(norm, "weight")  # not getattr: nn.Module.__getattr__ costs microseconds
    if weight is None:
        return None, None, None
    bias = module_attr(norm, "bias")
    if not casts_weights(norm) and all(t is None or (t.device == x.device and t.dtype == x.dtype)
                                        for t in (weight, bias)):
        return weight, bias, None
    ops = sys.modules.get("comfy.ops")
    cast = getattr(ops, "cast_bias_weight", None)
    if cast is None:
        return tuple(None if t is None else t.to(device=x.device, dtype=x.dtype) for t in (weight, bias)) + (None,)
    if takes_offloadable(cast):  # ComfyUI 0.4+: hand the cast back after use
        w, b, stream = cast(norm, x, offloadable=True)
        return w, b, (lambda: ops.uncast_bias_weight(norm, w, b, stream))
    w, b = cast(norm, x)
    return w, b, None


def casts_weights(module: torch.nn.Module) -> bool:
    """Whether comfy.ops casts this module's weight per call (manual cast, offloading, LoRA
    weight functions): ComfyUI sets these on the instance over class-level defaults."""
    d, cls = module.__dict__, type(module)
    return bool(d.get("comfy_cast_weights", getattr(cls, "comfy_cast_weights", False))
                or d.get("weight_function", getattr(cls, "weight_function", ()))
                or d.get("bias_function", getattr(cls, "bias_function", ())))


@functools.lru_cache(maxsize=4)
def takes_offloadable(cast) -> bool:
    """Whether comfy.ops.cast_bias_weight has ComfyUI 0.4+'s offloadable argument (read once:
    every fused block call asks)."""
    return "offloadable" in inspect.signature(cast).parameters


def is_own_forward(module: torch.nn.Module, class_name: str, module_name: str = WAN_MODULE) -> bool:
    cls = type(module)
    return (cls.__name__ == class_name and cls.__module__ == module_name
            and getattr(cls.forward, "__qualname__", "") == f"{class_name}.forward")


def block_guard_failure(ours: torch.Tensor, reference: torch.Tensor) -> str | None:
    return guard_failure(ours, reference, GUARD_MAX_REL_L2)
