"""Other packs' Linear in the Linear patch: forced as the Settings node's `linear` "ext:<name>",
considered by auto by priority next to ours, guarded against ComfyUI's Linear, handed back on
failure, listed by the status route, zeroed by the stats reset, timed by the benchmark engine.

Fakes (ComfyLinear, FakePatcher, the tiny Flux-like model) are test_patch_linear's. Inputs are
CPU tensors. Tolerances: an extension that is F.linear on the weight and bias the patch hands it
(the layer's own tensors, cast to x's dtype: a no-op here) must equal ComfyUI's forward exactly
(atol 0), and so must every call handed back (ComfyUI's forward computed it). The guard's bars
are patch_linear.EXT_GUARD_MAX_REL_L2: rel. L2 <= 0.02 for a lossless extension, <= 0.05 for a
lossy one.
"""
from __future__ import annotations

import importlib.util
import math
import threading
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from triton_accel import kernels
from triton_accel.kernels.core import extensions
from triton_accel.kernels.core.gpu_rules import LINEAR_FP8_W8A8, LINEAR_MODES, Decision
from triton_accel.nodes import benchmark_node
from triton_accel.runtime import benchmark_core as core
from triton_accel.runtime import call_stats
from triton_accel.nodes import routes, status
from triton_accel.nodes import patch_nodes
from triton_accel.runtime import linear_common, linear_layer, linear_state
from triton_accel.runtime.settings import AccelSettings
from triton_accel.nodes.settings_node import TritonAccelSettings

def _fakes():
    """test_patch_linear's fakes (tests run with --import-mode=importlib: no sibling imports)."""
    spec = importlib.util.spec_from_file_location("_patch_linear_fakes", Path(__file__).with_name("test_patch_linear.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_f = _fakes()
REF_BACKEND, BaseModel, ComfyLinear, FakePatcher, _inputs = _f.REF_BACKEND, _f.BaseModel, _f.ComfyLinear, \
    _f.FakePatcher, _f._inputs
CPU = {"device_types": ["cpu"]}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def f_linear(x, weight, bias):
    return F.linear(x, weight, bias)


def counting(fn):
    def wrapped(x, weight, bias):
        wrapped.calls += 1
        return fn(x, weight, bias)
    wrapped.calls = 0
    return wrapped


class GpuRuleSettings(AccelSettings):
    """Linear auto as on a GPU whose rule runs our FP8 W8A8 (on the CPU auto runs none of ours, so
    it considers no extension there): gpu_rules' answer for an sm_89+ card, without the card."""

    def _select_linear(self, device, weight_is_fp8):
        return Decision(LINEAR_FP8_W8A8, "auto: a test GPU with FP8 tensor cores")


@pytest.fixture(autouse=True)
def _clean():
    call_stats.reset()
    kernels.core.stats.reset()
    yield
    for entry in extensions.list_extensions():
        extensions.unregister(entry["name"])
    extensions.reset_counts()
    kernels.clear_caches()


def _linear_stats() -> dict:
    return call_stats.snapshot()["kinds"].get("linear", {"served": 0, "handed_back": 0, "reasons": {}, "paths": {}})


def _layer(settings, min_tokens=4, module=None, backend=REF_BACKEND, dtype=torch.float32):
    label = f"Ext #{uuid.uuid4().hex[:8]}"
    state = linear_state.LinearPatchState(settings, linear_common.SkipPatterns.parse(""), min_tokens, backend, label=label)
    torch.manual_seed(1)
    module = (module if module is not None else ComfyLinear(32, 48)).to(dtype)
    calls = []

    def previous(*args, **kwargs):
        calls.append(1)
        return module.__class__.forward(module, *args, **kwargs)

    layer = linear_layer.LinearLayer(state, "blocks.0.qkv", module, previous)
    state.layers.append(layer)
    return layer, calls


def _forced(path):
    return AccelSettings("off", linear_mode=path)


# ---- forced: Settings `linear` = "ext:<name>" ----------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", [(2, 8, 32), (3, 32), (1, 1, 1, 32)], ids=["3d", "2d", "one-token-4d"])
def test_forced_extension_serves_every_call_exactly(dtype, shape):
    fn = counting(f_linear)
    path = extensions.register_linear("forced", fn, constraints={**CPU, "dtypes": ["fp32", "fp16", "bf16"]})
    layer, calls = _layer(_forced(path), min_tokens=1024, dtype=dtype)  # min_tokens is our methods' rule
    x = torch.randn(*shape).to(dtype)
    first, second = layer(x), layer(x)
    ref = layer.module.__class__.forward(layer.module, x)
    torch.testing.assert_close(first, ref, atol=0, rtol=0)
    torch.testing.assert_close(second, ref, atol=0, rtol=0)
    assert fn.calls == 2 and len(calls) == 1, "the guard's reference runs on the first call only"
    stats = _linear_stats()
    assert stats["served"] == 2 and stats["paths"] == {path: 2} and stats["handed_back"] == 0, stats
    assert kernels.core.stats.counts().get("triton_linear_fp8_w8a8", 0) == 0, "ours never runs in a forced ext mode"
    assert extensions.list_extensions()[0]["served"] == 2


def test_forced_extension_on_the_whole_model_matches_unpatched_and_skips_by_name():
    fn = counting(f_linear)
    path = extensions.register_linear("model", fn, constraints=CPU)
    base = FakePatcher(BaseModel())
    x, t = _inputs()
    ref = base.model.diffusion_model(x, t)
    result = patch_nodes.TritonAccelPatchLinear().patch(base, "auto", 1024, _forced(path))
    patched = result["result"][0]
    patched.patch_model()
    try:
        out = patched.model.diffusion_model(x, t)
    finally:
        patched.detach()
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    stats = _linear_stats()
    # 8 Linear layers, 4 of them skipped by the default patterns (img_in, time_in, img_mod, final_layer).
    assert stats["paths"] == {path: 4} and stats["handed_back"] == 4, stats
    assert all(r.startswith("name matches skip pattern") for r in stats["reasons"]), stats["reasons"]
    assert f"{path} forced: " in result["ui"]["text"][0]


def test_combined_node_runs_the_forced_linear_extension():
    path = extensions.register_linear("combined", f_linear, constraints=CPU)
    base = FakePatcher(BaseModel())
    x, t = _inputs()
    ref = base.model.diffusion_model(x, t)
    patched = patch_nodes.TritonAccelPatch().patch(base, "auto", 1, AccelSettings("off", linear_mode=path))["result"][0]
    patched.patch_model()
    try:
        out = patched.model.diffusion_model(x, t)
    finally:
        patched.detach()
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert _linear_stats()["paths"] == {path: 4}


BROKEN = {
    "raises": (lambda x, w, b: (_ for _ in ()).throw(RuntimeError("no kernel image")), "raised RuntimeError"),
    "wrong-shape": (lambda x, w, b: F.linear(x, w, b)[..., :1], "returned shape"),
    "wrong-dtype": (lambda x, w, b: F.linear(x, w, b).half(), "returned dtype torch.float16"),
    "wrong-device": (lambda x, w, b: F.linear(x, w, b).to("meta"), "returned a tensor on meta"),
    "nan": (lambda x, w, b: F.linear(x, w, b) * math.nan, "NaN or Inf"),
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_failing_forced_extension_hands_calls_to_comfyui_with_the_reason(kind):
    fn, words = BROKEN[kind]
    path = extensions.register_linear("broken", fn, constraints=CPU)
    layer, calls = _layer(_forced(path))
    x = torch.randn(2, 8, 32)
    ref = layer.module.__class__.forward(layer.module, x)
    for _ in range(2):  # the second call of the signature goes straight back, counted again
        torch.testing.assert_close(layer(x), ref, atol=0, rtol=0)
    stats = _linear_stats()
    assert stats["served"] == 0 and stats["handed_back"] == 2, stats
    first, second = stats["reasons"]
    assert first.startswith(f"{path} failed: ") and words in first, stats["reasons"]
    assert second.startswith(f"{path}: ") and words in second, stats["reasons"]
    assert len(calls) == 2
    # The extension's own count: the call it failed on. Later calls of the signature are not
    # offered to it (as on the attention side); call_stats counts them with the reason above.
    assert extensions.list_extensions()[0]["handed_back"] == {first.removeprefix(f"{path} failed: "): 1}


def test_forced_extension_refusing_a_call_hands_it_back():
    path = extensions.register_linear("mult64", f_linear, constraints={**CPU, "out_features_multiple_of": 64})
    layer, calls = _layer(_forced(path))
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(layer(x), layer.module.__class__.forward(layer.module, x), atol=0, rtol=0)
    assert list(_linear_stats()["reasons"]) == [f"{path}: out_features 48 is not a multiple of 64"]


def test_forced_extension_not_installed_or_of_the_other_kind_says_so():
    attention_path = extensions.register_attention("an-attention", lambda q, k, v, attn_mask=None, scale=None,
                                                   is_causal=False: q, constraints=CPU)
    for mode, words in (("ext:not-installed", "ext:not-installed asked, but no Linear extension of that name is "
                                              "registered"),
                        (attention_path, f"{attention_path} asked, but {attention_path} is an attention extension")):
        call_stats.reset()
        layer, _ = _layer(_forced(mode))
        x = torch.randn(2, 8, 32)
        torch.testing.assert_close(layer(x), layer.module.__class__.forward(layer.module, x), atol=0, rtol=0)
        (reason,) = _linear_stats()["reasons"]
        assert reason.startswith(words) and reason.endswith("ComfyUI's Linear runs"), reason


GUARD_CASES = {
    # name: (lossy, rel. L2 off ComfyUI's Linear, kept?)
    "exact": (False, 0.0, True),
    "lossless-within-0.02": (False, 0.015, True),
    "lossless-beyond-0.02": (False, 0.03, False),
    "lossy-within-0.05": (True, 0.03, True),
    "lossy-beyond-0.05": (True, 0.08, False),
}


def _off_by(rel):
    def fn(x, weight, bias):
        out = F.linear(x, weight, bias)
        noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        return out + noise * (rel * out.norm() / noise.norm())
    return fn


@pytest.mark.parametrize("case", list(GUARD_CASES))
def test_the_guard_keeps_an_extension_per_layer_by_its_bar(case):
    lossy, rel, kept = GUARD_CASES[case]
    fn = counting(_off_by(rel))
    path = extensions.register_linear("guarded", fn, constraints=CPU, lossy=lossy)
    layer, calls = _layer(_forced(path))
    x = torch.randn(2, 8, 32)
    ref = layer.module.__class__.forward(layer.module, x)
    first, second = layer(x), layer(x)
    stats = _linear_stats()
    if kept:
        assert stats["paths"] == {path: 2} and len(calls) == 1, stats
        assert ((second - ref).norm() / ref.norm()).item() == pytest.approx(rel, abs=1e-5)
        assert linear_state.fallback_report() == [] or all(r["model"] != layer.state.label for r in linear_state.fallback_report())
    else:
        torch.testing.assert_close(first, ref, atol=0, rtol=0)
        torch.testing.assert_close(second, ref, atol=0, rtol=0)
        assert fn.calls == 1, "a layer whose guard failed is not offered to the extension again"
        assert stats["served"] == 0 and set(stats["reasons"]) == {linear_common.REASON_EXT_GUARD.format(path=path)}, stats
        rows = [r for r in linear_state.fallback_report() if r["model"] == layer.state.label]
        assert len(rows) == 1 and rows[0]["reason"].startswith(f"quality guard ({path}): rel. L2"), rows
        # Registered again (a fixed version): the layer is offered to it afresh.
        extensions.register_linear("guarded", f_linear, constraints=CPU)
        torch.testing.assert_close(layer(x), ref, atol=0, rtol=0)
        assert _linear_stats()["paths"] == {path: 1}


# ---- auto: extensions join ours by priority where auto runs ours ---------------------------

class SpyBackend:
    """REF_BACKEND counting the calls ours serves."""

    def __init__(self):
        self.runs = 0

        def run(*args):
            self.runs += 1
            return REF_BACKEND.run(*args)

        self.backend = linear_common.LinearBackend(REF_BACKEND.prepare, run, REF_BACKEND.refusal, REF_BACKEND.input_error)


AUTO_CASES = {
    # name: (extension priority, rows of the call, min_tokens, who serves: "ext" / "ours")
    "above-ours-serves-first": (200, 16, 4, "ext"),
    "below-ours-ours-serves": (10, 16, 4, "ours"),
    "tie-goes-to-ours": (100, 16, 4, "ours"),
    "below-ours-serves-what-ours-refuses": (10, 2, 4, "ext"),  # 2 rows < our min_tokens 4
}


@pytest.mark.parametrize("case", list(AUTO_CASES))
def test_auto_walks_extensions_and_ours_by_priority(case):
    priority, rows, min_tokens, who = AUTO_CASES[case]
    fn = counting(f_linear)
    path = extensions.register_linear("auto-ext", fn, constraints=CPU, priority=priority)
    spy = SpyBackend()
    layer, _ = _layer(GpuRuleSettings("off", linear_mode="auto"), min_tokens=min_tokens, backend=spy.backend)
    x = torch.randn(rows, 32)
    out = layer(x)
    stats = _linear_stats()
    if who == "ext":
        torch.testing.assert_close(out, layer.module.__class__.forward(layer.module, x), atol=0, rtol=0)
        assert fn.calls == 1 and spy.runs == 0 and stats["paths"] == {path: 1}, stats
    else:
        assert fn.calls == 0 and spy.runs >= 1 and stats["paths"] == {LINEAR_FP8_W8A8: 1}, stats
    plan = linear_state.extension_plan(layer.state.settings, torch.device("cpu"))
    assert plan == (((path,), True, ()) if priority > 100 else ((), True, (path,)))


def test_auto_moves_on_when_the_first_candidate_refuses_and_counts_every_reason():
    high = extensions.register_linear("high", f_linear, constraints={**CPU, "in_features": (64, 128)}, priority=500)
    low = extensions.register_linear("low", f_linear, constraints={**CPU, "min_tokens": 4}, priority=5)
    layer, _ = _layer(GpuRuleSettings("off", linear_mode="auto"), min_tokens=8)
    x = torch.randn(2, 32)  # high: in_features 32 refused; ours: 2 rows < 8; low: 2 tokens < 4
    torch.testing.assert_close(layer(x), layer.module.__class__.forward(layer.module, x), atol=0, rtol=0)
    (reason,) = _linear_stats()["reasons"]
    assert reason == (f"{high}: in_features 32 outside 64..128; fewer than 8 tokens: quantising cannot pay; "
                      f"{low}: 2 tokens < min_tokens 4"), reason
    call_stats.reset()
    layer(torch.randn(4, 32))  # low accepts 4 tokens; ours still refuses
    assert _linear_stats()["paths"] == {low: 1}


def test_auto_on_the_cpu_and_forced_methods_never_offer_extensions():
    fn = counting(f_linear)
    extensions.register_linear("never", fn, constraints=CPU, priority=1000)
    for settings in (AccelSettings("auto"), AccelSettings("off", linear_mode="off")):
        layer, _ = _layer(settings)
        layer(torch.randn(2, 8, 32))
        assert linear_state.extension_plan(settings, torch.device("cpu")) is None
    assert fn.calls == 0 and _linear_stats()["served"] == 0


def test_auto_text_names_the_order():
    extensions.register_linear("first", f_linear, constraints=CPU, priority=300)
    extensions.register_linear("last", f_linear, constraints=CPU, priority=-3)
    text = linear_state.extension_plan_text(GpuRuleSettings("off", linear_mode="auto"), torch.device("cpu"))
    assert text.endswith("ext:first > ours > ext:last"), text


# ---- thread safety --------------------------------------------------------------------------

def test_patched_layer_from_many_threads_while_the_extension_is_replaced():
    """MultiGPU work units run a layer from a thread per GPU while a pack may re-register: every
    output equals ComfyUI's Linear (the extension is exact, and a call it cannot take goes there)."""
    path = extensions.register_linear("threads", f_linear, constraints=CPU, pack="p")
    layer, _ = _layer(_forced(path))
    x = torch.randn(2, 8, 32)
    ref = layer.module.__class__.forward(layer.module, x)
    errors, equal = [], []

    def caller():
        for _ in range(30):
            try:
                with torch.no_grad():  # as in ComfyUI's worker threads (inference mode)
                    equal.append(torch.equal(layer(x), ref))
            except Exception as e:  # noqa: BLE001 - any exception fails the test
                errors.append(repr(e))

    threads = [threading.Thread(target=caller) for _ in range(6)]
    for t in threads:
        t.start()
    for i in range(30):
        extensions.register_linear("threads", f_linear, constraints=CPU, priority=i, pack="p")
        if i % 6 == 0:
            extensions.unregister(path)
            extensions.register_linear("threads", f_linear, constraints=CPU, pack="p")
    for t in threads:
        t.join()
    assert errors == [] and len(equal) == 180 and all(equal)
    assert _linear_stats()["served"] > 0


# ---- the Settings node, status, reset, benchmark --------------------------------------------

def test_settings_node_lists_linear_extensions_and_keeps_saved_values_valid():
    optional = TritonAccelSettings.INPUT_TYPES()["optional"]
    assert optional["linear"][0] == list(LINEAR_MODES)
    path = extensions.register_linear("listed", f_linear, constraints=CPU, label="Listed Linear")
    inputs = TritonAccelSettings.INPUT_TYPES()
    assert inputs["optional"]["linear"][0] == [*LINEAR_MODES, path]
    assert inputs["optional"]["linear"][1]["triton_accel_labels"][path].startswith(f"{path} (Listed Linear, from ")
    assert path not in inputs["required"]["mode"][0], "the attention dropdown lists attention extensions only"
    assert TritonAccelSettings.VALIDATE_INPUTS(mode="auto", linear="ext:from-another-machine") is True
    assert "linear 'fp4'" in TritonAccelSettings.VALIDATE_INPUTS(mode="auto", linear="fp4")
    with pytest.raises(ValueError, match="ext:<name>"):
        AccelSettings("auto", linear_mode="fp4")
    text = TritonAccelSettings().configure("off", "cpu", path)["ui"]["text"][0]
    assert f"Linear: {path} forced: Listed Linear from " in text, text


def test_status_lists_linear_extensions_with_their_kind():
    path = extensions.register_linear("shown", f_linear, constraints={**CPU, "in_features_multiple_of": 16},
                                      priority=7, label="Shown", pack="example_pack")
    extensions.register_linear("gpu-only", f_linear, constraints={"device_types": ["cuda"]}, pack="example_pack")
    layer, _ = _layer(_forced(path))
    layer(torch.randn(2, 8, 32))
    payload = status.extensions_status([torch.device("cpu")], [])
    shown = next(e for e in payload if e["path"] == path)
    assert shown["kind"] == "linear" and shown["pack"] == "example_pack" and shown["priority"] == 7
    assert shown["constraints"]["in_features_multiple_of"] == 16 and shown["served"] == 1
    assert shown["devices"] == [{"device": "cpu", "eligible": True, "refusal": None, "forced": True,
                                 "auto_considers_here": False, "chosen": True}]
    gpu = next(e for e in payload if e["path"] == "ext:gpu-only")
    assert gpu["devices"][0]["eligible"] is False and "device type 'cpu'" in gpu["devices"][0]["refusal"]
    assert {e["kind"] for e in status.status_payload()["extensions"]} == {"linear"}


def test_stats_reset_zeroes_extension_counts_too():
    """What POST /triton_accel/stats/reset runs (routes.reset_counts): call_stats, the kernels'
    counters and both kinds of extension counts."""
    lin = extensions.register_linear("reset-lin", f_linear, constraints=CPU)
    attn = extensions.register_attention("reset-attn", lambda q, k, v, attn_mask=None, scale=None, is_causal=False:
                                         F.scaled_dot_product_attention(q, k, v), constraints=CPU)
    layer, _ = _layer(_forced(lin))
    layer(torch.randn(2, 8, 32))
    q = torch.randn(1, 2, 8, 16)
    kernels.attention(q, q, q, backend=attn)
    assert {e["path"]: e["served"] for e in extensions.list_extensions()} == {lin: 1, attn: 1}
    routes.reset_counts()
    assert all(e["served"] == 0 and e["handed_back"] == {} for e in extensions.list_extensions())
    assert _linear_stats()["served"] == 0 and call_stats.snapshot()["calls"] == {}
    assert routes.stats_payload()["kinds"] == {}


def test_benchmark_times_linear_and_attention_extensions():
    lin = extensions.register_linear("bench-lin", f_linear, constraints=CPU, label="Bench Linear")
    attn = extensions.register_attention(
        "bench-attn", lambda q, k, v, attn_mask=None, scale=None, is_causal=False:
        F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask), constraints=CPU, label="Bench attention")
    chosen = benchmark_node.chosen_paths(AccelSettings(attn, linear_mode=lin), torch.device("cpu"), False)
    assert chosen["attention_paths"] == [attn] and chosen["linear_method"] == lin, chosen
    shape = core.AttentionShape(batch=1, heads=2, kv_heads=2, q_len=32, kv_len=32, head_dim=16, v_head_dim=16,
                                dtype="float32")
    result = core.run_benchmark([(shape, 2)], [(core.LinearShape(64, 32, 48, "float32"), 3)], "cpu",
                                attention_paths=chosen["attention_paths"], linear_method=chosen["linear_method"],
                                repeats=1)
    (attn_row,), (lin_row,) = result["attention"], result["linear"]
    ours_attn, ours_lin = attn_row["results"][1], lin_row["results"][1]
    assert ours_attn["error"] is None and ours_attn["label"] == f"{attn} (Bench attention)", ours_attn
    assert ours_lin["error"] is None and ours_lin["label"] == f"{lin} (Bench Linear)", ours_lin
    assert ours_attn["within_bar"] and ours_lin["within_bar"] and ours_lin["rel_l2"] < 1e-6
    assert lin_row["max_rel_l2"] == linear_common.EXT_GUARD_MAX_REL_L2[False]
    assert ours_lin["ms"] is not None and ours_attn["ms"] is not None


# ---- ComfyUI's dynamic VRAM: the weight comes from ComfyUI's per-call cast ------------------

def _dynamic_fakes():
    spec = importlib.util.spec_from_file_location(
        "_dynamic_vram_fakes", Path(__file__).with_name("test_patch_linear_dynamic_vram.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STREAMED_CASES = {
    # name: (stored weight dtype, per-channel scale_weight?, activation dtype)
    "bf16-weight-bf16-x": (torch.bfloat16, False, torch.bfloat16),
    "scaled-fp8-weight-fp32-x": (torch.float8_e4m3fn, True, torch.float32),
}


@pytest.mark.parametrize("case", list(STREAMED_CASES))
def test_forced_extension_on_a_streamed_layer_takes_comfyuis_cast(case):
    """The extension gets the weight ComfyUI's cast hands over (in x's dtype, scale_weight applied
    as a scaled-FP8 op applies it); the cast is undone after every call, never nested; the output
    equals ComfyUI's own forward over the same cast exactly."""
    weight_dtype, scaled, dtype = STREAMED_CASES[case]
    dyn = _dynamic_fakes()
    fn = counting(f_linear)
    path = extensions.register_linear("streamed", fn, constraints={**CPU, "dtypes": ["fp32", "bf16"]})
    torch.manual_seed(0)
    module = dyn.StreamedLinear(32, 48, weight_dtype, torch.linspace(0.005, 0.02, 48) if scaled else None)
    module.bias.data = module.bias.data.to(dtype)
    layer, cast, _, reference_calls = dyn._streamed_layer(module, settings=_forced(path))
    x = torch.randn(2, 8, 32).to(dtype)
    first, second = layer(x), layer(x)
    ref = dyn.comfy_forward(dyn.FakeCast(), module)(x)
    torch.testing.assert_close(first, ref, atol=0, rtol=0)
    torch.testing.assert_close(second, ref, atol=0, rtol=0)
    assert fn.calls == 2 and len(reference_calls) == 1
    assert cast.uncasts == len(cast.casts) and not cast.open
    assert all(asked == dtype for _, asked, _ in cast.casts), "the extension's weight is asked for in x's dtype"
    assert _linear_stats()["paths"] == {path: 2}
