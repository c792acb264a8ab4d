"""Marks on the outputs our Linear kernels activated (GELU in the GEMM epilogue), read by the
activation module's patch so that every output is activated exactly once."""
from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger("triton_accel")


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
