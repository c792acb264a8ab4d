"""auto's measurement of a whole call: ours against ComfyUI's, on the path the call really takes.

A kernel that is faster on the GPU can still make a step slower: our Linear call costs the host
two Triton launches and the node path's checks (~60-120 us), cuBLAS's one launch (~20 us), so a
step that waits on the host (SDXL's 580 small Linear calls, any model under dynamic VRAM, where
step graphs are off) loses what the kernels won. So auto times the call as the step runs it:

- mode "eager" (the step is issued call by call): wall time of back-to-back calls, host and
  device together, with one synchronisation at the end. A call whose host time exceeds its GPU
  time measures its host time, as it costs the step; a long call measures its GPU time.
- mode "graph" (step_graph will record the step and replay it, issuing no Python): GPU time
  only. A spin kernel ahead of the timed calls lets the host queue them all before the GPU
  reaches them, so host gaps do not count.

The mode of a call is what the step around it says (STEP_MODE, set by step_graph for the
duration of a step): steps that will be recorded are "graph", everything else is "eager".
Candidates are timed in alternating rounds and each keeps its fastest round (interference only
ever adds time). Ours is kept only when it beats ComfyUI's by WIN_MARGIN: a tie goes to ComfyUI,
whose path costs nothing of ours.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..kernels.core import env_settings
from ..kernels.core.json_cache import JsonCache

log = logging.getLogger("triton_accel.nodes.call_timing")  # not __name__: the clone's folder name

MODE_EAGER = "eager"
MODE_GRAPH = "graph"
# The step around a call: step_graph sets it per step; outside a patched step (tests, direct
# calls) a call is issued eagerly.
STEP_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("triton_accel_step_mode", default=MODE_EAGER)

# Ours must be at least this much faster: measurement noise must not hand the step a kernel
# that is not really faster, and a tie costs nothing on ComfyUI's side.
WIN_MARGIN = 0.03
ROUNDS = 5
# Calls per round: enough that one round lasts about TARGET_ROUND_MS, within these bounds (a
# call of tens of microseconds needs dozens in a round to rise above the host's jitter).
MIN_CALLS, MAX_CALLS = 3, 60
TARGET_ROUND_MS = 3.0
# graph mode: the spin ahead of a round lasts at least the host's time to queue the round
# (cycles at ~2 GHz; an overlong spin costs a little wall time and is never timed).
SPIN_CYCLES_PER_US = 2000
SPIN_US_PER_CALL = 200


@contextlib.contextmanager
def step_mode(mode: str):
    token = STEP_MODE.set(mode)
    try:
        yield
    finally:
        STEP_MODE.reset(token)


def current_mode() -> str:
    return STEP_MODE.get()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wall_round(fn: Callable, calls: int, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / calls


def _device_round(fn: Callable, calls: int, device: torch.device) -> float:
    _sync(device)
    torch.cuda._sleep(int(SPIN_CYCLES_PER_US * SPIN_US_PER_CALL * calls))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def time_calls(fns: dict[str, Callable], device: torch.device, mode: str | None = None) -> dict[str, float]:
    """{name: ms per call} of each zero-argument function, in `mode` (default: the current
    step's). Each function runs once first (warm), then ROUNDS rounds, alternating between
    candidates; a candidate keeps its fastest round."""
    mode = mode or current_mode()
    measure = _device_round if mode == MODE_GRAPH and device.type == "cuda" else _wall_round
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        single = {}
        for name, fn in fns.items():
            single[name] = _wall_round(fn, 1, device)  # also the warm-up call
        slowest = max(single.values()) if single else 1.0
        calls = int(min(MAX_CALLS, max(MIN_CALLS, TARGET_ROUND_MS / max(slowest, 1e-3))))
        best = {name: float("inf") for name in fns}
        for r in range(ROUNDS):
            order = list(fns) if r % 2 == 0 else list(reversed(fns))
            for name in order:
                best[name] = min(best[name], measure(fns[name], calls, device))
    return best


def ours_wins(ours_ms: float, theirs_ms: float) -> bool:
    return ours_ms < theirs_ms * (1.0 - WIN_MARGIN)


# How many timings auto ran in this process (Linear classes and attention shape classes): the
# step check (step_check) starts once a whole step ran without a new one.
_counts = {"measurements": 0}
_counts_lock = threading.Lock()
# label -> the step check's last result for that patched model ({"ours_ms", "comfyui_ms", "kept"})
_step_checks: dict[str, dict] = {}


def note_measurement() -> None:
    with _counts_lock:
        _counts["measurements"] += 1


def measurement_count() -> int:
    return _counts["measurements"]


def note_step_check(label: str | None, result: dict) -> None:
    if label is not None:
        with _counts_lock:
            _step_checks[label] = dict(result)


def step_check_of(label: str) -> dict | None:
    with _counts_lock:
        result = _step_checks.get(label)
        return dict(result) if result else None


# ---- Linear: one decision per call class, shared by every layer of that class -----------------

CACHE_VERSION = 1


def _host_name() -> str:
    """The host CPU, part of a decision's key: an eager call's cost is the host's as much as the GPU's."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return name


def cache_folder() -> Path:
    """Where auto's measurements live: TRITON_ACCEL_CACHE_DIR, else ComfyUI's user folder
    (with the user's other settings), else ~/.cache/triton_accel."""
    base = env_settings.cache_dir()
    if not base:
        try:
            import folder_paths  # ComfyUI's

            base = os.path.join(folder_paths.get_user_directory(), "triton_accel")
        except Exception:
            base = os.path.join(os.path.expanduser("~"), ".cache", "triton_accel")
    return Path(base)


def default_cache_file() -> Path:
    return cache_folder() / "linear_speed.json"


def _valid_entry(key: str, entry: object) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("ours"), bool)
            and isinstance(entry.get("ours_ms"), (int, float)) and isinstance(entry.get("theirs_ms"), (int, float)))


class LinearSpeedChoice:
    """Whether our Linear call beats ComfyUI's, per call class: measured once (per process and
    on disk), under a lock per class and one per device (two timings on one GPU would slow
    each other). `timer` is time_calls' seam for tests; `supports(device)` says where timing runs."""

    def __init__(self, cache_file: Path | None = None, timer=None, supports=None):
        self._cache = JsonCache("Linear speed cache", Path(cache_file) if cache_file else default_cache_file,
                                CACHE_VERSION, _valid_entry)
        self._timer = timer or time_calls
        self._supports = supports or (lambda device: device.type == "cuda")
        self._locks_lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._host = None

    def supports(self, device: torch.device) -> bool:
        return self._supports(device)

    def key(self, gpu: str, parts: tuple) -> str:
        if self._host is None:
            self._host = _host_name()
        return "|".join([gpu, self._host, *map(str, parts)])

    def _lock(self, name: str) -> threading.Lock:
        with self._locks_lock:
            lock = self._locks.get(name)
            if lock is None:
                lock = self._locks[name] = threading.Lock()
            return lock

    def known(self, key: str) -> dict | None:
        return self._cache.get(key)

    def decide(self, key: str, ours: Callable, theirs: Callable, device: torch.device, about: dict) -> dict:
        """{"ours": bool, "ours_ms", "theirs_ms", ...about}: the class's entry, measured now if new."""
        entry = self._cache.get(key)
        if entry:
            return entry
        with self._lock(key):
            entry = self._cache.get(key)
            if entry:
                return entry
            with self._lock(str(device)):
                timings = self._timer({"ours": ours, "theirs": theirs}, device)
            note_measurement()
            entry = {"ours": ours_wins(timings["ours"], timings["theirs"]), "ours_ms": round(timings["ours"], 5),
                     "theirs_ms": round(timings["theirs"], 5), **about}
            log.info("Triton Accel Linear: %s: ours %.3f ms, ComfyUI's %.3f ms a call (%s) -> %s",
                     about.get("shape_class", key), entry["ours_ms"], entry["theirs_ms"], about.get("mode"),
                     "ours" if entry["ours"] else "ComfyUI's")
            self._cache.put(key, entry)
            return entry

    def snapshot(self) -> dict:
        return self._cache.snapshot()


class PerProcess:
    """One instance of `factory`'s making per process, made at first use, from any thread."""

    def __init__(self, factory):
        self._factory = factory
        self._value = None
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            if self._value is None:
                self._value = self._factory()
            return self._value


# The LinearSpeedChoice the patched layers measure with (on the default cache file).
shared_linear = PerProcess(LinearSpeedChoice)


def timing_enabled() -> bool:
    """auto's call timing can be turned off (TRITON_ACCEL_CALL_TIMING=0): every call our rules
    admit is then served, as before the timing existed (for benchmarks of the kernels alone)."""
    return env_settings.call_timing_enabled()
