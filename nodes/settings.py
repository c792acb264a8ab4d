"""TritonAccelSettings: detect the GPU, pick the attention path, say why on the node."""
from __future__ import annotations

import dataclasses
import logging
import threading

import torch

from .device_probe import probe, summary
from ..kernels.core import extensions
from ..kernels.core.gpu_rules import LINEAR_MODES, MODES, PATH_LABEL, Decision, select_linear_method, select_path

log = logging.getLogger("triton_accel")

SETTINGS_TYPE = "TRITON_ACCEL_SETTINGS"
DEVICE_AUTO = "auto"
# What the mode dropdown shows beside each stored value (the web extension reads these from the
# input's options); the stored values stay the short names, so saved workflows keep loading.
MODE_LABELS = {
    "auto": "auto (fastest measured)",
    "fp8": "fp8",
    "int8": "int8",
    "fp16": "fp16 (FP16/BF16)",
    "off": "off (ComfyUI's attention)",
}
SEARCH_ALIASES = ["attention", "sage", "sageattention", "flash", "fp8", "int8", "speed", "fast", "triton",
                  "accelerate", "optimize"]


# Every (device, mode) decision made in this server, for the status route: what the nodes and
# the patched models really use, next to what auto would pick.
_decisions_made: dict[tuple[str, str], Decision] = {}
_linear_decisions_made: dict[tuple[str, str], Decision] = {}  # (device, linear mode): the Linear side
_made_lock = threading.Lock()


def decisions_made() -> dict[tuple[str, str], Decision]:
    with _made_lock:
        return dict(_decisions_made)


def linear_decisions_made() -> dict[tuple[str, str], Decision]:
    with _made_lock:
        return dict(_linear_decisions_made)


def user_facing(decision: Decision, mode: str) -> Decision:
    """A forced mode that could not be honoured says so first ("fp8 asked, but ..."), whatever
    the rule's own wording, so it never reads like auto's choice."""
    if decision.overridden and not decision.reason.startswith(f"{mode} asked, but"):
        runs = PATH_LABEL.get(decision.path, decision.path)
        return dataclasses.replace(decision, reason=f"{mode} asked, but {runs} runs instead: {decision.reason}")
    return decision


class DeviceChoiceError(ValueError):
    """The device text names no device of this machine; the message is one line for the node."""


_device_keys: dict = {}


def device_key(device) -> str:
    """str(device), remembered per device: the patched layers key their per-device state by it
    on every call, and str(torch.device) costs about a microsecond each time."""
    key = _device_keys.get(device)
    if key is None:
        key = str(device)
        if len(_device_keys) < 256:  # a handful of devices in practice; strings pass through too
            _device_keys[device] = key
    return key


class AccelSettings:
    """What the patch nodes read: the user's mode, decided per device when a call arrives.

    A rig with a 3090 and a 4090 gets a decision for each card, made from the tensors'
    device at call time rather than once for "the" GPU.
    """

    def __init__(self, mode: str = "auto", linear_mode: str = "auto"):
        if mode not in MODES and not extensions.is_extension_path(mode):
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES} or 'ext:<name>'")
        if linear_mode not in LINEAR_MODES and not extensions.is_extension_path(linear_mode):
            raise ValueError(f"unknown Linear mode {linear_mode!r}; expected one of {LINEAR_MODES} or 'ext:<name>'")
        self.mode = mode
        self.linear_mode = linear_mode
        self._decisions: dict[str, Decision] = {}
        self._linear_decisions: dict[tuple[str, bool], Decision] = {}
        self._lock = threading.Lock()

    def decision_for(self, device) -> Decision:
        key = device_key(device)
        decision = self._decisions.get(key)
        if decision is None:
            with self._lock:
                decision = self._decisions.get(key)
                if decision is None:
                    decision = user_facing(self._select(device), self.mode)
                    self._decisions[key] = decision
                    with _made_lock:
                        _decisions_made[(key, self.mode)] = decision
                    # DEBUG: the first attention call runs inside KSampler's progress bar; the
                    # INFO line is written when the Settings / Patch node executes.
                    log.debug("Triton Accel on %s: %s", key, decision.reason)
        return decision

    def _select(self, device) -> Decision:
        if extensions.is_extension_path(self.mode):  # another pack's attention, forced
            from ..kernels.core.device import describe

            return extensions.forced_decision(self.mode, describe(device))
        return select_path(probe(device), self.mode)

    def linear_decision_for(self, device, weight_is_fp8: bool = False) -> Decision:
        """The Linear method for `device` (gpu_rules.select_linear_method), remembered per device
        and weight kind: FP8 checkpoint weights may get another method (weight-only on sm_80/86)."""
        key = (device_key(device), bool(weight_is_fp8))
        decision = self._linear_decisions.get(key)
        if decision is None:
            with self._lock:
                decision = self._linear_decisions.get(key)
                if decision is None:
                    decision = self._select_linear(device, bool(weight_is_fp8))
                    self._linear_decisions[key] = decision
                    with _made_lock:
                        _linear_decisions_made[(key[0], self.linear_mode)] = decision
                    log.debug("Triton Accel Linear on %s: %s", key[0], decision.reason)
        return decision

    def _select_linear(self, device, weight_is_fp8: bool) -> Decision:
        if extensions.is_extension_path(self.linear_mode):  # another pack's Linear, forced
            from ..kernels.core.device import describe

            return extensions.forced_decision(self.linear_mode, describe(device), kind=extensions.KIND_LINEAR)
        return select_linear_method(probe(device), self.linear_mode, weight_is_fp8)

    # ModelPatcher.clone() deep-copies model_options; the settings are shared, not copied.
    def __deepcopy__(self, memo):
        return self

    def __repr__(self):
        return f"AccelSettings(mode={self.mode!r}, linear_mode={self.linear_mode!r})"


def default_device() -> torch.device:
    try:
        import comfy.model_management

        return comfy.model_management.get_torch_device()
    except Exception:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_choices() -> list[str]:
    """The device dropdown: auto, one "cuda:N (name)" per visible GPU, cpu. Never raises."""
    choices = [DEVICE_AUTO]
    try:
        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                choices.append(f"cuda:{index} ({torch.cuda.get_device_name(index)})")
    except Exception as e:  # a broken driver must not hide the node
        log.warning("Triton Accel: could not list the GPUs: %s", e)
    choices.append("cpu")
    return choices


def parse_device(text: str) -> torch.device | None:
    """The device a dropdown entry or an old free-text value names; None for auto.

    Accepts "cuda:0 (NVIDIA H200)" (the dropdown), "cuda:1", "cuda", "cpu" (what workflows
    saved when the field was free text). Raises DeviceChoiceError with a one-line message.
    """
    token = (text or "").split(" (")[0].strip()
    if token in ("", DEVICE_AUTO):
        return None
    try:
        device = torch.device(token)
    except (RuntimeError, ValueError):
        raise DeviceChoiceError(f"Could not probe device {text!r}: not a device name; choose auto, cuda:N or cpu") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DeviceChoiceError(f"Could not probe device {text!r}: this machine has no CUDA GPU; choose auto or cpu")
        if device.index is not None and device.index >= count:
            raise DeviceChoiceError(f"Could not probe device {text!r}: this machine has {count} GPU(s), "
                                    f"cuda:0 to cuda:{count - 1}")
    elif device.type != "cpu":
        raise DeviceChoiceError(f"Could not probe device {text!r}: only auto, cuda:N and cpu are supported here")
    return device


def mode_choices() -> list[str]:
    """The mode dropdown: our modes, then "ext:<name>" for each attention other packs registered."""
    return list(MODES) + list(extensions.paths_by_priority())


def mode_labels() -> dict[str, str]:
    labels = {m: MODE_LABELS.get(m, m) for m in MODES}
    for entry in extensions.list_extensions(extensions.KIND_ATTENTION):
        labels[entry["path"]] = f"{entry['path']} ({entry['label']}, from {entry['pack']})"
    return labels


def linear_mode_choices() -> list[str]:
    """The `linear` dropdown: our Linear modes, then "ext:<name>" for each Linear other packs registered."""
    return list(LINEAR_MODES) + list(extensions.paths_by_priority(kind=extensions.KIND_LINEAR))


def linear_mode_labels() -> dict[str, str]:
    labels = {m: m for m in LINEAR_MODES}
    for entry in extensions.list_extensions(extensions.KIND_LINEAR):
        labels[entry["path"]] = f"{entry['path']} ({entry['label']}, from {entry['pack']})"
    return labels


def describe_decision(settings: AccelSettings, device) -> str:
    facts = probe(device)
    decision = settings.decision_for(device)
    return f"{decision.reason}\n[{summary(facts)}]\n{linear_text(settings, device)}"


def linear_text(settings: AccelSettings, device) -> str:
    """The Linear decision(s) for `device` and the layers the quality guard sent back."""
    from .patch_linear import extension_plan_text, fallback_summary  # patch_linear imports this module

    linear = settings.linear_decision_for(device)
    text = f"Linear: {linear.reason}"
    linear_fp8 = settings.linear_decision_for(device, weight_is_fp8=True)
    if linear_fp8.path != linear.path:
        text += f"\nLinear, FP8 checkpoint weights: {linear_fp8.reason}"
    plan = extension_plan_text(settings, device)
    if plan:
        text += f"\n{plan}"
    fallbacks = fallback_summary()
    return f"{text}\n{fallbacks}" if fallbacks else text


def decision_text(settings: AccelSettings, device) -> str:
    """The decision for `device` as the node shows it; logged once per node execution at INFO."""
    text = describe_decision(settings, device)
    log.info("Triton Accel on %s: %s", device, settings.decision_for(device).reason)
    return text


def patched_model_text(model, label: str, settings: AccelSettings) -> str:
    """What a patch node shows: the clone's label (as the status panel names it) and the
    decision for the device the model will run on. Never raises: a patch node must patch."""
    device = getattr(model, "load_device", None)
    try:
        device = torch.device(device) if device is not None else default_device()
        return f"{label} on {device}: {decision_text(settings, device)}"
    except Exception as e:
        log.warning("Triton Accel: could not probe device %r for %s: %s: %s", device, label, type(e).__name__, e)
        return f"{label}: could not probe device {str(device)!r} ({type(e).__name__}: {e}); each call is decided " \
               "when it arrives"


class TritonAccelSettings:
    CATEGORY = "Triton Accel"
    DESCRIPTION = ("Picks the attention path for each GPU and shows the choice and why. auto: our Triton FP16/BF16 "
                   "kernel (and FP8 on sm_89+, INT8 on Turing/Ampere, where the GPU has them) is timed against "
                   "ComfyUI's own attention at each shape and kept only where it is faster and gives the same "
                   "result. Turing with Triton 3.3+, AMD, older GPUs and the CPU keep PyTorch attention in auto.")
    SEARCH_ALIASES = SEARCH_ALIASES
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
                    "tooltip": "Linear layers (Triton Accel Patch Linear / Patch): auto: FP8 W8A8 on sm_89+, "
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
            text = decision_text(settings, target)
        except DeviceChoiceError as e:
            log.warning("Triton Accel: %s", e)
            text = f"{e}. The model still runs; each GPU gets its own decision when the model runs on it."
        except Exception as e:  # a broken driver: say so, keep the graph running
            log.warning("Triton Accel: could not probe device %r: %s: %s", device, type(e).__name__, e)
            text = (f"Could not probe device {device!r}: {type(e).__name__}: {e}. The model still runs; "
                    "each GPU gets its own decision when the model runs on it.")
        return {"ui": {"text": [text]}, "result": (settings,)}
