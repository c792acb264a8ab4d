"""The quality guards' shared measures: whether our output may stand in for ComfyUI's (the
Linear guard, the fused norms' first-call check, a step graph's first replay: guard_failure)
and the agreement bars auto's attention choice holds a candidate to (agreement_bar)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.core import extensions
from ..kernels.core.gpu_rules import LOSSY_PATHS


@dataclass(frozen=True)
class AgreementBar:
    """How close a candidate's output must be to ComfyUI's for auto to keep it."""

    max_rel_l2: float  # ||ours - theirs|| / ||theirs|| over the whole output
    min_cosine: float | None  # worst cosine similarity over the (batch, head) slices; None: not checked


# Lossless paths (our FP16/BF16 kernel) differ from ComfyUI's attention by rounding only (rel. L2
# vs float32 ~0.0022 bf16, 0.0003 fp16, SDPA's own): 2e-2 is ten times that, and anything
# further apart means something is wrong with one path.
MAX_REL_L2_DIFFERENCE = 2e-2
LOSSLESS_BAR = AgreementBar(MAX_REL_L2_DIFFERENCE, None)
# Quantized paths (FP8, INT8) differ by their quantisation noise. Measured vs float32: full FP8
# rel. L2 0.010 (cosine >= 0.9999) on outlier-structured inputs, what real DiT / UNet activations
# look like, but 0.052-0.060 (cosine ~0.9985) on plain Gaussian ones, whose nearly flat softmax
# averages V into a small output the noise is large against. 0.05 keeps 5x headroom over real
# activations and stays below the Gaussian figures, so a layer whose activations look like noise
# (a random-weight model, a degenerate layer) stays on ComfyUI's attention instead of sneaking
# past by a loosened bar. The whole-output rel. L2 can hide one broken head among 24-40 (one head
# 20 % off moves the total by 0.2 / sqrt(40) = 3 %), so the worst (batch, head) slice must also
# keep cosine >= 0.998, the Gaussian-input bar (rel. L2 ~0.063 within that slice).
QUANTIZED_BAR = AgreementBar(0.05, 0.998)


def agreement_bar(path: str) -> AgreementBar:
    # Another pack's attention declares itself lossy or not (kernels/core/extensions.py); an unknown
    # name gets the lossless bar, the stricter one.
    return QUANTIZED_BAR if path in LOSSY_PATHS or extensions.is_lossy(path) else LOSSLESS_BAR


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1)


def guard_failure(ours: torch.Tensor, reference: torch.Tensor, max_rel_l2: float) -> str | None:
    """Why `ours` is not an acceptable stand-in for `reference`, or None (the Linear guard, the
    fused norms' first-call check, a step graph's first replay)."""
    if ours.shape != reference.shape:
        return f"shape {tuple(ours.shape)} instead of {tuple(reference.shape)}"
    ours32, ref32 = ours.detach().float(), reference.detach().float()
    if not bool(torch.isfinite(ref32).all()):
        return "ComfyUI's own output has NaN/Inf here: nothing to compare with"
    if not bool(torch.isfinite(ours32).all()):
        return "NaN/Inf in our output"
    ref_norm = ref32.norm().item()
    diff = (ours32 - ref32).norm().item()
    rel = diff / ref_norm if ref_norm > 0 else (0.0 if diff == 0 else float("inf"))
    if rel > max_rel_l2:
        return f"rel. L2 {rel:.3g} > {max_rel_l2}"
    return None


def agreement(out: torch.Tensor, ref: torch.Tensor, groups=None) -> dict:
    """{"rel_l2", "min_cosine"} of `out` against `ref`; `groups` maps an output to [slices, -1]
    (per batch and head; default: one slice). NaN anywhere gives NaN, which no bar accepts."""
    o, r = out.float(), ref.float()
    rel_l2 = ((o - r).norm() / r.norm().clamp_min(1e-12)).item()
    og, rg = (groups or _whole)(o), (groups or _whole)(r)
    norms = og.norm(dim=1) * rg.norm(dim=1)
    both_zero = (og.norm(dim=1) == 0) & (rg.norm(dim=1) == 0)  # a fully masked head: zeros on both sides
    cosine = torch.where(norms > 0, (og * rg).sum(dim=1) / norms.clamp_min(1e-30),
                         both_zero.float())
    return {"rel_l2": rel_l2, "min_cosine": cosine.min().item() if cosine.numel() else 1.0}


def agrees(metrics: dict, bar: AgreementBar) -> bool:
    # Written so that NaN fails every comparison.
    if not metrics["rel_l2"] <= bar.max_rel_l2:
        return False
    return bar.min_cosine is None or metrics["min_cosine"] >= bar.min_cosine
