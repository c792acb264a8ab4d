"""auto mode: time our kernel against ComfyUI's own attention at the shapes a model sends.

A GPU we have no measured figures for must never get slower: the first call of each shape
class runs both, keeps the faster (and only if both agree numerically), and remembers the
answer on disk, keyed by GPU, shape class and every version that changes the speed. The
file is a kernels.json_cache.JsonCache: ComfyUI processes sharing it merge their answers
under a cross-process lock instead of overwriting each other's, and an entry of the wrong
shape is dropped on reading, never raised from inside the sampler's attention call.
"""
from __future__ import annotations

import logging
import os
import statistics
import threading
from pathlib import Path

import torch

from ..kernels import env_settings
from ..kernels.json_cache import JsonCache

log = logging.getLogger("triton_accel.nodes.speed_choice")  # not __name__: the clone's folder name

CACHE_VERSION = 1
WARMUP_RUNS = 2
TIMED_RUNS = 5
# Outputs further apart than this mean something is wrong with one path; keep ComfyUI's.
MAX_REL_L2_DIFFERENCE = 2e-2

ORIGINAL = "original"


def _bucket(n: int) -> int:
    """Lengths grouped by the next power of two: speed ordering is stable inside a bucket."""
    return 1 << max(0, (int(n) - 1).bit_length())


def shape_class(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> str:
    b, hq, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    mask_kind = "none" if mask is None else ("bool" if mask.dtype == torch.bool else "additive")
    return f"b{b}-h{hq}/{hk}-q{_bucket(lq)}-k{_bucket(lk)}-d{d}-{str(q.dtype).replace('torch.', '')}-{mask_kind}"


def default_cache_file() -> Path:
    base = env_settings.cache_dir()
    if not base:
        try:
            import folder_paths  # ComfyUI's; keeps the cache with the user's other settings

            base = os.path.join(folder_paths.get_user_directory(), "triton_accel")
        except Exception:
            base = os.path.join(os.path.expanduser("~"), ".cache", "triton_accel")
    return Path(base) / "attention_speed.json"


def valid_entry(key: str, entry: object) -> bool:
    """{"choice": name, "timings": {...}}: what choose() writes and known() reads."""
    return (isinstance(entry, dict) and isinstance(entry.get("choice"), str)
            and isinstance(entry.get("timings", {}), dict))


def _time_ms(fn, device: torch.device) -> tuple[float, torch.Tensor]:
    out = None
    for _ in range(WARMUP_RUNS):
        out = fn()
    times = []
    for _ in range(TIMED_RUNS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), out


class SpeedChoice:
    def __init__(self, cache_file: Path | None = None, timer=None):
        # Without an explicit file the path is resolved at first use after a clear, so a
        # changed TRITON_ACCEL_CACHE_DIR takes effect after kernels' clear_caches().
        self._cache = JsonCache("auto speed cache", Path(cache_file) if cache_file else default_cache_file,
                                CACHE_VERSION, valid_entry)
        self._timer = timer or _time_ms
        self._lock = threading.Lock()  # one measurement at a time: timings must not overlap

    @property
    def cache_file(self) -> Path:
        return self._cache.path

    def known(self, key: str) -> str | None:
        entry = self._cache.get(key)
        return entry["choice"] if entry else None

    def choose(self, key: str, candidates: dict, device: torch.device):
        """(name, output): the fastest candidate that agrees with ComfyUI's, measured once per key.

        `candidates` maps names to zero-argument functions and must hold ORIGINAL, the
        reference every other candidate is compared with. The output is that of the winner's
        timed runs (None when the answer came from the cache).
        """
        with self._lock:
            entry = self._cache.get(key)
            if entry:
                return entry["choice"], None
            original_ms, original_out = self._timer(candidates[ORIGINAL], device)
            ref = original_out.float()
            timings = {ORIGINAL: {"ms": round(original_ms, 4)}}
            outputs = {ORIGINAL: original_out}
            choice, best_ms = ORIGINAL, original_ms
            for name, fn in candidates.items():
                if name == ORIGINAL:
                    continue
                ms, out = self._timer(fn, device)
                diff = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
                timings[name] = {"ms": round(ms, 4), "rel_l2": diff}
                outputs[name] = out
                if not diff <= MAX_REL_L2_DIFFERENCE:  # NaN lands here too
                    log.warning("Triton Accel: %s disagrees with ComfyUI's attention at %s (rel. L2 %.2e); "
                                "not used there", name, key, diff)
                    continue
                if ms < best_ms:
                    choice, best_ms = name, ms
            log.info("Triton Accel: %s: %s -> %s", key,
                     ", ".join(f"{n} {t['ms']:.3f} ms" for n, t in timings.items()), choice)
            self._cache.put(key, {"choice": choice, "timings": timings})
            return choice, outputs[choice]
