"""Counts of what the patched layers did with each call, and why they handed calls back.

Read through the HTTP routes /triton_accel/stats and /triton_accel/status (the status panel)
and by the integration tests, which must prove that our kernels really ran and that
unsupported calls reached ComfyUI's function.

Two views of the same calls:
- the original totals (`calls` / `reasons` / `paths`, attention only, as in the first
  release: their keys stay as they were, "triton" and "original");
- version 2: per kind ("attention", "linear") and per patched model (the label the patch
  node gave its clone), with "served" / "handed_back" counts.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections import Counter, OrderedDict

STATS_VERSION = 2
OUTCOME_SERVED = "triton"  # served by one of our kernels (`path` says which)
OUTCOME_HANDED_BACK = "original"  # went, unchanged, to ComfyUI's own function
HANDED_BACK_LABEL = "handed back to ComfyUI"  # what users read instead of "original"
KIND_ATTENTION = "attention"
KIND_LINEAR = "linear"
# Models patched in one server session are few; the oldest labels are dropped past this many
# so a server that patches for weeks keeps a bounded table.
MAX_MODELS = 64

_lock = threading.Lock()
_calls: Counter = Counter()
_reasons: Counter = Counter()
_paths: Counter = Counter()
_kinds: dict[str, dict] = {}
_models: OrderedDict[str, dict] = OrderedDict()
_model_numbers: Counter = Counter()


def _empty_counts() -> dict:
    return {"served": 0, "handed_back": 0, "paths": Counter(), "reasons": Counter()}


def _add(counts: dict, served: bool, reason: str | None, path: str | None) -> None:
    counts["served" if served else "handed_back"] += 1
    if reason:
        counts["reasons"][reason] += 1
    if path:
        counts["paths"][path] += 1


# ComfyUI's supported_models classes (model.model.model_config) -> the names users know. Names
# not here are shown as ComfyUI spells them; prefixes cover the variants (WAN21_I2V, ...).
FAMILY_NAMES = {
    "SD15": "SD1.5", "SD15_instructpix2pix": "SD1.5", "SD20": "SD2", "SD21UnclipL": "SD2.1 unCLIP",
    "SD21UnclipH": "SD2.1 unCLIP", "SDXL": "SDXL", "SDXLRefiner": "SDXL Refiner", "SSD1B": "SSD-1B",
    "SDXL_instructpix2pix": "SDXL", "SD3": "SD3", "Flux": "Flux", "FluxSchnell": "Flux Schnell",
    "FluxInpaint": "Flux Fill", "Flux2": "Flux 2", "Chroma": "Chroma", "AuraFlow": "AuraFlow",
    "HiDream": "HiDream", "Lumina2": "Lumina 2", "QwenImage": "Qwen-Image", "LTXV": "LTXV", "LTXAV": "LTX-2",
    "GenmoMochi": "Mochi", "HunyuanVideo15": "HunyuanVideo 1.5", "HunyuanImage21": "HunyuanImage 2.1",
    "HunyuanDiT": "HunyuanDiT", "HunyuanDiT1": "HunyuanDiT", "PixArtAlpha": "PixArt-α", "PixArtSigma": "PixArt-Σ",
    "SVD_img2vid": "SVD", "Stable_Cascade_C": "Stable Cascade", "Stable_Cascade_B": "Stable Cascade",
    "ZImage": "Z-Image", "Kandinsky5": "Kandinsky 5", "Kandinsky5Image": "Kandinsky 5",
    "Omnigen2": "OmniGen2", "StableAudio": "Stable Audio", "ACEStep": "ACE-Step", "CogVideoX_T2V": "CogVideoX",
    # comfy.model_base classes, where a model has no model_config
    "WAN21": "Wan 2.1", "WAN22": "Wan 2.2", "BaseModel": "Model",
}
FAMILY_PREFIXES = (("WAN21", "Wan 2.1"), ("WAN22", "Wan 2.2"), ("HunyuanVideo15", "HunyuanVideo 1.5"),
                   ("HunyuanVideo", "HunyuanVideo"), ("Cosmos", "Cosmos"), ("CogVideoX", "CogVideoX"),
                   ("Hunyuan3D", "Hunyuan3D"))


def model_family(model) -> str:
    """The family a ComfyUI model belongs to, as users name it ("Flux", "SDXL", "Wan 2.1"):
    from its supported_models class (model.model.model_config), else its model_base class.
    Never raises: an object without these attributes is named by its class."""
    inner = getattr(model, "model", None)
    config = getattr(inner, "model_config", None)
    # The supported_models class first (named as ComfyUI spells it when not mapped), then the
    # model_base class, then the object's own class.
    for name in (type(config).__name__ if config is not None else "",
                 type(inner).__name__ if inner is not None else "", type(model).__name__):
        if name in FAMILY_NAMES:
            return FAMILY_NAMES[name]
        family = next((f for prefix, f in FAMILY_PREFIXES if name.startswith(prefix)), None)
        if family is not None:
            return family
        if name and name not in ("NoneType", "ModelPatcher", "object"):
            return name
    return "Model"


def _new_label_locked(family: str, taken: set[str]) -> str:
    number = 1
    while (label := family if number == 1 else f"{family} #{number}") in taken:
        number += 1
    _models[label] = {"model_class": family, "kinds": {}}  # a new model: its counts start at 0
    _models.move_to_end(label)
    while len(_models) > MAX_MODELS:
        _models.popitem(last=False)
    return label


def new_model_label(model_class: str) -> str:
    """A new label, never given before in this process, for a model not otherwise known: its
    family and, from the second on, a number ("Flux", "Flux #2")."""
    with _lock:
        _model_numbers[model_class] += 1
        return _new_label_locked(model_class, set(_models) | set(_live_labels.values())
                                 | {f"{model_class} #{n}" if n > 1 else model_class
                                    for n in range(1, _model_numbers[model_class])})


# The loaded model (ComfyUI's BaseModel, which every clone of a ModelPatcher shares) -> its label:
# one label per loaded model however often its patch nodes run. A model ComfyUI has unloaded
# gives its label to the next one of its family.
_live_labels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_label(model) -> str:
    """The label of a ComfyUI model (a ModelPatcher or a clone of it): its family ("Flux"), with
    a number only while two of that family are loaded ("Flux #2"); the same label every run."""
    key = getattr(model, "model", None)
    if key is None:
        key = model
    family = model_family(model)
    with _lock:
        try:
            label = _live_labels.get(key)
        except TypeError:  # not weakly referenceable: a label per call, as before
            return _new_label_locked(family, set(_models))
        if label is not None:
            if label not in _models:  # dropped from the bounded table: back, with fresh counts
                _models[label] = {"model_class": family, "kinds": {}}
            _models.move_to_end(label)  # the table lists the most recently patched model last
            return label
        label = _new_label_locked(family, set(_live_labels.values()))
        _live_labels[key] = label
        return label


# Set while auto times a call class (call_timing): the timed repeats are not calls the
# model made, and must not show in its counts.
_MUTED: contextvars.ContextVar[bool] = contextvars.ContextVar("triton_accel_stats_muted", default=False)


@contextlib.contextmanager
def muted():
    token = _MUTED.set(True)
    try:
        yield
    finally:
        _MUTED.reset(token)


def record(outcome: str, reason: str | None = None, path: str | None = None, *,
           kind: str = KIND_ATTENTION, model: str | None = None) -> None:
    """outcome: "triton" (served by one of our kernels, `path` says which) or "original".

    kind: "attention" or "linear"; model: the label from model_label() (or new_model_label()), when known.
    """
    if _MUTED.get():
        return
    served = outcome == OUTCOME_SERVED
    with _lock:
        if kind == KIND_ATTENTION:
            _calls[outcome] += 1
            if reason:
                _reasons[reason] += 1
            if path:
                _paths[path] += 1
        # get before setdefault: a step records ~500 calls, and building an empty entry (two
        # Counters) for each costs more host time than the counting.
        counts = _kinds.get(kind)
        if counts is None:
            counts = _kinds[kind] = _empty_counts()
        _add(counts, served, reason, path)
        if model is not None:
            entry = _models.get(model)
            if entry is None:  # dropped as too old, or recorded by a test without a label
                entry = _models[model] = {"model_class": model.split(" #")[0], "kinds": {}}
            counts = entry["kinds"].get(kind)
            if counts is None:
                counts = entry["kinds"][kind] = _empty_counts()
            _add(counts, served, reason, path)


def _plain(counts: dict) -> dict:
    return {"served": counts["served"], "handed_back": counts["handed_back"], "paths": dict(counts["paths"]),
            "reasons": dict(counts["reasons"])}


def snapshot() -> dict:
    with _lock:
        return {
            "calls": dict(_calls), "reasons": dict(_reasons), "paths": dict(_paths),
            "version": STATS_VERSION,
            "kinds": {kind: _plain(c) for kind, c in _kinds.items()},
            "models": {label: {"model_class": m["model_class"],
                               "kinds": {kind: _plain(c) for kind, c in m["kinds"].items()}}
                       for label, m in _models.items()},
        }


def reset() -> None:
    """Zero every count; the labels of patched models stay (their clones still exist)."""
    with _lock:
        _calls.clear()
        _reasons.clear()
        _paths.clear()
        _kinds.clear()
        for entry in _models.values():
            entry["kinds"] = {}
