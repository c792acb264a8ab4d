"""What the nodes show a user (no ComfyUI needed): names, aliases, the device dropdown and its
old free-text values, a bad device as one line, forced modes that were overridden, where the
decision is logged, the patch node's label and per-model counts."""
import copy
import logging

import pytest
import torch
from triton_accel import nodes as pack_nodes
from triton_accel.kernels.core.gpu_rules import MODES, Decision
from triton_accel.runtime import call_stats
from triton_accel.runtime import settings as settings_mod
from triton_accel.runtime.attention_patch import OVERRIDE_KEY
from triton_accel.nodes.patch_nodes import TritonAccelPatchAttention
from triton_accel.runtime.settings import AccelSettings, DeviceChoiceError, device_choices, parse_device, user_facing
from triton_accel.nodes.settings_node import TritonAccelSettings

WANTED_ALIASES = {"attention", "sage", "fp8", "int8", "speed", "triton", "accelerate"}


def test_display_names_fit_and_class_ids_stay():
    names = pack_nodes.NODE_DISPLAY_NAME_MAPPINGS
    assert names["TritonAccelSettings"] == "Triton Accel Settings"
    assert names["TritonAccelPatchAttention"] == "Triton Accel Attention"
    # The default node width shows ~22 characters of title; the old name had 28.
    assert all(len(title) <= 22 for title in names.values()), names
    assert {"TritonAccelSettings", "TritonAccelPatchAttention"} <= set(pack_nodes.NODE_CLASS_MAPPINGS)


@pytest.mark.parametrize("node", [TritonAccelSettings, TritonAccelPatchAttention], ids=["settings", "patch"])
def test_search_aliases(node):
    assert WANTED_ALIASES <= set(node.SEARCH_ALIASES)


def test_descriptions_match_the_readme():
    text = TritonAccelSettings.DESCRIPTION
    # The old text promised FP8 on every sm_89+ and Triton on sm_75 whatever the Triton version.
    assert "FP8 on sm_89+ (when available)" not in text
    for claim in ("timed against ComfyUI's own attention", "faster", "Turing with Triton 3.3+", "AMD",
                  "keep PyTorch attention in auto", "INT8 on Turing/Ampere"):
        assert claim in text, claim


def test_mode_labels_say_fp16_is_fp16_and_bf16_and_values_stay():
    mode_values, options = TritonAccelSettings.INPUT_TYPES()["required"]["mode"]
    assert mode_values == list(MODES) and {"auto", "fp8", "fp16", "off"} <= set(mode_values)  # saved workflows
    labels = options["triton_accel_labels"]
    assert set(labels) == set(mode_values)
    assert "FP16/BF16" in labels["fp16"]
    assert "BF16" in options["tooltip"]


def test_device_dropdown_on_this_machine():
    choices = device_choices()
    assert choices[0] == "auto" and choices[-1] == "cpu"
    cuda = [c for c in choices if c.startswith("cuda:")]
    assert len(cuda) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    device_input = TritonAccelSettings.INPUT_TYPES()["optional"]["device"]
    assert device_input[0] == choices and device_input[1]["default"] == "auto"


def test_device_dropdown_lists_each_gpu_by_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: ["NVIDIA H200", "NVIDIA GeForce RTX 3090"][i])
    assert device_choices() == ["auto", "cuda:0 (NVIDIA H200)", "cuda:1 (NVIDIA GeForce RTX 3090)", "cpu"]
    assert parse_device("cuda:1 (NVIDIA GeForce RTX 3090)") == torch.device("cuda", 1)
    with pytest.raises(DeviceChoiceError, match=r"has 2 GPU\(s\), cuda:0 to cuda:1"):
        parse_device("cuda:2")


def test_device_dropdown_survives_a_broken_driver(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: (_ for _ in ()).throw(RuntimeError("driver gone")))
    with caplog.at_level(logging.WARNING, logger="triton_accel"):
        assert device_choices() == ["auto", "cpu"]
    assert "driver gone" in caplog.text


@pytest.mark.parametrize("text,expected", [
    ("auto", None), ("", None), ("  auto ", None), ("cpu", torch.device("cpu")), ("cpu (this machine)", torch.device("cpu")),
], ids=["auto", "empty", "spaces", "cpu", "cpu-with-label"])
def test_parse_device_accepts(text, expected):
    assert parse_device(text) == expected


@pytest.mark.parametrize("text,message", [
    ("gpu0", "not a device name"),
    ("cuda:7", "no CUDA GPU" if not torch.cuda.is_available() else "GPU(s)"),
    ("mps", "only auto, cuda:N and cpu"),
    ("cuda:0; rm -rf /", "not a device name"),
], ids=["typo", "missing-gpu", "other-backend", "shell-text"])
def test_parse_device_refuses_with_one_line(text, message):
    with pytest.raises(DeviceChoiceError) as info:
        parse_device(text)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_old_free_text_values_pass_validation():
    assert TritonAccelSettings.VALIDATE_INPUTS(device="cuda:1") is True
    assert TritonAccelSettings.VALIDATE_INPUTS(device="gpu0") is True


@pytest.mark.parametrize("device", ["gpu0", "cuda:9", "xla:0"], ids=["typo", "missing-gpu", "unknown-backend"])
def test_bad_device_one_line_on_the_node_one_warning_no_traceback(device, caplog):
    with caplog.at_level(logging.DEBUG, logger="triton_accel"):
        result = TritonAccelSettings().configure("auto", device)
    (text,) = result["ui"]["text"]
    assert text.startswith(f"Could not probe device {device!r}") and "\n" not in text
    assert result["result"][0].mode == "auto"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].exc_info is None, [r.getMessage() for r in warnings]


def test_decision_is_logged_at_the_node_not_inside_the_first_call(caplog):
    settings = AccelSettings("fp16")
    with caplog.at_level(logging.DEBUG, logger="triton_accel"):
        settings.decision_for(torch.device("cpu"))  # what the first attention call does
    assert [r.levelno for r in caplog.records if "Triton Accel on cpu" in r.getMessage()] == [logging.DEBUG]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="triton_accel"):
        TritonAccelSettings().configure("fp16", "cpu")
    assert [r.levelno for r in caplog.records if "Triton Accel on cpu" in r.getMessage()] == [logging.INFO]


@pytest.mark.parametrize("mode,reason", [
    ("fp8", "fp8 forced on the CPU through TRITON_INTERPRET=1"),  # a rule text that does not say it
    ("fp16", "PyTorch fallback: no GPU"),
], ids=["fp8-on-cpu", "fp16-blocked"])
def test_overridden_forced_mode_says_so_first(mode, reason):
    decision = Decision("triton_fp16" if mode == "fp8" else "pytorch", reason, overridden=True)
    shown = user_facing(decision, mode)
    assert shown.reason.startswith(f"{mode} asked, but ") and reason in shown.reason
    already = Decision("pytorch", f"{mode} asked, but PyTorch fallback: x", overridden=True)
    assert user_facing(already, mode) is already
    kept = Decision("triton_fp16", "auto: fine")
    assert user_facing(kept, "auto") is kept


def test_forced_fp8_on_the_cpu_reads_as_overridden():
    (text,) = TritonAccelSettings().configure("fp8", "cpu")["ui"]["text"]
    assert text.startswith("fp8 asked, but"), text


def test_decisions_made_are_recorded_for_the_status_route():
    AccelSettings("fp16").decision_for(torch.device("cpu"))
    made = settings_mod.decisions_made()
    assert made[("cpu", "fp16")].path == "triton_fp16"


class FakePatcher:
    """The part of ComfyUI's ModelPatcher the patch node touches."""

    def __init__(self, model_options=None, load_device="cpu"):
        self.model_options = model_options or {"transformer_options": {}}
        self.load_device = torch.device(load_device)
        self.model = type("Flux", (), {})()

    def clone(self):
        clone = FakePatcher(copy.deepcopy(self.model_options), str(self.load_device))
        clone.model = self.model
        return clone


def test_patch_node_labels_its_clone_and_counts_per_model():
    call_stats.reset()
    result = TritonAccelPatchAttention().patch(FakePatcher(), AccelSettings("fp16"))
    patched = result["result"][0]
    (label,) = result["ui"]["triton_accel_model"]
    assert label.split(" #")[0] == "Flux"
    (text,) = result["ui"]["text"]
    assert text.startswith(f"{label} on cpu: fp16 forced"), text
    override = patched.model_options["transformer_options"][OVERRIDE_KEY]
    q = torch.randn(1, 8, 2 * 32)
    override(lambda *a, **k: None, q, q, q, 2, transformer_options={})
    override(lambda *a, **k: q, q.double(), q.double(), q.double(), 2, transformer_options={})
    counts = call_stats.snapshot()["models"][label]["kinds"]["attention"]
    assert counts["served"] == 1 and counts["handed_back"] == 1
    assert counts["paths"] == {"triton_fp16": 1}


def test_patch_node_with_a_broken_device_still_patches(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("CUDA error: unknown error")

    monkeypatch.setattr(AccelSettings, "decision_for", broken)  # what the node's text asks first
    result = TritonAccelPatchAttention().patch(FakePatcher(), AccelSettings("auto"))
    assert "could not probe device 'cpu'" in result["ui"]["text"][0]
    assert OVERRIDE_KEY in result["result"][0].model_options["transformer_options"]
