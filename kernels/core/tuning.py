"""Kernel configs: tuned defaults per arch, opt-in autotuning, and an on-disk cache.

Nobody waits for autotuning unless they ask for it (TRITON_ACCEL_AUTOTUNE=1): the default is
a table lookup. Autotune results are stored per GPU name, capability, Triton version and
shape class, so a driver, GPU or Triton change never reuses a stale winner. The file is a
json_cache.JsonCache: several ComfyUI processes may share it, so writes merge under a
cross-process lock and replace the file atomically, and an entry that is not a flat config
dict is never returned.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path

from . import device as _device
from . import env_settings
from .json_cache import JsonCache

log = logging.getLogger("triton_accel.kernels.core.tuning")  # not __name__: the clone's folder name

CACHE_VERSION = 1


def autotune_enabled() -> bool:
    return env_settings.autotune_enabled()


def cache_path() -> Path:
    root = env_settings.cache_dir() or env_settings.user_cache_root()
    return Path(root) / f"tuning-v{CACHE_VERSION}.json"


def cache_key(op: str, info: _device.DeviceInfo, shape_class: Iterable) -> str:
    cap = f"{info.capability[0]}.{info.capability[1]}" if info.capability else "-"
    parts = [op, info.name, cap, info.arch, f"triton-{_device.triton_version()}", *map(str, shape_class)]
    return "|".join(parts)


def valid_config(key: str, config: object) -> bool:
    """A launch config: a non-empty dict of names to JSON scalars (BLOCK_M=128, TMA=False...)."""
    return (isinstance(config, dict) and bool(config)
            and all(isinstance(k, str) and isinstance(v, (bool, int, float, str)) for k, v in config.items()))


# The path is resolved at first use after clear_memory(), so tests and users may point
# TRITON_ACCEL_CACHE_DIR elsewhere and clear.
_cache = JsonCache("tuning cache", cache_path, CACHE_VERSION, valid_config)


def cached(key: str) -> dict | None:
    config = _cache.get(key)
    return dict(config) if config is not None else None


def store(key: str, config: dict) -> None:
    try:
        _cache.put(key, dict(config))
    except (TypeError, ValueError) as e:  # a config the file cannot hold: still used, just not kept
        log.warning("Triton Accel: not storing config %r for %s in the tuning cache: %s", config, key, e)


def clear_memory() -> None:
    """Forget the in-memory copy (tests point TRITON_ACCEL_CACHE_DIR elsewhere)."""
    _cache.clear()


# Autotuning compiles and times every candidate config: seconds, during a model's first call.
# kernels/ knows nothing of ComfyUI, so the nodes install a hook here that drives ComfyUI's
# progress bar; it is called as hook(done, total) after each candidate, failed ones included.
ProgressHook = Callable[[int, int], None]
_progress_hook: ProgressHook | None = None


def set_progress_hook(hook: ProgressHook | None) -> None:
    """Install (or, with None, remove) the function told autotuning's progress as (done, total)."""
    global _progress_hook
    _progress_hook = hook


def _report_progress(done: int, total: int) -> None:
    if _progress_hook is None:
        return
    try:
        _progress_hook(done, total)
    except Exception as e:  # a broken progress display must never stop the tuning it reports on
        log.debug("autotune progress hook failed: %s", e)


def autotune(candidates: list[dict], run: Callable[[dict], object]) -> tuple[dict, dict]:
    """Time every candidate with run(config) and return (best, {index: ms}).

    A candidate that fails to compile or run (too much shared memory, say) is skipped.
    """
    import triton.testing

    timings = {}
    best, best_ms = None, float("inf")
    total = len(candidates)
    _report_progress(0, total)
    for i, cfg in enumerate(candidates):
        try:
            run(cfg)
            ms = triton.testing.do_bench(lambda cfg=cfg: run(cfg), warmup=5, rep=20, return_mode="median")
        except Exception as e:
            log.debug("autotune candidate %s failed: %s", cfg, e)
            continue
        finally:
            _report_progress(i + 1, total)
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
        configs = candidates()
        shape_text = "-".join(map(str, shape_class))
        log.info("autotuning %s at %s: %d configs (first call only; TRITON_ACCEL_AUTOTUNE=1)",
                 op, shape_text, len(configs))
        best, timings = autotune(configs, run)
        # timings is empty when no config ran (each failed, or a stand-in autotune): say so, never raise
        best_ms = min(timings.values(), default=float("nan"))
        log.info("autotuned %s at %s: chose %s (%.3f ms)", op, shape_text, best, best_ms)
        store(key, best)
        return best
    return default
