"""Write tiny random-weight diffusion models that ComfyUI's own model detection recognises.

Run as a script with ComfyUI's folder as the working directory (the integration fixture does
this in a subprocess, so the test process never imports ComfyUI):

    python make_tiny_models.py <out_dir> [family ...]

Each model is built from ComfyUI's own model class with the config its detection
(comfy/model_detection.py) derives from the key layout, so the keys match whatever version of
ComfyUI runs this. Sizes keep what detection hard-codes (head dim 128 for Flux, Wan and
HunyuanVideo; model_channels 320, context 768 and 8 heads for SD1.5) and shrink the rest.
After saving, the file is read back through detection and the family is checked.

Prints one JSON line per model: family, file, detected class, unet config, parameter count.
Test scaffolding only, never part of the pack.
"""
import json
import math
import os
import sys

FAMILIES = {
    # SD1.5-style UNet: 320 channels, context 768, 8 heads -> head dims 40/80/160 at the three
    # levels (the fourth level of SD1.5 is dropped: detection reads channel_mult from the keys);
    # one transformer per level on the way up too (14 attention calls per step: the Triton
    # interpreter is slow).
    "sd15": dict(
        expect="SD15",
        config={
            "use_checkpoint": False, "image_size": 32, "use_spatial_transformer": True, "legacy": False,
            "adm_in_channels": None, "in_channels": 4, "out_channels": 4, "model_channels": 320,
            "num_res_blocks": [1, 1, 1], "transformer_depth": [1, 1, 1],
            "transformer_depth_output": [1, 0, 1, 0, 1, 0], "channel_mult": [1, 2, 4],
            "transformer_depth_middle": 1, "use_linear_in_transformer": False, "context_dim": 768,
            "use_temporal_resblock": False, "use_temporal_attention": False,
        },
    ),
    # Flux (schnell-style: no guidance_in): 2 heads x 128, one double and one single block.
    "flux": dict(
        expect="FluxSchnell",
        config={
            "image_model": "flux", "axes_dim": [16, 56, 56], "num_heads": 2, "mlp_ratio": 4.0,
            "theta": 10000, "out_channels": 16, "qkv_bias": True, "txt_ids_dims": [], "in_channels": 16,
            "hidden_size": 256, "context_in_dim": 64, "patch_size": 2, "vec_in_dim": 32, "depth": 1,
            "depth_single_blocks": 1, "guidance_embed": False, "yak_mlp": False, "txt_norm": False,
        },
    ),
    # Wan 2.1 text-to-video: 2 heads x 128, one block; text_dim stays 4096 (not in detection).
    "wan21": dict(
        expect="WAN21_T2V",
        config={
            "image_model": "wan2.1", "dim": 256, "out_dim": 16, "num_heads": 2, "ffn_dim": 512,
            "num_layers": 1, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1),
            "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "model_type": "t2v",
        },
    ),
    # HunyuanVideo: 2 heads x 128, one double and one single block, text refiner with a
    # [B, 1, L, L] additive mask and the joint blocks with a [1, 1, L] additive mask built from the
    # conditioning's attention_mask.
    "hunyuan_video": dict(
        expect="HunyuanVideo",
        config={
            "image_model": "hunyuan_video", "in_channels": 16, "patch_size": [1, 2, 2], "out_channels": 16,
            "vec_in_dim": 768, "axes_dim": [16, 56, 56], "context_in_dim": 64, "hidden_size": 256,
            "mlp_ratio": 4.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 1, "theta": 256,
            "qkv_bias": True, "guidance_embed": False,
            # newer ComfyUI only; dropped below when the class does not take them
            "meanflow": False, "byt5": False, "use_cond_type_embedding": False, "vision_in_dim": None,
            "meanflow_sum": False,
        },
    ),
}


def _init_weights(sd, seed, dtype):
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(sd):
        t = sd[name]
        if not t.is_floating_point():
            out[name] = t.clone()
            continue
        leaf = name.rsplit(".", 1)[-1]
        if t.dim() == 1 and ("norm" in name or leaf in ("scale",)):
            w = torch.ones(t.shape)
        elif t.dim() == 1:
            w = torch.randn(t.shape, generator=gen) * 0.02
        elif t.dim() >= 2:
            fan_in = math.prod(t.shape[1:])
            w = torch.randn(t.shape, generator=gen) / math.sqrt(fan_in)
        else:
            w = torch.randn(t.shape, generator=gen) * 0.02
        out[name] = w.to(dtype).contiguous()
    return out


def _norm(v):
    return [_norm(x) for x in v] if isinstance(v, (list, tuple)) else v


def _write(family, spec, config, out_dir):
    import dataclasses
    import inspect

    import torch
    import comfy.model_detection
    import comfy.ops
    import comfy.utils

    model_config = comfy.model_detection.model_config_from_unet_config(dict(config))
    if model_config is None or type(model_config).__name__ != spec["expect"]:
        raise SystemExit(f"{family}: config matches {type(model_config).__name__}, expected {spec['expect']}")
    unet_config = dict(model_config.unet_config)

    mod_name, cls_name = {
        "SD15": "comfy.ldm.modules.diffusionmodules.openaimodel:UNetModel",
        "FluxSchnell": "comfy.ldm.flux.model:Flux",
        "WAN21_T2V": "comfy.ldm.wan.model:WanModel",
        "HunyuanVideo": "comfy.ldm.hunyuan_video.model:HunyuanVideo",
    }[spec["expect"]].split(":")
    cls = getattr(__import__(mod_name, fromlist=[cls_name]), cls_name)
    params = inspect.signature(cls.__init__).parameters
    known = set(params)
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        # Flux(..., **kwargs) / HunyuanVideo(..., **kwargs) feed kwargs into a *Params dataclass
        # whose fields differ between ComfyUI versions: keep only the keys this version knows.
        for obj in vars(sys.modules[mod_name]).values():
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__name__.endswith("Params"):
                known |= {f.name for f in dataclasses.fields(obj)}
    unet_config = {k: v for k, v in unet_config.items() if k in known}
    model = cls(**unet_config, device="cpu", dtype=torch.float32, operations=comfy.ops.disable_weight_init)
    shapes = model.state_dict()
    nparams = sum(t.numel() for t in shapes.values())
    # Models that cannot be shrunk much (SD1.5 keeps 320/640/1280 channels; ComfyUI 0.3.x reads
    # Flux as 3072 wide whatever the weights say) are stored in fp16: lossless to load as fp32,
    # which ComfyUI runs on the CPU, and half the file.
    store = torch.float16 if nparams > 100_000_000 else torch.float32
    sd = _init_weights(shapes, seed=sum(map(ord, family)), dtype=store)
    del model, shapes

    path = os.path.join(out_dir, f"tiny_{family}.safetensors")
    comfy.utils.save_torch_file(sd, path)
    del sd
    loaded = comfy.utils.load_torch_file(path)
    detected = comfy.model_detection.model_config_from_unet(loaded, "")
    name = type(detected).__name__ if detected is not None else None
    if name != spec["expect"]:
        raise SystemExit(f"{family}: ComfyUI detects {name}, expected {spec['expect']}")
    detected_cfg = {k: _norm(v) for k, v in comfy.model_detection.detect_unet_config(loaded, "").items()
                    if isinstance(v, (int, float, str, bool, list, tuple, type(None)))}
    return path, name, nparams, detected_cfg


def build(family, out_dir):
    spec = FAMILIES[family]
    config = dict(spec["config"])
    for attempt in range(2):
        path, name, nparams, detected = _write(family, spec, config, out_dir)
        # Some ComfyUI versions hard-code sizes instead of reading them from the weights (0.3.x
        # Flux: hidden 3072, 24 heads, context 4096): take what detection says and build again.
        differ = {k: detected[k] for k in config if k in detected and _norm(config[k]) != detected[k]}
        if not differ:
            break
        print(f"{family}: detection reads {differ}; rebuilding with those", file=sys.stderr)
        config.update(differ)
    else:
        raise SystemExit(f"{family}: detection still disagrees after a rebuild: {differ}")
    return {"family": family, "file": os.path.basename(path), "detected": name, "params": nparams,
            "unet_config": detected}


def main(argv):
    out_dir = os.path.abspath(argv[1])
    families = argv[2:] or list(FAMILIES)
    sys.path.insert(0, os.getcwd())
    import comfy.cli_args
    comfy.cli_args.args.cpu = True  # never touch a GPU while writing weights
    os.makedirs(out_dir, exist_ok=True)
    for family in families:
        print(json.dumps(build(family, out_dir)), flush=True)


if __name__ == "__main__":
    main(sys.argv)
