"""End to end in real ComfyUI code: milliseconds per denoising step, one run, every variant.

Builds full-size Flux-architecture (12B) and Wan 2.1 14B-architecture models with random
weights made in place (bf16, on the GPU; nothing is downloaded), patches them the way the
nodes do, and times `BaseModel.apply_model` (what the sampler calls once per step at cfg 1)
with:
  default      ComfyUI's own attention (PyTorch SDPA with its default backend)
  sdpa-flash   the same, SDPA forced to its FlashAttention-2 backend (the RTX default)
  sage         ComfyUI's SageAttention path (sageattention 1.0.6, Triton)
  ours-auto    TritonAccelPatchAttention with settings auto
  ours-triton  TritonAccelPatchAttention with settings fp16 (our kernel forced)
  ours-fp8     TritonAccelPatchAttention with settings fp8 (our FP8 Q.K kernel forced, sm_89+)
and reports each variant's ms/step, its ratio to the default, and the relative L2 difference
of its output from the default's.

    python benchmarks/e2e_comfyui.py --comfyui .ext/ComfyUI-0.29.0 [--models flux wan] [--tiny]

--tiny builds two-block models for a CPU smoke run (use TRITON_INTERPRET=1 there).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FULL = {
    # Flux.1-dev: 19 double + 38 single blocks, hidden 3072, 24 heads of 128; 1024x1024 image
    # = 128x128 latent = 4096 image tokens + 512 T5 tokens.
    "flux": dict(unet=dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096,
                           hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=19, depth_single_blocks=38,
                           axes_dim=[16, 56, 56], theta=10000, qkv_bias=True, guidance_embed=True, patch_size=2,
                           txt_ids_dims=[]),
                 latent=(1, 16, 128, 128), text=(1, 512, 4096), pooled=(1, 768)),
    # Wan 2.1 T2V 14B: 40 layers, dim 5120, 40 heads of 128; 832x480x81 frames = latent
    # 21x60x104 = 32,760 tokens after the (1,2,2) patch; 512 umT5 tokens.
    "wan": dict(unet=dict(image_model="wan2.1", model_type="t2v", dim=5120, out_dim=16, num_heads=40, ffn_dim=13824,
                          num_layers=40, patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True,
                          cross_attn_norm=True, eps=1e-6, in_dim=16, text_len=512),
                latent=(1, 16, 21, 60, 104), text=(1, 512, 4096), pooled=None),
}
TINY = {
    "flux": dict(unet={**FULL["flux"]["unet"], "hidden_size": 256, "num_heads": 2, "depth": 1,
                       "depth_single_blocks": 1, "axes_dim": [16, 56, 56], "context_in_dim": 64, "vec_in_dim": 32},
                 latent=(1, 16, 8, 8), text=(1, 8, 64), pooled=(1, 32)),
    "wan": dict(unet={**FULL["wan"]["unet"], "dim": 256, "num_heads": 2, "ffn_dim": 512, "num_layers": 1},
                latent=(1, 16, 2, 8, 8), text=(1, 8, 4096), pooled=None),
}


def load_pack(name="triton_accel_bench"):
    spec = importlib.util.spec_from_file_location(name, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def build(spec, dtype, device):
    import torch
    import comfy.model_detection
    import comfy.model_patcher

    config = comfy.model_detection.model_config_from_unet_config(dict(spec["unet"]))
    assert config is not None, f"ComfyUI does not recognise {spec['unet']['image_model']}"
    config.set_inference_dtype(dtype, None)
    model = config.get_model({}, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:  # weights: small random values keep activations finite through 60 blocks
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
                        .mul_(p.shape[-1] ** -0.5 * 0.5).to(p.dtype))
            elif name.endswith(("scale", "norm.weight", "norm1.weight", "norm2.weight", "norm3.weight")):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(p.dtype))
    model.to(device)
    model.eval()
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)
    return patcher


def inputs(spec, dtype, device):
    import torch

    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(spec["latent"], generator=gen, device=device, dtype=torch.float32)
    context = torch.randn(spec["text"], generator=gen, device=device, dtype=torch.float32)
    kwargs = {}
    if spec["pooled"] is not None:
        kwargs["y"] = torch.randn(spec["pooled"], generator=gen, device=device, dtype=torch.float32)
        kwargs["guidance"] = torch.full((1,), 3.5, device=device)
    t = torch.full((1,), 0.7, device=device)
    return x, t, context, kwargs


def sage_override():
    import comfy.ldm.modules.attention as attention

    sage = attention.REGISTERED_ATTENTION_FUNCTIONS.get("sage")
    if sage is None:
        return None

    def override(func, *args, **kwargs):
        return sage(*args, **kwargs)
    return override


def step_fn(patcher, x, t, context, kwargs):
    import copy
    import torch

    # What comfy.samplers.calc_cond_batch does per step: a copy of the model's
    # transformer_options handed to apply_model.
    def run():
        to = copy.copy(patcher.model_options.get("transformer_options", {}))
        with torch.no_grad():
            return patcher.model.apply_model(x, t, c_crossattn=context, transformer_options=to, **kwargs)
    return run


def time_steps(run, steps, device):
    import torch

    out = run()  # warm-up: compilation, autotune lookups, auto's one-off timing
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = run()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH", str(ROOT / ".ext" / "ComfyUI-0.29.0")))
    ap.add_argument("--models", nargs="+", default=["flux", "wan"])
    ap.add_argument("--variants", nargs="+", default=["default", "sdpa-flash", "sage", "ours-auto", "ours-triton", "ours-fp8"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "benchmarks" / "results")))
    args = ap.parse_args()

    sys.path.insert(0, args.comfyui)
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import comfy.cli_args

    if not torch.cuda.is_available():
        comfy.cli_args.args.cpu = True  # model_management asks CUDA for its device at import
    pack = load_pack()
    from triton_accel_bench.nodes import call_stats
    from triton_accel_bench.nodes.patch_attention import patch_model
    from triton_accel_bench.nodes.settings import AccelSettings

    os.environ.setdefault("TRITON_ACCEL_CACHE_DIR", str(Path(args.out) / "cache"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    specs = TINY if args.tiny else FULL
    results = []
    for name in args.models:
        spec = specs[name]
        t_build = time.perf_counter()
        base = build(spec, dtype, device)
        x, t, context, kwargs = inputs(spec, dtype, device)
        print(f"[{name}] built in {time.perf_counter() - t_build:.1f} s", flush=True)
        ref = None
        for variant in args.variants:
            ctx = contextlib.nullcontext()
            patcher = base
            if variant == "sdpa-flash":
                if device.type != "cuda":
                    continue
                ctx = sdpa_kernel([SDPBackend.FLASH_ATTENTION])
            elif variant == "sage":
                override = sage_override()
                if override is None:
                    results.append(dict(model=name, variant=variant, error="sageattention not importable"))
                    continue
                patcher = base.clone()
                patcher.model_options["transformer_options"]["optimized_attention_override"] = override
            elif variant == "ours-auto":
                patcher = patch_model(base, AccelSettings("auto"))
            elif variant == "ours-triton":
                patcher = patch_model(base, AccelSettings("fp16"))
            elif variant == "ours-fp8":
                patcher = patch_model(base, AccelSettings("fp8"))
            call_stats.reset()
            try:
                with ctx:
                    ms, out = time_steps(step_fn(patcher, x, t, context, kwargs), args.steps, device)
            except Exception as e:  # one broken variant must not lose the others' numbers
                results.append(dict(model=name, variant=variant, error=f"{type(e).__name__}: {e}"[:300]))
                print(f"[{name}] {variant}: FAILED {e}", flush=True)
                continue
            out = out.float()
            if ref is None:
                ref = out
            diff = ((out - ref).norm() / ref.norm()).item()
            row = dict(model=name, variant=variant, ms_per_step=ms, rel_l2_vs_default=diff,
                       finite=bool(torch.isfinite(out).all()), calls=call_stats.snapshot()["calls"],
                       paths=call_stats.snapshot()["paths"])
            results.append(row)
            print(f"[{name}] {variant}: {ms:.1f} ms/step, rel L2 vs default {diff:.2e}, calls {row['calls']}",
                  flush=True)
        del base, patcher
        if device.type == "cuda":
            torch.cuda.empty_cache()

    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                triton=pack.kernels.triton_version(), dtype=str(dtype), steps=args.steps, tiny=args.tiny)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "e2e_comfyui.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    print(f"\n{meta}")
    print(f"{'model':6} {'variant':12} {'ms/step':>9} {'vs default':>10} {'rel L2':>9}  calls")
    for name in args.models:
        default = next((r["ms_per_step"] for r in results if r["model"] == name and r["variant"] == "default"
                        and "ms_per_step" in r), None)
        for r in (r for r in results if r["model"] == name):
            if "error" in r:
                print(f"{name:6} {r['variant']:12} {'-':>9} {'-':>10} {'-':>9}  {r['error']}")
                continue
            ratio = default / r["ms_per_step"] if default else float("nan")
            print(f"{name:6} {r['variant']:12} {r['ms_per_step']:9.1f} {ratio:9.3f}x {r['rel_l2_vs_default']:9.2e}"
                  f"  {r['calls']} {r['paths']}")


if __name__ == "__main__":
    main()
