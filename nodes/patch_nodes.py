"""The patch nodes: Triton Accel Attention, Triton Accel Linear and Triton Accel Patch (both).

Each node clones the model and installs, in its own code path below, what it puts there:
- Attention: our attention override (runtime.attention_patch), the fused norm/RoPE passes
  (runtime.fused_norms; not in mode off, nor with TRITON_ACCEL_FUSED_NORMS=off) and the
  step's CUDA graphs (runtime.step_graph);
- Linear: our Linear layers (runtime.linear_patch) and the step's CUDA graphs;
- Patch: all of these, on one clone.
The node's text ends with one line saying which were installed.
"""
from __future__ import annotations

from ..runtime import step_graph
from ..runtime.attention_patch import fused_norms_wanted, override_of, patch_attention
from ..runtime.fused_norms import patch_fused_norms
from ..runtime.linear_common import DYNAMIC_VRAM_AUTO, DYNAMIC_VRAM_MODES, MIN_TOKENS, SKIP_AUTO
from ..runtime.linear_patch import patch_linear_layers
from ..runtime.settings import SEARCH_ALIASES as ATTENTION_SEARCH_ALIASES
from ..runtime.settings import SETTINGS_TYPE, AccelSettings
from .node_text import patch_text


def installs_line(attention: bool, linear: bool, fused_norms: int, step_graphs) -> str:
    """The node's last line: what it installed on the clone (fused_norms: how many blocks /
    QKNorms got the fused passes; step_graphs: step_graph.install's answer, None where this
    ComfyUI has no model wrappers)."""
    parts = (["attention"] if attention else []) + (["Linear"] if linear else [])
    if fused_norms:
        parts.append(f"fused norms ({fused_norms} blocks / QKNorms)")
    if step_graphs is not None:
        parts.append("step graphs")
    return "installs: " + ", ".join(parts)


def node_ui(text: str, label: str, kinds: list[str]) -> dict:
    """A patch node's UI output. triton_accel_model / triton_accel_kinds: the web extension adds
    the model's calls served / handed back of these kinds (from /triton_accel/status) under the text."""
    return {"text": [text], "triton_accel_model": [label], "triton_accel_kinds": list(kinds)}


class TritonAccelPatchAttention:
    CATEGORY = "Triton Accel"
    DESCRIPTION = ("Puts Triton Accel's attention into a model (SD1.5, SDXL, SD3, Flux, Wan, HunyuanVideo, LTXV, "
                   "Qwen-Image, Lumina 2...): a Triton flash-attention kernel (FP8/INT8 where the GPU has them), "
                   "an alternative to SageAttention. Calls it cannot serve go to ComfyUI's own attention. Shows "
                   "the model, the path chosen for its GPU, the expected or measured speed-up and, after a run, "
                   "the calls served and handed back.")
    SEARCH_ALIASES = ATTENTION_SEARCH_ALIASES
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The same model with Triton Accel attention (the input model is left untouched).",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The diffusion model to speed up (from a loader or a LoRA node)."}),
            },
            "optional": {
                "settings": (SETTINGS_TYPE, {
                    "tooltip": "From Triton Accel Settings. Not connected: auto (the fastest safe path per GPU)."}),
            },
        }

    def patch(self, model, settings: AccelSettings | None = None):
        settings = settings or AccelSettings("auto")
        patched = patch_attention(model, settings)
        label = override_of(patched).label
        graphs = step_graph.install(patched, label)
        norms = patch_fused_norms(patched, label) if fused_norms_wanted(settings) else 0
        text = patch_text(patched, label, settings, attention=True, linear=False,
                          installs=installs_line(True, False, norms, graphs))
        return {"ui": node_ui(text, label, ["attention"]), "result": (patched,)}


def _dynamic_vram_input() -> dict:
    return {"dynamic_vram": (list(DYNAMIC_VRAM_MODES), {
        "default": DYNAMIC_VRAM_AUTO,
        "tooltip": "ComfyUI 0.29+ dynamic VRAM streams each layer's weight per call. auto: FP8 weights feed our "
                   "FP8 matmul as they are; BF16/FP16 weights are quantised to FP8 on every call (one layer's "
                   "FP8 copy of memory, freed after the call; a pass over the weight that large calls repay). "
                   "fp8_weights_only: only FP8 weights; off: ComfyUI's Linear for every streamed layer.",
    })}


def _linear_inputs() -> dict:
    return {
        "skip": ("STRING", {
            "default": SKIP_AUTO,
            "tooltip": "Layers left to ComfyUI's Linear, by name (comma-separated fnmatch patterns such as "
                       "'double_blocks.0.*', or 're:<regex>'). 'auto': embedders, final layers and modulation "
                       "layers of every family; 'auto, single_blocks.3?.*' adds to them; empty: none.",
        }),
        "min_tokens": ("INT", {
            "default": MIN_TOKENS, "min": 1, "max": 1 << 20,
            "tooltip": "Calls with fewer rows (tokens x batch) go to ComfyUI's Linear: quantising cannot pay.",
        }),
    }


# What users type into the node search to find the Linear nodes (the frontend matches these too).
LINEAR_SEARCH_ALIASES = ["linear", "matmul", "gemm", "quantize", "w8a8", "fp8", "int8", "speed", "fast",
                         "triton", "accelerate", "optimize"]


class TritonAccelPatchLinear:
    CATEGORY = "Triton Accel"
    DESCRIPTION = ("Runs the diffusion model's Linear layers through Triton Accel's quantised matmul (FP8 W8A8 on "
                   "sm_89+, INT8 W8A8 on sm_75-sm_86, FP8 weight-only for FP8 checkpoints on sm_80/86). The first "
                   "call checks each layer against ComfyUI's Linear; calls it cannot serve go to ComfyUI's Linear. "
                   "Shows the method chosen for the GPU, the expected or measured speed-up and, after a run, the "
                   "calls served and handed back.")
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The same model with Triton Accel Linear layers (the input model is left untouched).",)
    FUNCTION = "patch"
    SEARCH_ALIASES = LINEAR_SEARCH_ALIASES

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"model": ("MODEL", {"tooltip": "The diffusion model (from a loader or a LoRA node)."}),
                         **_linear_inputs()},
            "optional": {"settings": (SETTINGS_TYPE, {
                "tooltip": "From Triton Accel Settings (its 'linear' mode). Not connected: auto."}),
                **_dynamic_vram_input()},
        }

    def patch(self, model, skip: str = SKIP_AUTO, min_tokens: int = MIN_TOKENS, settings: AccelSettings | None = None,
              dynamic_vram: str = DYNAMIC_VRAM_AUTO):
        settings = settings or AccelSettings("auto")
        patched = patch_linear_layers(model, settings, skip, min_tokens, dynamic_vram=dynamic_vram)
        state = patched.triton_accel_linear
        graphs = step_graph.install(patched, state.label, state)
        text = patch_text(patched, state.label, settings, attention=False, linear=True,
                          installs=installs_line(False, True, 0, graphs))
        return {"ui": node_ui(text, state.label, ["linear"]), "result": (patched,)}


class TritonAccelPatch:
    CATEGORY = "Triton Accel"
    DESCRIPTION = ("Triton Accel Attention and Triton Accel Linear in one node: our attention (a Triton "
                   "flash-attention kernel, FP8/INT8 where the GPU has them) and our quantised Linear layers, each "
                   "decided per GPU by Triton Accel Settings (or auto). Shows the decision, the expected or "
                   "measured speed-up and, after a run, the calls served and handed back. On a CPU it passes the "
                   "model through.")
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = (("The same model with Triton Accel attention and Linear layers (the input model is left "
                        "untouched)."),)
    FUNCTION = "patch"
    SEARCH_ALIASES = ATTENTION_SEARCH_ALIASES + [a for a in LINEAR_SEARCH_ALIASES if a not in ATTENTION_SEARCH_ALIASES]

    @classmethod
    def INPUT_TYPES(cls):
        return TritonAccelPatchLinear.INPUT_TYPES()

    def patch(self, model, skip: str = SKIP_AUTO, min_tokens: int = MIN_TOKENS, settings: AccelSettings | None = None,
              dynamic_vram: str = DYNAMIC_VRAM_AUTO):
        settings = settings or AccelSettings("auto")
        patched = patch_attention(model, settings)
        label = override_of(patched).label
        norms = patch_fused_norms(patched, label) if fused_norms_wanted(settings) else 0
        patched = patch_linear_layers(patched, settings, skip, min_tokens, label=label, dynamic_vram=dynamic_vram)
        graphs = step_graph.install(patched, label, patched.triton_accel_linear)
        text = patch_text(patched, label, settings, attention=True, linear=True,
                          installs=installs_line(True, True, norms, graphs))
        return {"ui": node_ui(text, label, ["attention", "linear"]), "result": (patched,)}
