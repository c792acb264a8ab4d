"""Issue 4: TritonAccelSettings + TritonAccelPatchAttention in a real ComfyUI, per model family.

The server runs on the CPU with TRITON_INTERPRET=1: mode "fp16" forces our Triton kernel
through the interpreter, "auto" on the CPU must fall back to ComfyUI's own attention.

Also: ComfyUI's TorchCompileModel after the patch serves the same calls from the compiled graph.

Contract checked here (from the lead):
- TritonAccelSettings: mode combo ["auto", "fp8", "int8", "fp16", "off"], optional device string
  (default "auto"); output TRITON_ACCEL_SETTINGS.
- TritonAccelPatchAttention: model (MODEL), optional settings (TRITON_ACCEL_SETTINGS); output MODEL.
- GET /triton_accel/stats -> {"calls": {"triton": n, "original": m, ...}, "reasons": {...}};
  POST /triton_accel/stats/reset zeroes them.

Tolerance for a patched run against the unpatched one (same seed, same tiny model, fp32 on
the CPU, 2 Euler steps): relative L2 of the sampled latent < LATENT_TOL[family]: 1e-4 for
Flux, Wan and HunyuanVideo, 1e-6 for SD1.5.
Why: on the CPU ComfyUI runs these models in fp32 and the pack hands fp32 q/k/v to our
kernel as they are, which the interpreter computes in fp32 (numpy); the only difference to
ComfyUI's attention_sub_quad is summation order, measured 3.2e-8 (SD1.5) .. 1.8e-7 (Flux, Wan,
HunyuanVideo) on ComfyUI 0.29.0 and 0.3.64. How much the latent reacts to attention differs
per family: scaling every attention output by 1.01 moves it by 1.1e-3..1.3e-3 (Flux),
2.4e-3 (Wan), 1.5e-3 (HunyuanVideo) but only 4.8e-5 for the tiny SD1.5 UNet (its resblocks
dominate, and eps-prediction at sigma 14.6 keeps most of the noise). So a bound of 1e-3 would
let a 1% attention error pass; the bounds above catch ~0.1% (SD1.5: ~0.02%) while keeping
>30x margin over the fp32 summation-order noise.
test_tolerance_detects_wrong_attention keeps this honest (a 1% error, and ignoring
HunyuanVideo's padding mask, must move the latent by > 10x the bound). If the pack ever
computes fp32 inputs in fp16/bf16, expect ~1e-3 (fp16 rounding, 2^-11 relative) and revisit.
"""
import json

import pytest

from it_workflows import (FAMILIES, fused_norms, patch, probe_reports, probe_workflow, read_latent, rel_l2,
                          sampling_workflow, spy)

LATENT_TOL = {"sd15": 1e-6, "flux": 1e-4, "wan21": 1e-4, "hunyuan_video": 1e-4}
EXACT_TOL = 1e-6  # runs that must not change the numerics at all (fallback, pass-through spy)
FAMILY_IDS = list(FAMILIES)
# Family for the tests that only need some model: Wan 2.1 is tiny in every ComfyUI version
# (0.3.x reads Flux as 3072 wide, 533M parameters).
ANY = "wan21"


def _counts(stats: dict) -> dict:
    if "_unavailable" in stats:
        pytest.fail(f"this pack's stats route is unavailable: {stats['_unavailable']}")
    return stats.get("calls") or {}


def _calls(stats: dict, key: str) -> int:
    return int(_counts(stats).get(key, 0))


def _total(stats: dict) -> int:
    return sum(int(v) for v in _counts(stats).values())


class Runs:
    """Runs a workflow with counters reset first; caches the unpatched references."""

    def __init__(self, comfy):
        self.comfy = comfy
        self._refs = {}

    def _reset(self):
        try:
            self.comfy.reset_stats()
        except RuntimeError:
            pass  # reported by _stats
        self.comfy.reset_spy()

    def _stats(self):
        try:
            return self.comfy.stats()
        except RuntimeError as e:
            return {"_unavailable": str(e)}

    def sample(self, family, chain=(), probes=(), tag="run"):
        prompt, save, probe_nodes = sampling_workflow(family, model_chain=chain, probe_cases=probes, tag=tag,
                                                      models=self.comfy.models)
        self._reset()
        entry = self.comfy.run(prompt)
        return dict(latent=read_latent(self.comfy, entry, save), stats=self._stats(),
                    spy=self.comfy.spy(), probes=probe_reports(entry, probe_nodes))

    def probe(self, family, chain=(), cases=("fp32_full_precision",)):
        prompt, probe_nodes = probe_workflow(family, model_chain=chain, probe_cases=cases)
        self._reset()
        entry = self.comfy.run(prompt)
        return dict(stats=self._stats(), spy=self.comfy.spy(), probes=probe_reports(entry, probe_nodes))

    def reference(self, family):
        if family not in self._refs:
            self._refs[family] = self.sample(family, tag="ref")
        return self._refs[family]


@pytest.fixture(scope="module")
def runs(comfy):
    return Runs(comfy)


def _combo_options(spec):
    """Combo options from /object_info in either format (classic [[...], {...}] or V3 ["COMBO", {"options": [...]}])."""
    if isinstance(spec[0], list):
        return spec[0]
    assert spec[0] == "COMBO", spec
    return spec[1]["options"]


def _record(comfy, name, data):
    path = comfy.report_dir / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=True))
    return path


# ---- node contract ----------------------------------------------------------------------------

def test_settings_node_contract(comfy):
    info = comfy.object_info("TritonAccelSettings")["TritonAccelSettings"]
    required = info["input"].get("required", {})
    optional = info["input"].get("optional", {})
    assert "mode" in required, info["input"]
    assert _combo_options(required["mode"]) == ["auto", "fp8", "int8", "fp16", "off"]
    labels = required["mode"][-1].get("triton_accel_labels", {})
    assert set(labels) == {"auto", "fp8", "int8", "fp16", "off"}, labels
    assert "BF16" in labels["fp16"], labels  # the name alone hides that fp16 also means BF16
    # issue #13: device is a dropdown of the detected devices (plus auto), not free text where a
    # typo printed a traceback; this CPU-only server detects only the CPU
    assert "device" in optional, f"device should be an optional input: {info['input']}"
    device_options = _combo_options(optional["device"])
    assert device_options[0] == "auto" and "cpu" in device_options, device_options
    assert optional["device"][-1].get("default") == "auto"
    assert "linear" in optional, f"linear should be an optional input: {info['input']}"
    assert _combo_options(optional["linear"]) == ["auto", "fp8", "int8", "fp8_weight_only", "off"]
    assert optional["linear"][-1].get("default") == "auto"
    assert list(info["output"]) == ["TRITON_ACCEL_SETTINGS"]
    assert info["category"] == "Triton Accel"


def test_patch_node_contract(comfy):
    info = comfy.object_info("TritonAccelPatchAttention")["TritonAccelPatchAttention"]
    required = info["input"].get("required", {})
    optional = info["input"].get("optional", {})
    assert required.get("model", [None])[0] == "MODEL", info["input"]
    assert optional.get("settings", [None])[0] == "TRITON_ACCEL_SETTINGS", info["input"]
    assert list(info["output"]) == ["MODEL"]
    assert info["category"] == "Triton Accel"


def test_stats_routes(comfy):
    comfy.reset_stats()
    stats = comfy.stats()
    assert isinstance(stats.get("calls"), dict) and isinstance(stats.get("reasons"), dict), stats
    assert _total(stats) == 0, stats


# ---- per family -------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILY_IDS)
def test_unpatched_model_is_untouched(runs, family):
    ref = runs.reference(family)
    assert _total(ref["stats"]) == 0, f"counters moved for a model that was never patched: {ref['stats']}"
    assert ref["spy"] == {}


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_override_signatures_recorded(runs, comfy, family):
    """A pass-through foreign override sees every attention call: record what ComfyUI sends."""
    ref = runs.reference(family)
    run = runs.sample(family, chain=[spy(f"spy_{family}")], tag="spy")
    seen = run["spy"].get(f"spy_{family}", {})
    path = _record(comfy, f"override_calls_{comfy.version}_{family}", seen)
    print(f"\n[{family}] ComfyUI {comfy.version}: {seen.get('count', 0)} attention calls ({path})")
    for sig, n in sorted(seen.get("signatures", {}).items()):
        print(f"  {n:3d} x override(func, {sig[1:]}")
    assert seen.get("count", 0) > 0, run["spy"]
    assert rel_l2(run["latent"], ref["latent"]) < EXACT_TOL


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_forced_fp16_runs_triton_and_matches(runs, family):
    ref = runs.reference(family)
    run = runs.sample(family, chain=[patch("fp16")], tag="fp16")
    stats = run["stats"]
    err = rel_l2(run["latent"], ref["latent"])
    print(f"\n[{family}] fp16 forced: rel L2 vs unpatched = {err:.3e}; stats = {json.dumps(stats)}")
    assert _calls(stats, "triton") > 0, f"our Triton kernel never ran: {stats}"
    assert err < LATENT_TOL[family], f"sampled latent differs from the unpatched run: rel L2 {err:.3e} (stats {stats})"


# Compiled against eager, both ours: inductor re-orders ComfyUI's own fp32 arithmetic around the
# attention (measured up to ~1e-6 on the tiny models); a wrong attention moves it by > 1e-3.
COMPILED_TOL = 1e-4


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_torch_compile_model_after_the_patch_serves_every_call(runs, family):
    """ComfyUI's TorchCompileModel (inductor) after our patch: every attention call the eager
    patch served is served from the compiled graph too (one patched_attention op each; masks,
    cross-attention, skip_reshape as each family sends them), with the same latent."""
    # Eager with the fused norms off: their first-call check runs one Wan block twice (ComfyUI's
    # forward and ours), which the compiled graph, tracing ComfyUI's forward, does not.
    eager = runs.sample(family, chain=[fused_norms(patch("fp16"), "off")], tag="fp16_eager")
    run = runs.sample(family, chain=[patch("fp16"), ("TorchCompileModel", {"backend": "inductor"})],
                      tag="fp16_compiled")
    err = rel_l2(run["latent"], eager["latent"])
    print(f"\n[{family}] TorchCompileModel after the fp16 patch: rel L2 vs uncompiled {err:.3e}; "
          f"calls {_counts(run['stats'])} (uncompiled {_counts(eager['stats'])})")
    assert _calls(run["stats"], "triton") == _calls(eager["stats"], "triton") > 0, (run["stats"], eager["stats"])
    assert err < COMPILED_TOL, err


@pytest.mark.parametrize("family,perturb,drop_mask", [
    ("sd15", 0.01, False), ("flux", 0.01, False), ("wan21", 0.01, False), ("hunyuan_video", 0.01, False),
    ("hunyuan_video", 0.0, True)])
def test_tolerance_detects_wrong_attention(runs, family, perturb, drop_mask):
    """The latent comparison is sensitive enough: a 1% attention error, or a dropped mask,
    moves the latent by more than LATENT_TOL (so a passing fp16 test means something)."""
    ref = runs.reference(family)
    run = runs.sample(family, chain=[spy(f"wrong_{family}", perturb, drop_mask)], tag="wrong")
    err = rel_l2(run["latent"], ref["latent"])
    print(f"\n[{family}] perturb={perturb} drop_mask={drop_mask}: rel L2 {err:.3e}")
    assert err > 10 * LATENT_TOL[family], f"a deliberately wrong attention moved the latent by only {err:.3e}"


@pytest.mark.parametrize("family", ["wan21", "sd15"])
def test_auto_on_cpu_falls_back(runs, family):
    ref = runs.reference(family)
    run = runs.sample(family, chain=[patch("auto")], tag="auto")
    stats = run["stats"]
    assert _calls(stats, "triton") == 0, stats
    assert rel_l2(run["latent"], ref["latent"]) < EXACT_TOL


def test_mode_off_is_numerically_unchanged(runs):
    ref = runs.reference(ANY)
    run = runs.sample(ANY, chain=[patch("off")], tag="off")
    assert _calls(run["stats"], "triton") == 0, run["stats"]
    assert rel_l2(run["latent"], ref["latent"]) < EXACT_TOL


def test_patch_without_settings_input(runs):
    """settings is optional: the node must work with nothing connected (auto: fallback on the CPU)."""
    ref = runs.reference(ANY)
    run = runs.sample(ANY, chain=[patch(None)], tag="nosettings")
    assert _calls(run["stats"], "triton") == 0, run["stats"]
    assert rel_l2(run["latent"], ref["latent"]) < EXACT_TOL


# ---- calls the pack must hand back ------------------------------------------------------------

@pytest.mark.parametrize("case", ["fp32_full_precision", "head_dim_512"])
def test_unsupported_call_reaches_original(runs, case):
    """A call through ComfyUI's optimized_attention/wrap_attn with the patched model's
    transformer_options that our kernel must not serve goes to the original function."""
    run = runs.probe(ANY, chain=[patch("fp16")], cases=(case,))
    stats, report = run["stats"], run["probes"][0]
    print(f"\n[{case}] probe {report}; stats {json.dumps(stats)}")
    assert _calls(stats, "original") > 0, f"the original function was not called: {stats}"
    assert _calls(stats, "triton") == 0, f"our kernel served a call it must refuse: {stats}"
    assert report["rel_l2"] < 1e-5, report  # ComfyUI's own fp32 attention
    assert report["out_shape"] == report["shape"]


@pytest.mark.parametrize("case,tol", [("fp32_plain", 1e-5), ("fp16_plain", 2e-3), ("bf16_plain", 1e-2)])
def test_supported_probe_call_uses_triton(runs, case, tol):
    """The same direct path with an ordinary call is served by our kernel (the probe is sound),
    in fp32 and in the half types real GPUs run (error against an fp64 reference)."""
    run = runs.probe(ANY, chain=[patch("fp16")], cases=(case,))
    stats, report = run["stats"], run["probes"][0]
    print(f"\n[{case}] probe {report}; stats {json.dumps(stats)}")
    assert _calls(stats, "triton") > 0, stats
    assert report["rel_l2"] < tol, report
    assert report["out_shape"] == report["shape"]


def test_probe_on_unpatched_model_moves_no_counter(runs):
    run = runs.probe(ANY, chain=(), cases=("fp32_full_precision", "fp32_plain"))
    assert _total(run["stats"]) == 0, run["stats"]
    assert all(r["rel_l2"] < 1e-5 for r in run["probes"]), run["probes"]


# ---- another override already installed --------------------------------------------------------

def test_existing_override_is_wrapped(runs):
    """A foreign override installed first keeps receiving the calls ours hands back."""
    ref = runs.reference(ANY)
    run = runs.sample(ANY, chain=[spy("foreign"), patch("fp16")], probes=("fp32_full_precision",),
                      tag="wrapped")
    stats, foreign = run["stats"], run["spy"].get("foreign", {})
    print(f"\n[wrapped] stats {json.dumps(stats)}; foreign override {json.dumps(foreign)}")
    assert _calls(stats, "triton") > 0, stats
    assert foreign.get("count", 0) >= 1, f"the foreign override never ran for the handed-back call: {run['spy']}"
    assert run["probes"][0]["rel_l2"] < 1e-5, run["probes"]
    assert rel_l2(run["latent"], ref["latent"]) < LATENT_TOL[ANY]


def test_existing_override_gets_everything_when_off(runs):
    solo = runs.sample(ANY, chain=[spy("foreign")], tag="foreign_solo")
    run = runs.sample(ANY, chain=[spy("foreign"), patch("off")], tag="foreign_off")
    n_solo = solo["spy"].get("foreign", {}).get("count", 0)
    n_off = run["spy"].get("foreign", {}).get("count", 0)
    assert n_solo > 0
    assert n_off == n_solo, f"foreign override saw {n_off} calls under mode off, {n_solo} alone ({run['stats']})"
    assert _calls(run["stats"], "triton") == 0, run["stats"]
    assert rel_l2(run["latent"], solo["latent"]) < EXACT_TOL


# ---- the settings node on its own ---------------------------------------------------------------

@pytest.mark.parametrize("mode,device,expect", [
    ("fp16", "auto", "fp16 forced on the CPU"),
    ("fp16", "cpu", "fp16 forced on the CPU"),
    ("auto", "auto", "PyTorch fallback"),
    ("off", "auto", "off"),
])
def test_settings_node_shows_its_decision(comfy, mode, device, expect):
    """TritonAccelSettings is an output node: it runs alone and shows the decision (ui text)."""
    entry = comfy.run({"1": {"class_type": "TritonAccelSettings", "inputs": {"mode": mode, "device": device}}})
    text = " ".join(entry["outputs"]["1"]["text"])
    assert expect in text, text


def test_settings_node_bad_device_string_keeps_graph_running(comfy):
    """A mistyped device must not break the graph (the node says it could not probe)."""
    entry = comfy.run({"1": {"class_type": "TritonAccelSettings", "inputs": {"mode": "auto", "device": "gpu0"}}})
    text = " ".join(entry["outputs"]["1"]["text"])
    assert "gpu0" in text, text
