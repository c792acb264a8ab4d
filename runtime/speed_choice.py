"""auto mode: time our kernels against ComfyUI's own attention at the shapes a model sends.

A GPU we have no measured figures for must never get slower: the first call of each shape
class runs every candidate path and ComfyUI's attention, keeps the fastest candidate that also
agrees with ComfyUI's output (a bar per path: agreement_bar()), and remembers the answer on disk,
keyed by GPU, shape class and every version that changes the speed. The file is a
kernels.core.json_cache.JsonCache: ComfyUI processes sharing it merge their answers under a
cross-process lock instead of overwriting each other's, and an entry of the wrong shape is
dropped on reading, never raised from inside the sampler's attention call. speed_summary()
gives the measurements per device and shape class to the Settings node and the status panel.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from ..kernels.core import tuning
from ..kernels.core.gpu_rules import PATH_LABEL
from ..kernels.core.json_cache import JsonCache
from . import call_timing
from .guards import LOSSLESS_BAR, agreement, agreement_bar, agrees
from .progress import AutotuneProgress, comfy_progress_bar

log = logging.getLogger("triton_accel.nodes.speed_choice")  # not __name__: the clone's folder name

# 2: entries time the whole call in its step's mode (call_timing); 1 timed the kernels alone.
CACHE_VERSION = 2
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
    return call_timing.cache_folder() / "attention_speed.json"


def valid_entry(key: str, entry: object) -> bool:
    """{"choice": name, "timings": {...}}: what choose() writes and known() reads."""
    return (isinstance(entry, dict) and isinstance(entry.get("choice"), str)
            and isinstance(entry.get("timings", {}), dict))


tuning.set_progress_hook(AutotuneProgress())


def _time_ms(fn, device: torch.device) -> tuple[float, torch.Tensor]:
    """(ms per call, output): the whole call in the current step's mode (call_timing), warm."""
    out = fn()
    return call_timing.time_calls({"call": fn}, device)["call"], out


class SpeedChoice:
    def __init__(self, cache_file: Path | None = None, timer=None):
        # Without an explicit file the path is resolved at first use after a clear, so a
        # changed TRITON_ACCEL_CACHE_DIR takes effect after kernels' clear_caches().
        self._cache = JsonCache("auto speed cache", Path(cache_file) if cache_file else default_cache_file,
                                CACHE_VERSION, valid_entry)
        self._timer = timer or _time_ms
        # Two locks, taken in this order, never the other way round:
        # - one per cache key, so a shape class is measured once and every other thread asking
        #   for it waits for that answer instead of measuring again;
        # - one per device, so two measurements never overlap on one GPU (they would slow each
        #   other down). Different devices (MultiGPU work units: a thread per GPU) measure at
        #   the same time; one lock for everything made cuda:1 wait for all of cuda:0's timings.
        self._locks_lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self._device_locks: dict[str, threading.Lock] = {}

    @property
    def cache_file(self) -> Path:
        return self._cache.path

    def _lock_for(self, table: dict, name: str) -> threading.Lock:
        with self._locks_lock:
            lock = table.get(name)
            if lock is None:
                lock = table[name] = threading.Lock()
            return lock

    def known(self, key: str) -> str | None:
        entry = self._cache.get(key)
        return entry["choice"] if entry else None

    def snapshot(self) -> dict:
        """Every remembered measurement: this process's and what the cache file held when read."""
        return self._cache.snapshot()

    def choose(self, key: str, candidates: dict, device: torch.device, groups=None, about: dict | None = None):
        """(name, output): the fastest candidate that agrees with ComfyUI's, measured once per key.

        `candidates` maps names to zero-argument functions and must hold ORIGINAL, the
        reference every other candidate is compared with (each by agreement_bar(name)). The
        output is that of the winner's timed runs (None when the answer came from the cache).
        `groups` splits an output into its (batch, head) slices for the cosine check; `about`
        ({"device", "gpu", "arch", "shape_class"}) is stored with the entry for speed_summary().
        """
        entry = self._cache.get(key)
        if entry:
            return entry["choice"], None
        with self._lock_for(self._key_locks, key):
            entry = self._cache.get(key)  # measured by another thread while this one waited
            if entry:
                return entry["choice"], None
            with self._lock_for(self._device_locks, str(device)):
                return self._measure(key, candidates, device, groups, about)

    @staticmethod
    def _interleaved(candidates: dict, device: torch.device):
        """name -> (ms, output): every candidate timed in the same rounds (call_timing), so the
        host's drift between candidates does not pick the winner."""
        outputs = {name: fn() for name, fn in candidates.items()}
        ms = call_timing.time_calls(candidates, device)
        return lambda name: (ms[name], outputs[name])

    def _measure(self, key: str, candidates: dict, device: torch.device, groups, about: dict | None):
        """choose()'s timing and agreement check, under its key's and its device's locks."""
        about = dict(about or {})
        where = about.get("shape_class") or key
        names = [name for name in candidates if name != ORIGINAL]
        log.info("Triton Accel: timing %s against ComfyUI's attention at %s (first call only)",
                 ", ".join(names), where)
        bar = comfy_progress_bar(len(names) + 1)  # ComfyUI's attention, then each candidate
        call_timing.note_measurement()
        timer = self._interleaved(candidates, device) if self._timer is _time_ms else \
            (lambda name: self._timer(candidates[name], device))
        original_ms, original_out = timer(ORIGINAL)
        if bar is not None:
            bar.update(1)
        timings = {ORIGINAL: {"ms": round(original_ms, 4)}}
        outputs = {ORIGINAL: original_out}
        choice, best_ms = ORIGINAL, original_ms
        for name in names:
            ms, out = timer(name)
            if bar is not None:
                bar.update(1)
            metrics = agreement(out, original_out, groups)
            ok = agrees(metrics, agreement_bar(name))
            timings[name] = {"ms": round(ms, 4), **metrics, "agrees": ok}
            outputs[name] = out
            if not ok and agreement_bar(name) is LOSSLESS_BAR:
                log.warning("Triton Accel: %s disagrees with ComfyUI's attention at %s (rel. L2 %.2e); "
                            "not used there", name, where, metrics["rel_l2"])
            # A tie, within call_timing's margin, goes to ComfyUI's attention.
            if ok and ms < best_ms and call_timing.ours_wins(ms, original_ms):
                choice, best_ms = name, ms
        log.info("Triton Accel: %s: %s -> %s (%.2fx ComfyUI's attention)", where,
                 ", ".join(_timing_words(n, t) for n, t in timings.items()), choice, original_ms / best_ms
                 if best_ms > 0 else 1.0)
        self._cache.put(key, {"choice": choice, "timings": timings, **about})
        return choice, outputs[choice]


def _timing_words(name: str, timing: dict) -> str:
    words = f"{name} {timing['ms']:.3f} ms"
    if "agrees" in timing and not timing["agrees"]:
        words += f" (disagrees: rel. L2 {timing['rel_l2']:.3f}, min cosine {timing['min_cosine']:.4f})"
    return words


def _row(key: str, entry: dict) -> dict:
    """One speed_summary() row; entries written before `about` was stored are read from their key
    (gpu | arch | torch | triton | pack | paths | shape class)."""
    parts = key.split("|")
    timings = {name: t.get("ms") for name, t in entry.get("timings", {}).items() if isinstance(t, dict)}
    chosen, original = timings.get(entry["choice"]), timings.get(ORIGINAL)
    speedup = round(original / chosen, 3) if isinstance(chosen, (int, float)) and isinstance(
        original, (int, float)) and chosen > 0 else None
    return {
        "device": str(entry.get("device", "")), "gpu": str(entry.get("gpu", parts[0])),
        "arch": str(entry.get("arch", parts[1] if len(parts) > 1 else "")),
        "shape_class": str(entry.get("shape_class", parts[-1])), "choice": entry["choice"],
        "timings_ms": timings, "speedup_vs_original": speedup,
        "agreement": {name: {m: t[m] for m in ("rel_l2", "min_cosine", "agrees") if m in t}
                      for name, t in entry.get("timings", {}).items() if isinstance(t, dict) and "rel_l2" in t},
    }


# The SpeedChoice the patch nodes measure with (one per process, on the default cache file).
shared = call_timing.PerProcess(SpeedChoice)


def speed_summary(speed_choice: SpeedChoice | None = None) -> list[dict]:
    """auto's measurements, one row per GPU and shape class: {device, gpu, arch, shape_class,
    choice, timings_ms: {path: ms}, speedup_vs_original (ComfyUI's ms / the chosen path's ms),
    agreement: {path: {rel_l2, min_cosine, agrees}}}, from memory and the cache file."""
    entries = (speed_choice or shared()).snapshot()
    return [_row(key, entry) for key, entry in sorted(entries.items()) if valid_entry(key, entry)]


# Which devices each patched model (call_stats' label, "Flux #1") ran auto's measured path on,
# so its node shows the measurements of its own device(s), not every GPU's.
_model_devices: dict[str, set[str]] = {}
_model_devices_lock = threading.Lock()
MAX_SPEED_LINES = 6


def note_model_device(label: str | None, device: torch.device | str) -> None:
    if label is None:
        return
    with _model_devices_lock:
        _model_devices.setdefault(label, set()).add(str(device))


def model_devices(label: str) -> set[str]:
    with _model_devices_lock:
        return set(_model_devices.get(label, ()))


def _speed_line(row: dict) -> str:
    where = f"auto at {row['shape_class']}"
    timings = row.get("timings_ms") or {}
    original = timings.get(ORIGINAL)
    if row["choice"] != ORIGINAL:
        label = PATH_LABEL.get(row["choice"], row["choice"])
        if row.get("speedup_vs_original") is None:
            return f"{where}: {label} kept"
        return f"{where}: {label} {row['speedup_vs_original']:.2f}x faster than ComfyUI's (kept)"
    agreement_of = row.get("agreement") or {}
    agreeing = {name for name, a in agreement_of.items() if a.get("agrees")}
    ours = {name: ms for name, ms in timings.items()
            if name != ORIGINAL and isinstance(ms, (int, float)) and ms > 0}
    pool = [ms for name, ms in ours.items() if name in agreeing] or list(ours.values())
    if not pool or not isinstance(original, (int, float)):
        return f"{where}: ComfyUI's kept"
    why = "" if agreeing or not agreement_of else ", did not match its output"
    return f"{where}: ComfyUI's kept (ours {original / min(pool):.2f}x{why})"


def speed_lines(devices: set[str] | None = None, rows: list[dict] | None = None,
                limit: int = MAX_SPEED_LINES) -> list[str]:
    """auto's measured speed-up per shape class, one short line each, for the patch node's
    text: rows of speed_summary() measured on `devices` (None: all). At most `limit` lines; the
    rest are counted in the last one."""
    rows = speed_summary() if rows is None else rows
    if devices is not None:
        rows = [r for r in rows if r.get("device") in devices]
    if len(rows) <= limit:
        return [_speed_line(r) for r in rows]
    shown = [_speed_line(r) for r in rows[:limit - 1]]
    rest = rows[limit - 1:]
    faster = sum(1 for r in rest if r["choice"] != ORIGINAL)
    return shown + [f"... {len(rest)} more shape classes ({faster} on our kernels): see the Triton Accel panel"]
