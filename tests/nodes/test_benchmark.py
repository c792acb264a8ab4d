"""TritonAccelBenchmark without ComfyUI: recording on a fake model, timing and accuracy on the
CPU (our kernels through TRITON_INTERPRET=1, set by tests/conftest.py), report text, chart
with matplotlib and with the Pillow text-table fallback, the saved result.

Tolerances (rel. L2 of an implementation's output against the float32 reference the
benchmark computes on sampled rows):
- attention: float32 1e-5 (interpreter / SDPA in fp32, summation order only), float16 2e-3
  (fp16 output rounding, 2^-11 relative), bfloat16 1e-2 (bf16 output rounding, 2^-8);
- Linear (PyTorch): the same per dtype.
"""
import json
import sys

import numpy as np
import pytest
import torch

from triton_accel.nodes import benchmark_node as node
from triton_accel.runtime import benchmark_chart as chart
from triton_accel.runtime import benchmark_core as core
from triton_accel.runtime.attention_patch import OVERRIDE_KEY
from triton_accel.runtime.settings import AccelSettings

TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
DTYPES = list(TOL)

# name -> AttentionShape (small versions of real calls: the interpreter is slow)
ATTENTION_CASES = {
    "flux_joint_d128": core.AttentionShape(1, 2, 2, 48, 48, 128, 128, "float32"),
    "sd15_cross_77_keys_d40": core.AttentionShape(2, 8, 8, 64, 77, 40, 40, "float32"),
    "hunyuan_additive_padding_mask": core.AttentionShape(1, 2, 2, 28, 28, 128, 128, "float32", "additive",
                                                          (1, 1, 1, 28)),
    "bool_mask_per_query": core.AttentionShape(1, 2, 2, 32, 40, 64, 64, "float32", "bool", (1, 1, 32, 40)),
    "lumina_gqa_4_over_2_d96": core.AttentionShape(1, 4, 2, 32, 32, 96, 96, "float32"),
}


def _with_dtype(shape, dtype):
    return core.AttentionShape(**{**shape.__dict__, "dtype": dtype})


# ---- timing and accuracy --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_row_times_both_and_checks_accuracy(case, dtype):
    shape = _with_dtype(ATTENTION_CASES[case], dtype)
    row = core.bench_attention(shape, 3, "cpu", core.Timer("cpu", 1), core.sdpa_attention, "SDPA",
                               ["triton_fp16"])
    assert [r["impl"] for r in row["results"]] == ["pytorch", "triton_fp16"]
    for r in row["results"]:
        assert r["error"] is None, r
        assert r["ms"] > 0 and r["tflops"] > 0
        assert r["rel_l2"] < TOL[dtype], (case, dtype, r)
    assert row["count"] == 3 and row["flops"] == shape.flops


def test_attention_wrong_baseline_is_caught():
    """The accuracy check can fail: an attention that drops the mask is far from the reference."""
    shape = ATTENTION_CASES["hunyuan_additive_padding_mask"]
    row = core.bench_attention(shape, 1, "cpu", core.Timer("cpu", 1),
                               lambda q, k, v, m: core.sdpa_attention(q, k, v, None), "no mask", [])
    assert row["results"][0]["rel_l2"] > 1e-2


def test_attention_unknown_path_is_reported_not_raised():
    row = core.bench_attention(ATTENTION_CASES["flux_joint_d128"], 1, "cpu", core.Timer("cpu", 1),
                               core.sdpa_attention, "SDPA", ["no_such_path"])
    assert row["results"][1]["error"].startswith("refused"), row
    assert core.best_ours(row) is None


# One source of truth for "accurate enough": auto's per-path bar (speed_choice.agreement_bar).
# Outputs off the float32 reference by a set rel. L2 (noise spread over every head) or with one
# head of eight broken (whole-output rel. L2 0.035 hides it; that head's cosine is ~0.995).
BAR_CASES = {
    # name: (path, whole-output noise, break one head, within the bar)
    "fp16_rounding": ("triton_fp16", 1e-3, False, True),
    "fp16_at_quantized_noise": ("triton_fp16", 3e-2, False, False),  # lossless bar 2e-2
    "fp8_quantized_noise": ("triton_fp8", 3e-2, False, True),  # quantized bar 0.05
    "fp8_too_noisy": ("triton_fp8", 8e-2, False, False),
    "fp8_one_broken_head": ("triton_fp8", 0.0, True, False),  # worst-head cosine < 0.998
}


@pytest.mark.parametrize("case", list(BAR_CASES))
def test_attention_paths_are_judged_by_autos_bar(case):
    from triton_accel.runtime.guards import agreement_bar

    path, noise, broken_head, expected = BAR_CASES[case]
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1, 8, 64, 64, generator=g)
    direction = torch.randn(ref.shape, generator=g)
    out = ref + direction * (noise * ref.norm() / direction.norm())
    if broken_head:
        out[0, 3] = ref[0, 3] + 0.1 * torch.randn(ref[0, 3].shape, generator=g)  # that head: rel. L2 0.1
    entry = core._measure(path, path, lambda: out, lambda fn: 1.0, 1e9, ref, torch.arange(64),
                          lambda o, rows: o, judge_path=path)
    bar = agreement_bar(path)
    assert entry["within_bar"] is expected, entry
    if broken_head:  # the whole-output figure alone would have kept it
        assert entry["rel_l2"] < bar.max_rel_l2 and entry["min_cosine"] < bar.min_cosine, entry
    assert entry["bar"] == {"max_rel_l2": bar.max_rel_l2, "min_cosine": bar.min_cosine}
    row = {"results": [{"ms": 2.0}, entry], "max_rel_l2": core.ATTENTION_MAX_REL_L2}
    assert (core.best_ours(row) is entry) is expected


def test_report_states_the_bars_it_judged_by():
    result = synthetic_result()
    fp8 = result["attention"][0]["results"][1]
    fp8.update(impl="triton_fp8", label="Triton FP8", rel_l2=0.03, min_cosine=0.999, within_bar=True,
               bar={"max_rel_l2": 0.05, "min_cosine": 0.998})
    text = core.report_text(result)
    assert ("accuracy bar vs float32 (auto's and the Linear guard's; * = outside it, not counted): "
            "Triton FP8: rel. L2 <= 0.05 and worst-head cosine >= 0.998; Triton FP16/BF16: rel. L2 <= 0.02") in text
    assert "3.0e-02" in text and "3.0e-02*" not in text  # FP8 within its bar
    assert "5.0e-01*" in text  # the FP16 row at 0.5 is outside its bar
    assert core.summarize(result)["attention"]["ours_ms"] == pytest.approx(57 * 1.0 + 10 * 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_row_pytorch_accuracy(dtype):
    shape = core.LinearShape(96, 64, 48, dtype)
    row = core.bench_linear(shape, 2, "cpu", core.Timer("cpu", 1), None)
    assert len(row["results"]) == 1
    assert row["results"][0]["rel_l2"] < TOL[dtype]


def test_linear_kept_by_patch_rules_is_not_timed():
    shape = core.LinearShape(8, 64, 64, "float32", kept_by=core.linear_kept_by("blocks.0.ff", 8))
    row = core.bench_linear(shape, 1, "cpu", core.Timer("cpu", 1), "fp8_w8a8")
    assert row["results"][1]["error"].startswith("not patched: 8 rows"), row
    assert core.linear_kept_by("final_layer.linear", 4096).startswith("default skip pattern")
    assert core.linear_kept_by("double_blocks.0.img_attn.qkv", 4096) == ""


def test_linear_ours_runs_in_interpreter():
    """fp8_w8a8 through the interpreter: it runs and lands within its quality-guard bar."""
    shape = core.LinearShape(64, 64, 32, "float32")
    row = core.bench_linear(shape, 1, "cpu", core.Timer("cpu", 1), "fp8_w8a8")
    ours = row["results"][1]
    assert ours["error"] is None, ours
    assert 0 < ours["rel_l2"] <= row["max_rel_l2"], ours
    assert "prepare_ms" in row


def test_cpu_timer_is_a_median():
    calls = []
    timer = core.Timer("cpu", 5)
    timer(lambda: calls.append(1))
    assert len(calls) == 6  # one warm-up, five timed
    assert "median of 5" in timer.name


# ---- summary and report -----------------------------------------------------------------------------

def _row(kind, label, count, base_ms, ours_ms, rel=1e-3, bar=2e-2, error=None):
    results = [{"impl": "pytorch", "label": "PyTorch", "ms": base_ms, "tflops": 100.0, "rel_l2": 1e-3, "error": None}]
    results.append({"impl": "triton_fp16", "label": "Triton FP16/BF16", "ms": None if error else ours_ms,
                    "tflops": None if error else 200.0, "rel_l2": None if error else rel, "error": error})
    return {"kind": kind, "label": label, "shape": {}, "count": count, "flops": 1e12, "results": results,
            "max_rel_l2": bar}


def synthetic_result(forward_ms=100.0):
    result = {"version": 1, "source": "synthetic", "device": "cuda:0", "device_name": "Test GPU", "torch": "2.x",
              "triton": "3.x", "timer": "test", "notes": ["a note"], "forward_ms": forward_ms,
              "attention": [_row("attention", "B1 H24 4608x4608 d128 bfloat16", 57, 2.0, 1.0),
                            _row("attention", "B1 H24 4608x512 d128 bfloat16", 10, 1.0, 0.5, rel=0.5)],
              "linear": [_row("linear", "4608x3072->9216 bfloat16", 57, 1.0, 0.5),
                         _row("linear", "16x3072->3072 bfloat16", 2, 0.1, None, error="not patched: 16 rows")]}
    result["summary"] = core.summarize(result)
    return result


def test_summary_auto_keeps_the_faster_attention():
    result = synthetic_result()
    result["attention"][0]["results"][1]["ms"] = 4.0  # ours slower than PyTorch's 2.0 ms
    assert core.summarize(result)["attention"]["ours_ms"] == pytest.approx(57 * 4.0 + 10 * 1.0)  # forced
    result["attention_keeps_faster"] = True
    assert core.summarize(result)["attention"]["ours_ms"] == pytest.approx(57 * 2.0 + 10 * 1.0)  # auto


def test_summary_counts_calls_and_skips_inaccurate_paths():
    s = synthetic_result()["summary"]
    # attention: PyTorch 57*2 + 10*1 = 124 ms; ours 57*1 + 10*1 (the 0.5 ms path is too far off) = 67
    assert s["attention"]["pytorch_ms"] == pytest.approx(124.0)
    assert s["attention"]["ours_ms"] == pytest.approx(67.0)
    # Linear: 57*1 + 2*0.1 = 57.2 -> 57*0.5 + 0.2 = 28.7
    assert s["linear"]["ours_ms"] == pytest.approx(28.7)
    assert s["both"]["speedup"] == pytest.approx((124.0 + 57.2) / (67.0 + 28.7))
    assert "forward" not in s  # 100 ms measured < 181 ms in the calls: no share to claim


def test_summary_predicts_whole_forward():
    s = synthetic_result(forward_ms=400.0)["summary"]
    assert s["forward"]["share"] == pytest.approx(181.2 / 400.0)
    assert s["forward"]["predicted_ms"] == pytest.approx(400.0 - 181.2 + 95.7)


def test_report_text_lists_shapes_notes_and_speedups():
    text = core.report_text(synthetic_result(forward_ms=400.0))
    for expected in ("B1 H24 4608x4608 d128 bfloat16", "4608x3072->9216 bfloat16", "note: a note",
                     "2.00x", "not patched: 16 rows", "attention + Linear: 181.20 ms", "whole forward"):
        assert expected in text, expected
    lines = core.table_lines(synthetic_result())
    assert lines[0].startswith("kind") and len(lines) == 1 + 8


# ---- chart -------------------------------------------------------------------------------------------

def _is_drawn(image):
    assert isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    assert image.shape[0] > 50 and image.shape[1] > 200
    dark = (image.max(axis=2) < 100).sum()
    assert dark > 500, "almost nothing drawn"  # text and bars, not a blank canvas


def test_chart_with_matplotlib():
    pytest.importorskip("matplotlib")
    assert chart.chart_backend() == "matplotlib"
    image = chart.draw_chart(synthetic_result())
    _is_drawn(image)
    assert chart.png_bytes(image).startswith(b"\x89PNG")


def test_chart_without_matplotlib_draws_the_table(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert chart.chart_backend() == "pillow"
    small = chart.draw_chart(synthetic_result())
    _is_drawn(small)
    bigger = synthetic_result()
    bigger["attention"] = bigger["attention"] * 3
    assert chart.draw_chart(bigger).shape[0] > small.shape[0]  # one line per implementation


def test_chart_without_any_library_gives_none_and_a_grey_image():
    assert chart.draw_chart(synthetic_result(), backend="none") is None
    image = node._image_tensor(None)
    assert image.shape == (1, 64, 64, 3)


def test_image_tensor_is_comfyui_image():
    image = node._image_tensor(chart.draw_chart(synthetic_result(), backend="pillow"))
    assert image.dim() == 4 and image.shape[0] == 1 and image.shape[3] == 3
    assert image.dtype == torch.float32 and 0.0 <= image.min() and image.max() <= 1.0


# ---- recording on a fake model -----------------------------------------------------------------------

def comfy_attention(q, k, v, heads, mask=None, skip_reshape=False, **kwargs):
    """ComfyUI's attention_pytorch contract, enough for the fake model."""
    if not skip_reshape:
        b, _, inner = q.shape
        q, k, v = (t.view(b, -1, heads, inner // heads).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(out.shape[0], -1, out.shape[1] * out.shape[3])


class FakeDiffusionModel(torch.nn.Module):
    """Two layouts of attention call (as SD1.5 and Flux send them) through the override, as
    wrap_attn does, and Linear layers including one the default skip patterns keep."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(64, 192)
        self.final_layer = torch.nn.ModuleDict({"linear": torch.nn.Linear(64, 16, bias=False)})  # Flux's name

    def forward(self, x, transformer_options):
        def attention(*args, **kwargs):
            override = transformer_options.get(OVERRIDE_KEY)
            return override(comfy_attention, *args, **kwargs) if override else comfy_attention(*args, **kwargs)

        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = attention(q, k, v, 4)  # [B, L, H*D], heads positional
        h = attention(q, k, v, heads=4)  # twice: counted, not listed twice
        b, n, _ = x.shape
        qs = q.view(b, n, 2, 32).transpose(1, 2)
        mask = torch.zeros(b, 1, 1, n)
        attention(qs, qs, qs, 2, mask=mask, skip_reshape=True)
        return self.final_layer["linear"](h)


class FakeInnerModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.diffusion_model = FakeDiffusionModel()


class FakePatcher:
    """What recording() uses of ComfyUI's ModelPatcher: clone(), model_options, model."""

    def __init__(self, model, model_options=None):
        self.model = model
        self.model_options = model_options if model_options is not None else {"transformer_options": {}}

    def clone(self):
        import copy

        return FakePatcher(self.model, copy.deepcopy(self.model_options))


def test_recording_counts_shapes_and_leaves_nothing_behind(monkeypatch):
    monkeypatch.setattr(core, "MIN_TOKENS", 64)  # the fake's 160-row calls count as patched
    patcher = FakePatcher(FakeInnerModel())
    x = torch.randn(2, 80, 64)
    with node.recording(patcher) as (clone, recorder, timing):
        clone.model.diffusion_model(x, clone.model_options["transformer_options"])
    joint = core.AttentionShape(2, 4, 4, 80, 80, 16, 16, "float32")
    masked = core.AttentionShape(2, 2, 2, 80, 80, 32, 32, "float32", "additive", (2, 1, 1, 80))
    assert recorder.attention == {joint: 2, masked: 1}
    by_name = {s.kept_by: (s, n) for s, n in recorder.linear.items()}
    qkv, n_qkv = by_name[""]
    assert (qkv.rows, qkv.in_features, qkv.out_features, qkv.bias, n_qkv) == (160, 64, 192, True, 1)
    final = [s for s in recorder.linear if s.kept_by.startswith("default skip pattern")]
    assert len(final) == 1 and final[0].out_features == 16 and not final[0].bias
    assert timing["forward_ms"] > 0
    # nothing left: no hooks on the shared modules, no override on the input model
    for module in patcher.model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks
    assert OVERRIDE_KEY not in patcher.model_options["transformer_options"]


def test_recording_override_passes_through_to_previous():
    seen = []

    def previous(func, *args, **kwargs):
        seen.append(args[3] if len(args) > 3 else kwargs["heads"])
        return func(*args, **kwargs)

    patcher = FakePatcher(FakeInnerModel(), {"transformer_options": {OVERRIDE_KEY: previous}})
    x = torch.randn(1, 64, 64)
    expected = patcher.model.diffusion_model(x, {})
    with node.recording(patcher) as (clone, recorder, _):
        out = clone.model.diffusion_model(x, clone.model_options["transformer_options"])
    assert seen == [4, 4, 2]
    torch.testing.assert_close(out, expected)
    assert sum(recorder.attention.values()) == 3


def test_recording_notes_calls_it_cannot_read():
    recorder = core.ShapeRecorder()
    override = node.RecordingOverride(recorder)
    q = torch.randn(1, 8, 64)
    assert override(lambda *a, **k: "original", q, q, q, 3) == "original"  # 64 is not a multiple of 3 heads
    assert recorder.skipped == {"hidden size is not a multiple of heads": 1}
    assert not recorder.attention


def test_shapes_json_round_trip():
    recorder = core.ShapeRecorder()
    for shape in ATTENTION_CASES.values():
        recorder.add_attention(shape)
    recorder.add_attention(ATTENTION_CASES["flux_joint_d128"])
    recorder.add_linear(torch.randn(3, 5, 32), torch.nn.Linear(32, 48), "blocks.0.mlp")
    data = json.loads(json.dumps(recorder.shapes()))
    attention, linear = core.shapes_from_json(data)
    assert dict(attention) == dict(recorder.attention)
    assert dict(linear) == dict(recorder.linear)
    # and from a saved result's rows
    result = {"attention": [{"shape": data["attention"][0], "count": 7}], "linear": []}
    assert core.shapes_from_json(result)[0][0][1] == 7


# ---- paths, saved result -------------------------------------------------------------------------------

def test_auto_on_cpu_times_pytorch_only_and_says_why():
    chosen = node.chosen_paths(AccelSettings("auto"), torch.device("cpu"), False)
    assert chosen["attention_paths"] == [] and chosen["linear_method"] is None
    assert any(n.startswith("our attention was not timed: ") for n in chosen["notes"]), chosen
    assert any(n.startswith("our Linear was not timed: ") for n in chosen["notes"]), chosen


def test_forced_modes_on_cpu_time_our_kernels():
    chosen = node.chosen_paths(AccelSettings("fp16", "fp8"), torch.device("cpu"), False)
    assert chosen["attention_paths"] == ["triton_fp16"] and not chosen["attention_keeps_faster"]
    assert chosen["linear_method"] == "fp8_w8a8"


def test_saved_result_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(node, "result_dir", lambda: tmp_path)
    assert node.load_last_result() is None and node.load_last_chart() is None
    result = synthetic_result()
    png = chart.png_bytes(chart.draw_chart(result, backend="pillow"))
    node.save_result(result, png)
    assert node.load_last_result()["attention"][0]["label"] == result["attention"][0]["label"]
    assert node.load_last_chart() == png
    node.save_result(result, None)  # a run without a chart removes the old one
    assert node.load_last_chart() is None
    node.last_result_path().write_text("{not json")
    assert node.load_last_result() is None
    node.last_result_path().write_bytes(b"{}" + b" " * (node.MAX_RESULT_BYTES + 1))
    assert node.load_last_result() is None


def test_run_benchmark_reports_progress_and_interpreter_note():
    seen = []
    linear = [(core.LinearShape(64, 32, 32, "float32"), 3)]
    result = core.run_benchmark([(ATTENTION_CASES["flux_joint_d128"], 2)], linear, "cpu",
                                attention_paths=["triton_fp16"], linear_method=None, repeats=1,
                                progress=lambda done, total, what: seen.append((done, total)))
    assert seen == [(1, 2), (2, 2)]
    assert result["interpreter"] and any("interpreter" in n for n in result["notes"])
    assert result["summary"]["attention"]["pytorch_ms"] == pytest.approx(2 * result["attention"][0]["results"][0]["ms"])
    json.dumps(result)  # JSON-ready


# ---- the command line (benchmarks/model_benchmark.py, in a subprocess: it loads its own copy) ------

CLI = core.__file__.replace("runtime/benchmark_core.py", "benchmarks/model_benchmark.py")


def _cli(*args, interpreter=False):
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpreter:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, CLI, *args], capture_output=True, text=True, env=env, timeout=600)


def test_cli_knows_flux_and_wan_shapes():
    proc = _cli("--model", "flux", "--model", "wan", "--list-shapes")
    assert proc.returncode == 0, proc.stderr[-3000:]
    shapes = json.loads(proc.stdout)
    attention = {(s["batch"], s["heads"], s["q_len"], s["kv_len"], s["head_dim"]): s["count"]
                 for s in shapes["attention"]}
    assert attention == {(1, 24, 4608, 4608, 128): 57, (1, 40, 32760, 32760, 128): 40, (1, 40, 32760, 512, 128): 40}
    linear = {(s["rows"], s["in_features"], s["out_features"]) for s in shapes["linear"]}
    assert {(4608, 3072, 9216), (4608, 3072, 12288), (4608, 12288, 3072), (4608, 3072, 3072),
            (32760, 5120, 5120), (32760, 5120, 13824), (32760, 13824, 5120)} <= linear


def test_cli_writes_png_json_and_prints_the_table_last(tmp_path):
    """CPU without the interpreter: PyTorch only, and the output says why ours was not timed."""
    proc = _cli("--model", "sd15", "--tiny", "--device", "cpu", "--repeats", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(p.suffix for p in tmp_path.iterdir())
    assert files == [".json", ".png"], files
    result = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert len(result["attention"]) == 8 and len(result["linear"]) == 16
    assert any(n.startswith("our attention was not timed: ") for n in result["notes"]), result["notes"]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("linear "), last


def test_linear_fp8_checkpoint_weights_are_upcast_in_the_baseline():
    """weight_dtype fp8_e4m3fn: the baseline pays ComfyUI's per-call upcast; accuracy is against the
    FP8 weights themselves (so PyTorch's error stays at the activation dtype's rounding)."""
    shape = core.LinearShape(64, 64, 32, "float32", weight_dtype="float8_e4m3fn")
    row = core.bench_linear(shape, 1, "cpu", core.Timer("cpu", 1), "fp8_weight_only")
    base, ours = row["results"]
    assert "upcast" in base["label"] and base["rel_l2"] < TOL["float32"], base
    assert ours["error"] is None and ours["rel_l2"] <= row["max_rel_l2"], ours


def test_chart_keeps_the_largest_shares_when_there_are_many_shapes():
    many = synthetic_result()
    many["linear"] = [_row("linear", f"{i}x64->64", 1, float(i + 1), 0.5) for i in range(chart.MAX_CHART_ROWS + 6)]
    shown = chart._top_rows(many["linear"])
    assert len(shown) == chart.MAX_CHART_ROWS and shown[0]["label"] == "6x64->64"  # the 6 cheapest left out
    if chart.chart_backend() == "matplotlib":
        _is_drawn(chart.draw_chart(many))
