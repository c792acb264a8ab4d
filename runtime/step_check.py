"""auto's last word in an eager step: the whole step with its choices against ComfyUI's own.

Per call, auto keeps our kernel where the call measured faster (call_timing). In an eager step
that is not enough: the host and the GPU run side by side, and a call that wins alone can still
make the step slower. A step that waits on the host (SDXL, SD1.5, any model under dynamic VRAM)
pays our call's extra host time in full however much GPU time it saves, and our extra host time
can make a GPU-bound step host-bound. So once the per-call choices are made (a step without a
new measurement), the sampler's next steps alternate between them (A) and ComfyUI's own Linear
and attention everywhere (B), each step timed between two synchronisations, A B A B; ComfyUI's
keeps the step signature unless every A step beats every B step by STEP_MARGIN. The steps in B run
ComfyUI's code, so no step is slower than ComfyUI's by more than what one A step lost.

Only eager steps: a step graph's replay issues no Python, and there the calls' GPU times, which
call_timing measures for such steps, are the step's. A new step signature (resolution, batch,
eager or graph) measures and checks again.
"""
from __future__ import annotations

import collections
import logging
import time

import torch

from . import call_timing, linear_choice

log = logging.getLogger("triton_accel")

STEP_MARGIN = 0.01
PHASES = ("ours", "comfyui", "ours", "comfyui")
OVERRIDE_KEY = "optimized_attention_override"  # attention_patch's transformer_options key


def _override(kwargs: dict):
    """Our attention override in this call's transformer_options (or None)."""
    to = kwargs.get("transformer_options")
    override = to.get(OVERRIDE_KEY) if isinstance(to, dict) else None
    return override if hasattr(override, "force_original") else None


MAX_SIGNATURES = 8  # cond and uncond of different shapes alternate: each keeps its own check


class _Signature:
    """The check's state for one step signature."""

    def __init__(self, seen: int):
        self.phase = -1  # index into PHASES of the running check, -1: not started
        self.seen = seen  # call_timing.measurement_count() at the start of its last step
        self.times: dict[str, list[float]] = {"ours": [], "comfyui": []}
        self.kept: str | None = None  # "ours" / "comfyui" once decided
        self.result: dict | None = None


class StepCheck:
    """One per patched model (step_graph's wrapper holds it): the A/B state of each step
    signature it runs (a sampler alternates two where cond and uncond differ in shape)."""

    def __init__(self, label: str | None = None):
        self.label = label
        self.signatures: collections.OrderedDict = collections.OrderedDict()

    def __deepcopy__(self, memo):  # clones share it, as they share the diffusion model
        return self

    @staticmethod
    def supports(device: torch.device) -> bool:
        return device.type == "cuda"

    @staticmethod
    def _sync(device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def kept(self, signature) -> str | None:
        entry = self.signatures.get(signature)
        return entry.kept if entry is not None else None

    def run(self, executor, args, kwargs, signature, linear_states, device: torch.device):
        """The step, timed where the check needs it; the check's configuration applied first.
        Only what auto decides is checked: forced modes are the user's to keep."""
        if not self.supports(device) or not call_timing.timing_enabled():
            return executor(*args, **kwargs)
        override = _override(kwargs)
        if override is not None and getattr(override.settings, "mode", None) != "auto":
            override = None
        linear_states = [s for s in linear_states if s.settings.linear_mode == "auto"]
        entry = self.signatures.get(signature)
        if entry is None:
            entry = self.signatures[signature] = _Signature(call_timing.measurement_count())
            while len(self.signatures) > MAX_SIGNATURES:
                self.signatures.popitem(last=False)
            self._apply("ours", linear_states, override)
            return executor(*args, **kwargs)
        if entry.kept is not None:
            self._apply(entry.kept, linear_states, override)  # its own, or a reload re-applied our patches
            return executor(*args, **kwargs)
        count = call_timing.measurement_count()
        if entry.phase < 0:
            if count != entry.seen or not (linear_states or override is not None):
                entry.seen = count  # the last step still measured: wait for one that did not
                self._apply("ours", linear_states, override)
                return executor(*args, **kwargs)
            entry.phase = 0
        config = PHASES[entry.phase]
        self._apply(config, linear_states, override)
        self._sync(device)
        t0 = time.perf_counter()
        out = executor(*args, **kwargs)
        self._sync(device)
        entry.times[config].append((time.perf_counter() - t0) * 1e3)
        if call_timing.measurement_count() != count:  # something new was measured in it: start over
            entry.phase, entry.seen = -1, call_timing.measurement_count()
            entry.times = {"ours": [], "comfyui": []}
            self._apply("ours", linear_states, override)
            return out
        entry.phase += 1
        if entry.phase == len(PHASES):
            self._decide(entry, linear_states, override)
        return out

    def _decide(self, entry: _Signature, linear_states, override) -> None:
        # Every step with our choices must beat every step on ComfyUI's: an eager step's time
        # moves by several percent with the host from one step to the next, and a step that
        # only sometimes wins is not faster.
        slowest_ours, ours, theirs = max(entry.times["ours"]), min(entry.times["ours"]), min(entry.times["comfyui"])
        entry.kept = "ours" if slowest_ours < theirs * (1.0 - STEP_MARGIN) else "comfyui"
        entry.result = {"ours_ms": round(ours, 2), "comfyui_ms": round(theirs, 2), "kept": entry.kept}
        self._apply(entry.kept, linear_states, override)
        log.info("Triton Accel%s: whole eager step with auto's choices %.1f ms, with ComfyUI's Linear and attention "
                 "%.1f ms -> %s", f" ({self.label})" if self.label else "", ours, theirs,
                 "ours kept" if entry.kept == "ours" else "ComfyUI's kept for this step signature")
        call_timing.note_step_check(self.label, entry.result)

    @staticmethod
    def _apply(config: str, linear_states, override) -> None:
        comfy = config == "comfyui"
        for state in linear_states:
            linear_choice.force_comfyui(state, comfy)
        if override is not None:
            override.force_original = comfy
