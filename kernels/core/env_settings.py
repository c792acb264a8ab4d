"""Every environment variable the pack reads, read here and only here.

One meaning of "off" for every switch: unset means the documented default; a value that is
empty, "0", "false", "no" or "off" (any case, surrounding spaces ignored) means off; any other
value means on. Before this module the pack had two lists of false words ("no" turned
autotuning on but not fast launches off), so the same setting meant different things in
different files.

TRITON_INTERPRET belongs to Triton, not to us: Triton decides whether its interpreter runs,
so `interpreter_enabled()` copies Triton's own reading of it rather than ours.

Stdlib only, and no relative imports: install.py (which must not import the pack as a
package) may load this file by path. docs/settings.md lists every variable below; a test
keeps the two in step and fails when shipped code reads one of these variables elsewhere.
"""
from __future__ import annotations

import os
from typing import NamedTuple

FALSE_WORDS = frozenset({"", "0", "false", "no", "off"})
# Triton >= 3.4 (triton.knobs -> getenv_bool) takes these, case-insensitive, not stripped;
# Triton <= 3.3 took only "1", which is why the docs say to set it to 1.
INTERPRET_TRUE_WORDS = frozenset({"1", "true", "on", "yes"})

AUTOTUNE = "TRITON_ACCEL_AUTOTUNE"
FAST_LAUNCH = "TRITON_ACCEL_FAST_LAUNCH"
CACHE_DIR = "TRITON_ACCEL_CACHE_DIR"
GLUON = "TRITON_ACCEL_GLUON"
FUSED_NORMS = "TRITON_ACCEL_FUSED_NORMS"
FUSED_ROPE = "TRITON_ACCEL_FUSED_ROPE"
STEP_GRAPH = "TRITON_ACCEL_STEP_GRAPH"
SPLIT_TAIL = "TRITON_ACCEL_SPLIT_TAIL"
CALL_TIMING = "TRITON_ACCEL_CALL_TIMING"
TRITON_INTERPRET = "TRITON_INTERPRET"
XDG_CACHE_HOME = "XDG_CACHE_HOME"


class Setting(NamedTuple):  # not a dataclass: those fail to load by path unless put in sys.modules first
    name: str
    default: str  # as a user reads it in docs/settings.md
    meaning: str


SETTINGS = (
    Setting(AUTOTUNE, "off",
            "Time every candidate kernel config the first time a shape class is seen on this "
            "GPU and keep the fastest (stored in the tuning cache). Off: the tuned table."),
    Setting(FAST_LAUNCH, "on",
            "Launch already compiled kernels directly, skipping Triton's per-call argument "
            "binding (verified bit for bit against the normal launch first). Off: always the "
            "normal Triton launch."),
    Setting(CACHE_DIR, "unset",
            "Folder of the pack's two caches, tuning-v1.json and attention_speed.json. Unset: "
            "the tuning cache lives in $XDG_CACHE_HOME/triton_accel (else ~/.cache/triton_accel), "
            "the speed cache in ComfyUI's user folder, user/triton_accel (else ~/.cache/triton_accel)."),
    Setting(GLUON, "auto",
            "The FP8 path on sm_90 runs the warp-specialised Gluon kernel where the installed Triton "
            "has Gluon and the kernel compiles there; off (any false word): always the plain-Triton "
            "full-FP8 kernel. Any other value means auto."),
    Setting(FUSED_NORMS, "all",
            "Patch nodes that put our attention into a model also fuse its norms. all (the "
            "default): as qk, and the double and single blocks of ComfyUI's Flux layers (Flux, "
            "HunyuanVideo): norm + modulation, gated residual + norm + modulation and the last "
            "gated residual in one pass each (7.7 ms less GPU time per Flux 1024² step on an H100). "
            "qk: Wan blocks as for blocks, and the per-head q/k RMSNorm of every QKNorm in "
            "ComfyUI's Flux layers (Flux, Chroma, HunyuanVideo) in one launch (10-11 ms less GPU "
            "time per Flux 1024² step on an H100). blocks (any value but the false words, qk and all): "
            "Wan blocks only: LayerNorm + modulation (norm2 with the cross-attention's residual "
            "add), q/k RMSNorm + RoPE, gated residual + LayerNorm, one pass each, the last gated "
            "residual vectorised, and on sm_89+ the FP8 Linear's e4m3 input rows written by the "
            "norm passes. Off (any false word): none. The first call of each fused block is "
            "checked against ComfyUI's."),
    Setting(FUSED_ROPE, "on",
            "Inside the fused Flux-layer blocks (TRITON_ACCEL_FUSED_NORMS=all), q and k's per-head "
            "RMSNorm and the rotary embedding in one pass, written straight into the attention's q "
            "and k ([B, L, H, D] memory, a double block's text and image rows in one tensor): no "
            "RoPE pass, no concatenation of q and k, and no copy of the attention output. Off: the "
            "QK norm kernel, then ComfyUI's concatenation and RoPE."),
    Setting(STEP_GRAPH, "on",
            "Models patched by the pack record their diffusion-model call as one CUDA graph at the "
            "third call with the same signature and replay it for later steps (the host then issues "
            "one graph instead of ~600 launches a Flux step: 0.7-1.2 ms of host time per Flux 1024² "
            "step on an H100, the same output bit for bit), where nothing else patches or wraps the "
            "model, the weights stay on the GPU and no ComfyUI hooks change them; the recording is "
            "checked against the eager call and dropped when the weights change or sampling ends. "
            "Off: every step runs eagerly."),
    Setting(SPLIT_TAIL, "on",
            "The FP8 Linear GEMM on sm_90 cuts the last, partial wave of its output tiles along K "
            "across the SMs the wave would leave idle, where K is long enough to pay (Flux's single "
            "blocks' output and MLP down projections, K 15360 / 12288: 432 tiles on 132 SMs run as 3 "
            "whole waves plus 36 tiles in 3 slices each instead of 4 waves; 7-8 % faster calls on an "
            "H100), summed in a fixed order (the same bits every run). Read when a Linear call "
            "signature is first served. Off (any false word): every tile whole."),
    Setting(CALL_TIMING, "on",
            "In auto, the first call of each Linear call class (shape, dtypes, weight kind, dynamic "
            "VRAM streaming, eager or step-graph step) is timed ours against ComfyUI's on the path the "
            "call really takes (host and GPU time for an eager step, GPU time for a step graph), and "
            "ComfyUI's Linear keeps the class unless ours is faster; layers it keeps run ComfyUI's own "
            "forward with nothing of ours in the call. Attention's auto times the whole call the same "
            "way. Off (any false word): every call the rules admit is served (kernel benchmarks only)."))


def flag(name: str, default: bool) -> bool:
    """A switch: `default` when unset, off for FALSE_WORDS, on for anything else."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in FALSE_WORDS


def text(name: str) -> str | None:
    """A free-text setting: None when unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or None


def autotune_enabled() -> bool:
    return flag(AUTOTUNE, False)


def fast_launch_enabled() -> bool:
    return flag(FAST_LAUNCH, True)


def cache_dir() -> str | None:
    """TRITON_ACCEL_CACHE_DIR, or None: each cache then picks its own default folder."""
    return text(CACHE_DIR)


def gluon_allowed() -> bool:
    """TRITON_ACCEL_GLUON: "auto" (unset, or any value but a false word) lets the FP8 path use the
    Gluon kernel where it can run; a false word keeps the plain-Triton kernel."""
    return flag(GLUON, True)


def fused_norms() -> str:
    """TRITON_ACCEL_FUSED_NORMS: "off", "blocks" (Wan's blocks), "qk" (those and Flux-layer
    QKNorms) or "all" (those and Flux-layer blocks; when unset)."""
    value = os.environ.get(FUSED_NORMS)
    if value is None:
        return "all"
    value = value.strip().lower()
    if value in FALSE_WORDS:
        return "off"
    return value if value in ("all", "qk") else "blocks"


def fused_rope_enabled() -> bool:
    """TRITON_ACCEL_FUSED_ROPE: on unless a false word."""
    return flag(FUSED_ROPE, True)


def step_graph_enabled() -> bool:
    """TRITON_ACCEL_STEP_GRAPH: on unless a false word."""
    return flag(STEP_GRAPH, True)


def call_timing_enabled() -> bool:
    """TRITON_ACCEL_CALL_TIMING: on unless a false word."""
    return flag(CALL_TIMING, True)


def split_tail_enabled() -> bool:
    """TRITON_ACCEL_SPLIT_TAIL: on unless a false word."""
    return flag(SPLIT_TAIL, True)


def user_cache_root() -> str:
    """The per-user cache folder of the pack when TRITON_ACCEL_CACHE_DIR is unset."""
    base = text(XDG_CACHE_HOME) or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "triton_accel")


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels through its CPU interpreter in this process (Triton's reading)."""
    return os.environ.get(TRITON_INTERPRET, "0").lower() in INTERPRET_TRUE_WORDS
