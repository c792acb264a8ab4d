"""auto's measured choice per Linear layer (runtime/linear_choice.py, runtime/call_timing.py).

On the CPU nothing is timed by default (timing runs on CUDA): these tests give the state a
LinearSpeedChoice whose timer returns set figures and which admits the CPU, and settings whose
Linear auto runs our FP8 W8A8 (GpuRuleSettings) with the reference matmul as the kernel
(REF_BACKEND): what is tested is the decision and what it leaves in the call, not the kernels.

The check that a handed-back call runs nothing of ours: sys.setprofile records every Python
frame entered during the call; none may belong to the pack's files.
"""
from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path

import pytest
import torch
from triton_accel.kernels.core.gpu_rules import LINEAR_FP8_W8A8, Decision
from triton_accel.runtime import call_stats, call_timing, linear_choice
from triton_accel.runtime import fused_activations, linear_common, linear_patch
from triton_accel.runtime.settings import AccelSettings


def _fakes():
    """test_patch_linear's fakes (tests run with --import-mode=importlib: no sibling imports)."""
    spec = importlib.util.spec_from_file_location("_patch_linear_fakes_choice",
                                                  Path(__file__).with_name("test_patch_linear.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_f = _fakes()


def _ref_run(x, prepared, bias, out_dtype, activation=None, activation_from=0, activation_out=None):
    """The reference matmul with kernels.linear.dispatch's epilogue arguments (the fused GELU, its copy)."""
    out = _f.linear_ref(x, prepared, bias).to(out_dtype)
    if activation is not None:
        out[..., activation_from:] = torch.nn.functional.gelu(out[..., activation_from:].float(),
                                                              approximate="tanh").to(out_dtype)
        if activation_out is not None:
            activation_out.copy_(out[..., activation_from:])
    return out


FUSING_BACKEND = linear_common.LinearBackend(_f.kernels.prepare_weight, _ref_run, _f.kernels.linear_refusal,
                                  _f.kernels.LinearInputError, None, (LINEAR_FP8_W8A8,))


class GpuRuleSettings(AccelSettings):
    """Linear auto as on a GPU whose rule runs our FP8 W8A8."""

    def __init__(self):
        super().__init__("off", linear_mode="auto")

    def _select_linear(self, device, weight_is_fp8):
        return Decision(LINEAR_FP8_W8A8, "auto: a test GPU with FP8 tensor cores")


class SetTimer:
    """time_calls' stand-in: ms per call set per candidate; counts the classes it timed and
    runs each candidate once, as the real timer does (at least)."""

    def __init__(self, ours_ms: float, theirs_ms: float):
        self.ms = {"ours": ours_ms, "theirs": theirs_ms}
        self.timed = 0

    def __call__(self, fns, device, mode=None):
        self.timed += 1
        for fn in fns.values():
            fn()
        return dict(self.ms)


@pytest.fixture(autouse=True)
def _fresh():
    call_stats.reset()
    yield


def _patched(ours_ms, theirs_ms, tmp_path, min_tokens=4, model=None):
    timer = SetTimer(ours_ms, theirs_ms)
    speed = call_timing.LinearSpeedChoice(tmp_path / f"linear-{uuid.uuid4().hex[:6]}.json", timer=timer,
                                          supports=lambda device: True)
    base = _f.FakePatcher(model if model is not None else _f.BaseModel())
    patched = linear_patch.patch_linear_model(base, GpuRuleSettings(), skip="", min_tokens=min_tokens,
                                    backend=_f.REF_BACKEND, label=f"Choice #{uuid.uuid4().hex[:6]}")
    state = patched.triton_accel_linear
    state.speed = speed
    patched.patch_model()
    return patched, state, timer


def _run(patched, steps: int, tokens: int = 8):
    """The patched model's forward `steps` times on one input; the input."""
    x, t = _f._inputs(tokens=tokens)
    with torch.no_grad():
        for _ in range(steps):
            patched.model.diffusion_model(x, t)
    return x, t


def _layer(state, name="blocks.0.qkv"):
    return next(layer for layer in state.layers if layer.name == name)


def test_comfyui_faster_gives_the_module_its_own_forward_back(tmp_path, pack_frames):
    patched, state, timer = _patched(ours_ms=1.0, theirs_ms=0.9, tmp_path=tmp_path)
    model = patched.model.diffusion_model
    x, t = _f._inputs(tokens=8)
    with torch.no_grad():
        model(x, t)  # first calls: guard (ours + ComfyUI's)
        model(x, t)  # served, timed: ComfyUI's is faster -> handed back
    layer = _layer(state)
    module = layer.module
    assert timer.timed >= 1
    assert module.__dict__["forward"] is layer.previous and layer.uninstalled
    assert all(v is False for v in layer.verdicts.values())
    before = call_stats.snapshot()["kinds"]["linear"]
    frames = pack_frames(lambda: module(torch.randn(16, module.in_features)))
    assert frames == [], frames  # nothing of ours on the way
    assert call_stats.snapshot()["kinds"]["linear"] == before  # and nothing counted
    with torch.no_grad():
        frames = pack_frames(lambda: model(x, t))
    assert not [f for f in frames if "patch_linear" in f or "linear_choice" in f], frames


def test_ours_faster_keeps_the_patch_and_serves(tmp_path):
    patched, state, _ = _patched(ours_ms=0.5, theirs_ms=1.0, tmp_path=tmp_path)
    model = patched.model.diffusion_model
    x, t = _f._inputs(tokens=8)
    with torch.no_grad():
        for _ in range(3):
            model(x, t)
    layer = _layer(state)
    assert layer.module.__dict__["forward"] is layer and not layer.uninstalled
    assert any(v is True for v in layer.verdicts.values())
    served = call_stats.snapshot()["kinds"]["linear"]["paths"]
    assert served.get(LINEAR_FP8_W8A8, 0) > 0, served


def test_a_tie_goes_to_comfyui(tmp_path):
    # within WIN_MARGIN: noise must not hand the step a kernel that is not really faster
    patched, state, _ = _patched(ours_ms=0.99, theirs_ms=1.0, tmp_path=tmp_path)
    x, t = _run(patched, 2)
    assert _layer(state).uninstalled


def test_one_class_is_timed_once_for_every_layer_of_it(tmp_path):
    # blocks.0.proj is the only 32 -> 32 layer; every class is timed once, not once per layer
    patched, state, timer = _patched(ours_ms=0.5, theirs_ms=1.0, tmp_path=tmp_path)
    x, t = _f._inputs(tokens=8)
    with torch.no_grad():
        for _ in range(3):
            patched.model.diffusion_model(x, t)
    classes = {layer.name: linear_choice.class_parts(layer, torch.empty(16, layer.module.in_features), False,
                                                     LINEAR_FP8_W8A8)
               for layer in state.layers if any(layer.verdicts.values())}
    assert timer.timed == len(set(classes.values())) > 0


def test_too_few_tokens_is_handed_back_for_good_without_timing(tmp_path, pack_frames):
    patched, state, timer = _patched(ours_ms=0.5, theirs_ms=1.0, tmp_path=tmp_path, min_tokens=10 ** 6)
    x, t = _f._inputs(tokens=8)
    with torch.no_grad():
        patched.model.diffusion_model(x, t)
    assert timer.timed == 0
    assert all(layer.uninstalled for layer in state.layers)
    with torch.no_grad():
        frames = pack_frames(lambda: patched.model.diffusion_model(x, t))
    assert frames == [], frames


def test_a_new_step_signature_puts_the_patch_back_for_its_classes(tmp_path):
    patched, state, timer = _patched(ours_ms=1.0, theirs_ms=0.5, tmp_path=tmp_path)
    model = patched.model.diffusion_model
    x, t = _f._inputs(tokens=8)
    state.begin_step(((x.shape,), "eager"))
    with torch.no_grad():
        model(x, t)
        model(x, t)
    layer = _layer(state)
    assert layer.uninstalled
    state.begin_step(((x.shape,), "eager"))  # the same signature: nothing changes
    assert layer.module.__dict__["forward"] is layer.previous
    x2, t2 = _f._inputs(tokens=16)
    state.begin_step(((x2.shape,), "eager"))
    assert layer.module.__dict__["forward"] is layer and not layer.uninstalled
    timed = timer.timed
    with torch.no_grad():
        model(x2, t2)
        model(x2, t2)
    assert timer.timed > timed and layer.uninstalled  # the new class was timed, and lost too


def test_comfyui_reapplying_our_patch_hands_back_at_the_first_call(tmp_path):
    patched, state, _ = _patched(ours_ms=1.0, theirs_ms=0.5, tmp_path=tmp_path)
    model = patched.model.diffusion_model
    x, t = _f._inputs(tokens=8)
    with torch.no_grad():
        model(x, t)
        model(x, t)
    layer = _layer(state)
    patched.detach()  # ComfyUI unloads: its backup (the module's own forward) goes back
    assert layer.module.__dict__.get("forward") is not layer
    patched.patch_model()  # and loads again: our patch is on the module once more
    assert layer.module.__dict__["forward"] is layer
    with torch.no_grad():
        model(x, t)
    assert layer.module.__dict__["forward"] is layer.previous


def test_a_layer_that_wins_one_class_keeps_its_patch_for_the_other(tmp_path):
    timer_ms = {"ours": 0.5, "theirs": 1.0}

    class ByRows(SetTimer):
        def __call__(self, fns, device, mode=None):
            self.timed += 1
            for fn in fns.values():
                fn()
            return dict(timer_ms)

    patched, state, _ = _patched(ours_ms=0.5, theirs_ms=1.0, tmp_path=tmp_path)
    state.speed._timer = ByRows(0, 0)
    layer = _layer(state)
    module = layer.module
    a, b = torch.randn(16, module.in_features), torch.randn(32, module.in_features)
    module(a)  # guard
    module(a)  # timed: ours
    timer_ms.update(ours=2.0)
    module(b)
    module(b)  # timed: ComfyUI's, but `a` is ours in this step: the patch stays
    assert module.__dict__["forward"] is layer
    assert layer.verdicts[linear_choice.verdict_key(b)] is False
    served = call_stats.snapshot()["kinds"]["linear"]["served"]
    out = module(b)
    assert call_stats.snapshot()["kinds"]["linear"]["served"] == served  # ComfyUI's forward served it
    assert torch.equal(out, torch.nn.functional.linear(b, module.weight, module.bias))


def test_fused_gelu_goes_back_with_its_layer(tmp_path, pack_frames):
    model = _f.FusableModel()
    timer = SetTimer(1.0, 0.5)
    speed = call_timing.LinearSpeedChoice(tmp_path / "linear.json", timer=timer, supports=lambda device: True)
    patched = linear_patch.patch_linear_model(_f.FakePatcher(model), GpuRuleSettings(), skip="", min_tokens=4,
                                    backend=FUSING_BACKEND)
    state = patched.triton_accel_linear
    state.speed = speed
    patched.patch_model()
    x = torch.randn(2, 40, 48)
    with torch.no_grad():
        model.diffusion_model(x)
        model.diffusion_model(x)
    layer = next(layer for layer in state.layers if layer.name == "double_mlp.0")
    gelu = model.diffusion_model.double_mlp[1]
    assert layer.uninstalled and layer.activation_patch is not None and len(layer.companions) == 2
    assert "forward" not in gelu.__dict__ or not isinstance(gelu.__dict__["forward"], fused_activations.FusedActivation)
    with torch.no_grad():
        frames = pack_frames(lambda: model.diffusion_model(x))
    assert frames == [], frames


def test_forced_modes_and_unsupported_devices_time_nothing(tmp_path):
    timer = SetTimer(1.0, 0.5)
    speed = call_timing.LinearSpeedChoice(tmp_path / "linear.json", timer=timer, supports=lambda device: False)
    patched = linear_patch.patch_linear_model(_f.FakePatcher(_f.BaseModel()), GpuRuleSettings(), skip="", min_tokens=4,
                                    backend=_f.REF_BACKEND)
    patched.triton_accel_linear.speed = speed
    patched.patch_model()
    x, t = _f._inputs(tokens=8)
    with torch.no_grad():
        for _ in range(3):
            patched.model.diffusion_model(x, t)
    assert timer.timed == 0
    assert not any(layer.uninstalled for layer in patched.triton_accel_linear.layers)


def test_decisions_are_kept_on_disk_and_read_by_another_process(tmp_path):
    cache = tmp_path / "linear.json"
    first = call_timing.LinearSpeedChoice(cache, timer=SetTimer(0.5, 1.0), supports=lambda d: True)
    entry = first.decide("k", lambda: None, lambda: None, torch.device("cpu"), {"mode": "eager"})
    assert entry["ours"] is True
    again = SetTimer(2.0, 1.0)
    second = call_timing.LinearSpeedChoice(cache, timer=again, supports=lambda d: True)
    assert second.decide("k", lambda: None, lambda: None, torch.device("cpu"), {})["ours"] is True
    assert again.timed == 0


@pytest.mark.parametrize("mode", [call_timing.MODE_EAGER, call_timing.MODE_GRAPH])
def test_time_calls_runs_every_candidate_and_keeps_its_fastest_round(mode):
    counts = {"a": 0, "b": 0}

    def make(name):
        def fn():
            counts[name] += 1
        return fn

    ms = call_timing.time_calls({"a": make("a"), "b": make("b")}, torch.device("cpu"), mode)
    assert set(ms) == {"a", "b"} and all(v >= 0 for v in ms.values())
    # one warm call, then ROUNDS rounds of at least MIN_CALLS calls each
    assert all(n >= 1 + call_timing.ROUNDS * call_timing.MIN_CALLS for n in counts.values()), counts


def test_wins_needs_the_margin():
    assert call_timing.ours_wins(0.9, 1.0)
    assert not call_timing.ours_wins(0.99, 1.0)
    assert not call_timing.ours_wins(1.1, 1.0)


def test_the_model_status_says_what_auto_measured(tmp_path):
    from triton_accel.nodes import status

    patched, state, _ = _patched(ours_ms=1.0, theirs_ms=0.5, tmp_path=tmp_path)
    x, t = _run(patched, 2)
    entry = next(r for r in status.models_status() if r["label"] == state.label)
    assert any("on ComfyUI's (measured as fast or faster)" in line for line in entry["speed"]), entry["speed"]


def test_alternating_signatures_do_not_put_the_patches_back_each_step(tmp_path):
    """cond and uncond of different shapes alternate step signatures: each is new only once."""
    patched, state, _ = _patched(ours_ms=1.0, theirs_ms=0.5, tmp_path=tmp_path)
    layer = _layer(state)
    state.begin_step(("cond",))
    _run(patched, 2)
    assert layer.uninstalled
    state.begin_step(("uncond",))  # new: the patch is back for its classes
    assert not layer.uninstalled
    _run(patched, 1)  # a class it decided already: ComfyUI's forward at once
    assert layer.uninstalled
    for signature in [("cond",), ("uncond",)] * 3:
        state.begin_step(signature)
        assert layer.uninstalled and layer.module.__dict__["forward"] is layer.previous
