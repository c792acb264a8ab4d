"""Every process-wide cache of the pack, so one call forgets them all.

A module that keeps a cache (remembered routes, fitted configs, compiled launch plans, the
tuning cache's memory copy...) registers a function that empties it; `clear_all()` (what
`kernels.clear_caches()` and the tests call after changing an environment variable or the
registry) walks them. A cache that is not registered here is a bug: its stale answers would
survive a clear.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

_clearers: dict[str, Callable[[], None]] = {}
_lock = threading.Lock()
_generation = 0  # clears so far: what was recorded from a cache is stale once it moves


def register(name: str, clear: Callable[[], None]) -> None:
    """`clear` empties the cache called `name` (one name per cache; re-registering replaces it)."""
    with _lock:
        _clearers[name] = clear


def names() -> list[str]:
    with _lock:
        return sorted(_clearers)


def generation() -> int:
    """How many times clear_all() ran (a CUDA graph that read a cache's tensors is stale after)."""
    return _generation


def clear_all() -> None:
    global _generation
    with _lock:
        clearers = list(_clearers.values())
        _generation += 1
    for clear in clearers:
        clear()
