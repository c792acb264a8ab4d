"""Counts of what the patched layers did with each call, and why they handed calls back.

Read through the HTTP routes /triton_accel/stats and /triton_accel/status (the status panel)
and by the integration tests, which must prove that our kernels really ran and that
unsupported calls reached ComfyUI's function.

Two views of the same calls:
- the original totals (`calls` / `reasons` / `paths`, attention only, as in the first
  release: their keys stay as they were, "triton" and "original");
- version 2: per kind ("attention", "linear") and per patched model (the label the patch
  node gave its clone), with "served" / "handed_back" counts.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
from collections import Counter, OrderedDict

STATS_VERSION = 2
OUTCOME_SERVED = "triton"  # served by one of our kernels (`path` says which)
OUTCOME_HANDED_BACK = "original"  # went, unchanged, to ComfyUI's own function
HANDED_BACK_LABEL = "handed back to ComfyUI"  # what users read instead of "original"
KIND_ATTENTION = "attention"
KIND_LINEAR = "linear"
# Models patched in one server session are few; the oldest labels are dropped past this many
# so a server that patches for weeks keeps a bounded table.
MAX_MODELS = 64

_lock = threading.Lock()
_calls: Counter = Counter()
_reasons: Counter = Counter()
_paths: Counter = Counter()
_kinds: dict[str, dict] = {}
_models: OrderedDict[str, dict] = OrderedDict()
_model_numbers: Counter = Counter()


def _empty_counts() -> dict:
    return {"served": 0, "handed_back": 0, "paths": Counter(), "reasons": Counter()}


def _add(counts: dict, served: bool, reason: str | None, path: str | None) -> None:
    counts["served" if served else "handed_back"] += 1
    if reason:
        counts["reasons"][reason] += 1
    if path:
        counts["paths"][path] += 1


def new_model_label(model_class: str) -> str:
    """A short label for one patched clone: its model class and a counter ("Flux #2")."""
    with _lock:
        _model_numbers[model_class] += 1
        label = f"{model_class} #{_model_numbers[model_class]}"
        _models[label] = {"model_class": model_class, "kinds": {}}
        while len(_models) > MAX_MODELS:
            _models.popitem(last=False)
        return label


# Set while auto times a call class (call_timing): the timed repeats are not calls the
# model made, and must not show in its counts.
_MUTED: contextvars.ContextVar[bool] = contextvars.ContextVar("triton_accel_stats_muted", default=False)


@contextlib.contextmanager
def muted():
    token = _MUTED.set(True)
    try:
        yield
    finally:
        _MUTED.reset(token)


def record(outcome: str, reason: str | None = None, path: str | None = None, *,
           kind: str = KIND_ATTENTION, model: str | None = None) -> None:
    """outcome: "triton" (served by one of our kernels, `path` says which) or "original".

    kind: "attention" or "linear"; model: the label from new_model_label(), when known.
    """
    if _MUTED.get():
        return
    served = outcome == OUTCOME_SERVED
    with _lock:
        if kind == KIND_ATTENTION:
            _calls[outcome] += 1
            if reason:
                _reasons[reason] += 1
            if path:
                _paths[path] += 1
        # get before setdefault: a step records ~500 calls, and building an empty entry (two
        # Counters) for each costs more host time than the counting.
        counts = _kinds.get(kind)
        if counts is None:
            counts = _kinds[kind] = _empty_counts()
        _add(counts, served, reason, path)
        if model is not None:
            entry = _models.get(model)
            if entry is None:  # dropped as too old, or recorded by a test without a label
                entry = _models[model] = {"model_class": model.split(" #")[0], "kinds": {}}
            counts = entry["kinds"].get(kind)
            if counts is None:
                counts = entry["kinds"][kind] = _empty_counts()
            _add(counts, served, reason, path)


def _plain(counts: dict) -> dict:
    return {"served": counts["served"], "handed_back": counts["handed_back"], "paths": dict(counts["paths"]),
            "reasons": dict(counts["reasons"])}


def snapshot() -> dict:
    with _lock:
        return {
            "calls": dict(_calls), "reasons": dict(_reasons), "paths": dict(_paths),
            "version": STATS_VERSION,
            "kinds": {kind: _plain(c) for kind, c in _kinds.items()},
            "models": {label: {"model_class": m["model_class"],
                               "kinds": {kind: _plain(c) for kind, c in m["kinds"].items()}}
                       for label, m in _models.items()},
        }


def reset() -> None:
    """Zero every count; the labels of patched models stay (their clones still exist)."""
    with _lock:
        _calls.clear()
        _reasons.clear()
        _paths.clear()
        _kinds.clear()
        for entry in _models.values():
            entry["kinds"] = {}
