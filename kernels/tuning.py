"""Kernel configs: tuned defaults per arch, opt-in autotuning, and an on-disk cache.

Nobody waits for autotuning unless they ask for it (TRITON_ACCEL_AUTOTUNE=1): the default is
a table lookup. Autotune results are stored per GPU name, capability, Triton version and
shape class, so a driver, GPU or Triton change never reuses a stale winner. Writes are
atomic (temp file + os.replace) because several ComfyUI processes may share the cache.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from . import device as _device

log = logging.getLogger(__name__)

CACHE_VERSION = 1
_lock = threading.Lock()
_memory: dict[str, dict] | None = None


def autotune_enabled() -> bool:
    return os.environ.get("TRITON_ACCEL_AUTOTUNE", "0") not in ("", "0", "false", "False")


def cache_path() -> Path:
    root = os.environ.get("TRITON_ACCEL_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "triton_accel")
    return Path(root) / f"tuning-v{CACHE_VERSION}.json"


def cache_key(op: str, info: _device.DeviceInfo, shape_class: Iterable) -> str:
    cap = f"{info.capability[0]}.{info.capability[1]}" if info.capability else "-"
    parts = [op, info.name, cap, info.arch, f"triton-{_device.triton_version()}", *map(str, shape_class)]
    return "|".join(parts)


def _load() -> dict[str, dict]:
    global _memory
    if _memory is None:
        try:
            data = json.loads(cache_path().read_text())
            _memory = data.get("entries", {}) if data.get("version") == CACHE_VERSION else {}
        except FileNotFoundError:
            _memory = {}
        except Exception as e:  # a corrupt cache must not break inference; it is rebuilt
            log.warning("ignoring unreadable tuning cache %s: %s", cache_path(), e)
            _memory = {}
    return _memory


def cached(key: str) -> dict | None:
    with _lock:
        return _load().get(key)


def store(key: str, config: dict) -> None:
    path = cache_path()
    with _lock:
        entries = _load()
        entries[key] = config
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:  # merge what other processes wrote since we read
                on_disk = json.loads(path.read_text()).get("entries", {})
                on_disk.update(entries)
                entries.update(on_disk)
            except Exception:
                pass
            fd, tmp = tempfile.mkstemp(prefix=".tuning-", suffix=".json", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("could not write tuning cache %s: %s", path, e)


def clear_memory() -> None:
    """Forget the in-memory copy (tests point TRITON_ACCEL_CACHE_DIR elsewhere)."""
    global _memory
    with _lock:
        _memory = None


def autotune(candidates: list[dict], run: Callable[[dict], object]) -> tuple[dict, dict]:
    """Time every candidate with run(config) and return (best, {index: ms}).

    A candidate that fails to compile or run (too much shared memory, say) is skipped.
    """
    import triton.testing

    timings = {}
    best, best_ms = None, float("inf")
    for i, cfg in enumerate(candidates):
        try:
            run(cfg)
            ms = triton.testing.do_bench(lambda: run(cfg), warmup=5, rep=20, return_mode="median")
        except Exception as e:
            log.debug("autotune candidate %s failed: %s", cfg, e)
            continue
        timings[i] = ms
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError("no autotune candidate ran")
    return best, timings


def choose(op: str, info: _device.DeviceInfo, shape_class: tuple, default: dict,
           candidates: Callable[[], list[dict]] | None = None,
           run: Callable[[dict], object] | None = None) -> dict:
    """The config for this call: cached autotune result, else fresh autotune (opt-in), else default."""
    key = cache_key(op, info, shape_class)
    hit = cached(key)
    if hit is not None:
        return hit
    if autotune_enabled() and candidates is not None and run is not None:
        log.info("autotuning %s for %s (TRITON_ACCEL_AUTOTUNE=1)", op, key)
        best, _ = autotune(candidates(), run)
        store(key, best)
        return best
    return default
