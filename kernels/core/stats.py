"""Call counters per implementation, so tests can prove which path really ran.

The pack may be imported twice in one process under different package names; the custom
op is registered once and would then count into the first copy only. The counters live
in one process-wide object instead, so every copy reads the same numbers.
"""
from __future__ import annotations

import sys
import threading
import types
from collections import Counter

_SHARED_NAME = "_triton_accel_shared_state"


def shared() -> types.ModuleType:
    state = sys.modules.get(_SHARED_NAME)
    if state is None:
        state = types.ModuleType(_SHARED_NAME)
        state.counts = Counter()
        state.lock = threading.Lock()
        state.dispatch = None  # set by the first kernels.attention module that registers the op
        state = sys.modules.setdefault(_SHARED_NAME, state)
    return state


def increment(name: str, n: int = 1) -> None:
    state = shared()
    with state.lock:
        state.counts[name] += n


def counts() -> dict[str, int]:
    state = shared()
    with state.lock:
        return dict(state.counts)


def reset() -> None:
    state = shared()
    with state.lock:
        state.counts.clear()
