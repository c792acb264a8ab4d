"""TritonAccelBenchmark: how much faster is this model on this GPU? Measured, with a chart.

One real forward (one sigma, KSampler's own path at cfg 1) runs on a clone of the model with a
pass-through recording attention override and forward pre-hooks on the diffusion model's
Linear layers; the hooks are removed afterwards and the clone dropped, so nothing is left on
the input model. Then every recorded shape is timed on the model's device with random data:
ComfyUI's own attention against each attention path the settings allow, torch's Linear against
our Linear method (runtime/benchmark_core.py), and the chart is drawn (runtime/benchmark_chart.py).
The last result is kept as JSON + PNG in ComfyUI's user folder for the status panel.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .. import kernels
from ..kernels.core import extensions
from ..kernels.core.gpu_rules import PATH_PYTORCH
from ..runtime.attention_patch import OVERRIDE_KEY, Unsupported, adapt_call, timed_on
from ..runtime.benchmark_chart import chart_backend, draw_chart, png_bytes
from ..runtime.benchmark_core import ShapeRecorder, attention_shape_of, report_text, run_benchmark, sdpa_attention
from ..runtime.linear_common import is_linear_module
from ..runtime.linear_state import extension_plan
from ..runtime.settings import SETTINGS_TYPE, AccelSettings

log = logging.getLogger("triton_accel.benchmark")

RESULT_NAME = "benchmark_last.json"
CHART_NAME = "benchmark_last.png"
MAX_RESULT_BYTES = 8 * 2**20  # what the routes will read back; a result is a few tens of kB


# ---- recording -----------------------------------------------------------------------------------

class RecordingOverride:
    """A pass-through optimized_attention_override that notes each call's shape."""

    def __init__(self, recorder: ShapeRecorder, previous=None):
        self.recorder = recorder
        self.previous = previous

    def __deepcopy__(self, memo):  # ModelPatcher.clone() deep-copies model_options: keep this one
        return self

    def __call__(self, func, *args, **kwargs):
        try:
            call = adapt_call(args, kwargs)
            self.recorder.add_attention(attention_shape_of(call["q"], call["k"], call["v"], call["mask"]))
        except Unsupported as e:
            self.recorder.skipped[str(e)] += 1
        if self.previous is not None:
            return self.previous(func, *args, **kwargs)
        return func(*args, **kwargs)


def _diffusion_model(patcher) -> torch.nn.Module:
    inner = getattr(patcher, "model", None)
    module = getattr(inner, "diffusion_model", None)
    if not isinstance(module, torch.nn.Module):
        raise TypeError("the MODEL has no diffusion_model module (is it a diffusion model from a loader?)")
    return module


@contextlib.contextmanager
def recording(model):
    """(clone, recorder, timing): a clone of `model` whose attention calls and Linear inputs are
    recorded while the block runs; timing["forward_ms"] gets the first diffusion-model forward's
    wall time. The hooks come off the (shared) modules when the block ends, whatever happens."""
    recorder = ShapeRecorder()
    clone = model.clone()
    options = clone.model_options.setdefault("transformer_options", {})
    options[OVERRIDE_KEY] = RecordingOverride(recorder, previous=options.get(OVERRIDE_KEY))
    diffusion_model = _diffusion_model(clone)
    names = {m: name for name, m in diffusion_model.named_modules() if is_linear_module(m)}
    timing: dict = {}
    started: list = []

    def on_linear(module, args):
        if args and isinstance(args[0], torch.Tensor):
            recorder.add_linear(args[0], module, names.get(module, ""))

    def sync(x):
        if isinstance(x, torch.Tensor) and x.is_cuda:
            torch.cuda.synchronize(x.device)

    def before_forward(module, args):
        sync(args[0] if args else None)
        started.append(time.perf_counter())

    def after_forward(module, args, output):
        if len(started) == 1 and "forward_ms" not in timing:
            sync(output)
            timing["forward_ms"] = (time.perf_counter() - started[0]) * 1e3

    handles = [m.register_forward_pre_hook(on_linear) for m in names]
    handles.append(diffusion_model.register_forward_pre_hook(before_forward))
    handles.append(diffusion_model.register_forward_hook(after_forward))
    try:
        yield clone, recorder, timing
    finally:
        for handle in handles:
            handle.remove()


def record_forward(model, positive, latent: dict, seed: int = 0):
    """Run one sampling step (one model call at cfg 1) of `model` on a recording clone."""
    import comfy.sample

    with recording(model) as (clone, recorder, timing):
        latent_image = comfy.sample.fix_empty_latent_channels(clone, latent["samples"])
        noise = comfy.sample.prepare_noise(latent_image, seed, latent.get("batch_index"))
        comfy.sample.sample(clone, noise, 1, 1.0, "euler", "simple", positive, positive, latent_image,
                            denoise=1.0, disable_pbar=True, seed=seed)
        device = torch.device(clone.load_device)
    return recorder, timing.get("forward_ms"), device


# ---- what to time ------------------------------------------------------------------------------

def _comfy_attention():
    """ComfyUI's own attention (what an unpatched model runs) as f(q, k, v, mask) on [B, H, L, D]."""
    try:
        import comfy.ldm.modules.attention as comfy_attention

        fn = comfy_attention.optimized_attention
    except Exception:
        return sdpa_attention, "PyTorch SDPA"

    def run(q, k, v, mask):
        return fn(q, k, v, q.shape[1], mask=mask, skip_reshape=True, skip_output_reshape=True)
    return run, "ComfyUI " + getattr(fn, "__name__", "attention").replace("attention_", "")


def chosen_paths(settings: AccelSettings, device: torch.device, weight_is_fp8: bool) -> dict:
    """What the settings would run on `device`: {"attention_paths": [...], "attention_keeps_faster":
    auto's per-shape timing, "linear_method": a method or None, "notes": why anything is not timed}."""
    notes = []
    decision = settings.decision_for(device)
    paths = [] if decision.path == PATH_PYTORCH else list(decision.candidates)
    timed_extensions = []
    if settings.mode == "auto" and timed_on(device):
        # auto times other packs' attention next to ours there (attention_patch.AttentionOverride._auto_extensions).
        timed_extensions = [p for p in extensions.paths_by_priority(kernels.describe(device)) if p not in paths]
        paths += timed_extensions
    if not paths:
        notes.append(f"our attention was not timed: {decision.reason}")
    linear_decision = settings.linear_decision_for(device, weight_is_fp8)
    method = None if linear_decision.path == PATH_PYTORCH else linear_decision.path
    plan = extension_plan(settings, device, weight_is_fp8)
    linear_extensions = [p for p in (*plan[0], *plan[2]) if p != method] if plan is not None else []
    if method is None and not linear_extensions:
        notes.append(f"our Linear was not timed: {linear_decision.reason}")
    return {"attention_paths": paths, "attention_keeps_faster": bool(paths and (decision.measure or timed_extensions)),
            "linear_method": method, "linear_extensions": linear_extensions, "notes": notes}


# ---- the saved result --------------------------------------------------------------------------

def result_dir() -> Path:
    try:
        import folder_paths

        base = folder_paths.get_user_directory()
    except Exception:
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "triton_accel"


def last_result_path() -> Path:
    """The JSON of the last benchmark (its chart is beside it, benchmark_last.png)."""
    return result_dir() / RESULT_NAME


def last_chart_path() -> Path:
    return result_dir() / CHART_NAME


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save_result(result: dict, png: Optional[bytes]) -> None:
    try:
        _write_atomic(last_result_path(), json.dumps(result, indent=1).encode())
        if png is not None:
            _write_atomic(last_chart_path(), png)
        elif last_chart_path().exists():
            last_chart_path().unlink()  # an old chart must not stand for the new numbers
    except OSError:
        log.warning("Triton Accel benchmark: could not save the result in %s", result_dir(), exc_info=True)


def _read_bounded(path: Path) -> Optional[bytes]:
    try:
        if path.stat().st_size > MAX_RESULT_BYTES:
            return None
        return path.read_bytes()
    except OSError:
        return None


def load_last_result() -> Optional[dict]:
    """The last result as a dict (None: none yet, unreadable or not a result)."""
    raw = _read_bounded(last_result_path())
    try:
        data = json.loads(raw) if raw else None
    except ValueError:
        return None
    return data if isinstance(data, dict) and "attention" in data else None


def load_last_chart() -> Optional[bytes]:
    raw = _read_bounded(last_chart_path())
    return raw if raw and raw.startswith(b"\x89PNG") else None


def register_benchmark_routes(routes) -> None:
    """GET /triton_accel/benchmark.json and /triton_accel/benchmark.png on ComfyUI's route table
    (nodes/routes.py calls this). Fixed files only: nothing in the request is read."""
    from aiohttp import web

    @routes.get("/triton_accel/benchmark.json")
    async def benchmark_json(request):
        data = load_last_result()
        if data is None:
            return web.json_response({"error": "no benchmark result yet: run Triton Accel Benchmark"}, status=404)
        return web.json_response(data, headers={"Cache-Control": "no-store"})

    @routes.get("/triton_accel/benchmark.png")
    async def benchmark_png(request):
        png = load_last_chart()
        if png is None:
            return web.json_response({"error": "no benchmark chart yet: run Triton Accel Benchmark"}, status=404)
        return web.Response(body=png, content_type="image/png", headers={"Cache-Control": "no-store"})


# ---- the node ----------------------------------------------------------------------------------

def _image_tensor(image: Optional[np.ndarray]) -> torch.Tensor:
    """ComfyUI's IMAGE: [1, H, W, 3] float32 in 0..1 (a small grey image when nothing could be drawn)."""
    if image is None:
        image = np.full((64, 64, 3), 200, dtype=np.uint8)
    return torch.from_numpy(image.astype(np.float32) / 255.0).unsqueeze(0)


def _preview(png: Optional[bytes]) -> list:
    """The chart as a temp-folder image the node shows, as PreviewImage does."""
    if png is None:
        return []
    try:
        import folder_paths

        name = f"triton_accel_benchmark_{uuid.uuid4().hex[:12]}.png"
        _write_atomic(Path(folder_paths.get_temp_directory()) / name, png)
        return [{"filename": name, "subfolder": "", "type": "temp"}]
    except Exception:
        log.warning("Triton Accel benchmark: could not write the preview image", exc_info=True)
        return []


def benchmark(model, positive, latent: dict, settings: Optional[AccelSettings] = None, repeats: int = 20):
    """(report text, chart RGB array or None, result dict, PNG bytes or None)."""
    import comfy.model_management
    import comfy.utils

    settings = settings or AccelSettings("auto")
    bar = comfy.utils.ProgressBar(2)  # the recording forward, then one step per shape
    log.info("Triton Accel benchmark: recording one forward of the model")
    recorder, forward_ms, device = record_forward(model, positive, latent)
    attention = list(recorder.attention.most_common())
    linear = list(recorder.linear.most_common())
    weight_is_fp8 = any(s.weight_dtype.startswith("float8") for s, _ in linear)
    chosen = chosen_paths(settings, device, weight_is_fp8)
    chosen["notes"] += [f"{n} attention calls not recorded: {reason}" for reason, n in recorder.skipped.items()]
    bar.update_absolute(1, 1 + len(attention) + len(linear))
    baseline, baseline_label = _comfy_attention()

    def progress(done, total, what):
        bar.update_absolute(1 + done, 1 + total)
        comfy.model_management.throw_exception_if_processing_interrupted()  # Cancel works between shapes
    result = run_benchmark(attention, linear, device, **chosen, baseline=baseline, baseline_label=baseline_label,
                           repeats=repeats, progress=progress, source=type(getattr(model, "model", model)).__name__,
                           forward_ms=forward_ms)
    result["shapes"] = recorder.shapes()
    result["chart"] = chart_backend()
    text = report_text(result)
    result["report"] = text
    image = draw_chart(result)
    png = png_bytes(image) if image is not None else None
    save_result(result, png)
    log.info("Triton Accel benchmark:\n%s", text)
    return text, image, result, png


class TritonAccelBenchmark:
    CATEGORY = "Triton Accel"
    DESCRIPTION = ("Measures Triton Accel on your model and GPU: runs one step, records every attention and "
                   "Linear call shape, then times ComfyUI's attention and torch's Linear against the pack's "
                   "kernels at those shapes (with accuracy), draws a chart and predicts the speed-up per step.")
    RETURN_TYPES = ("STRING", "IMAGE")
    RETURN_NAMES = ("report", "chart")
    OUTPUT_TOOLTIPS = ("The measurements as text (also shown on the node).",
                       "A bar chart per recorded shape: ours vs PyTorch, speed-up and accuracy.")
    FUNCTION = "run"
    OUTPUT_NODE = True
    # No "sage" / "flash": those searches are for the Attention and Patch nodes.
    SEARCH_ALIASES = ["benchmark", "speed test", "speed", "chart", "attention", "triton", "fp8", "measure"]

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The diffusion model to measure (patched or not)."}),
                "positive": ("CONDITIONING", {"tooltip": "The conditioning KSampler would get: the text "
                                                         "length sets the cross-attention shapes."}),
                "latent": ("LATENT", {"tooltip": "The latent KSampler would get: its size sets the token "
                                                 "counts of every attention and Linear call."}),
                "repeats": ("INT", {"default": 20, "min": 1, "max": 1000,
                                    "tooltip": "Timed runs per shape and implementation (the median is shown)."}),
            },
            "optional": {
                "settings": (SETTINGS_TYPE, {"tooltip": "From Triton Accel Settings: which of our paths to time. "
                                                        "Not connected: auto."}),
            },
        }

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        # A measurement: run again on every queue. A fresh value rather than NaN: ComfyUI 0.3.x
        # looks the node's UI output up under the same key, and NaN never equals itself.
        return uuid.uuid4().hex

    def run(self, model, positive, latent, repeats: int = 20, settings: Optional[AccelSettings] = None):
        text, image, _result, png = benchmark(model, positive, latent, settings, repeats)
        return {"ui": {"text": [text], "images": _preview(png)}, "result": (text, _image_tensor(image))}
