"""Our Linear under ComfyUI 0.29's dynamic VRAM, without ComfyUI and without a GPU.

A layer whose weights ComfyUI streams has a VBAR slot (`module._v`) and takes its weight from
comfy.ops.cast_bias_weight per call. `FakeCast` restates that cast through the seam the patch
uses (LinearPatchState.weight_cast): asked for the stored dtype it returns the stored tensor
itself (the VBAR view: no copy), otherwise a converted copy with the layer's weight_function /
bias_function applied (post_cast); `uncast` is counted, and a cast while another one of the same
layer is open fails the test (ComfyUI's cast of one layer must not nest). `comfy_forward`
restates ComfyUI's own Linear forward over the same cast (the guard's reference and what
handed-back calls run): upcast, `scale_weight` applied as a scaled-FP8 op does, F.linear.
Kernels run on the CPU through TRITON_INTERPRET=1 (tests/conftest.py).

Tolerances (rel. L2 against float32 F.linear of the weight ComfyUI's cast gives):
- FP8 weights used as they are (fp8_w8a8): the weight is exact, only the activations are
  rounded to e4m3 per token: < 0.06 (~0.03 on Gaussian data);
- 16/32-bit weights quantised per call (fp8_w8a8): both operands e4m3: < 0.06 (~0.035);
the same for float32 / float16 / bfloat16 activations (their rounding is 2^-8 or finer).
"""
from __future__ import annotations

import gc
import sys
import types
import uuid
import weakref

import pytest
import torch
import torch.nn.functional as F
from triton_accel import kernels
from triton_accel.kernels.linear.dispatch import prepare_weight_per_call
from triton_accel.runtime import call_stats
from triton_accel.nodes import patch_nodes
from triton_accel.runtime import dynamic_vram, linear_common, linear_layer, linear_patch, linear_state
from triton_accel.runtime.settings import AccelSettings

TOL = 0.06
FP8 = AccelSettings("off", linear_mode="fp8")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
STREAMED_PATH = "fp8_w8a8 (dynamic VRAM)"


@pytest.fixture(autouse=True)
def _fresh_counters():
    call_stats.reset()
    kernels.core.stats.reset()


def _linear_stats() -> dict:
    return call_stats.snapshot()["kinds"].get("linear", {"served": 0, "handed_back": 0, "reasons": {}, "paths": {}})


def _rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


class FakeCast:
    """comfy.ops.cast_bias_weight / uncast_bias_weight on a streamed layer, as the patch sees them."""

    def __init__(self, lora_cast: bool = False):
        self.lora_cast = lora_cast  # the cast that applies a LoRA returns it in x's dtype
        self.casts = []  # (module, weight_dtype asked for, weight handed out)
        self.uncasts = 0
        self.open = set()
        self.events = []

    def streams(self, module, x) -> bool:
        return hasattr(module, "_v")

    def cast(self, module, x, weight_dtype):
        assert id(module) not in self.open, "a second cast of a layer whose cast is still open"
        self.open.add(id(module))
        stored = module.weight.detach()
        weight = stored if weight_dtype == stored.dtype else stored.to(weight_dtype)
        if self.lora_cast:
            weight = stored.to(x.dtype) * 1.25
        bias = None if module.bias is None else module.bias.detach().to(x.dtype)
        if weight_dtype != torch.float8_e4m3fn:  # post_cast applies the _function lists
            for f in module.weight_function:
                weight = f(weight)
            for f in module.bias_function:
                bias = f(bias)
        self.casts.append((module, weight_dtype, weight))
        self.events.append(("cast", weight_dtype))
        return weight, bias, ("handle", id(module))

    def uncast(self, module, weight, bias, handle) -> None:
        assert handle == ("handle", id(module))
        self.open.discard(id(module))
        self.uncasts += 1
        self.events.append(("uncast", None))


class StreamedLinear(torch.nn.Linear):
    """A comfy.ops Linear under ModelPatcherDynamic: a VBAR slot, per-call cast, no function lists."""

    weight_function = []
    bias_function = []
    comfy_cast_weights = True

    def __init__(self, k, n, weight_dtype=torch.bfloat16, scale=None):
        super().__init__(k, n)
        self._v = object()
        w = torch.randn(n, k) * k ** -0.5
        if weight_dtype == torch.float8_e4m3fn:
            w = (w / (1.0 if scale is None else scale.reshape(-1, 1))).clamp(-448, 448)
        self.weight = torch.nn.Parameter(w.to(weight_dtype), requires_grad=False)
        if scale is not None:
            self.scale_weight = torch.nn.Parameter(scale, requires_grad=False)


def comfy_forward(cast: FakeCast, module):
    """ComfyUI's Linear forward over the same cast (a scaled-FP8 op applies scale_weight)."""

    def forward(x):
        weight, bias, handle = cast.cast(module, x, x.dtype)
        scale = getattr(module, "scale_weight", None)
        if scale is not None:
            weight = (weight.float() * scale.float().reshape(-1, 1)).to(x.dtype)
        out = F.linear(x, weight, bias)
        cast.uncast(module, weight, bias, handle)
        return out
    return forward


class Recorder:
    """The real kernels, with what the patch hands them recorded."""

    def __init__(self, run=None):
        self.prepared = []  # (weight handed over, prepared)
        self.runs = 0
        self._run = run or kernels.linear
        self.backend = linear_common.LinearBackend(kernels.prepare_weight, self.run, kernels.linear_refusal,
                                        kernels.LinearInputError, self.prepare_per_call)

    def prepare_per_call(self, weight, method, scale):
        prepared = prepare_weight_per_call(weight, method, scale)
        self.prepared.append((weight, prepared))
        return prepared

    def run(self, x, prepared, bias, out_dtype):
        self.runs += 1
        return self._run(x, prepared, bias, out_dtype)


def _streamed_layer(module, mode=linear_common.DYNAMIC_VRAM_AUTO, settings=FP8, recorder=None, min_tokens=4):
    cast = FakeCast()
    recorder = recorder or Recorder()
    state = linear_state.LinearPatchState(settings, linear_common.SkipPatterns.parse(""), min_tokens, recorder.backend,
                                label=f"Dyn #{uuid.uuid4().hex[:8]}", dynamic_vram=mode, weight_cast=cast)
    reference_calls = []
    forward = comfy_forward(cast, module)

    def previous(*args, **kwargs):
        reference_calls.append(args)
        return forward(*args, **kwargs)

    layer = linear_layer.LinearLayer(state, "blocks.0.qkv", module, previous)
    state.layers.append(layer)
    return layer, cast, recorder, reference_calls


def _dequantised(module) -> torch.Tensor:
    w = module.weight.float()
    scale = getattr(module, "scale_weight", None)
    return w if scale is None else w * scale.float().reshape(-1, 1)


# ---- FP8 weights: the cast's own FP8 tensor feeds the kernel ----------------------------------

FP8_SCALES = {
    "no-scale (weight_dtype fp8_e4m3fn)": None,
    "per-tensor scale_weight (scaled FP8)": torch.tensor(0.0125),
    "per-channel scale_weight": torch.linspace(0.005, 0.02, 48),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale_case", list(FP8_SCALES))
def test_fp8_weight_feeds_the_kernel_without_an_upcast(dtype, scale_case):
    torch.manual_seed(0)
    module = StreamedLinear(64, 48, torch.float8_e4m3fn, FP8_SCALES[scale_case])
    layer, cast, recorder, references = _streamed_layer(module)
    x = torch.randn(2, 16, 64).to(dtype)
    ref = F.linear(x.float(), _dequantised(module), module.bias.float())
    for _ in range(2):  # the guarded first call and a plain one
        out = layer(x)
        assert out.dtype == dtype and out.shape == (2, 16, 48)
        assert _rel_l2(out, ref) < TOL
    ours = [c for c in cast.casts if c[1] != dtype]  # the reference's own casts ask for x's dtype
    assert [c[1] for c in ours] == [torch.float8_e4m3fn] * 2, "the FP8 weight was upcast"
    for weight, prepared in recorder.prepared:
        assert weight.dtype == torch.float8_e4m3fn
        assert prepared.weight.data_ptr() == module.weight.data_ptr(), "the FP8 weight was copied"
    assert cast.uncasts == len(cast.casts) and not cast.open
    assert len(references) == 1, "the guard compares the first call only"
    stats = _linear_stats()
    assert (stats["served"], stats["handed_back"]) == (2, 0), stats
    assert stats["paths"] == {STREAMED_PATH: 2}


@pytest.mark.parametrize("scale_case", list(FP8_SCALES))
def test_fp8_weight_returned_patched_in_the_input_dtype_is_quantised_with_its_scale(scale_case):
    """The cast that applies a LoRA to an FP8 layer returns it in x's dtype (in stored units):
    quantised per call, scale_weight applied as ComfyUI's scaled layers apply it."""
    torch.manual_seed(0)
    module = StreamedLinear(64, 48, torch.float8_e4m3fn, FP8_SCALES[scale_case])
    layer, cast, recorder, _ = _streamed_layer(module)
    cast.lora_cast = True
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    out = layer(x)
    ref = F.linear(x.float(), _dequantised(module) * 1.25, module.bias.float())
    assert _rel_l2(out, ref) < TOL
    (weight, prepared), = recorder.prepared
    assert weight.dtype == torch.bfloat16 and prepared.weight.dtype == torch.float8_e4m3fn
    assert _linear_stats()["served"] == 1


# ---- 16/32-bit weights: quantised per call, nothing kept ------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_float_weight_is_quantised_per_call_and_freed(dtype, weight_dtype):
    torch.manual_seed(0)
    module = StreamedLinear(64, 48, weight_dtype)
    layer, cast, recorder, _ = _streamed_layer(module)
    x = torch.randn(32, 64).to(dtype)
    ref = F.linear(x.float(), module.weight.to(dtype).float(), module.bias.to(dtype).float())
    outs = [layer(x) for _ in range(3)]
    for out in outs:
        assert _rel_l2(out, ref) < TOL
    assert len(recorder.prepared) == 3, "one quantisation per call"
    for weight, prepared in recorder.prepared:
        assert weight.dtype == dtype, "the cast is asked for the input's dtype, as ComfyUI's Linear asks"
        assert prepared.weight.dtype == torch.float8_e4m3fn
    freed = weakref.ref(recorder.prepared[-1][1].weight)
    del weight, prepared
    recorder.prepared.clear()
    gc.collect()
    assert freed() is None, "the per-call FP8 weight outlived its call"
    assert layer.entries == {} and layer.state.prepared_bytes() == 0, "a streamed layer keeps no prepared weight"
    assert cast.uncasts == len(cast.casts) and not cast.open
    assert _linear_stats()["paths"] == {STREAMED_PATH: 3}


def test_per_call_quantisation_matches_the_persistent_one():
    """The fused row quantiser gives the per-channel scales and e4m3 values prepare_weight gives."""
    torch.manual_seed(0)
    weight = torch.randn(48, 64, dtype=torch.bfloat16)
    weight[3] = 0  # a zero channel: finite scale, zeros stay zeros
    weight[5, 7] = 300.0  # an outlier sets its channel's scale
    per_call = prepare_weight_per_call(weight, "fp8_w8a8")
    once = kernels.prepare_weight(weight, "fp8_w8a8")
    assert torch.allclose(per_call.scale, once.scale, rtol=1e-6, atol=0)
    differing = (per_call.weight.float() != once.weight.float()).float().mean().item()
    assert differing < 0.01, f"{differing:.2%} of the e4m3 values differ (only last-bit ties may)"
    assert not per_call.weight[3].float().any()


def test_per_call_preparation_refuses_what_prepare_weight_refuses():
    with pytest.raises(kernels.LinearInputError, match="multiple of 16"):
        prepare_weight_per_call(torch.randn(48, 24), "fp8_w8a8")
    with pytest.raises(kernels.LinearInputError, match="only for float8_e4m3fn"):
        prepare_weight_per_call(torch.randn(48, 64), "fp8_w8a8", torch.tensor(0.5))


# ---- the cast is always undone --------------------------------------------------------------

def _broken_kernel(*args, **kwargs):
    raise RuntimeError("launch failed")


@pytest.mark.parametrize("when", ["guarded first call", "later call"])
def test_uncast_also_when_our_kernel_raises(when):
    torch.manual_seed(0)
    module = StreamedLinear(64, 48)
    layer, cast, recorder, references = _streamed_layer(module)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    if when == "later call":
        layer(x)
    recorder._run = _broken_kernel
    out = layer(x)
    expected = F.linear(x, module.weight.to(x.dtype), module.bias.to(x.dtype))
    assert torch.equal(out, expected), "ComfyUI's own forward did not serve the failed call"
    assert cast.uncasts == len(cast.casts) and not cast.open
    assert layer.fallbacks.get("cpu", "").startswith("kernel error: RuntimeError")
    stats = _linear_stats()
    assert stats["reasons"] == {linear_common.REASON_KERNEL_ERROR: 1}, stats
    casts = len(cast.casts)
    layer(x)  # from now on ComfyUI's Linear, without our cast
    assert len(cast.casts) == casts + 1 and len(references) == (3 if when == "later call" else 2)


def test_weight_the_kernels_refuse_is_handed_back_after_uncast_and_not_cast_again():
    module = StreamedLinear(24, 48)  # K = 24: not a multiple of 16
    layer, cast, _, references = _streamed_layer(module)
    x = torch.randn(32, 24)
    layer(x)
    assert cast.uncasts == len(cast.casts) and not cast.open
    ours_before = len(cast.casts) - len(references)
    layer(x)
    assert len(cast.casts) - len(references) == ours_before, "a refused layer is cast again for nothing"
    reasons = _linear_stats()["reasons"]
    assert sum(reasons.values()) == 2 and all("multiple of 16" in r for r in reasons), reasons


# ---- the guard, LoRA and the function lists -------------------------------------------------

def test_quality_guard_rejects_a_wrong_kernel_and_returns_comfyuis_output():
    module = StreamedLinear(64, 48)
    layer, cast, recorder, _ = _streamed_layer(module)
    recorder._run = lambda x, p, b, dt: torch.zeros(*x.shape[:-1], p.out_features, dtype=dt)
    x = torch.randn(32, 64)
    out = layer(x)
    assert torch.allclose(out, F.linear(x, module.weight.float(), module.bias))
    assert layer.fallbacks["cpu"].startswith("quality guard (fp8_w8a8)")
    assert _linear_stats()["reasons"] == {linear_common.REASON_GUARD: 1}
    assert recorder.runs == 2, "a disagreement is checked once more on the weight the reference read"
    assert cast.uncasts == len(cast.casts)


def test_guard_reference_runs_after_our_uncast():
    """Ours first, then ComfyUI's forward: the reference sees the weight ComfyUI keeps from then
    on (the first FP8 cast of a LoRA'd layer requantises it into the VBAR), never a nested cast."""
    module = StreamedLinear(64, 48, torch.float8_e4m3fn)
    layer, cast, _, _ = _streamed_layer(module)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    layer(x)
    assert cast.events == [("cast", torch.float8_e4m3fn), ("uncast", None), ("cast", torch.bfloat16),
                           ("uncast", None)]


def test_guard_runs_ours_again_on_the_weight_the_first_cast_wrote_back():
    """ComfyUI's first cast of an FP8 layer with a LoRA hands over the exact patched weight and
    writes a rounded copy into the VBAR, which the reference then reads (~5 % apart): ours runs
    again on that copy before the guard judges the kernel."""
    torch.manual_seed(0)
    module = StreamedLinear(64, 48, torch.float8_e4m3fn)
    layer, cast, recorder, references = _streamed_layer(module)
    exact = module.weight.float() * 1.25
    written_back = (exact * (1 + 0.3 * torch.randn_like(exact))).to(torch.float8_e4m3fn)
    real_cast = cast.cast

    def first_cast_writes_back(mod, x, weight_dtype):
        if not cast.casts:  # the LoRA's first cast: exact weight out, rounded copy written back
            mod.weight.data = written_back
            cast.casts.append((mod, weight_dtype, exact))
            cast.events.append(("cast", weight_dtype))
            cast.open.add(id(mod))
            return exact.to(x.dtype), mod.bias.detach().to(x.dtype), ("handle", id(mod))
        return real_cast(mod, x, weight_dtype)

    cast.cast = first_cast_writes_back
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    out = layer(x)
    assert [str(w.dtype) for w, _ in recorder.prepared] == ["torch.bfloat16", "torch.float8_e4m3fn"]
    assert _rel_l2(out, F.linear(x.float(), written_back.float(), module.bias.float())) < TOL
    assert _linear_stats()["served"] == 1 and not layer.fallbacks
    assert len(references) == 1 and cast.uncasts == len(cast.casts) and not cast.open


def test_a_new_weight_version_runs_the_guard_again():
    """A LoRA loaded under dynamic VRAM changes patches_uuid (ON_LOAD sets weights_token)."""
    module = StreamedLinear(64, 48)
    layer, _, _, references = _streamed_layer(module)
    x = torch.randn(32, 64)
    layer(x)
    layer(x)
    assert len(references) == 1
    layer.state.on_load(types.SimpleNamespace(patches_uuid=uuid.uuid4()))
    layer(x)
    assert len(references) == 2


def test_weight_function_is_applied_by_the_cast_and_served():
    """LoRA in low-VRAM form (weight_function) on a streamed 16-bit weight: ComfyUI's cast applies
    it, so the call is ours, with the patched weight."""
    module = StreamedLinear(64, 48, torch.float32)
    module.weight_function = [lambda w: w * 1.5]
    layer, _, recorder, _ = _streamed_layer(module)
    x = torch.randn(32, 64)
    out = layer(x)
    assert _rel_l2(out, F.linear(x, module.weight * 1.5, module.bias)) < TOL
    assert _linear_stats()["served"] == 1
    assert len(recorder.prepared) == 1


def test_fp8_weight_with_weight_function_goes_back_without_a_cast():
    module = StreamedLinear(64, 48, torch.float8_e4m3fn)
    module.weight_function = [lambda w: w * 1.5]
    layer, cast, _, references = _streamed_layer(module)
    layer(torch.randn(32, 64))
    assert _linear_stats()["reasons"] == {linear_common.REASON_WEIGHT_FUNCTION: 1}
    assert len(cast.casts) == len(references) == 1, "only ComfyUI's own forward casts"


# ---- the per-model choice and the other hand-backs ------------------------------------------

MODE_CASES = {
    # name: (mode, stored weight dtype, reason, or None when served)
    "off, bf16 weight": (linear_common.DYNAMIC_VRAM_OFF, torch.bfloat16, linear_common.REASON_DYNAMIC_VRAM_OFF),
    "off, fp8 weight": (linear_common.DYNAMIC_VRAM_OFF, torch.float8_e4m3fn, linear_common.REASON_DYNAMIC_VRAM_OFF),
    "fp8 only, bf16 weight": (linear_common.DYNAMIC_VRAM_FP8_WEIGHTS, torch.bfloat16, linear_common.REASON_STREAMED_PER_CALL_OFF),
    "fp8 only, fp8 weight": (linear_common.DYNAMIC_VRAM_FP8_WEIGHTS, torch.float8_e4m3fn, None),
    "auto, bf16 weight": (linear_common.DYNAMIC_VRAM_AUTO, torch.bfloat16, None),
}


@pytest.mark.parametrize("case", list(MODE_CASES))
def test_dynamic_vram_choice_per_model(case):
    mode, weight_dtype, reason = MODE_CASES[case]
    module = StreamedLinear(64, 48, weight_dtype)
    layer, cast, _, references = _streamed_layer(module, mode=mode)
    layer(torch.randn(32, 64))
    stats = _linear_stats()
    if reason is None:
        assert (stats["served"], stats["handed_back"]) == (1, 0), stats
    else:
        assert stats["reasons"] == {reason: 1}, stats
        assert len(cast.casts) == len(references), "a handed-back call was cast by us"


def test_unknown_dynamic_vram_choice_is_refused():
    with pytest.raises(ValueError, match="dynamic_vram"):
        linear_state.LinearPatchState(FP8, linear_common.SkipPatterns(), dynamic_vram="sometimes")


@pytest.mark.parametrize("case", ["few-tokens", "skip-pattern", "auto-on-cpu", "extra-argument"])
def test_cheap_refusals_come_before_any_cast(case):
    module = StreamedLinear(64, 48)
    settings = AccelSettings("auto") if case == "auto-on-cpu" else FP8
    layer, cast, _, references = _streamed_layer(module, settings=settings, min_tokens=64 if case == "few-tokens" else 4)
    if case == "skip-pattern":
        layer.skip_reason = "name matches skip pattern 'blocks.*'"
    x = torch.randn(32, 64)
    if case == "extra-argument":
        layer.previous = lambda *a, **k: references.append(a) or torch.zeros(32, 48)
        layer(x, "extra")
    else:
        layer(x)
    assert _linear_stats()["handed_back"] == 1
    assert len(cast.casts) == (0 if case == "extra-argument" else len(references)), "we cast a handed-back call"


def test_streamed_layer_on_a_cpu_input_keeps_the_old_reason():
    """ComfyUI's real cast streams only to a CUDA device: a CPU input is not the streamed route."""
    real = dynamic_vram.ComfyWeightCast()
    module = StreamedLinear(64, 48)
    assert not real.streams(module, torch.randn(4, 64))
    del module._v
    assert not real.streams(module, torch.randn(4, 64))


# ---- the adapter asks ComfyUI's cast the way ComfyUI's own Linear layers do -----------------

def test_comfy_weight_cast_calls(monkeypatch):
    seen = []
    ops = types.ModuleType("comfy.ops")
    ops.cast_bias_weight = lambda *a, **k: seen.append(("cast", a, k)) or ("w", "b", "h")
    ops.uncast_bias_weight = lambda *a, **k: seen.append(("uncast", a, k))
    comfy = types.ModuleType("comfy")
    comfy.ops = ops
    for name, module in (("comfy", comfy), ("comfy.ops", ops)):
        monkeypatch.setitem(sys.modules, name, module)
    layer, x = object(), torch.randn(2, 64, dtype=torch.bfloat16)
    cast = dynamic_vram.ComfyWeightCast()
    assert cast.cast(layer, x, torch.bfloat16) == ("w", "b", "h")
    assert seen[-1] == ("cast", (layer, x), {"offloadable": True})  # forward_comfy_cast_weights' own call
    cast.cast(layer, x, torch.float8_e4m3fn)
    # A LoRA applied in x's dtype and not requantised for us: the VBAR gets what ComfyUI's Linear writes.
    assert seen[-1] == ("cast", (layer, x), dict(dtype=torch.float8_e4m3fn, device=x.device, bias_dtype=torch.bfloat16,
                                                 offloadable=True, compute_dtype=torch.bfloat16))
    cast.uncast(layer, "w", "b", "h")
    assert seen[-1] == ("uncast", (layer, "w", "b", "h"), {})


@pytest.mark.parametrize("node", [patch_nodes.TritonAccelPatchLinear, patch_nodes.TritonAccelPatch])
def test_nodes_offer_the_choice_as_an_optional_input(node):
    """Optional, so API prompts and saved workflows from before keep validating (default auto)."""
    options, spec = node.INPUT_TYPES()["optional"]["dynamic_vram"]
    assert tuple(options) == linear_common.DYNAMIC_VRAM_MODES and spec["default"] == linear_common.DYNAMIC_VRAM_AUTO
    assert "dynamic_vram" not in node.INPUT_TYPES()["required"]


@pytest.mark.parametrize("aimdo_enabled", [False, True])
def test_node_text_names_the_choice_when_dynamic_vram_is_on(monkeypatch, aimdo_enabled):
    state = linear_state.LinearPatchState(FP8, linear_common.SkipPatterns(), label="Dyn text", dynamic_vram=linear_common.DYNAMIC_VRAM_FP8_WEIGHTS)
    patched = types.SimpleNamespace(triton_accel_linear=state, load_device="cpu")
    monkeypatch.setitem(sys.modules, "comfy.memory_management", types.SimpleNamespace(aimdo_enabled=aimdo_enabled))
    text = linear_patch.patched_linear_text(patched, FP8)
    line = f"ComfyUI's dynamic VRAM is on: {linear_patch.DYNAMIC_VRAM_TEXT[linear_common.DYNAMIC_VRAM_FP8_WEIGHTS]}"
    assert (line in text) == aimdo_enabled, text
