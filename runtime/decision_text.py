"""What the Settings and patch nodes say about a device's decisions: the attention path, the
Linear method(s), the Linear extensions auto considers and the layers the quality guard sent back."""
from __future__ import annotations

import logging

import torch

from .device_probe import probe, summary
from .linear_state import extension_plan_text, fallback_summary
from .settings import AccelSettings, default_device

log = logging.getLogger("triton_accel")


def describe_decision(settings: AccelSettings, device) -> str:
    facts = probe(device)
    decision = settings.decision_for(device)
    return f"{decision.reason}\n[{summary(facts)}]\n{linear_text(settings, device)}"


def linear_text(settings: AccelSettings, device) -> str:
    """The Linear decision(s) for `device` and the layers the quality guard sent back."""
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


def log_decision(settings: AccelSettings, device) -> None:
    """The attention decision for `device`, logged once per node execution at INFO."""
    log.info("Triton Accel on %s: %s", device, settings.decision_for(device).reason)


def decision_text(settings: AccelSettings, device) -> str:
    """The decision for `device` in full (the nodes show nodes/node_text.py's shorter text);
    logged once per node execution at INFO."""
    text = describe_decision(settings, device)
    log_decision(settings, device)
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
