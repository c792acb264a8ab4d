"""The Linear method each device gets (kernels/gpu_rules.select_linear_method), over real cards,
AMD, Intel, CPU and forced modes that cannot be honoured; and kernels.linear_refusal agreeing."""
import importlib

import pytest
import torch

from triton_accel.kernels.core.gpu_rules import (
    LINEAR_FP8_W8A8, LINEAR_FP8_WEIGHT_ONLY, LINEAR_INT8_W8A8, LINEAR_MODES, PATH_PYTORCH, Facts,
    select_linear_method,
)

linear_mod = importlib.import_module("triton_accel.kernels.linear.dispatch")
device_mod = importlib.import_module("triton_accel.kernels.core.device")

CARDS = {
    "sm_61": ("NVIDIA GeForce GTX 1080 Ti", (6, 1)),
    "sm_75": ("NVIDIA GeForce RTX 2080 Ti", (7, 5)),
    "sm_80": ("NVIDIA A100-SXM4-80GB", (8, 0)),
    "sm_86": ("NVIDIA GeForce RTX 3090", (8, 6)),
    "sm_89": ("NVIDIA GeForce RTX 4090", (8, 9)),
    "sm_90": ("NVIDIA H200", (9, 0)),
    "sm_120": ("NVIDIA GeForce RTX 5090", (12, 0)),
}


def nvidia(card, triton="3.6.0"):
    name, cap = CARDS[card]
    return Facts(device="cuda:0", vendor="nvidia", name=name, capability=cap, arch=card, triton_version=triton,
                 torch_version="2.9.1", torch_cuda="12.8")


AMD = Facts(device="cuda:0", vendor="amd", name="AMD Radeon RX 7900 XTX", arch="gfx1100", triton_version="3.6.0")
INTEL = Facts(device="xpu:0", vendor="intel", name="Intel Arc A770", triton_version="3.6.0")
CPU = Facts(device="cpu", vendor="cpu", name="cpu", triton_version="3.6.0")
CPU_INTERP = Facts(device="cpu", vendor="cpu", name="cpu", triton_version="3.6.0", interpreter=True)
NO_TRITON = Facts(device="cuda:0", vendor="nvidia", name="NVIDIA H200", capability=(9, 0), triton_version=None)

# id -> (facts, mode, weight_is_fp8, method, overridden, words the reason must contain)
TABLE = {
    "sm_61-auto": (nvidia("sm_61"), "auto", False, PATH_PYTORCH, False, ["sm_61"]),
    "sm_75-triton-3.2-auto": (nvidia("sm_75", "3.2.0"), "auto", False, LINEAR_INT8_W8A8, False, ["INT8"]),
    "sm_75-fp8-weights-auto": (nvidia("sm_75", "3.2.0"), "auto", True, LINEAR_INT8_W8A8, False, ["INT8"]),
    "sm_75-triton-3.3-auto": (nvidia("sm_75", "3.3.1"), "auto", False, PATH_PYTORCH, False, ["Turing", "3.3"]),
    "sm_80-auto": (nvidia("sm_80"), "auto", False, LINEAR_INT8_W8A8, False, ["sm_80", "INT8"]),
    "sm_80-fp8-weights-auto": (nvidia("sm_80"), "auto", True, LINEAR_FP8_WEIGHT_ONLY, False, ["weight-only"]),
    "sm_86-auto": (nvidia("sm_86"), "auto", False, LINEAR_INT8_W8A8, False, ["sm_86"]),
    "sm_86-fp8-weights-auto": (nvidia("sm_86"), "auto", True, LINEAR_FP8_WEIGHT_ONLY, False, ["FP8 checkpoint"]),
    "sm_89-auto": (nvidia("sm_89"), "auto", False, LINEAR_FP8_W8A8, False, ["sm_89", "FP8 W8A8"]),
    "sm_89-fp8-weights-auto": (nvidia("sm_89"), "auto", True, LINEAR_FP8_W8A8, False, ["FP8 W8A8"]),
    "sm_90-auto": (nvidia("sm_90"), "auto", False, LINEAR_FP8_W8A8, False, ["H200"]),
    "sm_120-auto": (nvidia("sm_120"), "auto", False, LINEAR_FP8_W8A8, False, ["sm_120"]),
    "sm_120-old-triton": (nvidia("sm_120", "3.2.0"), "auto", False, PATH_PYTORCH, False, ["Blackwell"]),
    "amd-auto": (AMD, "auto", False, PATH_PYTORCH, False, ["not run on AMD hardware", "gfx1100"]),
    "intel-auto": (INTEL, "auto", False, PATH_PYTORCH, False, ["Intel"]),
    "cpu-auto": (CPU, "auto", False, PATH_PYTORCH, False, ["no GPU"]),
    "cpu-interpreter-auto": (CPU_INTERP, "auto", False, PATH_PYTORCH, False, ["interpreter"]),
    "no-triton": (NO_TRITON, "auto", False, PATH_PYTORCH, False, ["Triton"]),
    # forced modes the device honours
    "sm_90-int8": (nvidia("sm_90"), "int8", False, LINEAR_INT8_W8A8, False, ["int8 forced"]),
    "sm_89-weight-only": (nvidia("sm_89"), "fp8_weight_only", False, LINEAR_FP8_WEIGHT_ONLY, False, ["forced"]),
    "sm_86-weight-only": (nvidia("sm_86"), "fp8_weight_only", False, LINEAR_FP8_WEIGHT_ONLY, False, ["forced"]),
    "sm_80-int8": (nvidia("sm_80"), "int8", True, LINEAR_INT8_W8A8, False, ["int8 forced"]),
    "cpu-interpreter-fp8": (CPU_INTERP, "fp8", False, LINEAR_FP8_W8A8, False, ["TRITON_INTERPRET"]),
    "cpu-interpreter-int8": (CPU_INTERP, "int8", False, LINEAR_INT8_W8A8, False, ["tests only"]),
    # forced modes that cannot be honoured: auto's choice there, said so
    "sm_86-fp8": (nvidia("sm_86"), "fp8", False, LINEAR_INT8_W8A8, True, ["fp8 asked, but", "sm_89"]),
    "sm_80-fp8-fp8-weights": (nvidia("sm_80"), "fp8", True, LINEAR_FP8_WEIGHT_ONLY, True, ["fp8 asked, but"]),
    "sm_75-fp8": (nvidia("sm_75", "3.2.0"), "fp8", False, LINEAR_INT8_W8A8, True, ["fp8 asked, but", "sm_75"]),
    "sm_75-weight-only": (nvidia("sm_75", "3.2.0"), "fp8_weight_only", True, LINEAR_INT8_W8A8, True,
                          ["fp8_weight_only asked, but", "sm_80"]),
    "amd-fp8-rdna3": (AMD, "fp8", False, PATH_PYTORCH, True, ["fp8 asked, but", "RDNA3 has no FP8"]),
    "cpu-fp8": (CPU, "fp8", False, PATH_PYTORCH, True, ["fp8 asked, but", "no GPU"]),
    "sm_61-int8": (nvidia("sm_61"), "int8", False, PATH_PYTORCH, True, ["int8 asked, but", "sm_75"]),
    "off": (nvidia("sm_90"), "off", False, PATH_PYTORCH, False, ["off"]),
}


@pytest.mark.parametrize("case", list(TABLE.values()), ids=list(TABLE))
def test_method_per_device(case):
    facts, mode, weight_is_fp8, method, overridden, words = case
    d = select_linear_method(facts, mode, weight_is_fp8=weight_is_fp8)
    assert d.path == method, d.reason
    assert d.overridden is overridden, d.reason
    for w in words:
        assert w in d.reason, (w, d.reason)


def test_every_mode_is_decided_and_unknown_mode_raises():
    for mode in LINEAR_MODES:
        assert select_linear_method(nvidia("sm_90"), mode).reason
    with pytest.raises(ValueError, match="unknown Linear mode"):
        select_linear_method(nvidia("sm_90"), "fp4")


def _fake_gpu(monkeypatch, card_or_info):
    if isinstance(card_or_info, str):
        name, cap = CARDS[card_or_info]
        info = device_mod.DeviceInfo("cuda", "nvidia", name, cap, card_or_info.replace("_", ""))
    else:
        info = card_or_info
    monkeypatch.setattr(linear_mod._device, "describe", lambda device=None: info)
    monkeypatch.setattr(linear_mod._device, "triton_version", lambda: "3.6.0")


# The kernels' own refusal (the registry's constraints) agrees with the rules: a method the rules
# would never pick for a card is refused with gpu_rules' reason.
REFUSALS = {
    ("sm_86", "fp8_w8a8", None): "FP8 tensor cores need sm_89+",
    ("sm_75", "fp8_weight_only", None): "need sm_80+",
    ("sm_86", "int8_w8a8", torch.bfloat16): None,
    ("sm_89", "fp8_w8a8", torch.bfloat16): None,
    ("sm_90", "fp8_weight_only", torch.float16): None,
    ("sm_80", "fp8_weight_only", torch.bfloat16): None,
    ("sm_90", "int8_w8a8", torch.int8): "activation dtype",
}


@pytest.mark.parametrize("case", list(REFUSALS.items()), ids=[f"{c}-{m}-{d}" for c, m, d in REFUSALS])
def test_linear_refusal_per_card(monkeypatch, case):
    (card, method, dtype), words = case
    _fake_gpu(monkeypatch, card)
    reason = linear_mod.linear_refusal(method, "cuda:0", dtype)
    if words is None:
        assert reason is None
    else:
        assert reason is not None and words in reason, reason


def test_linear_refusal_turing_bf16_and_new_triton(monkeypatch):
    _fake_gpu(monkeypatch, "sm_75")
    monkeypatch.setattr(linear_mod._device, "triton_version", lambda: "3.2.0")
    assert "bfloat16" in linear_mod.linear_refusal("int8_w8a8", "cuda:0", torch.bfloat16)
    assert linear_mod.linear_refusal("int8_w8a8", "cuda:0", torch.float16) is None
    monkeypatch.setattr(linear_mod._device, "triton_version", lambda: "3.3.1")
    assert "compiles for sm_80+" in linear_mod.linear_refusal("int8_w8a8", "cuda:0", torch.float16)


def test_linear_refusal_amd_unknown_method_and_cpu(monkeypatch):
    assert "unknown Linear method" in linear_mod.linear_refusal("fp4", "cpu")
    monkeypatch.setattr(linear_mod._device, "interpreter_enabled", lambda: False)
    assert "TRITON_INTERPRET" in linear_mod.linear_refusal("fp8_w8a8", "cpu")
    _fake_gpu(monkeypatch, device_mod.DeviceInfo("cuda", "amd", "AMD Instinct MI300X", (9, 4), "gfx942"))
    assert "fnuz" in linear_mod.linear_refusal("fp8_w8a8", "cuda:0")
    assert linear_mod.linear_refusal("int8_w8a8", "cuda:0") is None
    _fake_gpu(monkeypatch, device_mod.DeviceInfo("cuda", "amd", "AMD Radeon Pro W6800", (10, 3), "gfx1030"))
    assert "not an AMD target" in linear_mod.linear_refusal("int8_w8a8", "cuda:0")
