"""The few short lines a Settings or patch node shows, each reason once:

    <model> on <device>: <attention decision>          (patch nodes with attention; the Settings
    Linear: <Linear decision>[; what the layers do]     node shows the decision alone)
    speed-up: <expected or measured>                   (auto's measurements or the last benchmark
                                                        on this device; "not measured yet")
    next: <one step>                                   (only where something is missing)
    installs: ...                                      (patch nodes)

The calls served / handed back are added under the text by the web extension after each run
(the node's label and kinds, `triton_accel_model` / `triton_accel_kinds`, match it to its counts
in /triton_accel/status). Nothing here raises: a node must still patch and pass the model on.
"""
from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path

import torch

from ..kernels.core import gpu_rules
from ..runtime import speed_choice
from ..runtime.decision_text import log_decision
from ..runtime.device_probe import probe, summary
from ..runtime.linear_patch import dynamic_vram_line
from ..runtime.linear_state import extension_plan_text, fallback_summary
from ..runtime.settings import AccelSettings, default_device
from . import benchmark_node

log = logging.getLogger("triton_accel")

MAX_RESULT_BYTES = 2 * 1024 * 1024  # as status.MAX_FILE_BYTES: a bigger file is not the benchmark's
NOT_MEASURED = "speed-up: not measured yet"
CPU_NEXT = "next: these nodes pass the model through; an NVIDIA or AMD GPU is needed"
MEASURE_NEXT = ("next: run a generation (auto times each new shape on its first call) or the Triton Accel "
                "Benchmark node to measure the speed-up")
INSTALL_NEXT = "next: run install.py in the pack's folder (python install.py) to repair Triton"
AMD_NEXT = "next: to try our kernels on this AMD GPU, set mode fp16 in Triton Accel Settings"


def _is_ours(decision) -> bool:
    return decision is not None and decision.path != gpu_rules.PATH_PYTORCH


def _unchanged(attention, linear) -> str:
    parts = " and ".join(p for p, d in (("attention", attention), ("Linear", linear)) if d is not None)
    return f"ComfyUI's {parts or 'attention and Linear'} run{'s' if ' and ' not in (parts or ' and ') else ''} unchanged"


def readable_time(iso: str | None) -> str:
    """'2025-12-07 18:04' in local time from an ISO timestamp; the text as it came otherwise."""
    if not iso:
        return ""
    try:
        moment = datetime.datetime.fromisoformat(str(iso))
        if moment.tzinfo is not None:
            moment = moment.astimezone()
        return moment.strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return str(iso)


def benchmark_speedup(device: torch.device, result: dict | None = None) -> str:
    """'1.42x attention + Linear in the last benchmark (2025-12-07 18:04)' when the Benchmark
    node's last result ran on `device` on a GPU; "" otherwise."""
    try:
        if result is None:
            path = Path(benchmark_node.last_result_path())
            if not path.is_file() or path.stat().st_size > MAX_RESULT_BYTES:
                return ""
            result = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(result, dict) or result.get("interpreter") or str(result.get("device")) != str(device):
            return ""
        speedup = ((result.get("summary") or {}).get("both") or {}).get("speedup")
        if not isinstance(speedup, (int, float)):
            return ""
        when = readable_time(result.get("created"))
        return f"{speedup:.2f}x attention + Linear in the last benchmark" + (f" ({when})" if when else "")
    except Exception as e:  # a courtesy line: never stop a node over it
        log.debug("Triton Accel: no benchmark speed-up for %s: %s: %s", device, type(e).__name__, e)
        return ""


def measured_speedup(devices: set[str], rows: list[dict] | None = None) -> str:
    """auto's attention measurements on `devices`, in one phrase; "" when it measured nothing there."""
    try:
        rows = speed_choice.speed_summary() if rows is None else rows
    except Exception as e:
        log.debug("Triton Accel: auto's measurements could not be read: %s: %s", type(e).__name__, e)
        return ""
    rows = [r for r in rows if str(r.get("device", "")) in devices]
    if not rows:
        return ""
    kept = [r["speedup_vs_original"] for r in rows
            if r.get("choice") != speed_choice.ORIGINAL and isinstance(r.get("speedup_vs_original"), (int, float))]
    shapes = f"{len(rows)} shape{'s' if len(rows) != 1 else ''}"
    if not kept:
        return f"attention 1.00x (auto kept ComfyUI's at the {shapes} it measured: not faster here)"
    low, high = min(kept), max(kept)
    spread = f"{low:.2f}x" if round(low, 2) == round(high, 2) else f"{low:.2f}-{high:.2f}x"
    return f"attention {spread} where auto kept ours ({len(kept)} of {shapes} measured)"


def speed_line(device: torch.device, attention=None, linear=None, devices: set[str] | None = None,
               rows: list[dict] | None = None, benchmark: dict | None = None) -> str:
    """The node's speed-up line for `device` (attention / linear: the decisions shown; devices:
    where the model ran, for auto's measurements; default: `device`)."""
    if device.type == "cpu":
        if _is_ours(attention) or _is_ours(linear):
            return "speed-up: none on a CPU (forced modes run in the Triton interpreter: a check, not a speed-up)"
        return f"speed-up: none on a CPU ({_unchanged(attention, linear)})"
    if attention is not None and linear is not None and not _is_ours(attention) and not _is_ours(linear):
        return f"speed-up: none expected on this GPU ({_unchanged(attention, linear)})"
    parts = [p for p in (measured_speedup(devices or {str(device)}, rows), benchmark_speedup(device, benchmark)) if p]
    return "speed-up: " + "; ".join(parts) if parts else NOT_MEASURED


def next_step(device: torch.device, attention=None, linear=None, speed: str = "") -> str | None:
    """One next step where something is missing; None when nothing is."""
    if device.type == "cpu":
        return CPU_NEXT
    codes = {getattr(d, "code", "") for d in (attention, linear) if d is not None}
    if codes & {gpu_rules.TRITON_MISSING, gpu_rules.TRITON_BROKEN}:
        return INSTALL_NEXT
    if not _is_ours(attention) and not _is_ours(linear):
        return AMD_NEXT if gpu_rules.AMD_NOT_VALIDATED in codes else None
    return MEASURE_NEXT if speed == NOT_MEASURED else None


def _target(model) -> torch.device:
    device = getattr(model, "load_device", None)
    return torch.device(device) if device is not None else default_device()


def settings_text(settings: AccelSettings, device: torch.device) -> str:
    """The Settings node: the attention and Linear decisions for `device`, the device, the
    speed-up and the next step."""
    attention = settings.decision_for(device)
    linear = settings.linear_decision_for(device)
    lines = [attention.reason, f"Linear: {linear.reason}"]
    linear_fp8 = settings.linear_decision_for(device, weight_is_fp8=True)
    if linear_fp8.path != linear.path:
        lines.append(f"Linear, FP8 checkpoint weights: {linear_fp8.reason}")
    lines += [line for line in (extension_plan_text(settings, device), fallback_summary()) if line]
    lines.append(f"[{summary(probe(device))}]")
    speed = speed_line(device, attention, linear)
    lines += [speed] + [line for line in (next_step(device, attention, linear, speed),) if line]
    log_decision(settings, device)
    return "\n".join(lines)


def linear_layers_text(state, ours: bool) -> str:
    """What the patched Linear layers do, after the Linear decision: patched (when one of our
    methods serves them) or passing every call to ComfyUI's Linear."""
    n = len(state.layers)
    if not ours:
        return f"its {n} layers pass every call to ComfyUI's Linear"
    skipped = sum(1 for layer in state.layers if layer.skip_reason)
    text = (f"{n} Linear layers patched ({skipped} skipped by name; calls under {state.min_tokens} tokens go to "
            "ComfyUI's Linear)")
    if state.fused_activations:
        text += f"; {state.fused_activations} GELUs run in our GEMM"
    return text


def patch_text(patched, label: str, settings: AccelSettings, *, attention: bool, linear: bool,
               installs: str) -> str:
    """A patch node's text (Attention, Linear or Patch: `attention` / `linear` say which parts)."""
    try:
        device = _target(patched)
        att = settings.decision_for(device) if attention else None
        lin = settings.linear_decision_for(device) if linear else None
        lines = []
        if att is not None:
            lines.append(f"{label} on {device}: {att.reason}")
        if lin is not None:
            state = getattr(patched, "triton_accel_linear", None)
            head = "Linear" if att is not None else f"{label} on {device}, Linear"
            layers = f"; {linear_layers_text(state, _is_ours(lin))}" if state is not None else ""
            lines.append(f"{head}: {lin.reason}{layers}")
            if _is_ours(lin):
                plan = extension_plan_text(settings, device)
                lines += [plan] if plan else []
            lines += [line for line in (dynamic_vram_line(state),) if line]
        speed = speed_line(device, att, lin, devices=speed_choice.model_devices(label) | {str(device)})
        lines += [speed] + [line for line in (next_step(device, att, lin, speed),) if line]
        log_decision(settings, device)
    except Exception as e:
        log.warning("Triton Accel: could not probe device for %s: %s: %s", label, type(e).__name__, e)
        lines = [f"{label}: could not probe device {str(getattr(patched, 'load_device', None))!r} "
                 f"({type(e).__name__}: {e}); each call is decided when it arrives"]
    return "\n".join(lines + [installs])
