"""TritonAccelSettings: the attention and Linear modes for the patch nodes, and the decision
for one device shown on the node (the decisions themselves: runtime.settings)."""
import logging

from ..kernels.core import extensions
from ..kernels.core.gpu_rules import LINEAR_MODES, MODES
from .node_text import settings_text
from ..runtime.settings import (DEVICE_AUTO, SETTINGS_TYPE, AccelSettings, DeviceChoiceError,
                                default_device, device_choices, linear_mode_choices, linear_mode_labels,
                                mode_choices, mode_labels, parse_device)

log = logging.getLogger("triton_accel")


class TritonAccelSettings:
    CATEGORY = "Triton Accel"
    DESCRIPTION = ("Picks the attention path for each GPU and shows the choice and why. auto: our Triton FP16/BF16 "
                   "kernel (and FP8 on sm_89+, INT8 on Turing/Ampere, where the GPU has them) is timed against "
                   "ComfyUI's own attention at each shape and kept only where it is faster and gives the same "
                   "result. Turing with Triton 3.3+, AMD, older GPUs and the CPU keep PyTorch attention in auto. "
                   "Shows the decision for the GPU, the expected or measured speed-up and, where something is "
                   "missing, the next step.")
    # One spelling each (the Attention and Patch nodes carry the variants and rank first for them).
    SEARCH_ALIASES = ["settings", "attention", "sage", "flash", "fp8", "int8", "speed", "triton", "accelerate",
                      "optimize"]
    RETURN_TYPES = (SETTINGS_TYPE,)
    RETURN_NAMES = ("settings",)
    OUTPUT_TOOLTIPS = ("Connect to a Triton Accel patch node.",)
    FUNCTION = "configure"
    OUTPUT_NODE = True  # runs (and shows its decision) even when nothing is connected

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "mode": (mode_choices(), {
                    "default": "auto",
                    "tooltip": "auto: the fastest safe path for each GPU, timed against ComfyUI's own attention "
                               "so it is never slower. fp8 / int8 / fp16: force that Triton path (fp16 means "
                               "FP16 and BF16: the model's own precision). off: ComfyUI's attention, untouched. "
                               "A forced mode the GPU cannot run says so on the node. ext:<name>: the attention "
                               "another node pack registered (docs/extension_api.md), forced.",
                    "triton_accel_labels": mode_labels(),
                }),
            },
            "optional": {
                "device": (device_choices(), {
                    "default": DEVICE_AUTO,
                    "tooltip": "The device whose decision is shown here (auto: ComfyUI's main device). Every "
                               "GPU still gets its own decision when the model runs on it.",
                }),
                "linear": (linear_mode_choices(), {
                    "default": "auto",
                    "tooltip": "Linear layers (Triton Accel Linear / Patch): auto: FP8 W8A8 on sm_89+, "
                               "INT8 W8A8 on sm_75-sm_86 (FP8 weight-only on sm_80/86 for FP8 checkpoints), "
                               "ComfyUI's Linear elsewhere; Linear extensions of other packs join by priority "
                               "there. fp8 / int8 / fp8_weight_only: force that method. ext:<name>: the Linear "
                               "another node pack registered (docs/extension_api.md), forced. off: ComfyUI's "
                               "Linear layers, untouched.",
                    "triton_accel_labels": linear_mode_labels(),
                }),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, mode="auto", device=DEVICE_AUTO, linear="auto"):
        # Workflows saved while `device` was free text carry values the dropdown may not list
        # ("cuda:1" on a one-GPU machine, a typo): they run, and the node says what is wrong.
        # Likewise a saved "ext:<name>" (mode or linear) whose pack is not installed here: the
        # node says so and ComfyUI's attention / Linear runs. Any other value is an error, as
        # the dropdown's own check was (naming an input here turns ComfyUI's check off for it).
        if mode not in MODES and not extensions.is_extension_path(mode):
            return f"mode {mode!r} is not one of {', '.join(MODES)} or ext:<name>"
        if linear not in LINEAR_MODES and not extensions.is_extension_path(linear):
            return f"linear {linear!r} is not one of {', '.join(LINEAR_MODES)} or ext:<name>"
        return True

    def configure(self, mode: str, device: str = DEVICE_AUTO, linear: str = "auto"):
        settings = AccelSettings(mode, linear_mode=linear)
        try:
            target = parse_device(device) or default_device()
            text = settings_text(settings, target)
        except DeviceChoiceError as e:
            log.warning("Triton Accel: %s", e)
            text = f"{e}. The model still runs; each GPU gets its own decision when the model runs on it."
        except Exception as e:  # a broken driver: say so, keep the graph running
            log.warning("Triton Accel: could not probe device %r: %s: %s", device, type(e).__name__, e)
            text = (f"Could not probe device {device!r}: {type(e).__name__}: {e}. The model still runs; "
                    "each GPU gets its own decision when the model runs on it.")
        return {"ui": {"text": [text]}, "result": (settings,)}
