"""What the pack is doing, as one JSON document: GET /triton_accel/status and the side panel.

Everything here is read-only and cheap: no kernel is compiled or launched (a device whose
self-check has not run yet is described from its properties and says so), files are read
from fixed places with a size limit, and nothing comes from the request.

Sections: `devices` (per GPU, auto's path with its reason and code, and every mode a node
asked for), `models` (per patched model, calls served / handed back per kind, with reasons),
`measurements` (auto's timings per shape class), `install` (install.py's last report, every
remaining fix as one line), `benchmark` (the Benchmark node's last result, when it exists).
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from .. import __version__ as PACK_VERSION
from .. import kernels
from ..kernels.core import extensions, gpu_rules
from ..runtime import call_stats, linear_choice, speed_choice
from ..runtime.device_probe import cached_facts, probe, summary
from ..runtime.settings import decisions_made, linear_decisions_made, user_facing
from ..runtime import step_graph
from . import benchmark_node, node_text

log = logging.getLogger("triton_accel")

STATUS_VERSION = 1
PACK_DIR = Path(__file__).resolve().parents[1]
INSTALL_REPORT_NAME = "install_report.json"  # written by install.py next to itself
MAX_FILE_BYTES = 2 * 1024 * 1024  # a report or cache bigger than this is not ours to parse
MAX_MEASUREMENTS = 200


def read_json_file(path: Path) -> tuple[object | None, str]:
    """(document, "") or (None, why): a missing, huge or broken file is a status, not an error."""
    try:
        size = path.stat().st_size
    except OSError:
        return None, "not written yet"
    if size > MAX_FILE_BYTES:
        return None, f"{path.name} is {size} bytes, over the {MAX_FILE_BYTES} read limit"
    try:
        return json.loads(path.read_text(encoding="utf-8")), ""
    except (OSError, ValueError) as e:
        return None, f"{path.name} could not be read: {type(e).__name__}"


def visible_devices() -> list[torch.device]:
    devices = []
    try:
        if torch.cuda.is_available():
            devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    except Exception as e:
        log.debug("Triton Accel: could not list the GPUs: %s", e)
    return devices or [torch.device("cpu")]


def _decision_dict(decision: gpu_rules.Decision, mode: str) -> dict:
    return {"mode": mode, "path": decision.path, "label": gpu_rules.PATH_LABEL.get(decision.path, decision.path),
            "reason": decision.reason, "code": decision.code, "candidates": list(decision.candidates),
            "measured": decision.measure, "overridden": decision.overridden}


def device_status(device: torch.device) -> dict:
    facts = cached_facts(device)
    selfcheck = "passed" if facts is not None and not facts.triton_error else None
    if facts is None:
        facts = probe(device, selfcheck_kernel=False)
        selfcheck = "not run yet (runs at the first Triton Accel node on this device)"
    elif facts.triton_error:
        selfcheck = f"failed: {facts.triton_error}"
    auto = user_facing(gpu_rules.select_path(facts, "auto"), "auto")
    entry = {"device": facts.device, "name": facts.name or facts.device, "summary": summary(facts),
             "selfcheck": selfcheck, "auto": _decision_dict(auto, "auto"),
             "in_use": [_decision_dict(d, mode) for (dev, mode), d in sorted(decisions_made().items())
                        if dev == facts.device]}
    select_linear = getattr(gpu_rules, "select_linear_method", None)
    if select_linear is not None:
        try:
            entry["linear_auto"] = _decision_dict(select_linear(facts, "auto"), "auto")
        except Exception as e:  # the Linear rules are young; the panel must still render
            entry["linear_auto"] = {"mode": "auto", "path": gpu_rules.PATH_PYTORCH, "reason": f"unknown: {e}"}
    return entry


# What each kind of count is, in the panel's words.
KIND_LABELS = {call_stats.KIND_ATTENTION: "attention", call_stats.KIND_LINEAR: "Linear",
               "norms": "fused norms", step_graph.KIND: "whole-step replay (CUDA graphs)"}
# Reasons recorded in the engine's terms, said plainly (the recorded text stays in `reason`).
PLAIN_REASONS = {
    step_graph.REASON_NOT_CUDA: "the model runs on the CPU: whole-step replay needs an NVIDIA GPU",
    step_graph.REASON_OFF: "turned off (environment variable TRITON_ACCEL_STEP_GRAPH)",
    step_graph.REASON_WARMING: "first steps run as usual while the replay warms up",
    step_graph.REASON_RECORDING: "the step that records the replay runs as usual",
    step_graph.REASON_AUTOGRAD: "autograd is recording (training or a gradient-based node)",
    step_graph.REASON_MULTIGPU: "the model runs on several GPUs (MultiGPU threads)",
}


def _counts_for_people(counts: dict, kind: str = "") -> dict:
    reasons = sorted(counts["reasons"].items(), key=lambda kv: -kv[1])
    return {"served": counts["served"], "handed_back": counts["handed_back"], "paths": counts["paths"],
            "kind_label": KIND_LABELS.get(kind, kind),
            "reasons": [{"reason": r, "plain": PLAIN_REASONS.get(r, r), "calls": n} for r, n in reasons]}


def _speed_lines_of(label: str, rows: list[dict] | None) -> list[str]:
    """auto's measured speed-up on the devices this model ran on (its patch node's text)."""
    try:
        devices = speed_choice.model_devices(label)
        lines = speed_choice.speed_lines(devices, rows=rows) if devices else []
        return lines + linear_choice.model_lines(label)
    except Exception as e:  # the counts must still show
        log.debug("Triton Accel: speed lines for %s: %s: %s", label, type(e).__name__, e)
        return []


def model_speed_line(label: str, speed_rows: list[dict], devices: list[torch.device] | None = None) -> str:
    """One line for the model's node and panel entry: auto's measured speed-up on the devices the
    model ran on, or the last benchmark's; none on a CPU; "not measured yet" otherwise."""
    try:
        devices = devices if devices is not None else visible_devices()
        ran_on = speed_choice.model_devices(label)
        gpus = [d for d in devices if d.type != "cpu"]
        if not gpus:
            return "speed-up: none on a CPU (ComfyUI's attention and Linear run unchanged)"
        where = [d for d in gpus if str(d) in ran_on] or gpus[:1]
        return node_text.speed_line(where[0], devices=ran_on or {str(where[0])}, rows=speed_rows)
    except Exception as e:  # the counts must still show
        log.debug("Triton Accel: speed line for %s: %s: %s", label, type(e).__name__, e)
        return node_text.NOT_MEASURED


def models_status(snapshot: dict | None = None, speed_rows: list[dict] | None = None) -> list[dict]:
    """Per loaded model (one label each): its call counts, `speed_line` (one line: measured or
    expected speed-up) and `speed` (auto's measured speed-up per shape class)."""
    snapshot = snapshot or call_stats.snapshot()
    if speed_rows is None:
        speed_rows = measurements().get("rows", [])
    devices = visible_devices()
    return [{"label": label, "model_class": m["model_class"],
             "kinds": {kind: _counts_for_people(c, kind) for kind, c in m["kinds"].items()},
             "speed_line": model_speed_line(label, speed_rows, devices),
             "speed": _speed_lines_of(label, speed_rows)}
            for label, m in snapshot["models"].items()]


def _speed_cache_entries() -> list[dict]:
    """auto's measurements read from its cache file (when speed_summary() is not there)."""
    document, _ = read_json_file(speed_choice.default_cache_file())
    entries = document.get("entries") if isinstance(document, dict) else None
    if not isinstance(entries, dict):
        return []
    out = []
    for key, entry in list(entries.items())[:MAX_MEASUREMENTS]:
        if not (isinstance(entry, dict) and isinstance(entry.get("timings"), dict)):
            continue
        parts = str(key).split("|")
        timings = {name: t.get("ms") for name, t in entry["timings"].items() if isinstance(t, dict)}
        choice = entry.get("choice")
        ours, theirs = timings.get(choice), timings.get("original")
        out.append({"gpu": parts[0], "arch": parts[1] if len(parts) > 1 else "", "shape_class": parts[-1],
                    "choice": choice, "timings_ms": timings,
                    "speedup_vs_original": round(theirs / ours, 3) if ours and theirs else None})
    return out


def linear_measurements() -> list[dict]:
    """The Linear call classes auto timed, ours against ComfyUI's (linear_choice)."""
    try:
        return linear_choice.measured_rows(MAX_MEASUREMENTS)
    except Exception as e:  # the panel must still render
        log.warning("Triton Accel: Linear measurements could not be read: %s: %s", type(e).__name__, e)
        return []


def measurements() -> dict:
    try:
        summary_fn = getattr(speed_choice, "speed_summary", None)
        rows = summary_fn() if summary_fn is not None else _speed_cache_entries()
    except Exception as e:
        log.warning("Triton Accel: auto's measurements could not be read: %s: %s", type(e).__name__, e)
        return {"rows": [], "error": f"{type(e).__name__}: {e}"}
    return {"rows": list(rows)[:MAX_MEASUREMENTS], "original_label": "ComfyUI's attention"}


def measurements_note(device_entries: list[dict], rows: list) -> str:
    """What the measurements section says, true on every device: auto times shapes only on GPUs
    where it runs our kernels (attention_patch.timed_on)."""
    if rows:
        return ""
    timing = [d for d in device_entries if d.get("device") != "cpu" and (d.get("auto") or {}).get("measured")]
    if timing:
        return "None yet: auto times each new shape once, on its first call, on " + \
            ", ".join(d["device"] for d in timing) + "."
    if all(d.get("device") == "cpu" for d in device_entries):
        return "Nothing to measure on a CPU: auto leaves ComfyUI's attention and Linear in place."
    return "auto times nothing on this machine's GPUs: it keeps ComfyUI's attention there (see Devices)."


def header_lines(device_entries: list[dict]) -> list[str]:
    """The panel's first lines: what auto does on each device, in one line each."""
    lines = []
    for d in device_entries:
        auto, linear = d.get("auto") or {}, d.get("linear_auto") or {}
        attention = ("ComfyUI's attention" if auto.get("path") in (None, gpu_rules.PATH_PYTORCH)
                     else f"attention {auto.get('label', auto.get('path'))}")
        linear_words = ("ComfyUI's Linear" if linear.get("path") in (None, gpu_rules.PATH_PYTORCH)
                        else f"Linear {linear.get('label', linear.get('path'))}")
        where = d.get("name") if d.get("name") not in (None, "", d.get("device")) else ""
        lines.append(f"{d.get('device')}{f' ({where})' if where else ''} in auto: {attention}, {linear_words}")
    if all(d.get("device") == "cpu" for d in device_entries):
        lines.append("No GPU here: the nodes pass the model through; an NVIDIA or AMD GPU is needed.")
    return lines


def install_health(report_path: Path | None = None) -> dict:
    path = report_path or PACK_DIR / INSTALL_REPORT_NAME
    document, why = read_json_file(path)
    if not isinstance(document, dict):
        return {"found": False, "why": why or "not an install.py report",
                "hint": "run install.py from the pack's folder (python install.py) to check this machine"}
    plan = document.get("plan") if isinstance(document.get("plan"), dict) else {}
    verdict = document.get("verdict") if isinstance(document.get("verdict"), dict) else {}
    fixes = []
    for finding in plan.get("findings") or []:
        if not isinstance(finding, dict) or finding.get("severity") not in ("warning", "error"):
            continue
        line = f"[{str(finding.get('severity')).upper()}] {finding.get('message', '')}"
        fixes.append(line + (f" Fix: {finding['fix']}" if finding.get("fix") else ""))
    try:
        written = time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime))
    except OSError:
        written = None
    return {"found": True, "report_version": document.get("version"), "written": written,
            "verdict": verdict.get("message"), "path": verdict.get("path"),
            "triton_works": verdict.get("triton_works"), "fixes": fixes}


def benchmark_status() -> dict:
    """The Benchmark node's last result, if it has written one."""
    try:
        path = Path(benchmark_node.last_result_path())
    except Exception as e:
        return {"found": False, "why": f"{type(e).__name__}: {e}"}
    document, why = read_json_file(path)
    if document is None:
        return {"found": False, "why": why if why != "not written yet" else "run the Triton Accel Benchmark node"}
    chart = Path(benchmark_node.last_chart_path())
    return {"found": True, "result": document,
            "chart_url": "/triton_accel/benchmark.png" if chart.exists() else None}


def extensions_status(devices: list[torch.device], speed_rows: list[dict]) -> list[dict]:
    """Other packs' attention and Linear implementations (kernels/core/extensions.py): what
    list_extensions() gives (with `kind`), plus per device whether it may run there and whether a
    node forces it there; attention: at how many of auto's measured shape classes it was timed
    and kept; Linear: whether auto considers it there (linear_state.extension_plan)."""
    in_use = decisions_made()
    linear_in_use = linear_decisions_made()
    out = []
    for entry in extensions.list_extensions():
        per_device = []
        for device in devices:
            where = str(device)
            refusal = extensions.device_refusal(entry["path"], kernels.describe(device))
            if entry["kind"] == extensions.KIND_LINEAR:
                forced = any(dev == where and d.path == entry["path"] for (dev, _mode), d in linear_in_use.items())
                # auto considers Linear extensions where auto runs one of our methods (NVIDIA GPUs).
                considers = refusal is None and _linear_auto_runs_ours(device)
                auto_used = considers and any(dev == where and mode == "auto" for dev, mode in linear_in_use)
                per_device.append({"device": where, "eligible": refusal is None, "refusal": refusal,
                                   "forced": forced, "auto_considers_here": considers,
                                   "chosen": forced or auto_used})
                continue
            rows = [r for r in speed_rows
                    if r.get("device") == where and entry["path"] in (r.get("timings_ms") or {})]
            forced = any(dev == where and d.path == entry["path"] for (dev, _mode), d in in_use.items())
            kept = sum(1 for r in rows if r.get("choice") == entry["path"])
            # auto times (and so may choose an extension) on GPUs only: attention_patch.timed_on.
            per_device.append({"device": where, "eligible": refusal is None, "refusal": refusal, "forced": forced,
                               "auto_times_here": device.type == "cuda", "measured_shape_classes": len(rows),
                               "kept_shape_classes": kept, "chosen": forced or kept > 0})
        out.append({**entry, "devices": per_device})
    return out


def _linear_auto_runs_ours(device: torch.device) -> bool:
    try:
        return gpu_rules.select_linear_method(probe(device, selfcheck_kernel=False), "auto").path != \
            gpu_rules.PATH_PYTORCH
    except Exception as e:  # a broken driver: the panel says "not considered" rather than failing
        log.debug("Triton Accel: no Linear decision for %s: %s", device, e)
        return False


def status_payload() -> dict:
    snapshot = call_stats.snapshot()
    measured = measurements()
    devices = visible_devices()
    device_entries = [device_status(d) for d in devices]
    measured["note"] = measurements_note(device_entries, measured.get("rows", []))
    return {
        "version": STATUS_VERSION, "pack_version": PACK_VERSION,
        "triton_version": kernels.triton_version(), "torch_version": torch.__version__,
        "handed_back_label": call_stats.HANDED_BACK_LABEL,
        "header": header_lines(device_entries),
        "devices": device_entries,
        "models": models_status(snapshot, measured.get("rows", [])),
        "totals": {kind: _counts_for_people(c, kind) for kind, c in snapshot["kinds"].items()},
        "measurements": measured,
        "linear_measurements": linear_measurements(),
        "install": install_health(),
        "benchmark": benchmark_status(),
        "extensions": extensions_status(devices, measured.get("rows", [])),
        "extension_api_version": extensions.API_VERSION,
    }


def startup_line() -> str:
    """One line for the log when the pack loads: version, Triton, auto's path per GPU."""
    parts = []
    for device in visible_devices():
        facts = probe(device, selfcheck_kernel=False)
        decision = gpu_rules.select_path(facts, "auto")
        where = facts.device if facts.name in ("", facts.device) else f"{facts.device} {facts.name}"
        if facts.vendor == "nvidia" and facts.capability:
            where += f" ({gpu_rules.sm(facts.capability)})"
        parts.append(f"{where}: {gpu_rules.expected_paths(decision)}" + (f" ({decision.code})" if decision.code else ""))
    triton = kernels.triton_version()
    return (f"Triton Accel {PACK_VERSION} loaded (Triton {triton or 'not installed'}); attention in auto: "
            + "; ".join(parts))


def log_startup() -> None:
    try:
        log.info("%s", startup_line())
    except Exception as e:  # the load line is a courtesy: never stop the pack over it
        log.warning("Triton Accel: loaded, but the device summary failed: %s: %s", type(e).__name__, e)


__all__ = [
    "INSTALL_REPORT_NAME",
    "STATUS_VERSION",
    "benchmark_status",
    "device_status",
    "extensions_status",
    "install_health",
    "log_startup",
    "measurements",
    "models_status",
    "read_json_file",
    "startup_line",
    "status_payload",
]
