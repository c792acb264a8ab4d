"""The pack's HTTP routes and node UI contract, against the real ComfyUI of the harness.

- GET /triton_accel/status: the JSON shape the side panel reads (devices with paths, reasons
  and codes; per patched model the calls served / handed back per kind; measurements; install
  health; benchmark), filled in by a real run of a patched model;
- nothing in a request is used: path traversal attempts under our prefix and query strings
  carrying commands or paths get nothing from the file system and change nothing;
- request bodies are bounded: a 10 MB POST to /triton_accel/stats/reset is refused (413 or the
  connection is closed) and the counts are not reset; an empty POST still resets;
- /object_info: short display names, search aliases, the device dropdown, mode labels;
- a bad device string ("gpu0") and an old free-text value ("cuda:1" on a machine without it)
  run: one line on the node, one WARNING in the log, no traceback;
- the pack's one INFO line at load (version, Triton, auto's path per device).
"""
from __future__ import annotations

import http.client
import json
import re

import pytest
from it_workflows import Workflow, probe_workflow

STATUS = "/triton_accel/status"
PASSWD_MARK = "root:x:0:0"


def _raw_get(comfy, path: str) -> tuple[int, str]:
    """GET with the path sent exactly as written (urllib would normalise the dots)."""
    conn = http.client.HTTPConnection("127.0.0.1", comfy.port, timeout=30)
    try:
        conn.putrequest("GET", path, skip_accept_encoding=True)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.read(200_000).decode(errors="replace")
    finally:
        conn.close()


def _patched_probe_run(comfy, mode: str = "fp16") -> dict | None:
    """The patch node's UI output ({"text", "triton_accel_model"}); None where the history keeps
    only output nodes' (ComfyUI 0.3.64: the browser still gets it through the websocket)."""
    prompt, _ = probe_workflow("flux", [("TritonAccelPatchAttention",
                                              {"settings": ("settings", {"mode": mode, "device": "cpu"})})],
                                    probe_cases=("fp32_plain", "fp32_full_precision"))
    entry = comfy.run(prompt)
    patch_node = next(i for i, n in prompt.items() if n["class_type"] == "TritonAccelPatchAttention")
    return entry["outputs"].get(patch_node)


def test_status_shape_after_a_patched_run(comfy):
    outputs = _patched_probe_run(comfy)
    status = comfy.get_json(STATUS)
    label = status["models"][-1]["label"]  # the newest patched clone
    assert re.fullmatch(r"[\w.\- ]+?( #\d+)?", label), label  # the family ("Flux"), numbered from the second
    if outputs is not None:
        assert outputs["triton_accel_model"] == [label]
        assert outputs["text"][0].startswith(f"{label} on cpu: fp16 forced"), outputs["text"]

    assert status["version"] == 1 and status["pack_version"] and status["triton_version"]
    assert status["handed_back_label"] == "handed back to ComfyUI"
    (cpu,) = [d for d in status["devices"] if d["device"] == "cpu"]
    assert {"path", "label", "reason", "code", "candidates", "overridden"} <= set(cpu["auto"])
    assert cpu["auto"]["path"] == "pytorch" and cpu["auto"]["code"] == "INTERPRETER_ONLY"
    assert cpu["selfcheck"] == "passed"  # the Settings node probed the CPU through the interpreter
    assert [u["path"] for u in cpu["in_use"] if u["mode"] == "fp16"] == ["triton_fp16"]

    model = next(m for m in status["models"] if m["label"] == label)
    attention = model["kinds"]["attention"]
    # fp32_plain is served by our kernel; fp32 with low_precision_attention=False is handed back.
    assert attention["served"] >= 1 and attention["paths"].get("triton_fp16", 0) >= 1
    assert attention["handed_back"] >= 1
    assert any("low_precision_attention=False" in r["reason"] for r in attention["reasons"])
    assert isinstance(status["measurements"]["rows"], list)
    assert isinstance(status["install"]["found"], bool)
    if status["install"]["found"]:
        assert all(isinstance(line, str) and "\n" not in line for line in status["install"]["fixes"])
    assert isinstance(status["benchmark"]["found"], bool)
    # The old route keeps its keys and gains the per-kind / per-model view.
    stats = comfy.stats()
    assert {"calls", "reasons", "paths", "kernels", "kinds", "models"} <= set(stats)
    assert stats["models"][label]["kinds"]["attention"]["served"] == attention["served"]


@pytest.mark.parametrize("path", [
    "/triton_accel/status/../../etc/passwd",
    "/triton_accel/status/..%2F..%2F..%2Fetc%2Fpasswd",
    "/triton_accel/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
    "/triton_accel/..%5c..%5c..%5cetc%5cpasswd",
    "/triton_accel/benchmark.png/../../../../etc/passwd",
    "/triton_accel/status/%00",
], ids=["dots", "encoded-slashes", "encoded-dots", "backslashes", "benchmark-dots", "nul"])
def test_path_traversal_reads_nothing(comfy, path):
    status, body = _raw_get(comfy, path)
    assert PASSWD_MARK not in body, f"{path} -> HTTP {status} served /etc/passwd"
    assert status in (400, 403, 404), f"{path} -> HTTP {status}: {body[:300]}"


@pytest.mark.parametrize("query", [
    "cmd=cat%20/etc/passwd", "path=../../etc/passwd", "code=__import__('os').system('id')",
    "file=/etc/passwd&device=cuda:0;rm%20-rf%20/",
], ids=["cmd", "path", "code", "mixed"])
def test_query_strings_are_ignored(comfy, query):
    plain = comfy.get_json(STATUS)
    status, body = _raw_get(comfy, f"{STATUS}?{query}")
    assert status == 200 and PASSWD_MARK not in body
    document = json.loads(body)
    assert set(document) == set(plain)
    assert [d["device"] for d in document["devices"]] == [d["device"] for d in plain["devices"]]


def test_large_post_body_is_refused(comfy):
    _patched_probe_run(comfy)
    before = comfy.stats()["calls"]
    assert sum(before.values()) > 0
    body = b"x" * (10 * 1024 * 1024)
    conn = http.client.HTTPConnection("127.0.0.1", comfy.port, timeout=60)
    refused_with = None
    try:
        conn.request("POST", "/triton_accel/stats/reset", body=body,
                     headers={"Content-Type": "application/octet-stream"})
        response = conn.getresponse()
        refused_with = response.status
        assert response.status == 413, f"a 10 MB body got HTTP {response.status}"
    except (ConnectionResetError, BrokenPipeError) as e:  # the server may close before reading it all
        refused_with = type(e).__name__
    finally:
        conn.close()
    assert comfy.stats()["calls"] == before, f"the counts were reset by a refused request ({refused_with})"
    # Without a body the reset works.
    status, payload = comfy.request("POST", "/triton_accel/stats/reset")
    assert status == 200 and payload["calls"] == {}


def test_object_info_names_aliases_device_dropdown(comfy):
    info = comfy.object_info()
    settings, patch = info["TritonAccelSettings"], info["TritonAccelPatchAttention"]
    assert settings["display_name"] == "Triton Accel Settings"
    assert patch["display_name"] == "Triton Accel Attention"
    for node in (settings, patch):
        aliases = node.get("search_aliases")
        if aliases is None:  # ComfyUI 0.3.x does not send SEARCH_ALIASES in /object_info yet
            assert comfy.version.startswith("0.3."), f"ComfyUI {comfy.version} sent no search_aliases"
            continue
        assert {"attention", "sage", "fp8", "int8", "speed", "triton", "accelerate"} <= set(aliases)
    device = settings["input"]["optional"]["device"]
    choices = device[0] if isinstance(device[0], list) else device[1]["options"]
    assert choices[0] == "auto" and choices[-1] == "cpu"
    mode = settings["input"]["required"]["mode"]
    labels = mode[1]["triton_accel_labels"]
    assert "FP16/BF16" in labels["fp16"] and set(labels) == set(mode[0])
    assert "FP8 only" not in settings["description"] and "sm_75-sm_86, PyTorch otherwise" not in settings["description"]
    assert "AMD" in settings["description"] and "Triton 3.3" in settings["description"]


@pytest.mark.parametrize("device,expected", [
    ("gpu0", "Could not probe device 'gpu0': not a device name"),
    ("cuda:1", "Could not probe device 'cuda:1': this machine has no CUDA GPU"),
], ids=["typo", "old-free-text"])
def test_bad_device_one_line_one_warning(comfy, device, expected):
    wf = Workflow()
    node = wf.add("TritonAccelSettings", mode="auto", device=device)
    log_before = len(comfy.log())
    entry = comfy.run(wf.nodes)
    text = entry["outputs"][node]["text"][0]
    assert text.startswith(expected) and "\n" not in text, text
    new_log = comfy.log()[log_before:]
    warnings = [ln for ln in new_log.splitlines() if device in ln and "Could not probe" in ln]
    assert len(warnings) == 1, new_log[-3000:]
    assert "Traceback" not in new_log, new_log[-3000:]


def test_one_info_line_at_load(comfy):
    lines = [ln for ln in comfy.log().splitlines() if "Triton Accel" in ln and " loaded (Triton " in ln]
    assert len(lines) == 1, comfy.log_tail(80)
    assert "attention in auto: cpu: PyTorch attention (INTERPRETER_ONLY)" in lines[0], lines[0]
