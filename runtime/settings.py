"""AccelSettings: the attention and Linear modes a Settings node chose, and the decision for each
device (detect the GPU, pick the path, say why), remembered per device for the status route."""
from __future__ import annotations

import dataclasses
import logging
import threading

import torch

from ..kernels.core import extensions
from ..kernels.core.device import describe
from ..kernels.core.gpu_rules import LINEAR_MODES, MODES, PATH_LABEL, Decision, select_linear_method, select_path
from .device_probe import probe

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
# What users type into ComfyUI's node search to find the attention nodes. ComfyUI 0.29's frontend
# (1.47) ranks by the class id and display name only (then by how often a node is used), so an
# alias lets a node into the results but ranks it after every node whose title holds the word
# (tests/nodes/test_ui_search.py replays that ranking).
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
