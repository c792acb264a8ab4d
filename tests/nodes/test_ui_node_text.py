"""What the Settings, Attention, Linear and Patch nodes show (nodes/node_text.py): a few short
lines, each reason once, true on a CPU, a speed-up line and one next step; the three patch nodes
all hand the web extension their model's label and kinds, so each shows its calls served /
handed back; the descriptions name the nodes by their titles."""
import copy
import json

import pytest
import torch
from triton_accel import nodes as pack_nodes
from triton_accel.kernels.core.gpu_rules import Decision
from triton_accel.nodes import node_text
from triton_accel.nodes.patch_nodes import TritonAccelPatch, TritonAccelPatchAttention, TritonAccelPatchLinear
from triton_accel.nodes.settings_node import TritonAccelSettings
from triton_accel.runtime.settings import AccelSettings

CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)


class Inner(torch.nn.Module):
    """comfy.model_base.BaseModel with an SD1.5 config, as ComfyUI loads SD1.5."""

    def __init__(self):
        super().__init__()
        self.diffusion_model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        self.model_config = type("SD15", (), {})()


Inner.__name__ = "BaseModel"


class Patcher:
    def __init__(self, model=None, model_options=None):
        self.model = model if model is not None else Inner()
        self.model_options = model_options or {"transformer_options": {}}
        self.load_device = CPU
        self.object_patches = {}

    def clone(self):
        clone = Patcher(self.model, copy.deepcopy(self.model_options))
        clone.object_patches = dict(self.object_patches)
        return clone

    def add_object_patch(self, key, value):
        self.object_patches[key] = value

    def get_model_object(self, name):
        obj = self.model
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj


PATCH_NODES = {"attention": (TritonAccelPatchAttention, ["attention"]), "linear": (TritonAccelPatchLinear, ["linear"]),
               "patch": (TritonAccelPatch, ["attention", "linear"])}


def _run(node_class, model):
    node = node_class()
    return getattr(node, node.FUNCTION)(model)


@pytest.mark.parametrize("which", list(PATCH_NODES))
def test_every_patch_node_hands_its_label_and_kinds_to_the_web_extension(which):
    node_class, kinds = PATCH_NODES[which]
    ui = _run(node_class, Patcher())["ui"]
    (label,) = ui["triton_accel_model"]
    assert label.split(" #")[0] == "SD1.5"
    assert ui["triton_accel_kinds"] == kinds
    assert ui["text"][0].startswith(f"{label} on cpu")
    json.dumps(ui)


def test_the_label_stays_run_after_run_and_across_the_three_nodes():
    model = Patcher()
    labels = {_run(node_class, model)["ui"]["triton_accel_model"][0]
              for node_class, _ in PATCH_NODES.values() for _ in range(3)}
    assert len(labels) == 1 and labels.pop().split(" #")[0] == "SD1.5"


def _reasons_once(text: str, settings: AccelSettings):
    for reason in (settings.decision_for(CPU).reason, settings.linear_decision_for(CPU).reason):
        assert text.count(reason) <= 1, (reason, text)


@pytest.mark.parametrize("which", list(PATCH_NODES))
def test_patch_node_on_a_cpu_few_lines_each_reason_once_and_true(which):
    node_class, kinds = PATCH_NODES[which]
    (text,) = _run(node_class, Patcher())["ui"]["text"]
    lines = text.split("\n")
    assert len(lines) <= 5, text
    _reasons_once(text, AccelSettings("auto"))
    assert "speed-up: none on a CPU" in text and node_text.CPU_NEXT in lines
    assert sum(line.startswith("next:") for line in lines) == 1
    assert lines[-1].startswith("installs: ")
    if "linear" in kinds:
        # no "N Linear layers patched" while every call goes to ComfyUI's Linear
        assert "Linear layers patched" not in text and "pass every call to ComfyUI's Linear" in text, text


def test_settings_node_on_a_cpu():
    (text,) = TritonAccelSettings().configure("auto", "cpu")["ui"]["text"]
    lines = text.split("\n")
    _reasons_once(text, AccelSettings("auto"))
    assert lines[-2].startswith("speed-up: none on a CPU") and lines[-1] == node_text.CPU_NEXT, text
    assert len(lines) <= 6, text


def _decision(path, code=""):
    return Decision(path, "why", code=code)


def test_speed_line_not_measured_then_measured_then_benchmark():
    ours = _decision("triton_fp16")
    assert node_text.speed_line(GPU, ours, None, rows=[], benchmark={}) == node_text.NOT_MEASURED
    assert node_text.next_step(GPU, ours, None, node_text.NOT_MEASURED) == node_text.MEASURE_NEXT
    rows = [{"device": "cuda:0", "choice": "triton_fp16", "speedup_vs_original": 1.5},
            {"device": "cuda:0", "choice": "triton_fp8", "speedup_vs_original": 2.0},
            {"device": "cuda:0", "choice": "original", "speedup_vs_original": None},
            {"device": "cuda:1", "choice": "triton_fp16", "speedup_vs_original": 9.0}]
    line = node_text.speed_line(GPU, ours, None, rows=rows, benchmark={})
    assert line == "speed-up: attention 1.50-2.00x where auto kept ours (2 of 3 shapes measured)", line
    assert node_text.next_step(GPU, ours, None, line) is None
    bench = {"device": "cuda:0", "created": "2025-12-07T18:04:00+00:00", "interpreter": False,
             "summary": {"both": {"speedup": 1.42}}}
    line = node_text.speed_line(GPU, ours, None, rows=[], benchmark=bench)
    assert line.startswith("speed-up: 1.42x attention + Linear in the last benchmark (2025-12-") and "T" not in line
    assert node_text.speed_line(GPU, ours, None, rows=[], benchmark={**bench, "device": "cuda:1"}) == \
        node_text.NOT_MEASURED


def test_next_step_per_situation():
    pytorch = _decision("pytorch")
    assert node_text.next_step(CPU, pytorch, pytorch) == node_text.CPU_NEXT
    assert node_text.next_step(GPU, _decision("pytorch", "TRITON_MISSING"), pytorch) == node_text.INSTALL_NEXT
    assert node_text.next_step(GPU, _decision("pytorch", "AMD_NOT_VALIDATED"), pytorch) == node_text.AMD_NEXT
    assert node_text.next_step(GPU, _decision("pytorch", "GPU_TOO_OLD"), pytorch) is None
    assert "none expected" in node_text.speed_line(GPU, pytorch, pytorch, rows=[], benchmark={})


def test_readable_time():
    assert node_text.readable_time("2025-12-07T18:04:00") == "2025-12-07 18:04"
    assert node_text.readable_time("not a time") == "not a time" and node_text.readable_time(None) == ""


def test_descriptions_name_the_nodes_by_their_titles():
    titles = pack_nodes.NODE_DISPLAY_NAME_MAPPINGS
    for node_id, node_class in pack_nodes.NODE_CLASS_MAPPINGS.items():
        for old in ("Patch Attention", "Patch Linear"):
            assert old not in node_class.DESCRIPTION, (node_id, node_class.DESCRIPTION)
            for spec in [*node_class.INPUT_TYPES().get("required", {}).values(),
                         *node_class.INPUT_TYPES().get("optional", {}).values()]:
                assert old not in str(spec[1].get("tooltip", "")) if len(spec) > 1 else True, (node_id, spec)
    patch = TritonAccelPatch.DESCRIPTION
    assert titles["TritonAccelPatchAttention"] in patch and titles["TritonAccelPatchLinear"] in patch, patch
