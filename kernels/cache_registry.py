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


def register(name: str, clear: Callable[[], None]) -> None:
    """`clear` empties the cache called `name` (one name per cache; re-registering replaces it)."""
    with _lock:
        _clearers[name] = clear


def names() -> list[str]:
    with _lock:
        return sorted(_clearers)


def clear_all() -> None:
    with _lock:
        clearers = list(_clearers.values())
    for clear in clearers:
        clear()
