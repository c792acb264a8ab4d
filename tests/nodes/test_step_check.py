"""The step check (runtime/step_check.py): once auto's per-call choices are made, eager steps
alternate between them and ComfyUI's own Linear and attention, and the faster keeps the step.

The steps here are a stand-in executor that sleeps for a set time per configuration (read from
what the check applied: the Linear state's `forced`, the override's `force_original`); the
synchronisation is a no-op and the CPU counts as a GPU.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
from triton_accel.runtime import call_timing, step_check
from triton_accel.runtime.settings import AccelSettings

CPU = torch.device("cpu")


class State:
    """What the check uses of a LinearPatchState."""

    def __init__(self, mode="auto"):
        self.settings = AccelSettings("off", linear_mode=mode)
        self.forced = False
        self.layers = []
        self.changes = 0
        self._lock = threading.RLock()


class Override:
    def __init__(self, mode="auto"):
        self.settings = AccelSettings(mode)
        self.force_original = False


class Check(step_check.StepCheck):
    supports = staticmethod(lambda device: True)
    _sync = staticmethod(lambda device: None)


def _executor(state, override, ours_ms, comfy_ms, measure_in=None):
    steps = []

    def run(*args, **kwargs):
        comfy = state.forced
        assert override is None or override.force_original == comfy  # both parts switch together
        steps.append("comfyui" if comfy else "ours")
        if measure_in is not None and len(steps) == measure_in:
            call_timing.note_measurement()
        time.sleep((comfy_ms if comfy else ours_ms) / 1e3)
        return len(steps)
    return run, steps


def _steps(check, run, state, override, n, signature=("sig",)):
    kwargs = {"transformer_options": {step_check.OVERRIDE_KEY: override}} if override is not None else {}
    for _ in range(n):
        check.run(run, (), kwargs, signature, [state], CPU)


@pytest.mark.parametrize("ours_ms, comfy_ms, kept", [(8, 2, "comfyui"), (2, 8, "ours"), (5, 5, "comfyui")])
def test_the_faster_configuration_keeps_the_step(ours_ms, comfy_ms, kept):
    state, override = State(), Override()
    check = Check("Test #1")
    run, steps = _executor(state, override, ours_ms, comfy_ms)
    _steps(check, run, state, override, 8)
    # the first step starts the signature; the second finds no new measurement since and starts A B A B
    assert steps[:5] == ["ours", "ours", "comfyui", "ours", "comfyui"]
    assert check.kept(("sig",)) == kept and steps[5:] == [kept] * 3
    assert state.forced == (kept == "comfyui") and override.force_original == (kept == "comfyui")
    assert call_timing.step_check_of("Test #1")["kept"] == kept
    from triton_accel.runtime import linear_choice

    line, = linear_choice.model_lines("Test #1")  # what the model's node shows
    assert line.startswith("Whole eager step:") and line.endswith("ours kept" if kept == "ours" else "ComfyUI kept")


def test_a_measurement_during_the_check_starts_it_over():
    state, override = State(), Override()
    check = Check()
    run, steps = _executor(state, override, 8, 2, measure_in=3)  # in the first ComfyUI step
    _steps(check, run, state, override, 12)
    assert check.kept(("sig",)) == "comfyui"
    assert steps[:6] == ["ours", "ours", "comfyui", "ours", "comfyui", "ours"]  # A B, then A B A B again


def test_a_new_signature_checks_again_from_our_choices():
    state, override = State(), Override()
    check = Check()
    run, steps = _executor(state, override, 8, 2)
    _steps(check, run, state, override, 7)
    assert check.kept(("sig",)) == "comfyui" and state.forced
    _steps(check, run, state, override, 1, signature=("other",))
    assert steps[-1] == "ours" and check.kept(("other",)) is None and not state.forced


def test_cond_and_uncond_of_other_shapes_keep_a_check_each():
    """A sampler alternating two step signatures (cond and uncond of different text lengths)
    decides each; the configuration switches with the signature of each step."""
    state, override = State(), Override()
    check = Check()
    ran = []

    def run(*args, **kwargs):
        ran.append(state.forced)
        return None

    for _ in range(8):
        for signature in (("cond",), ("uncond",)):
            check.run(run, (), {"transformer_options": {step_check.OVERRIDE_KEY: override}}, signature, [state], CPU)
    # stand-in steps take no time: neither configuration beats the other, ComfyUI's keeps both
    assert check.kept(("cond",)) == "comfyui" and check.kept(("uncond",)) == "comfyui"
    assert ran[-2:] == [True, True]


def test_forced_modes_are_never_checked():
    state, override = State(mode="fp8"), Override(mode="fp16")
    check = Check()
    run, steps = _executor(state, override, 8, 2)
    _steps(check, run, state, override, 8)
    assert set(steps) == {"ours"} and check.kept(("sig",)) is None


def test_the_check_switches_real_linear_layers(tmp_path, pack_frames):
    """force_comfyui moves a patched layer's forward aside and back (linear_choice)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_choice_tests", Path(__file__).with_name("test_linear_choice.py"))
    choice = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(choice)
    patched, state, _ = choice._patched(ours_ms=0.5, theirs_ms=1.0, tmp_path=tmp_path)
    x, t = choice._f._inputs(tokens=8)
    with torch.no_grad():
        patched.model.diffusion_model(x, t)
        patched.model.diffusion_model(x, t)
    layer = choice._layer(state)
    assert layer.module.__dict__["forward"] is layer
    from triton_accel.runtime import linear_choice

    linear_choice.force_comfyui(state, True)
    assert layer.module.__dict__["forward"] is layer.previous and layer.forced_out
    with torch.no_grad():
        assert pack_frames(lambda: patched.model.diffusion_model(x, t)) == []
    linear_choice.force_comfyui(state, False)
    assert layer.module.__dict__["forward"] is layer and not layer.forced_out
