"""TritonAccelBenchmark in a real ComfyUI workflow on the CPU (smoke: tiny model, tiny timings).

UNETLoader (tiny Flux) + random conditioning + empty latent -> TritonAccelBenchmark -> SaveImage.
Checked: the node's contract in /object_info; the report lists the shapes the forward really
sent (Flux sends [B, H, L, 128] joint attention, here 2 heads x 24 tokens on ComfyUI 0.29 and
24 heads on 0.3.64, whose tiny Flux is 3072 wide); the IMAGE output is an image SaveImage
can write; the chart is shown on the node; the result is saved in the user folder; in auto
on the CPU only PyTorch is timed and the report says why; forced fp16 times our kernel through
the interpreter and its output agrees with ComfyUI's attention (rel. L2 < 1e-5: fp32 inputs,
summation order only).
"""
import json
import re

import pytest
from PIL import Image

from it_workflows import Workflow, family_spec

NODE = "TritonAccelBenchmark"
FAMILY = "flux"
FP32_REL_L2 = 1e-5


def _workflow(comfy, mode=None, repeats=1, save_image=True):
    spec = family_spec(FAMILY, comfy.models)
    wf = Workflow()
    model = wf.add("UNETLoader", unet_name=f"tiny_{FAMILY}.safetensors", weight_dtype="default")
    cond = wf.add("TritonAccelTestConditioning", seed=7, **spec["cond"])
    latent = wf.add("TritonAccelTestEmptyLatent", **spec["latent"])
    inputs = dict(model=wf.link(model), positive=wf.link(cond), latent=wf.link(latent), repeats=repeats)
    if mode is not None:
        inputs["settings"] = wf.link(wf.add("TritonAccelSettings", mode=mode))
    bench = wf.add(NODE, **inputs)
    save = (wf.add("SaveImage", images=wf.link(bench, 1), filename_prefix=f"it/benchmark_{mode or 'none'}")
            if save_image else None)
    return wf.nodes, bench, save


@pytest.fixture(scope="module")
def runs(comfy):
    """Both runs once per module: mode -> (history entry, benchmark node id, SaveImage node id or
    None, the result JSON the node saved). auto feeds its IMAGE to SaveImage; fp16 runs the node
    alone: ComfyUI 0.3.64 under --cache-none drops the UI output of a node once its dependents
    have run, so only a node without dependents keeps its text in the history there."""
    out = {}
    for mode, save_image in ((None, True), ("fp16", False)):
        prompt, bench, save = _workflow(comfy, mode, save_image=save_image)
        entry = comfy.run(prompt)
        saved = json.loads((comfy.base_dir / "user" / "triton_accel" / "benchmark_last.json").read_text())
        out[mode] = (entry, bench, save, saved)
    return out


def _report(run) -> str:
    entry, bench, _save, saved = run
    ui = entry["outputs"].get(bench)
    text = "\n".join(ui["text"]) if ui else saved["report"]
    assert text == saved["report"]
    return text


def test_benchmark_node_contract(comfy):
    info = comfy.object_info(NODE)[NODE]
    required, optional = info["input"]["required"], info["input"].get("optional", {})
    assert [required[k][0] for k in ("model", "positive", "latent", "repeats")] == ["MODEL", "CONDITIONING",
                                                                                     "LATENT", "INT"]
    assert optional["settings"][0] == "TRITON_ACCEL_SETTINGS"
    assert list(info["output"]) == ["STRING", "IMAGE"]
    assert info["output_node"] is True and info["category"] == "Triton Accel"


def test_report_lists_recorded_shapes(runs, comfy):
    text = _report(runs[None])
    print(f"\n[benchmark, auto, ComfyUI {comfy.version}]\n{text}")
    recorded = re.search(r"recorded: (\d+) attention shapes \((\d+) calls\), (\d+) Linear shapes \((\d+) calls\)", text)
    assert recorded, text
    n_attn_shapes, n_attn_calls, n_lin_shapes, n_lin_calls = map(int, recorded.groups())
    assert n_attn_shapes >= 1 and n_attn_calls >= 2 and n_lin_shapes >= 5 and n_lin_calls >= n_lin_shapes
    heads = comfy.models[FAMILY]["unet_config"]["num_heads"]
    assert re.search(rf"attention +B1 H{heads} (\d+)x\1 d128 float32", text), text  # Flux's joint attention
    assert "PyTorch Linear" in text
    assert re.search(r"^attention .* ComfyUI \w+", text, re.M), text  # ComfyUI's own attention is the baseline


def test_auto_on_cpu_times_pytorch_only_and_says_why(runs):
    text = _report(runs[None])
    assert "our attention was not timed: " in text, text
    assert "Triton FP16/BF16" not in text


def test_forced_fp16_times_our_kernel_in_the_interpreter(runs):
    entry, bench, _save, _saved = runs["fp16"]
    text = "\n".join(entry["outputs"][bench]["text"])  # the text shown on the node
    assert text == _report(runs["fp16"])
    print(f"\n[benchmark, fp16]\n{text}")
    assert "ran in the Triton interpreter" in text
    # table rows only (the report's header also names the path, with its accuracy bar)
    ours = [ln for ln in text.splitlines() if "Triton FP16/BF16" in ln and not ln.startswith("accuracy bar")]
    assert ours, text
    for line in ours:
        rel = float(line.split()[-1])
        assert rel < FP32_REL_L2, line


def _is_chart(path):
    with Image.open(path) as image:
        assert image.mode == "RGB" and image.width > 200 and image.height > 50, (path, image.size)
        assert image.getextrema() != ((255, 255), (255, 255), (255, 255)), f"blank chart {path}"


def test_image_output_goes_to_save_image(runs, comfy):
    entry, _bench, save, _saved = runs[None]
    _is_chart(comfy.output_file(entry["outputs"][save]["images"][0]))


def test_chart_is_shown_on_the_node(runs, comfy):
    entry, bench, _save, _saved = runs["fp16"]
    preview = entry["outputs"][bench].get("images") or []
    assert preview and preview[0]["type"] == "temp", entry["outputs"][bench]
    _is_chart(comfy.output_file(preview[0]))


def test_result_saved_for_the_status_panel(runs, comfy):
    folder = comfy.base_dir / "user" / "triton_accel"
    result = json.loads((folder / "benchmark_last.json").read_text())
    assert result == runs["fp16"][3]  # the last run's
    assert result["attention"] and result["linear"] and result["shapes"]["attention"]
    assert (folder / "benchmark_last.png").read_bytes().startswith(b"\x89PNG")
    status, payload = comfy.request("GET", "/triton_accel/benchmark.json")
    if status == 404 and not isinstance(payload, dict):
        pytest.skip("GET /triton_accel/benchmark.json is not registered (nodes/routes.py does not call "
                    "register_benchmark_routes yet)")
    assert status == 200 and payload["created"] == result["created"], (status, str(payload)[:300])
