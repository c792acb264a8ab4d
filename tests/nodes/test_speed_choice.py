"""auto mode's measured choice: the faster of two equal functions, remembered on disk."""
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triton_accel.kernels.core.gpu_rules import PATH_TRITON_FP16 as OURS
from triton_accel.runtime.speed_choice import ORIGINAL, SpeedChoice, shape_class


def fake_timer(times):
    def timer(fn, device):
        out = fn()
        return times[fn.__name__], out
    return timer


def make(value):
    def ours():
        return torch.full((4,), value)

    def original():
        return torch.full((4,), 1.0)
    return ours, original


def cands(ours, original, **more):
    return {OURS: ours, ORIGINAL: original, **more}


def test_faster_ours_is_kept_and_remembered(tmp_path):
    cache = tmp_path / "speed.json"
    sc = SpeedChoice(cache, timer=fake_timer({"ours": 1.0, "original": 2.0}))
    ours, original = make(1.0)
    choice, out = sc.choose("k1", cands(ours, original), torch.device("cpu"))
    assert choice == OURS and torch.equal(out, ours())
    saved = json.loads(cache.read_text())
    assert saved["entries"]["k1"]["choice"] == OURS
    assert saved["entries"]["k1"]["timings"]["original"]["ms"] == 2.0
    # A new process reads the file and measures nothing.
    never = SpeedChoice(cache, timer=lambda fn, d: (_ for _ in ()).throw(AssertionError("measured again")))
    assert never.choose("k1", cands(ours, original), torch.device("cpu")) == (OURS, None)
    assert never.known("k1") == OURS


def test_slower_ours_keeps_comfyui_attention(tmp_path):
    sc = SpeedChoice(tmp_path / "s.json", timer=fake_timer({"ours": 3.0, "original": 2.0}))
    ours, original = make(1.0)
    choice, out = sc.choose("k", cands(ours, original), torch.device("cpu"))
    assert choice == ORIGINAL and torch.equal(out, original())


def test_disagreeing_outputs_keep_comfyui_attention_even_when_faster(tmp_path):
    sc = SpeedChoice(tmp_path / "s.json", timer=fake_timer({"ours": 0.1, "original": 2.0}))
    ours, original = make(1.5)
    assert sc.choose("k", cands(ours, original), torch.device("cpu"))[0] == ORIGINAL
    ours_nan, original = make(float("nan"))
    assert sc.choose("k-nan", cands(ours_nan, original), torch.device("cpu"))[0] == ORIGINAL


def test_corrupt_or_old_cache_is_ignored(tmp_path):
    cache = tmp_path / "s.json"
    cache.write_text("{not json")
    assert SpeedChoice(cache).known("k") is None
    cache.write_text(json.dumps({"version": 0, "entries": {"k": {"choice": OURS}}}))
    assert SpeedChoice(cache).known("k") is None


def test_shape_class_groups_lengths_by_power_of_two():
    q = torch.empty(1, 24, 4608, 128, dtype=torch.bfloat16)
    k = torch.empty(1, 24, 4608, 128, dtype=torch.bfloat16)
    k2 = torch.empty(1, 24, 5000, 128, dtype=torch.bfloat16)
    assert shape_class(q, k, None) == shape_class(q, k2, None) == "b1-h24/24-q8192-k8192-d128-bfloat16-none"
    assert shape_class(q, k, torch.zeros(1, 1, 1, 4608, dtype=torch.bool)).endswith("-bool")


def test_fastest_agreeing_candidate_wins_among_several(tmp_path):
    def fp8():
        return torch.full((4,), 1.001)

    def lossy():
        return torch.full((4,), 1.2)

    sc = SpeedChoice(tmp_path / "s.json", timer=fake_timer({"ours": 1.0, "original": 2.0, "fp8": 0.5, "lossy": 0.1}))
    ours, original = make(1.0)
    choice, out = sc.choose("k", cands(ours, original, fp8=fp8, lossy=lossy), torch.device("cpu"))
    assert choice == "fp8" and torch.equal(out, fp8())


# Cache files that used to raise from inside the sampler's attention call (AttributeError,
# TypeError from known()/choose()) or were reset without a word.
BAD_CACHES = {
    "truncated": '{"version": 2, "entries": {"k": {"choice": "original"',
    "empty": "",
    "binary": "\x00\xff\xfe\x80garbage",
    "list": "[1, 2]",
    "number": "5",
    "entries_list": '{"version": 2, "entries": []}',
    "entries_null": '{"version": 2, "entries": null}',
    "string_entry": '{"version": 2, "entries": {"k": "triton_fp16"}}',
    "entry_without_choice": '{"version": 2, "entries": {"k": {"timings": {}}}}',
    "choice_not_a_string": '{"version": 2, "entries": {"k": {"choice": 3}}}',
}


def _warnings_naming(caplog, path):
    return [r for r in caplog.records if r.levelno >= logging.WARNING and str(path) in r.getMessage()]


@pytest.mark.parametrize("case", list(BAD_CACHES))
def test_wrong_shaped_cache_is_measured_again_and_rebuilt_with_one_warning(tmp_path, caplog, case):
    cache = tmp_path / "s.json"
    cache.write_bytes(BAD_CACHES[case].encode("latin-1"))
    sc = SpeedChoice(cache, timer=fake_timer({"ours": 1.0, "original": 2.0}))
    assert sc.known("k") is None
    ours, original = make(1.0)
    assert sc.choose("k", cands(ours, original), torch.device("cpu"))[0] == OURS
    assert sc.choose("k2", cands(ours, original), torch.device("cpu"))[0] == OURS
    saved = json.loads(cache.read_text())
    assert saved["version"] == 2 and set(saved["entries"]) == {"k", "k2"}
    assert SpeedChoice(cache).known("k") == OURS
    assert len(_warnings_naming(caplog, cache)) == 1


def test_directory_in_place_of_the_cache_measures_once_and_leaves_no_temp_file(tmp_path, caplog):
    cache = tmp_path / "s.json"
    cache.mkdir()
    calls = []

    def timer(fn, device):
        calls.append(fn.__name__)
        return {"ours": 1.0, "original": 2.0}[fn.__name__], fn()

    sc = SpeedChoice(cache, timer=timer)
    ours, original = make(1.0)
    for _ in range(3):
        assert sc.choose("k", cands(ours, original), torch.device("cpu"))[0] == OURS
    assert sc.known("k") == OURS
    assert len(calls) == 2  # measured once, remembered in memory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]
    assert len(_warnings_naming(caplog, cache)) == 1


# Loads runtime/speed_choice.py with its real JsonCache, without the pack's __init__ files (no
# ComfyUI, no Triton), waits for its partner, and records WRITES shape classes.
WORKER = r"""
import importlib, os, sys, time, types
root, me, other, path, n = sys.argv[1:]
for name, folder in (("triton_accel", root), ("triton_accel.kernels", os.path.join(root, "kernels")),
                     ("triton_accel.runtime", os.path.join(root, "runtime"))):
    pkg = types.ModuleType(name)
    pkg.__path__ = [folder]
    sys.modules[name] = pkg
import torch
speed = importlib.import_module("triton_accel.runtime.speed_choice")
sc = speed.SpeedChoice(path, timer=lambda fn, device: (1.0, fn()))
candidates = {speed.ORIGINAL: lambda: torch.ones(4), "triton_fp16": lambda: torch.ones(4)}
open(path + ".ready-" + me, "w").close()
while not os.path.exists(path + ".ready-" + other):
    time.sleep(0.001)
for i in range(int(n)):
    sc.choose(me + "-" + str(i), candidates, torch.device("cpu"))
"""
TRIALS = 2
WRITES = 20


def test_two_processes_measuring_at_once_lose_no_entry(tmp_path):
    root = Path(__file__).resolve().parents[2]
    lost = []
    for trial in range(TRIALS):
        path = tmp_path / f"speed{trial}.json"
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(root), me, other, str(path), str(WRITES)],
                                  stderr=subprocess.PIPE, text=True)
                 for me, other in (("a", "b"), ("b", "a"))]
        for p in procs:
            _, err = p.communicate(timeout=180)
            assert p.returncode == 0, err
        lost.append(2 * WRITES - len(json.loads(path.read_text())["entries"]))
    assert lost == [0] * TRIALS
