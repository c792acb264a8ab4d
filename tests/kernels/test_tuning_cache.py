"""kernels/core/tuning.py's on-disk cache (tuning-v1.json): never a wrong-shaped config, never a raise.

Named cases: the file shapes that raised AttributeError from cached()/choose() or handed a
string to the kernel as its config, and two processes storing at once. No dtype: configs are
JSON, compared exactly.
"""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from triton_accel.kernels.core import tuning
from triton_accel.kernels.core.device import DeviceInfo

ROOT = Path(__file__).resolve().parents[2]
INFO = DeviceInfo("cuda", "nvidia", "NVIDIA H200", (9, 0), "sm90")
DEFAULT = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_ACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_ACCEL_AUTOTUNE", raising=False)
    tuning.clear_memory()
    yield tmp_path
    tuning.clear_memory()


def test_cache_path_follows_the_settings(cache_dir, monkeypatch):
    assert tuning.cache_path() == cache_dir / "tuning-v1.json"
    monkeypatch.delenv("TRITON_ACCEL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_dir / "xdg"))
    assert tuning.cache_path() == cache_dir / "xdg" / "triton_accel" / "tuning-v1.json"


BAD = {
    "truncated": '{"version": 1, "entries": {"K": {"BLOCK_M": 1',
    "empty": "",
    "list": "[1, 2]",
    "number": "5",
    "entries_list": '{"version": 1, "entries": []}',
    "entries_null": '{"version": 1, "entries": null}',
    "string_entry": '{"version": 1, "entries": {"K": "BLOCK_M=128"}}',
    "empty_config": '{"version": 1, "entries": {"K": {}}}',
    "nested_config": '{"version": 1, "entries": {"K": {"BLOCK_M": {"x": 1}}}}',
    "wrong_version": '{"version": 2, "entries": {"K": {"BLOCK_M": 128}}}',
}


@pytest.mark.parametrize("case", list(BAD))
def test_unusable_tuning_cache_gives_the_default_and_is_rebuilt(cache_dir, caplog, case):
    key = tuning.cache_key("attention", INFO, ("bfloat16", 128))
    path = tuning.cache_path()
    path.write_text(BAD[case].replace('"K"', json.dumps(key)))
    assert tuning.cached(key) is None
    assert tuning.choose("attention", INFO, ("bfloat16", 128), DEFAULT) == DEFAULT
    tuning.store(key, {"BLOCK_M": 128, "num_warps": 8})
    tuning.clear_memory()
    assert tuning.cached(key) == {"BLOCK_M": 128, "num_warps": 8}
    expected_warnings = 0 if case == "wrong_version" else 1
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING and str(path) in r.getMessage()]) \
        == expected_warnings


def test_returned_config_is_a_copy(cache_dir):
    tuning.store("k", {"BLOCK_M": 64})
    tuning.cached("k")["BLOCK_M"] = 1
    assert tuning.cached("k") == {"BLOCK_M": 64}


WORKER = r"""
import importlib, os, sys, time, types
root, me, other, n = sys.argv[1:]
pkg = types.ModuleType("_kernels_only")
pkg.__path__ = [os.path.join(root, "kernels", "core")]
sys.modules["_kernels_only"] = pkg
tuning = importlib.import_module("_kernels_only.tuning")
tuning.cached("warm")  # load the (empty) file first, as a running ComfyUI would have
ready = os.path.join(os.environ["TRITON_ACCEL_CACHE_DIR"], "ready-")
open(ready + me, "w").close()
while not os.path.exists(ready + other):
    time.sleep(0.001)
for i in range(int(n)):
    tuning.store(me + "-" + str(i), {"BLOCK_M": i})
"""
TRIALS = 2
WRITES = 20


def test_two_processes_storing_at_once_lose_nothing(tmp_path):
    lost = []
    for trial in range(TRIALS):
        folder = tmp_path / str(trial)
        folder.mkdir()
        env = dict(os.environ, TRITON_ACCEL_CACHE_DIR=str(folder))
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(ROOT), me, other, str(WRITES)], env=env,
                                  stderr=subprocess.PIPE, text=True)
                 for me, other in (("a", "b"), ("b", "a"))]
        for p in procs:
            _, err = p.communicate(timeout=180)
            assert p.returncode == 0, err
        lost.append(2 * WRITES - len(json.loads((folder / "tuning-v1.json").read_text())["entries"]))
    assert lost == [0] * TRIALS


@pytest.mark.parametrize("config", [{}, {"BLOCK_M": [64]}, {"BLOCK_M": object()}], ids=["empty", "list", "object"])
def test_config_the_file_cannot_hold_is_not_stored_and_does_not_raise(cache_dir, caplog, config):
    tuning.store("k", config)
    assert tuning.cached("k") is None
    assert any("not storing" in r.getMessage() for r in caplog.records)
