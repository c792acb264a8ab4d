"""Progress while the pack works (issue #13) and the patch node's measured speed-up.

- auto's first-call timing drives ComfyUI's progress bar (one step for ComfyUI's attention, one
  per candidate path) when comfy.utils is loaded, and runs without it;
- kernels.core.tuning's autotuning reaches ComfyUI's progress bar through the hook speed_choice
  installs (kernels/ never imports ComfyUI);
- speed_lines(): one short line per shape class auto measured on the model's device, at most
  MAX_SPEED_LINES, the rest summarised; status.models_status() hands them to the node's text.

comfy.utils is faked in sys.modules. No dtype: the outputs are fixed tensors and the timings
fake, compared exactly (speed-ups to 2 decimals as printed).
"""
import sys
import types

import pytest
import torch

from triton_accel.kernels.core import tuning
from triton_accel.kernels.core.gpu_rules import PATH_TRITON_FP16 as FP16
from triton_accel.kernels.core.gpu_rules import PATH_TRITON_FP8 as FP8
from triton_accel.runtime import attention_patch, progress
from triton_accel.runtime import call_stats, speed_choice
from triton_accel.nodes import status
from triton_accel.runtime.speed_choice import ORIGINAL, SpeedChoice

REF = torch.ones(2, 4, 8)


class FakeProgressBar:
    made = []

    def __init__(self, total):
        self.total, self.current, self.updates = total, 0, []
        FakeProgressBar.made.append(self)

    def update(self, value):
        self.current += value
        self.updates.append(self.current)

    def update_absolute(self, value, total=None):
        self.current = value
        self.updates.append(value)


@pytest.fixture
def comfy_utils(monkeypatch):
    FakeProgressBar.made = []
    module = types.ModuleType("comfy.utils")
    module.ProgressBar = FakeProgressBar
    monkeypatch.setitem(sys.modules, "comfy.utils", module)
    return FakeProgressBar


def _timer(ms):
    def timer(fn, device):
        return ms[fn.__name__], fn()
    return timer


def _candidates(names):
    def make(name):
        def fn():
            return REF.clone()
        fn.__name__ = name
        return fn
    return {name: make(name) for name in names}


# ---- auto's first-call timing -------------------------------------------------------------------

@pytest.mark.parametrize("paths", [[FP16], [FP8, FP16]], ids=["one_candidate", "two_candidates"])
def test_first_call_timing_steps_the_progress_bar(tmp_path, comfy_utils, paths):
    sc = SpeedChoice(tmp_path / "speed.json", timer=_timer({ORIGINAL: 2.0, FP8: 1.0, FP16: 1.5}))
    cands = _candidates([*paths, ORIGINAL])
    sc.choose("key", cands, torch.device("cpu"))
    (bar,) = comfy_utils.made
    assert bar.total == len(paths) + 1 and bar.updates == list(range(1, len(paths) + 2))
    sc.choose("key", cands, torch.device("cpu"))  # remembered: no timing, no new bar
    assert len(comfy_utils.made) == 1


def test_first_call_timing_without_comfyui(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "comfy.utils", raising=False)
    sc = SpeedChoice(tmp_path / "speed.json", timer=_timer({ORIGINAL: 2.0, FP16: 1.0}))
    assert sc.choose("key", _candidates([FP16, ORIGINAL]), torch.device("cpu"))[0] == FP16


# ---- autotuning, through kernels.core.tuning's hook ----------------------------------------------------

def test_speed_choice_installs_the_autotune_hook(comfy_utils):
    hook = tuning._progress_hook
    assert isinstance(hook, progress.AutotuneProgress)
    for done in range(4):
        hook(done, 3)
    (bar,) = comfy_utils.made
    assert bar.total == 3 and bar.updates == [0, 1, 2, 3]
    hook(0, 2)  # the next autotuning run gets its own bar
    assert len(comfy_utils.made) == 2 and comfy_utils.made[1].total == 2


def test_autotune_hook_without_comfyui(monkeypatch):
    monkeypatch.delitem(sys.modules, "comfy.utils", raising=False)
    hook = progress.AutotuneProgress()
    hook(0, 2)
    hook(2, 2)  # nothing to draw on, nothing raised


# ---- the measured speed-up on the patch node ------------------------------------------------------

def _row(shape, choice, ms, agrees=None, device="cuda:0"):
    agreement = {name: {"agrees": ok} for name, ok in (agrees or {}).items()}
    speedup = round(ms[ORIGINAL] / ms[choice], 3) if choice != ORIGINAL else 1.0
    return {"device": device, "gpu": "NVIDIA H200", "arch": "sm_90", "shape_class": shape, "choice": choice,
            "timings_ms": ms, "speedup_vs_original": speedup, "agreement": agreement}


WAN = "b1-h40/40-q32768-k32768-d128-bfloat16-none"
CASES = {
    "ours_kept": (_row(WAN, FP8, {ORIGINAL: 1.32, FP8: 1.0}, {FP8: True}),
                  f"auto at {WAN}: Triton FP8 1.32x faster than ComfyUI's (kept)"),
    "comfyui_kept_slower": (_row(WAN, ORIGINAL, {ORIGINAL: 0.81, FP16: 1.0}, {FP16: True}),
                            f"auto at {WAN}: ComfyUI's kept (ours 0.81x)"),
    "comfyui_kept_disagrees": (_row(WAN, ORIGINAL, {ORIGINAL: 2.0, FP8: 1.0}, {FP8: False}),
                               f"auto at {WAN}: ComfyUI's kept (ours 2.00x, did not match its output)"),
    # a faster path that disagrees must not be shown as ours when a slower one agreed
    "fastest_disagrees": (_row(WAN, ORIGINAL, {ORIGINAL: 1.0, FP8: 0.5, FP16: 1.25}, {FP8: False, FP16: True}),
                          f"auto at {WAN}: ComfyUI's kept (ours 0.80x)"),
    "cache_file_row_without_agreement": ({"device": "", "shape_class": WAN, "choice": ORIGINAL,
                                          "timings_ms": {ORIGINAL: 1.0}}, f"auto at {WAN}: ComfyUI's kept"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speed_line(case):
    row, expected = CASES[case]
    assert speed_choice.speed_lines(rows=[row]) == [expected]


def test_speed_lines_only_the_models_device_and_at_most_six():
    rows = [_row(f"b1-h24/24-q{1 << i}-k{1 << i}-d128-bfloat16-none", FP16 if i % 2 else ORIGINAL,
                 {ORIGINAL: 2.0, FP16: 1.0}, {FP16: True}) for i in range(9)]
    rows.append(_row(WAN, FP8, {ORIGINAL: 3.0, FP8: 1.0}, {FP8: True}, device="cuda:1"))
    assert speed_choice.speed_lines({"cuda:1"}, rows=rows) == [
        f"auto at {WAN}: Triton FP8 3.00x faster than ComfyUI's (kept)"]
    lines = speed_choice.speed_lines({"cuda:0"}, rows=rows)
    assert len(lines) == speed_choice.MAX_SPEED_LINES == 6
    assert lines[-1] == "... 4 more shape classes (2 on our kernels): see the Triton Accel panel"
    assert speed_choice.speed_lines(set(), rows=rows) == []


def test_models_status_carries_the_speed_lines_of_the_models_device(monkeypatch):
    call_stats.reset()
    label = call_stats.new_model_label("WAN21")
    call_stats.record("triton", path=FP8, model=label)
    other = call_stats.new_model_label("Flux")
    speed_choice.note_model_device(label, torch.device("cuda", 0))
    row, expected = CASES["ours_kept"]
    models = {m["label"]: m for m in status.models_status(speed_rows=[row])}
    assert models[label]["speed"] == [expected]
    assert models[other]["speed"] == []  # never measured: no line


def test_patch_records_the_device_auto_measured_on(tmp_path, monkeypatch):
    """The override notes the device where auto measures, so its node shows that device's lines
    (CUDA timing faked: the CPU stands in for the GPU, fake timings decide)."""
    from triton_accel.kernels.core.gpu_rules import Decision
    from triton_accel.runtime import attention_patch as patch_attention

    sc = SpeedChoice(tmp_path / "speed.json", timer=lambda fn, device: (1.0, fn()))
    monkeypatch.setattr(patch_attention, "_speed", lambda: sc)
    monkeypatch.setattr(patch_attention, "timed_on", lambda device: True)
    monkeypatch.setattr(patch_attention, "probe", lambda device: types.SimpleNamespace(
        name="Fake GPU", arch="sm_90", torch_version="2.x", triton_version="3.x"))
    settings = types.SimpleNamespace(mode="auto", decision_for=lambda device: Decision(
        FP16, "measured in the test", measure=True, candidates=(FP16,)))
    label = call_stats.new_model_label("SD15")
    override = attention_patch.AttentionOverride(settings, label=label)
    q = torch.randn(1, 16, 2 * 32)

    def comfy_attention(q, k, v, heads, **kwargs):
        return torch.nn.functional.scaled_dot_product_attention(
            *(t.view(1, -1, heads, 32).transpose(1, 2) for t in (q, k, v))).transpose(1, 2).reshape(1, -1, heads * 32)

    override(comfy_attention, q, q, q, 2)
    assert speed_choice.model_devices(label) == {"cpu"}
    (row,) = [r for r in speed_choice.speed_summary(sc) if r["gpu"] == "Fake GPU"]
    assert row["device"] == "cpu" and speed_choice.speed_lines({"cpu"}, rows=[row])[0].startswith("auto at b1-h2/2-q16")
