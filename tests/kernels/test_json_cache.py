"""kernels/core/json_cache.py: the shared JSON cache behind the tuning and the auto speed caches.

Every way a cache file can be unusable (named cases below) must leave a working cache and at
most one warning naming the file; two processes writing at once must lose no entry.
No dtype or tolerance here: the cache stores JSON, compared exactly.
"""
import errno
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from triton_accel.kernels.core import cache_registry, json_cache
from triton_accel.kernels.core.json_cache import JsonCache

ROOT = Path(__file__).resolve().parents[2]
VERSION = 1


def valid(key, entry):
    return isinstance(entry, dict) and isinstance(entry.get("v"), int)


def make(path):
    return JsonCache("test cache", path, VERSION, valid)


def warnings_about(caplog, path):
    return [r for r in caplog.records if r.levelno >= logging.WARNING and str(path) in r.getMessage()]


def leftovers(folder, path):
    """Files the cache left in `folder` besides its own file and its lock file."""
    return sorted(p.name for p in folder.iterdir() if p.name not in (path.name, path.name + ".lock"))


# name -> (file bytes, entries that survive reading, warnings expected)
BAD_FILES = {
    "truncated": (b'{"version": 1, "entries": {"a": {"v": 1}', {}, 1),
    "empty": (b"", {}, 1),
    "binary": (bytes(range(256)) * 4, {}, 1),
    "utf16_bom": ('{"version": 1, "entries": {}}'.encode("utf-16"), {}, 1),
    "list": (b"[1, 2]", {}, 1),
    "number": (b"5", {}, 1),
    "string": (b'"entries"', {}, 1),
    "entries_list": (b'{"version": 1, "entries": []}', {}, 1),
    "entries_null": (b'{"version": 1, "entries": null}', {}, 1),
    "no_version": (b'{"entries": {"a": {"v": 1}}}', {}, 1),
    "string_entry": (b'{"version": 1, "entries": {"a": "fast", "b": {"v": 2}}}', {"b": {"v": 2}}, 1),
    "null_entry": (b'{"version": 1, "entries": {"a": null, "b": {"v": 2}}}', {"b": {"v": 2}}, 1),
    # An older pack's file: expected after an upgrade, so logged at info level, not warned.
    "wrong_version": (b'{"version": 0, "entries": {"a": {"v": 1}}}', {}, 0),
    "deeply_nested": (b"[" * 100000 + b"]" * 100000, {}, 1),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_unusable_file_is_rebuilt_with_one_warning(tmp_path, caplog, case):
    content, survivors, n_warnings = BAD_FILES[case]
    path = tmp_path / "cache.json"
    path.write_bytes(content)
    caplog.set_level(logging.INFO)
    cache = make(path)
    assert cache.snapshot() == survivors
    assert cache.get("a") is None  # never an entry of the wrong shape
    cache.put("c", {"v": 3})
    cache.put("d", {"v": 4})  # a second write reads the (now rebuilt) file again
    on_disk = json.loads(path.read_text())
    assert on_disk == {"version": VERSION, "entries": {**survivors, "c": {"v": 3}, "d": {"v": 4}}}
    assert make(path).snapshot() == on_disk["entries"]  # the next process reads it back
    assert len(warnings_about(caplog, path)) == n_warnings, [r.getMessage() for r in caplog.records]
    assert leftovers(tmp_path, path) == []


def test_directory_in_its_place_keeps_memory_only(tmp_path, caplog):
    path = tmp_path / "cache.json"
    path.mkdir()
    cache = make(path)
    assert cache.get("a") is None
    for i in range(3):
        cache.put(f"k{i}", {"v": i})
    assert cache.get("k2") == {"v": 2} and cache.memory_only
    assert len(warnings_about(caplog, path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]  # no temp or lock file
    assert list(path.iterdir()) == []


def test_directory_appearing_after_reading_leaves_no_temp_file(tmp_path, caplog):
    path = tmp_path / "cache.json"
    cache = make(path)
    assert cache.get("a") is None  # read while the file was missing
    path.mkdir()
    cache.put("a", {"v": 1})
    cache.put("b", {"v": 2})
    assert cache.snapshot() == {"a": {"v": 1}, "b": {"v": 2}} and cache.memory_only
    assert len(warnings_about(caplog, path)) == 1
    assert leftovers(tmp_path, path) == []


def test_path_under_a_regular_file_keeps_memory_only(tmp_path, caplog):
    # ENOTDIR: what a folder that cannot be written gives even to root, where chmod does not.
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("x")
    path = blocker / "cache.json"
    cache = make(path)
    cache.put("a", {"v": 1})
    cache.put("b", {"v": 2})
    assert cache.get("a") == {"v": 1} and cache.memory_only
    assert len(warnings_about(caplog, path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not_a_folder"]


def make_read_only(folder):
    """Make `folder` unwritable; returns the undo. Root ignores permission bits, so as root the
    folder is made immutable (chattr +i, ext4/xfs/btrfs) instead, or the test is skipped."""
    if os.name != "posix":
        pytest.skip("folder permissions are POSIX here")
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return lambda: folder.chmod(0o755)
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("running as root, where chmod does not stop writes, and chattr +i is unavailable")
    return lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)


@pytest.mark.parametrize("existing", [False, True], ids=["no_file", "existing_file"])
def test_read_only_folder_keeps_memory_only(tmp_path, caplog, existing):
    folder = tmp_path / "ro"
    folder.mkdir()
    path = folder / "cache.json"
    if existing:
        path.write_text(json.dumps({"version": VERSION, "entries": {"old": {"v": 0}}}))
    undo = make_read_only(folder)
    try:
        cache = make(path)
        cache.put("a", {"v": 1})
        cache.put("b", {"v": 2})
        assert cache.get("a") == {"v": 1} and cache.memory_only
        assert (cache.get("old") is not None) == existing
        assert len(warnings_about(caplog, path)) == 1
        assert leftovers(folder, path) == []
    finally:
        undo()
    if existing:
        assert json.loads(path.read_text())["entries"] == {"old": {"v": 0}}  # untouched


def test_wrong_shaped_put_is_refused(tmp_path):
    cache = make(tmp_path / "c.json")
    with pytest.raises(ValueError):
        cache.put("a", "fast")
    with pytest.raises(ValueError):
        cache.put("a", {"v": "one"})
    with pytest.raises(TypeError):  # not JSON: refused before anything is written
        JsonCache("t", tmp_path / "d.json", VERSION, lambda k, e: True).put("a", {"v": object()})
    assert not (tmp_path / "c.json").exists() and not (tmp_path / "d.json").exists()


def test_writers_merge_instead_of_overwriting(tmp_path):
    path = tmp_path / "c.json"
    first, second = make(path), make(path)  # two processes' memory copies, loaded before any write
    assert first.get("x") is None and second.get("x") is None
    first.put("a", {"v": 1})
    second.put("b", {"v": 2})
    first.put("c", {"v": 3})
    assert json.loads(path.read_text())["entries"] == {"a": {"v": 1}, "b": {"v": 2}, "c": {"v": 3}}
    assert first.get("b") == {"v": 2}  # picked up from disk on its write
    # Another process's newer value for a key wins over this process's older copy of it...
    second.put("a", {"v": 10})
    first.put("d", {"v": 4})
    assert json.loads(path.read_text())["entries"]["a"] == {"v": 10}
    # ...and what this process writes now wins over what is on disk.
    first.put("a", {"v": 11})
    assert json.loads(path.read_text())["entries"]["a"] == {"v": 11}


def test_threads_lose_nothing(tmp_path):
    path = tmp_path / "c.json"
    cache = make(path)
    threads = [threading.Thread(target=lambda t=t: [cache.put(f"t{t}-{i}", {"v": i}) for i in range(25)])
               for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(json.loads(path.read_text())["entries"]) == 150 == len(cache.snapshot())


def test_clear_all_forgets_the_memory_copy(tmp_path):
    path = tmp_path / "c.json"
    cache = make(path)
    cache.put("a", {"v": 1})
    path.write_text(json.dumps({"version": VERSION, "entries": {"a": {"v": 2}}}))
    assert cache.get("a") == {"v": 1}
    assert "json_cache" in cache_registry.names()
    cache_registry.clear_all()
    assert cache.get("a") == {"v": 2}


def test_path_function_is_resolved_again_after_clear(tmp_path):
    where = {"dir": tmp_path / "one"}
    cache = JsonCache("t", lambda: where["dir"] / "c.json", VERSION, valid)
    cache.put("a", {"v": 1})
    where["dir"] = tmp_path / "two"
    cache.clear()
    assert cache.get("a") is None
    cache.put("b", {"v": 2})
    assert json.loads((tmp_path / "two" / "c.json").read_text())["entries"] == {"b": {"v": 2}}


def _refuse_os_lock(fd):
    raise OSError(errno.ENOLCK, "no locks on this file system")


def test_fallback_lock_file_is_used_and_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(json_cache, "_os_lock", _refuse_os_lock)
    path = tmp_path / "c.json"
    stale = tmp_path / "c.json.lock-held"
    stale.write_text("")
    old = time.time() - json_cache.STALE_LOCK_S - 5
    os.utime(stale, (old, old))  # left by a process that died holding it
    make(path).put("a", {"v": 1})
    assert json.loads(path.read_text())["entries"] == {"a": {"v": 1}}
    assert not stale.exists()


@pytest.mark.parametrize("lock_kind", ["os_lock", "fallback"])
def test_lock_held_too_long_writes_anyway_with_one_warning(tmp_path, monkeypatch, caplog, lock_kind):
    monkeypatch.setattr(json_cache, "LOCK_TIMEOUT_S", 0.05)
    path = tmp_path / "c.json"
    if lock_kind == "fallback":
        monkeypatch.setattr(json_cache, "_os_lock", _refuse_os_lock)
        (tmp_path / "c.json.lock-held").write_text("")  # fresh: a live holder
        holder = None
    else:
        holder = json_cache.CrossProcessLock(path, timeout=1).__enter__()
    try:
        cache = make(path)
        cache.put("a", {"v": 1})
        cache.put("b", {"v": 2})
    finally:
        if holder is not None:
            holder.__exit__(None, None, None)
    assert json.loads(path.read_text())["entries"] == {"a": {"v": 1}, "b": {"v": 2}}
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING and "lock" in r.getMessage()]) == 1


# A worker process loads kernels/core/json_cache.py without importing the pack (no torch), waits
# for its partner so both write at the same time, and puts N entries.
WORKER = r"""
import errno, importlib, os, sys, time, types
root, me, other, path, n, fallback = sys.argv[1:]
pkg = types.ModuleType("_kernels_only")
pkg.__path__ = [os.path.join(root, "kernels", "core")]
sys.modules["_kernels_only"] = pkg
jc = importlib.import_module("_kernels_only.json_cache")
if fallback == "1":
    def refuse(fd):
        raise OSError(errno.ENOLCK, "no locks")
    jc._os_lock = refuse
cache = jc.JsonCache("race", path, 1, lambda k, e: isinstance(e, dict))
open(path + ".ready-" + me, "w").close()
while not os.path.exists(path + ".ready-" + other):
    time.sleep(0.001)
for i in range(int(n)):
    cache.put(me + "-" + str(i), {"i": i})
"""

TRIALS = 4
WRITES = 20


@pytest.mark.parametrize("fallback", [False, True], ids=["os_lock", "fallback_lock_file"])
def test_two_processes_writing_at_once_lose_nothing(tmp_path, fallback):
    lost_per_trial = []
    for trial in range(TRIALS):
        path = tmp_path / f"race{trial}.json"
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(ROOT), me, other, str(path), str(WRITES),
                                   "1" if fallback else "0"], stderr=subprocess.PIPE, text=True)
                 for me, other in (("a", "b"), ("b", "a"))]
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
        entries = json.loads(path.read_text())["entries"]
        lost_per_trial.append(2 * WRITES - len(entries))
    assert lost_per_trial == [0] * TRIALS
    assert not [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp" or p.name.endswith("lock-held")]
