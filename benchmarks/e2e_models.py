"""The models of the end-to-end benchmarks: ComfyUI's own model classes at full size (FULL) or a
CPU-sized cut of them (TINY), random weights made in place, and the inputs of one step.

Families: sd15 (SD1.5, 512x512, batch 2), sdxl (SDXL base, 1024x1024, batch 2), flux (Flux.1-dev
12B, 1024x1024), qwen_image (Qwen-Image 20B, 1024x1024), wan (Wan 2.1 T2V 14B, 832x480x81).
Each FULL unet config is what comfy/model_detection.py's detect_unet_config makes of the real
checkpoint (tests/integration/test_e2e_builders.py checks it: a FULL model built on the meta
device is detected back to the same config and supported model).

Random weights keep activations finite through 60 blocks and keep every block visible in the
output: attention logits have a spread of a few units (a real model's peaked attention, not a
uniform average that hides the kernels' errors) and each block's output projections write an
update that is a sizeable fraction of the residual (in bf16 an update below 2^-9 of the residual
rounds away). `sensitivity` measures it: a 1 % change of one module's output and the step
output's relative change.
"""
from __future__ import annotations

FAMILIES = ("sd15", "sdxl", "flux", "qwen_image", "wan")

# SD1.5 / SDXL: detect_unet_config's keys for the original checkpoints (the supported model
# adds num_heads / num_head_channels).
_UNET_COMMON = dict(use_checkpoint=False, image_size=32, use_spatial_transformer=True, legacy=False, in_channels=4,
                    out_channels=4, use_temporal_resblock=False, use_temporal_attention=False)
SD15_UNET = dict(_UNET_COMMON, adm_in_channels=None, model_channels=320, num_res_blocks=[2, 2, 2, 2],
                 transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0], transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
                 channel_mult=[1, 2, 4, 4], transformer_depth_middle=1, use_linear_in_transformer=False, context_dim=768)
SDXL_UNET = dict(_UNET_COMMON, num_classes="sequential", adm_in_channels=2816, model_channels=320,
                 num_res_blocks=[2, 2, 2], transformer_depth=[0, 0, 2, 2, 10, 10],
                 transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10], channel_mult=[1, 2, 4],
                 transformer_depth_middle=10, use_linear_in_transformer=True, context_dim=2048)

# Per family: the supported model ComfyUI picks (comfy.supported_models); `gains`: (name
# suffixes, factor) on the weight scale of the modules whose output is added to the residual
# stream (attention outputs, MLP outputs, ResBlocks' last conv) and of the final layer; the DiTs'
# gates come out of their modulation Linear at ~0.05, which their writers make up for;
# `attention_out`: the modules that end an attention (the sensitivity probes).
FAMILY = {
    "sd15": dict(config_class="SD15", attention_out=("attn1.to_out.0",),
                 gains=((("attn1.to_out.0", "attn2.to_out.0"), 2.0), (("diffusion_model.out.2",), 3.5))),
    "sdxl": dict(config_class="SDXL", attention_out=("attn1.to_out.0",),
                 gains=((("attn1.to_out.0", "attn2.to_out.0"), 2.0), (("diffusion_model.out.2",), 3.5))),
    "flux": dict(config_class="Flux", attention_out=("img_attn.proj", "linear2"),
                 gains=((("img_attn.proj", "txt_attn.proj"), 20.0), (("img_mlp.2", "txt_mlp.2"), 12.0),
                        (("linear2",), 15.0), (("final_layer.linear",), 2.0))),
    "qwen_image": dict(config_class="QwenImage", attention_out=("attn.to_out.0",),
                       gains=((("attn.to_out.0", "attn.to_add_out"), 25.0), (("img_mlp.net.2", "txt_mlp.net.2"), 20.0),
                              (("diffusion_model.proj_out",), 2.0))),
    "wan": dict(config_class="WAN21_T2V", attention_out=("self_attn.o",),
                gains=((("self_attn.o", "cross_attn.o"), 10.0), (("ffn.2",), 4.0), (("head.head",), 2.0))),
}

FULL = {
    # SD1.5 at 512x512, batch 2: latent 64x64, 77 CLIP-L tokens.
    "sd15": dict(unet=SD15_UNET, latent=(2, 4, 64, 64), text=(2, 77, 768), pooled=None),
    # SDXL base at 1024x1024, batch 2: latent 128x128, 77 CLIP-L+G tokens, pooled + size embedding (2816).
    "sdxl": dict(unet=SDXL_UNET, latent=(2, 4, 128, 128), text=(2, 77, 2048), pooled=(2, 2816)),
    # Flux.1-dev: 19 double + 38 single blocks, hidden 3072, 24 heads of 128; 1024x1024 image
    # = 128x128 latent = 4096 image tokens + 512 T5 tokens.
    "flux": dict(unet=dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096,
                           hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=19, depth_single_blocks=38,
                           axes_dim=[16, 56, 56], theta=10000, qkv_bias=True, guidance_embed=True, patch_size=2,
                           txt_ids_dims=[], yak_mlp=False, txt_norm=False),
                 latent=(1, 16, 128, 128), text=(1, 512, 4096), pooled=(1, 768)),
    # Qwen-Image: 60 blocks, 24 heads of 128 (3072 wide), Qwen2.5-VL 7B text states (3584); detection
    # reads in_channels (64 = 16 latent channels x 2x2 patch) and the block count. 1024x1024 = a
    # 16x1x128x128 latent (Wan 2.1's format: the sampler adds the frame axis) = 4096 image tokens,
    # with ~256 text tokens.
    "qwen_image": dict(unet=dict(image_model="qwen_image", in_channels=64, num_layers=60),
                       latent=(1, 16, 1, 128, 128), text=(1, 256, 3584), pooled=None),
    # Wan 2.1 T2V 14B: 40 layers, dim 5120, 40 heads of 128; 832x480x81 frames = latent
    # 21x60x104 = 32,760 tokens after the (1,2,2) patch; 512 umT5 tokens.
    "wan": dict(unet=dict(image_model="wan2.1", model_type="t2v", dim=5120, out_dim=16, num_heads=40, ffn_dim=13824,
                          num_layers=40, patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True,
                          cross_attn_norm=True, eps=1e-6, in_dim=16),
                latent=(1, 16, 21, 60, 104), text=(1, 512, 4096), pooled=None),
}
# A step of each in seconds on a CPU: one or two blocks, a few hundred tokens. The UNets keep
# their structure (res blocks, down/up sampling, spatial transformers) at 64 channels.
_UNET_TINY = dict(model_channels=64, num_res_blocks=[1, 1], channel_mult=[1, 2], transformer_depth_middle=1,
                  context_dim=64)
TINY = {
    "sd15": dict(unet=dict(SD15_UNET, **_UNET_TINY, transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1]),
                 latent=(2, 4, 16, 16), text=(2, 8, 64), pooled=None),
    "sdxl": dict(unet=dict(SDXL_UNET, **_UNET_TINY, transformer_depth=[0, 1], transformer_depth_output=[0, 0, 1, 1],
                           adm_in_channels=96),
                 latent=(2, 4, 16, 16), text=(2, 8, 64), pooled=(2, 96)),
    "flux": dict(unet={**FULL["flux"]["unet"], "hidden_size": 256, "num_heads": 2, "depth": 1,
                       "depth_single_blocks": 1, "axes_dim": [16, 56, 56], "context_in_dim": 64, "vec_in_dim": 32},
                 latent=(1, 16, 16, 16), text=(1, 8, 64), pooled=(1, 32)),
    # heads of 128: the RoPE axes (16, 56, 56) fill a head
    "qwen_image": dict(unet=dict(FULL["qwen_image"]["unet"], num_layers=1, num_attention_heads=2, attention_head_dim=128,
                                 joint_attention_dim=64),
                       latent=(1, 16, 1, 16, 16), text=(1, 8, 64), pooled=None),
    "wan": dict(unet={**FULL["wan"]["unet"], "dim": 256, "num_heads": 2, "ffn_dim": 512, "num_layers": 1},
                latent=(1, 16, 2, 16, 16), text=(1, 8, 4096), pooled=None),
}
for _name in FAMILIES:
    FULL[_name].update(family=_name, tiny=False)
    TINY[_name].update(family=_name, tiny=True)

# Weight of a weight matrix: N(0, (WEIGHT_STD / sqrt(fan_in))^2), an activation's scale kept
# through a Linear or a convolution. QK_GAIN: the RMS of q and k entries feeding attention (the
# QK-norm weight where the model has one, else the q/k projections' gain): logits then have a
# standard deviation of about QK_GAIN^2.
WEIGHT_STD = 0.5
QK_GAIN = 1.75
_QK_NORMS = ("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight", "query_norm.weight",
             "key_norm.weight")
_QK_PROJECTIONS = ("to_q.weight", "to_k.weight")


def model_config(spec):
    """The supported-model config ComfyUI's loader makes for this unet config: through
    model_config_from_unet_config for the full sizes (as load_diffusion_model_state_dict does), the
    family's supported model built directly for a TINY cut (detection does not recognise those).
    A spec of no family (another benchmark's own cut) goes through detection alone."""
    import comfy.model_detection
    import comfy.supported_models

    family = FAMILY.get(spec.get("family"))
    cls = family and getattr(comfy.supported_models, family["config_class"])
    if spec.get("tiny") and cls:
        return cls(dict(spec["unet"]))
    config = comfy.model_detection.model_config_from_unet_config(dict(spec["unet"]))
    assert config is not None, f"ComfyUI does not recognise {spec['unet']}"
    assert cls is None or type(config) is cls, f"ComfyUI picks {type(config).__name__}, not {cls.__name__}"
    return config


def init_weights(model, spec, device, seed: int = 0) -> None:
    """Random weights in place (see the module's docstring). A spec of no family gets the plain
    scheme: no gains, QK norms at 1."""
    import torch

    family = FAMILY.get(spec.get("family"))
    gains = family["gains"] if family else ()
    gen = torch.Generator(device=device).manual_seed(seed)
    qk_norms = any(name.endswith(_QK_NORMS) for name, _ in model.named_parameters())

    def randn(shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)

    with torch.no_grad():
        for name, p in model.named_parameters():
            module_name = name.rsplit(".", 1)[0]
            if p.ndim >= 2:  # Linear / conv weights (fan in: all but the first axis), Wan's modulation
                fan_in = p[0].numel() if p.ndim > 2 and p.shape[0] != 1 else p.shape[-1]
                gain = WEIGHT_STD * next((g for suffixes, g in gains if module_name.endswith(suffixes)), 1.0)
                if family and not qk_norms and name.endswith(_QK_PROJECTIONS):
                    gain = QK_GAIN
                p.copy_(randn(p.shape).mul_(gain * fan_in ** -0.5).to(p.dtype))
            elif name.endswith(_QK_NORMS):
                p.fill_(QK_GAIN if family else 1.0)
            elif name.endswith(("weight", "scale")):  # norms' (GroupNorm, LayerNorm, RMSNorm) scales
                p.fill_(1.0)
            else:  # biases
                p.copy_(randn(p.shape).mul_(0.02).to(p.dtype))


def make_patcher(model, device, dynamic_vram: bool):
    """The ModelPatcher ComfyUI's loader would make: under dynamic VRAM the weights go to the
    offload device (the CPU) and ModelPatcherDynamic streams them; otherwise they stay on `device`."""
    import torch
    import comfy.model_patcher

    if not dynamic_vram:
        return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)
    model.to("cpu")  # built and initialised on the GPU (fast), kept where ComfyUI keeps it
    torch.cuda.empty_cache()
    return comfy.model_patcher.ModelPatcherDynamic(model, load_device=device, offload_device=torch.device("cpu"))


def build_model(spec, dtype, device, weights="bf16"):
    """The BaseModel with random weights. weights: "bf16" (dtype), "fp8-fast" (ComfyUI's
    fp8_e4m3fn_fast: FP8 weights and its FP8 matmul ops) or "fp8" (weight_dtype fp8_e4m3fn: FP8
    weights upcast per call)."""
    import torch

    config = model_config(spec)
    if weights == "bf16":
        config.set_inference_dtype(dtype, None)
    else:
        # What load_diffusion_model_state_dict does for these weight_dtype choices.
        config.set_inference_dtype(torch.float8_e4m3fn, dtype)
        if weights == "fp8-fast":
            config.optimizations["fp8"] = True
    model = config.get_model({}, device=device)
    if device.type != "meta":
        init_weights(model, spec, device)
    model.to(device)
    model.eval()
    model.requires_grad_(False)  # as ComfyUI's loaders leave them (LoRA merging rounds in place)
    return model


def build(spec, dtype, device, weights="bf16", dynamic_vram=False):
    """The ModelPatcher of build_model's model (see make_patcher)."""
    return make_patcher(build_model(spec, dtype, device, weights), device, dynamic_vram)


def inputs(spec, dtype, device):
    """(x, sigma, context, kwargs) of one apply_model call: the latent, a sigma per batch item, the
    text states and the family's extra conditioning (SDXL's y, Flux's pooled y and guidance)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(spec["latent"], generator=gen, device=device, dtype=torch.float32)
    context = torch.randn(spec["text"], generator=gen, device=device, dtype=torch.float32)
    kwargs = {}
    if spec["pooled"] is not None:
        kwargs["y"] = torch.randn(spec["pooled"], generator=gen, device=device, dtype=torch.float32)
    if spec["unet"].get("guidance_embed"):  # Flux.1-dev's distilled guidance, as its workflows set it
        kwargs["guidance"] = torch.full((spec["latent"][0],), 3.5, device=device)
    t = torch.full((spec["latent"][0],), 0.7, device=device)
    return x, t, context, kwargs


def probe_modules(model, spec) -> list[str]:
    """The attention-ending modules the sensitivity check perturbs: the first, the middle and the
    last one of the model (the first one's change has every later block to cross)."""
    names = [n for n, _ in model.named_modules() if n.endswith(FAMILY[spec["family"]]["attention_out"])]
    if not names:
        return []
    picks = [names[0], names[len(names) // 2], names[-1]]
    return list(dict.fromkeys(picks))


def sensitivity(run, model, spec, scale: float = 1.01, modules: list[str] | None = None) -> dict:
    """Relative L2 change of the step output when one module's output is scaled by `scale` (a
    forward hook), per probed module, beside `noise`: the change between two unperturbed steps."""
    import torch

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    base = run().float().clone()
    result = {"noise": rel(run(), base), "changes": {}}
    lookup = dict(model.named_modules())
    for name in modules or probe_modules(model, spec):
        handle = lookup[name].register_forward_hook(lambda _m, _args, out: out * scale)
        try:
            out = run()
        finally:
            handle.remove()
        result["changes"][name] = rel(out, base)
    result["finite"] = bool(torch.isfinite(base).all())
    return result


def block_update_ratios(run, model) -> list[float]:
    """Per transformer block (the entries of the model's block lists), RMS of the update it adds
    to the hidden states over the RMS of the hidden states it receives: how much of the residual
    each block writes."""
    import torch

    ratios, handles, received = [], [], []

    def hidden(args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states", kwargs.get("x", kwargs.get("img")))
        return x if isinstance(x, torch.Tensor) else None

    def before(_module, args, kwargs):  # a copy: some blocks add to their input in place
        x = hidden(args, kwargs)
        received.append(None if x is None else x.float().clone())

    def after(_module, _args, _kwargs, out):
        x = received.pop()
        outs = out if isinstance(out, (tuple, list)) else (out,)
        y = None if x is None else next((o for o in outs if isinstance(o, torch.Tensor) and o.shape == x.shape), None)
        if y is not None:
            ratios.append(((y.float() - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt()).item())

    blocks = [m for n, lst in model.named_modules() if isinstance(lst, torch.nn.ModuleList)
              and n.endswith(("blocks", "transformer_blocks")) for m in lst]
    for m in blocks:
        handles += [m.register_forward_pre_hook(before, with_kwargs=True), m.register_forward_hook(after, with_kwargs=True)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return ratios


def check_sensitivity(name, spec, patcher, run) -> dict:
    """sensitivity and block_update_ratios of the unpatched model, loaded as the sampler loads it,
    printed on one line."""
    import statistics

    import comfy.model_management

    comfy.model_management.load_models_gpu([patcher], force_full_load=True)
    try:
        result = sensitivity(run, patcher.model, spec)
        ratios = block_update_ratios(run, patcher.model)
    finally:
        comfy.model_management.unload_all_models()
    result["block_update_ratio"] = dict(n=len(ratios), min=min(ratios, default=0), max=max(ratios, default=0),
                                        median=statistics.median(ratios) if ratios else 0)
    changes = ", ".join(f"{module}: {change:.2e}" for module, change in result["changes"].items())
    print(f"[{name}] sensitivity to 1 % on one attention output: {changes} (noise {result['noise']:.1e}, finite "
          f"{result['finite']}); block update / residual {result['block_update_ratio']}", flush=True)
    return result
