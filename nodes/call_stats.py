"""Counts of what the patched attention did with each call, and why it handed calls back.

Read through the HTTP route /triton_accel/stats (and by the integration tests, which must
prove that our kernel really ran and that unsupported calls reached ComfyUI's function).
"""
from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_calls: Counter = Counter()
_reasons: Counter = Counter()
_paths: Counter = Counter()


def record(outcome: str, reason: str | None = None, path: str | None = None) -> None:
    """outcome: "triton" (served by one of our kernels, `path` says which) or "original"."""
    with _lock:
        _calls[outcome] += 1
        if reason:
            _reasons[reason] += 1
        if path:
            _paths[path] += 1


def snapshot() -> dict:
    with _lock:
        return {"calls": dict(_calls), "reasons": dict(_reasons), "paths": dict(_paths)}


def reset() -> None:
    with _lock:
        _calls.clear()
        _reasons.clear()
        _paths.clear()
