"""Workflows (ComfyUI API-format prompts) for the integration tests, and latent read-back."""
from __future__ import annotations

import uuid

import torch

# What each tiny model needs: its latent shape and random conditioning shaped like its text
# encoder's output. Flux/HunyuanVideo text dims are whatever make_tiny_models.py gave txt_in;
# Wan keeps text_dim 4096 (not read by ComfyUI's detection); SD1.5 has CLIP-L's 77 x 768.
FAMILIES = {
    "sd15": dict(latent=dict(channels=4, frames=0, height=8, width=8),
                 cond=dict(tokens=77, dim=768, pooled_dim=0, masked_tokens=0)),
    "flux": dict(latent=dict(channels=16, frames=0, height=8, width=8),
                 cond=dict(tokens=8, dim=64, pooled_dim=32, masked_tokens=0)),
    "wan21": dict(latent=dict(channels=16, frames=1, height=8, width=8),
                  cond=dict(tokens=8, dim=4096, pooled_dim=0, masked_tokens=0)),
    # 12 text tokens of which the last 4 are padding: HunyuanVideo turns the conditioning's
    # attention_mask into additive masks ([B, 1, L, L] in the token refiner, [1, 1, L] joint).
    "hunyuan_video": dict(latent=dict(channels=16, frames=1, height=8, width=8),
                          cond=dict(tokens=12, dim=64, pooled_dim=768, masked_tokens=4)),
}

SEED = 1234
STEPS = 2


class Workflow:
    """A small builder: add(node_type, **inputs) -> node id; link(id, slot) for connections."""

    def __init__(self):
        self.nodes = {}

    def add(self, class_type: str, **inputs) -> str:
        node_id = str(len(self.nodes) + 1)
        self.nodes[node_id] = {"class_type": class_type, "inputs": inputs}
        return node_id

    @staticmethod
    def link(node_id: str, slot: int = 0):
        return [node_id, slot]


# Widest tiny model whose FP8 Linear the Triton interpreter runs in reasonable time (ComfyUI
# 0.3.x builds the tiny Flux 3072 wide, whatever make_tiny_models.py asked for).
MAX_INTERPRETED_WIDTH = 512


def model_width(models: dict, family: str) -> int:
    """The hidden width of the tiny `family` model ComfyUI built (its unet_config)."""
    cfg = (models or {}).get(family, {}).get("unet_config", {})
    return int(cfg.get("hidden_size") or cfg.get("dim") or 320)


def family_spec(family: str, models: dict | None = None) -> dict:
    """FAMILIES[family], with the text width the model on disk really has (ComfyUI 0.3.x reads
    Flux as context 4096 whatever make_tiny_models.py asked for)."""
    spec = {"latent": dict(FAMILIES[family]["latent"]), "cond": dict(FAMILIES[family]["cond"])}
    unet_config = ((models or {}).get(family) or {}).get("unet_config", {})
    if family in ("flux", "hunyuan_video") and "context_in_dim" in unet_config:
        spec["cond"]["dim"] = unet_config["context_in_dim"]
    return spec


def sampling_workflow(family: str, model_chain=(), probe_cases=(), tag: str = "run", models=None,
                      weight_dtype: str = "default", steps: int | None = None, cfg: float = 1.0):
    """UNETLoader -> model_chain... -> KSampler -> SaveLatent for one family.

    model_chain: items (class_type, inputs) applied to the model in order; an input value of
    the form ("settings", {...}) creates a TritonAccelSettings node and links it.
    probe_cases: TritonAccelTestAttentionProbe nodes run on the final model.
    weight_dtype: UNETLoader's (e.g. "fp8_e4m3fn": the weights stored as FP8, upcast per call).
    steps / cfg: KSampler's (default STEPS, 1.0: one model call a step).
    Returns (prompt, save_node_id, probe_node_ids).
    """
    spec = family_spec(family, models)
    wf = Workflow()
    model = wf.add("UNETLoader", unet_name=f"tiny_{family}.safetensors", weight_dtype=weight_dtype)
    for class_type, inputs in model_chain:
        inputs = dict(inputs)
        for key, value in list(inputs.items()):
            if isinstance(value, tuple) and value and value[0] == "settings":
                inputs[key] = wf.link(wf.add("TritonAccelSettings", **value[1]))
        model = wf.add(class_type, model=wf.link(model), **inputs)
    probes = [wf.add("TritonAccelTestAttentionProbe", model=wf.link(model), case=c, seed=i)
              for i, c in enumerate(probe_cases)]
    cond = wf.add("TritonAccelTestConditioning", seed=7, **spec["cond"])
    latent = wf.add("TritonAccelTestEmptyLatent", **spec["latent"])
    sampler = wf.add("KSampler", model=wf.link(model), seed=SEED, steps=steps or STEPS, cfg=cfg,
                     sampler_name="euler", scheduler="simple", positive=wf.link(cond),
                     negative=wf.link(cond), latent_image=wf.link(latent), denoise=1.0)
    save = wf.add("SaveLatent", samples=wf.link(sampler),
                  filename_prefix=f"it/{family}_{tag}_{uuid.uuid4().hex[:8]}")
    return wf.nodes, save, probes


def probe_workflow(family: str, model_chain=(), probe_cases=("fp32_full_precision",)):
    """Only load the model, patch it and run attention probes (no sampling)."""
    wf = Workflow()
    model = wf.add("UNETLoader", unet_name=f"tiny_{family}.safetensors", weight_dtype="default")
    for class_type, inputs in model_chain:
        inputs = dict(inputs)
        for key, value in list(inputs.items()):
            if isinstance(value, tuple) and value and value[0] == "settings":
                inputs[key] = wf.link(wf.add("TritonAccelSettings", **value[1]))
        model = wf.add(class_type, model=wf.link(model), **inputs)
    probes = [wf.add("TritonAccelTestAttentionProbe", model=wf.link(model), case=c, seed=i)
              for i, c in enumerate(probe_cases)]
    return wf.nodes, probes


def read_latent(comfy, history_entry: dict, save_node: str) -> torch.Tensor:
    from safetensors.torch import load_file

    files = history_entry["outputs"][save_node]["latents"]
    return load_file(str(comfy.output_file(files[0])))["latent_tensor"]


def probe_reports(history_entry: dict, probe_nodes) -> list[dict]:
    return [history_entry["outputs"][n]["probe"][0] for n in probe_nodes]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


PATCH = "TritonAccelPatchAttention"


def patch(mode: str | None = "fp16", device: str = "auto"):
    """A model_chain item for TritonAccelPatchAttention (mode None: no settings input)."""
    if mode is None:
        return (PATCH, {})
    return (PATCH, {"settings": ("settings", {"mode": mode, "device": device})})


def fused_norms(item: tuple, norms: str) -> tuple:
    """A PATCH or COMBINED_PATCH model_chain item run with TRITON_ACCEL_FUSED_NORMS=norms ("all",
    "qk", "blocks" or "off"; unset, the pack's default, is "all") through the TritonAccelTestFusedNorms test node;
    the combined node then gets skip "auto" and min_tokens 1, as linear_patch() gives it."""
    node, inputs = item
    wrapped = {"node": node, "attn1_patch": False, "fused_norms": norms}
    if "settings" in inputs:
        wrapped["settings"] = inputs["settings"]
    return ("TritonAccelTestFusedNorms", wrapped)


LINEAR_PATCH = "TritonAccelPatchLinear"
COMBINED_PATCH = "TritonAccelPatch"


def linear_patch(linear_mode: str | None = "fp8", min_tokens: int = 1, skip: str = "auto",
                 attention_mode: str = "off", combined: bool = False):
    """A model_chain item for TritonAccelPatchLinear (or, combined, TritonAccelPatch); the
    Settings node gets `attention_mode` and `linear_mode` (None: no settings input)."""
    inputs = {"skip": skip, "min_tokens": min_tokens}
    if linear_mode is not None:
        inputs["settings"] = ("settings", {"mode": attention_mode, "device": "auto", "linear": linear_mode})
    return (COMBINED_PATCH if combined else LINEAR_PATCH, inputs)


def lora(name: str, strength: float = 1.0):
    """A model_chain item for ComfyUI's LoraLoaderModelOnly (the file in models/loras)."""
    return ("LoraLoaderModelOnly", {"lora_name": name, "strength_model": strength})


def spy(tag: str, perturb: float = 0.0, drop_mask: bool = False):
    return ("TritonAccelTestSpyOverride", {"tag": tag, "perturb": perturb, "drop_mask": drop_mask})
