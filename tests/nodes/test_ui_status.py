"""nodes/status.py and the request-body bound of nodes/routes.py, without ComfyUI.

The status document is built from fixed places only (install.py's report beside the pack,
auto's cache file, the benchmark node's result); these tests give it such files, broken ones
and huge ones, and check that nothing is launched on a device to answer.
"""
import asyncio
import json

import pytest
import torch
from triton_accel.kernels.core import selfcheck
from triton_accel.runtime import call_stats, speed_choice
from triton_accel.nodes import routes, status


def _report(findings, verdict="Triton works here: Triton FP16/BF16 attention."):
    return {"version": 2, "dry_run": False, "facts": {}, "results": None, "self_check": None, "seconds": 1.0,
            "plan": {"findings": findings, "actions": [], "path": "triton_fp16", "blockers": []},
            "verdict": {"path": "triton_fp16", "triton_works": True, "message": verdict}}


def test_install_health_lists_each_remaining_fix_on_one_line(tmp_path):
    path = tmp_path / "install_report.json"
    path.write_text(json.dumps(_report([
        {"code": "VCRT_OLD", "severity": "error", "message": "The VC++ runtime is too old (14.29).",
         "fix": "install https://aka.ms/vs/17/release/vc_redist.x64.exe"},
        {"code": "LONG_PATHS", "severity": "warning", "message": "Long paths are off.", "fix": ""},
        {"code": "TRITON_OK", "severity": "info", "message": "triton 3.5.1 is installed.", "fix": ""},
    ])))
    health = status.install_health(path)
    assert health["found"] and health["report_version"] == 2 and health["path"] == "triton_fp16"
    assert health["verdict"].startswith("Triton works here")
    assert health["fixes"] == [
        "[ERROR] The VC++ runtime is too old (14.29). Fix: install https://aka.ms/vs/17/release/vc_redist.x64.exe",
        "[WARNING] Long paths are off.",
    ]


@pytest.mark.parametrize("content,why", [
    (None, "not written yet"),
    ("{not json", "could not be read"),
    ('["a list"]', "not an install.py report"),
    ("huge", "read limit"),
], ids=["missing", "broken-json", "wrong-shape", "too-large"])
def test_install_health_without_a_usable_report(tmp_path, content, why):
    path = tmp_path / "install_report.json"
    if content == "huge":
        path.write_bytes(b" " * (status.MAX_FILE_BYTES + 1))
    elif content is not None:
        path.write_text(content)
    health = status.install_health(path)
    assert health["found"] is False and why in health["why"] and "install.py" in health["hint"]


def test_measurements_read_from_the_cache_file_when_no_summary(tmp_path, monkeypatch):
    cache = tmp_path / "attention_speed.json"
    key = "NVIDIA H200|sm_90|torch 2.9|triton 3.5|pack 0.1.0|triton_fp16|b1-h24/24-q8192-k8192-d128-bfloat16-none"
    cache.write_text(json.dumps({"version": 1, "entries": {
        key: {"choice": "triton_fp16", "timings": {"original": {"ms": 3.0}, "triton_fp16": {"ms": 2.0, "rel_l2": 1e-3}}},
        "junk": "not an entry"}}))
    monkeypatch.setattr(speed_choice, "default_cache_file", lambda: cache)
    monkeypatch.delattr(speed_choice, "speed_summary", raising=False)
    (row,) = status.measurements()["rows"]
    assert row == {"gpu": "NVIDIA H200", "arch": "sm_90", "shape_class": "b1-h24/24-q8192-k8192-d128-bfloat16-none",
                   "choice": "triton_fp16", "timings_ms": {"original": 3.0, "triton_fp16": 2.0},
                   "speedup_vs_original": 1.5}


def test_measurements_prefer_speed_summary(monkeypatch):
    rows = [{"device": "cuda:0", "shape_class": "x", "choice": "original", "timings_ms": {}}]
    monkeypatch.setattr(speed_choice, "speed_summary", lambda: rows, raising=False)
    assert status.measurements()["rows"] == rows


def test_measurements_failure_is_reported_not_raised(monkeypatch):
    def broken():
        raise OSError("disk gone")

    monkeypatch.setattr(speed_choice, "speed_summary", broken, raising=False)
    result = status.measurements()
    assert result["rows"] == [] and "disk gone" in result["error"]


def test_status_payload_shape_and_no_kernel_launch(monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("the status route must not launch a kernel")

    monkeypatch.setattr(selfcheck, "triton_works", no_launch)
    call_stats.reset()
    label = call_stats.new_model_label("Flux")
    call_stats.record("triton", path="triton_fp16", model=label)
    call_stats.record("original", "low_precision_attention=False with float32 inputs", model=label)
    payload = status.status_payload()
    json.dumps(payload)  # what the route sends
    assert {"version", "pack_version", "triton_version", "handed_back_label", "devices", "models", "totals",
            "measurements", "install", "benchmark"} <= set(payload)
    device = payload["devices"][0]
    assert device["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert {"path", "label", "reason", "code", "candidates", "overridden"} <= set(device["auto"])
    (model,) = [m for m in payload["models"] if m["label"] == label]
    reason = "low_precision_attention=False with float32 inputs"
    assert model["kinds"]["attention"] == {
        "served": 1, "handed_back": 1, "paths": {"triton_fp16": 1}, "kind_label": "attention",
        "reasons": [{"reason": reason, "plain": reason, "calls": 1}]}
    assert model["speed_line"].startswith("speed-up: ")
    assert isinstance(payload["benchmark"]["found"], bool)


def test_startup_line_names_version_triton_and_path(monkeypatch):
    monkeypatch.setattr(selfcheck, "triton_works", lambda *a, **k: (_ for _ in ()).throw(AssertionError("launch")))
    line = status.startup_line()
    assert line.startswith("Triton Accel ") and " loaded (Triton " in line and "attention in auto: " in line
    if not torch.cuda.is_available():
        assert line.endswith(("cpu: PyTorch attention (INTERPRETER_ONLY)", "cpu: PyTorch attention (NO_GPU)"))


def test_log_startup_never_raises(monkeypatch, caplog):
    monkeypatch.setattr(status, "startup_line", lambda: (_ for _ in ()).throw(RuntimeError("no driver")))
    status.log_startup()
    assert "no driver" in caplog.text


class _Content:
    def __init__(self, data: bytes):
        self.data = data
        self.asked = None

    async def read(self, n):
        self.asked = n
        return self.data[:n]


class _Request:
    def __init__(self, data: bytes, declared: bool):
        self.content_length = len(data) if declared else None
        self.can_read_body = bool(data)
        self.content = _Content(data)


@pytest.mark.parametrize("size,declared,too_large", [
    (0, True, False), (routes.MAX_BODY_BYTES, True, False), (10 * 1024 * 1024, True, True),
    (routes.MAX_BODY_BYTES + 1, False, True), (10, False, False),
], ids=["empty", "at-limit", "10MB-declared", "chunked-over-limit", "chunked-small"])
def test_body_bound(size, declared, too_large):
    request = _Request(b"x" * size, declared)
    assert asyncio.run(routes.body_too_large(request)) is too_large
    if not declared and size:
        assert request.content.asked == routes.MAX_BODY_BYTES + 1  # never reads more than the limit + 1


def _install_module():
    import importlib.util
    import sys
    from pathlib import Path

    name = "_triton_accel_install_for_status_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(status.PACK_DIR) / "install.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_install_py_report_file_round_trip(tmp_path):
    install = _install_module()
    assert install.LAST_REPORT_NAME == status.INSTALL_REPORT_NAME
    messages = []
    report = _report([{"code": "X", "severity": "warning", "message": "Something to fix.", "fix": "do this"}])
    written = install.write_last_report(str(tmp_path), report, messages.append)
    assert written == str(tmp_path / status.INSTALL_REPORT_NAME) and messages == []
    assert status.install_health(tmp_path / status.INSTALL_REPORT_NAME)["fixes"] == ["[WARNING] Something to fix. Fix: do this"]


def test_install_py_report_in_a_folder_it_cannot_write(tmp_path):
    install = _install_module()
    messages = []
    assert install.write_last_report(str(tmp_path / "missing" / "folder"), _report([]), messages.append) is None
    assert len(messages) == 1 and "could not keep this report" in messages[0]


@pytest.mark.parametrize("facts,expected", [
    (dict(vendor="nvidia", name="NVIDIA H200", capability=(9, 0), arch="sm_90"),
     "cuda:0 NVIDIA H200 (sm_90): Triton FP8 and Triton FP16/BF16 attention, each timed"),
    (dict(vendor="nvidia", name="NVIDIA GeForce RTX 2080", capability=(7, 5), arch="sm_75"),
     "cuda:0 NVIDIA GeForce RTX 2080 (sm_75): PyTorch attention (GPU_TURING_DROPPED)"),
    (dict(vendor="amd", name="AMD Radeon RX 7900 XTX", capability=None, arch="gfx1100"),
     "cuda:0 AMD Radeon RX 7900 XTX: PyTorch attention (AMD_NOT_VALIDATED)"),
], ids=["h200", "turing-on-triton-3.5", "amd"])
def test_startup_line_per_gpu(monkeypatch, facts, expected):
    from triton_accel.kernels.core.gpu_rules import PATH_TRITON_FP8, PATH_TRITON_FP16, Facts

    probed = Facts(device="cuda:0", triton_version="3.5.1", torch_version="2.9.1", torch_cuda="12.8",
                   implemented=frozenset({PATH_TRITON_FP16, PATH_TRITON_FP8}), **facts)
    seen = []
    monkeypatch.setattr(status, "visible_devices", lambda: [torch.device("cuda", 0)])
    monkeypatch.setattr(status, "probe", lambda device, selfcheck_kernel=True: seen.append(selfcheck_kernel) or probed)
    line = status.startup_line()
    assert expected in line, line
    assert seen == [False]  # the load line never runs the self-check kernel


def _cpu_only(monkeypatch):
    monkeypatch.setattr(status, "visible_devices", lambda: [torch.device("cpu")])


def test_panel_on_a_cpu_says_what_is_true_there(monkeypatch):
    _cpu_only(monkeypatch)
    monkeypatch.setattr(speed_choice, "speed_summary", lambda: [], raising=False)
    call_stats.reset()
    payload = status.status_payload()
    note = payload["measurements"]["note"]
    assert "Nothing to measure on a CPU" in note and "first call" not in note, note
    assert payload["header"][0].startswith("cpu in auto: ComfyUI's attention, ComfyUI's Linear"), payload["header"]
    assert "an NVIDIA or AMD GPU is needed" in payload["header"][-1]
    label = call_stats.new_model_label("SD1.5")
    (model,) = [m for m in status.models_status() if m["label"] == label]
    assert model["speed_line"].startswith("speed-up: none on a CPU"), model


def test_measurement_note_on_a_gpu_that_times_and_on_one_that_does_not():
    gpu = {"device": "cuda:0", "auto": {"measured": True}}
    assert "first call" in status.measurements_note([gpu], [])
    assert "times nothing" in status.measurements_note([{"device": "cuda:0", "auto": {"measured": False}}], [])
    assert status.measurements_note([gpu], [{"row": 1}]) == ""


def test_reasons_in_plain_words_and_kinds_named():
    from triton_accel.runtime import step_graph

    call_stats.reset()
    label = call_stats.new_model_label("Flux")
    for _ in range(2):
        call_stats.record("original", step_graph.REASON_NOT_CUDA, kind=step_graph.KIND, model=label)
    (model,) = [m for m in status.models_status() if m["label"] == label]
    graph = model["kinds"][step_graph.KIND]
    assert graph["kind_label"] == "whole-step replay (CUDA graphs)"
    (reason,) = graph["reasons"]
    assert reason["reason"] == step_graph.REASON_NOT_CUDA and reason["calls"] == 2  # the recorded text stays
    assert "CUDA call" not in reason["plain"] and "CPU" in reason["plain"]


def test_one_panel_entry_per_loaded_model_however_often_it_runs(monkeypatch):
    _cpu_only(monkeypatch)
    from triton_accel.nodes.patch_nodes import TritonAccelPatchAttention

    class Inner:
        pass

    class Patcher:
        def __init__(self, model):
            self.model, self.model_options, self.load_device = model, {"transformer_options": {}}, torch.device("cpu")

        def clone(self):
            return Patcher(self.model)

    call_stats.reset()
    model = Patcher(Inner())
    model.model.model_config = type("WAN21_T2V", (), {})()
    before = [m["label"] for m in status.models_status()]
    shown = {TritonAccelPatchAttention().patch(model)["ui"]["triton_accel_model"][0] for _ in range(5)}
    labels = [m["label"] for m in status.models_status()]
    assert len(shown) == 1 and shown.pop().split(" #")[0] == "Wan 2.1"
    assert len(set(labels) - set(before)) <= 1 and len(labels) == len(set(labels)), labels
