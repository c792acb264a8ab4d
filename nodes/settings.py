"""TritonAccelSettings: detect the GPU, pick the attention path, say why on the node."""
from __future__ import annotations

import logging
import threading

import torch

from .device_probe import probe, summary
from ..kernels.gpu_rules import MODES, Decision, select_path

log = logging.getLogger("triton_accel")

SETTINGS_TYPE = "TRITON_ACCEL_SETTINGS"


class AccelSettings:
    """What the patch nodes read: the user's mode, decided per device when a call arrives.

    A rig with a 3090 and a 4090 gets a decision for each card, made from the tensors'
    device at call time rather than once for "the" GPU.
    """

    def __init__(self, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        self.mode = mode
        self._decisions: dict[str, Decision] = {}
        self._lock = threading.Lock()

    def decision_for(self, device) -> Decision:
        key = str(device)
        decision = self._decisions.get(key)
        if decision is None:
            with self._lock:
                decision = self._decisions.get(key)
                if decision is None:
                    decision = select_path(probe(device), self.mode)
                    self._decisions[key] = decision
                    log.info("Triton Accel on %s: %s", key, decision.reason)
        return decision

    # ModelPatcher.clone() deep-copies model_options; the settings are shared, not copied.
    def __deepcopy__(self, memo):
        return self

    def __repr__(self):
        return f"AccelSettings(mode={self.mode!r})"


def _default_device() -> torch.device:
    try:
        import comfy.model_management

        return comfy.model_management.get_torch_device()
    except Exception:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def describe_decision(settings: AccelSettings, device) -> str:
    facts = probe(device)
    decision = settings.decision_for(device)
    return f"{decision.reason}\n[{summary(facts)}]"


class TritonAccelSettings:
    CATEGORY = "Triton Accel"
    DESCRIPTION = ("Detects the GPU and picks the fastest safe attention path for it: FP8 on sm_89+ (when "
                   "available), Triton FP16/BF16 on sm_75-sm_86, PyTorch otherwise. Shows the choice and why.")
    RETURN_TYPES = (SETTINGS_TYPE,)
    RETURN_NAMES = ("settings",)
    OUTPUT_TOOLTIPS = ("Connect to a Triton Accel patch node.",)
    FUNCTION = "configure"
    OUTPUT_NODE = True  # runs (and shows its decision) even when nothing is connected

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "mode": (list(MODES), {
                    "default": "auto",
                    "tooltip": "auto: the fastest safe path for each GPU, timed against ComfyUI's own attention "
                               "so it is never slower. fp8 / fp16: force that Triton path. off: ComfyUI's "
                               "attention, untouched.",
                }),
            },
            "optional": {
                "device": ("STRING", {
                    "default": "auto",
                    "tooltip": "The device whose decision is shown here (auto: ComfyUI's main device, e.g. "
                               "cuda:1 for a second GPU). Every GPU still gets its own decision when the "
                               "model runs on it.",
                }),
            },
        }

    def configure(self, mode: str, device: str = "auto"):
        settings = AccelSettings(mode)
        target = device
        try:
            target = _default_device() if device.strip() in ("", "auto") else torch.device(device.strip())
            text = describe_decision(settings, target)
        except Exception as e:  # a bad device string or a broken driver: say so, keep the graph running
            log.warning("Triton Accel: could not probe %s", target, exc_info=True)
            text = (f"Could not probe device {str(target)!r}: {type(e).__name__}: {e}. The model still runs; "
                    "each GPU gets its own decision when the model runs on it.")
        return {"ui": {"text": [text]}, "result": (settings,)}
