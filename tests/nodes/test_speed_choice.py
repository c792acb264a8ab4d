"""auto mode's measured choice: the faster of two equal functions, remembered on disk."""
import json

import torch

from triton_accel.nodes.path_choice import PATH_TRITON_FP16 as OURS
from triton_accel.nodes.speed_choice import ORIGINAL, SpeedChoice, shape_class


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
