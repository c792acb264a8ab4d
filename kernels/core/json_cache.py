"""A JSON file of keyed entries shared by every process of one user (tuning and speed caches).

Why each part is there:
- Merge-on-write under a cross-process lock. Several ComfyUI processes (or ComfyUI and a
  benchmark) write the same file. Rewriting it from one process's memory loses the other
  processes' entries; reading, merging and replacing without a lock still loses them when
  two writers interleave between their read and their replace.
- Atomic replace (temp file in the same folder, then os.replace): a reader never sees half a
  file, with or without the lock.
- Per-entry validation: the file outlives upgrades and can be edited by hand; an entry of the
  wrong shape is dropped, never handed to a kernel or a sampler.
- The cache never breaks inference. A file that cannot be used (truncated, empty, binary,
  valid JSON of the wrong shape) is rebuilt on the next write, with one warning naming it. A
  path that cannot be written (a directory in its place, a read-only folder) leaves the cache
  in memory for the rest of the process, again with one warning, and no temp file behind.

Stdlib only, so a by-path loader (install.py, a test's worker process) can use it.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from . import cache_registry

log = logging.getLogger("triton_accel.kernels.core.json_cache")  # not __name__: the clone's folder name

LOCK_TIMEOUT_S = 10.0
# A write holds the lock for milliseconds, so a fallback lock file older than this was left by
# a process that died holding it. Shorter than LOCK_TIMEOUT_S: a waiter breaks a dead holder's
# lock instead of timing out on it.
STALE_LOCK_S = 5.0
_POLL_S = 0.005

if os.name == "nt":
    import msvcrt

    def _os_lock(fd: int) -> bool:
        """One non-blocking attempt: True when locked, False while another process holds it."""
        os.lseek(fd, 0, os.SEEK_SET)
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EDEADLK):
                return False
            raise
        return True

    def _os_unlock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
else:
    import fcntl

    def _os_lock(fd: int) -> bool:
        """One non-blocking attempt: True when locked, False while another process holds it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def _os_unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)


class LockTimeout(Exception):
    """Another process held the cache's lock for longer than LOCK_TIMEOUT_S."""


class CrossProcessLock:
    """Exclusive lock on `<file>.lock` across processes.

    The OS lock (flock / msvcrt.locking) is released by the OS when its holder dies. Where the
    file system refuses it (some network mounts: ENOLCK, EOPNOTSUPP), the fallback is an
    exclusively created `<file>.lock-held`, removed on release and treated as stale after
    STALE_LOCK_S. An OSError from creating the lock file itself means the folder cannot be
    written and is left to the caller.
    """

    def __init__(self, path: Path, timeout: float | None = None):
        self.lock_path = path.with_name(path.name + ".lock")
        self.fallback_path = path.with_name(path.name + ".lock-held")
        self.timeout = LOCK_TIMEOUT_S if timeout is None else timeout
        self._fd: int | None = None
        self._fallback_held = False

    def __enter__(self) -> CrossProcessLock:
        deadline = time.monotonic() + self.timeout
        try:
            self._fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError:  # a lock file another user created; locking needs no write access
            self._fd = os.open(self.lock_path, os.O_RDONLY)
        try:
            while not _os_lock(self._fd):
                if time.monotonic() > deadline:
                    raise LockTimeout(f"{self.lock_path} held by another process for {self.timeout:.0f} s")
                time.sleep(_POLL_S)
            return self
        except OSError as e:
            log.debug("OS file lock refused on %s (%s); using an exclusive lock file", self.lock_path, e)
        except BaseException:
            self._close()
            raise
        self._close()
        self._hold_fallback(deadline)
        return self

    def _hold_fallback(self, deadline: float) -> None:
        while True:
            try:
                os.close(os.open(self.fallback_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
                self._fallback_held = True
                return
            except FileExistsError:
                with contextlib.suppress(OSError):
                    if time.time() - os.stat(self.fallback_path).st_mtime > STALE_LOCK_S:
                        os.unlink(self.fallback_path)
                        continue
            if time.monotonic() > deadline:
                raise LockTimeout(f"{self.fallback_path} held by another process for {self.timeout:.0f} s")
            time.sleep(_POLL_S)

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops an OS lock too
            self._fd = None

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                _os_unlock(self._fd)
            self._close()
        if self._fallback_held:
            with contextlib.suppress(OSError):
                os.unlink(self.fallback_path)
            self._fallback_held = False


# One warning per (file, problem) per process, even across clear(): clear_caches() may run
# often and a broken cache must not fill the log.
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _warn_once(path: Path, problem: str, message: str, *args) -> None:
    with _warned_lock:
        if (str(path), problem) in _warned:
            return
        _warned.add((str(path), problem))
    log.warning(message, *args)


def _replace(tmp: str, path: Path) -> None:
    # On Windows os.replace fails while another process has the target open for reading
    # (a moment, in our readers); POSIX never does.
    attempts = 50 if os.name == "nt" else 1
    for attempt in range(attempts):
        try:
            os.replace(tmp, path)
            return
        except PermissionError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.02)


_MISSING, _OK, _UNREADABLE, _REBUILD = "missing", "ok", "unreadable", "rebuild"


class JsonCache:
    """`{"version": N, "entries": {key: entry}}` at `path`, with an in-memory copy.

    `path` is a Path or a function returning one (resolved at the first use after clear(),
    so a changed TRITON_ACCEL_CACHE_DIR takes effect). `valid_entry(key, entry)` says whether
    an entry read from disk may be used; others are dropped.
    """

    def __init__(self, name: str, path: Path | Callable[[], Path], version: int,
                 valid_entry: Callable[[str, object], bool]):
        self.name = name
        self.version = version
        self._path_source = path
        self._valid_entry = valid_entry
        self._lock = threading.RLock()
        self._path: Path | None = None
        self._entries: dict | None = None
        self._unsaved: dict = {}  # put() since the last successful write
        self._memory_only = False
        with _live_lock:
            _live.add(self)

    @property
    def path(self) -> Path:
        with self._lock:
            if self._path is None:
                source = self._path_source
                self._path = Path(source() if callable(source) else source)
            return self._path

    @property
    def memory_only(self) -> bool:
        with self._lock:
            self._load()
            return self._memory_only

    def get(self, key: str):
        with self._lock:
            return self._load().get(key)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._load())

    def put(self, key: str, entry) -> None:
        """Remember `entry` and write it, merged with what other processes wrote, to disk."""
        if not isinstance(key, str) or not self._valid_entry(key, entry):
            raise ValueError(f"{self.name}: refusing an entry of the wrong shape at {key!r}: {entry!r}")
        json.dumps(entry, allow_nan=True)  # TypeError here, not halfway through a write
        with self._lock:
            self._load()[key] = entry
            self._unsaved[key] = entry
            self._write()

    def clear(self) -> None:
        """Forget the memory copy (and the resolved path); the next use reads the file again."""
        with self._lock:
            self._path = None
            self._entries = None
            self._unsaved = {}
            self._memory_only = False

    def _load(self) -> dict:
        if self._entries is None:
            entries, status = self._read(self.path)
            self._entries = entries
            self._memory_only = status == _UNREADABLE
        return self._entries

    def _read(self, path: Path) -> tuple[dict, str]:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return {}, _MISSING
        except OSError as e:  # a directory in its place, a file where a folder should be, no permission
            _warn_once(path, "unusable", "Triton Accel: cannot use %s as the %s (%s); it is kept in memory "
                       "only in this process", path, self.name, e)
            return {}, _UNREADABLE
        try:
            document = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            _warn_once(path, "corrupt", "Triton Accel: %s (%s) is not valid JSON (truncated, empty or binary: "
                       "%s); it will be rebuilt", path, self.name, e)
            return {}, _REBUILD
        entries = document.get("entries") if isinstance(document, dict) else None
        if not isinstance(entries, dict) or not isinstance(document.get("version"), int):
            _warn_once(path, "shape", "Triton Accel: %s (%s) is not a {\"version\": int, \"entries\": {...}} "
                       "object; it will be rebuilt", path, self.name)
            return {}, _REBUILD
        if document["version"] != self.version:
            log.info("Triton Accel: %s was written by %s version %s (this is %s); starting it anew",
                     path, self.name, document["version"], self.version)
            return {}, _REBUILD
        valid = {k: v for k, v in entries.items() if self._valid_entry(k, v)}
        if len(valid) != len(entries):
            _warn_once(path, "entries", "Triton Accel: dropped %d entries of the wrong shape from %s (%s)",
                       len(entries) - len(valid), path, self.name)
        return valid, _OK

    def _write(self) -> None:
        if self._memory_only:
            return
        path = self.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_dir():
                raise IsADirectoryError(errno.EISDIR, "a directory is in the way", str(path))
            try:
                with CrossProcessLock(path):
                    self._merge_and_replace(path)
            except LockTimeout as e:
                # The replace is still atomic; unlocked, at worst another writer's entry is
                # measured again later.
                _warn_once(path, "lock", "Triton Accel: %s; writing %s without the lock", e, path)
                self._merge_and_replace(path)
        except OSError as e:
            self._memory_only = True
            _warn_once(path, "unusable", "Triton Accel: cannot use %s as the %s (%s); it is kept in memory "
                       "only in this process", path, self.name, e)

    def _merge_and_replace(self, path: Path) -> None:
        on_disk, status = self._read(path)
        if status == _UNREADABLE:
            raise IsADirectoryError(errno.EISDIR, "cannot be read", str(path))
        # Other processes' entries win over our older copies of theirs; ours written since
        # the last save win over everything.
        merged = {**self._entries, **on_disk, **self._unsaved}
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"version": self.version, "entries": merged}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            _replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._entries = merged
        self._unsaved = {}


_live: weakref.WeakSet[JsonCache] = weakref.WeakSet()
# A WeakSet is iterated in Python code: a cache made on one thread (auto's first attention call
# in a sampling thread) while another copies the set (clear_caches) raises "Set changed size
# during iteration" without this lock.
_live_lock = threading.Lock()


def clear_memory_copies() -> None:
    """Every live JsonCache forgets its memory copy (the files stay)."""
    with _live_lock:
        caches = list(_live)
    for cache in caches:
        cache.clear()


cache_registry.register("json_cache", clear_memory_copies)
