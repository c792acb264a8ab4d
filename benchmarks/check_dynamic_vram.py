"""On a CUDA GPU with comfy-aimdo: our Linear under ComfyUI 0.29's dynamic VRAM, one process.

Switches dynamic VRAM on the way ComfyUI's main.py does (benchmarks/e2e_comfyui.py's
start_aimdo / enable_dynamic_vram), builds a small Flux-architecture model from ComfyUI's own
classes (random weights; its Linear layers are comfy.ops.disable_weight_init.Linear with bf16
weights, or manual_cast.Linear holding float8_e4m3fn weights, and a scaled-FP8 variant where
each Linear carries a `scale_weight` (per tensor, or per output channel on every other layer)
applied as ComfyUI's scaled-FP8 layers apply it), loads it through ModelPatcherDynamic
(weights on the CPU, streamed per call from the VBAR) and compares, per weight kind:

  unpatched                      ComfyUI's Linear (the reference)
  patched                        patch_linear_model (Linear forced to fp8 W8A8, nothing skipped,
                                 min_tokens 1): every Linear call must be served by our
                                 kernels on the dynamic-VRAM route, output rel. L2 <= 0.05
  LoRA before our patch          a "diff" weight patch added with ModelPatcher.add_patches on a
                                 clone, then our patch: output vs the unpatched LoRA model
  LoRA after our patch           our patch, then add_patches on a clone of the patched model

The LoRA patches must move the unpatched output by rel. L2 0.1 or more, so that agreeing
with it proves the LoRA reached our kernels. Exit status 1 on any failure, with the reason.

    python benchmarks/check_dynamic_vram.py --comfyui .ext/comfy-slim [--weights bf16 fp8 fp8-scaled]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Model output (one denoising step) against the unpatched model: every Linear in FP8 W8A8 (e4m3
# weights per channel, activations per token: ~0.03 per layer on Gaussian data), errors of the
# layers partly averaging out; the CPU test of a tiny model holds 0.08, the H200 e2e runs of the
# full models measured cosine 0.99999 (rel. L2 ~0.005).
BAR = 0.05
# rel. L2 the LoRA patch moves the unpatched output by, at least: twice the bar, so an output
# that missed the LoRA cannot pass (0.22 bf16 / 0.32 scaled FP8 on a 256-wide model through the
# CPU interpreter and the legacy patcher).
LORA_MIN_EFFECT = 0.1
SPEC = dict(unet=dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=256, context_in_dim=512,
                      hidden_size=1024, mlp_ratio=4.0, num_heads=8, depth=2, depth_single_blocks=2,
                      axes_dim=[16, 56, 56], theta=10000, qkv_bias=True, guidance_embed=True, patch_size=2,
                      txt_ids_dims=[]),
            latent=(1, 16, 64, 64), text=(1, 64, 512), pooled=(1, 256))


def _e2e():
    spec = importlib.util.spec_from_file_location("e2e_comfyui", HERE / "e2e_comfyui.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["e2e_comfyui"] = module
    spec.loader.exec_module(module)
    return module


def scaled_fp8_linear_class():
    """manual_cast.Linear applying `scale_weight` to the FP8 weight it casts, as ComfyUI's
    scaled-FP8 layers do (comfy.ops.scaled_fp8_ops before 0.29; a [N, 1] scale is per channel)."""
    import torch
    import comfy.ops

    class ScaledFP8Linear(comfy.ops.manual_cast.Linear):
        def forward_comfy_cast_weights(self, input):
            weight, bias, offload_stream = comfy.ops.cast_bias_weight(self, input, offloadable=True)
            scale = self.scale_weight.to(device=weight.device, dtype=weight.dtype)
            out = torch.nn.functional.linear(input, weight * scale, bias)
            comfy.ops.uncast_bias_weight(self, weight, bias, offload_stream)
            return out
    return ScaledFP8Linear


def add_scales(model) -> int:
    """Turn every FP8 Linear into a scaled one: stored = w / scale (powers of two: exact in e4m3)."""
    import torch

    cls = scaled_fp8_linear_class()
    count = 0
    for name, module in model.diffusion_model.named_modules():
        weight = getattr(module, "weight", None)
        if type(module).__name__ != "Linear" or weight is None or weight.dtype != torch.float8_e4m3fn:
            continue
        n = weight.shape[0]
        if count % 2:
            scale = (2.0 ** -torch.arange(5, 8, device=weight.device).repeat(n // 3 + 1)[:n].float()).reshape(n, 1)
        else:
            scale = torch.tensor(2.0 ** -6, device=weight.device)
        with torch.no_grad():
            weight.copy_((weight.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn))
        module.scale_weight = torch.nn.Parameter(scale, requires_grad=False)
        module.__class__ = cls
        count += 1
    return count


def lora_patches(patcher, seed: int) -> dict:
    """A "diff" patch (what a merged LoRA adds) on every Linear weight, 0.5x the weight's own
    spread (stored values: a scaled FP8 weight's diff is in its stored units, as ComfyUI adds it)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    patches = {}
    for key, weight in patcher.model.state_dict().items():
        if key.startswith("diffusion_model.") and key.endswith(".weight") and weight.dim() == 2:
            spread = weight.float().std().item()
            patches[key] = ((torch.randn(weight.shape, generator=gen) * spread * 0.5).to(torch.bfloat16),)
    return patches


STREAMED_MODULES = {}  # id(model) -> modules with a VBAR slot while it was loaded


def run(e2e, patcher, inputs, device):
    import comfy.model_management

    x, t, context, kwargs = inputs
    comfy.model_management.load_models_gpu([patcher])
    try:
        STREAMED_MODULES[id(patcher.model)] = sum(1 for m in patcher.model.modules() if hasattr(m, "_v"))
        step = e2e.step_fn(patcher, x, t, context, kwargs)
        step()  # the guard's first calls and auto's one-off work
        return step().float()
    finally:
        comfy.model_management.unload_all_models()


def rel_l2(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def check_weights(e2e, weights: str, device, failures: list) -> None:
    import torch

    from triton_accel_bench.runtime import call_stats, linear_patch
    from triton_accel_bench.runtime.settings import AccelSettings

    settings = AccelSettings("off", linear_mode="fp8")
    base = e2e.build(SPEC, torch.bfloat16, device, "bf16" if weights == "bf16" else "fp8", dynamic_vram=True)
    if weights == "fp8-scaled":
        print(f"[{weights}] {add_scales(base.model)} Linear layers given a scale_weight", flush=True)
    # build() moved the model to the CPU for ModelPatcherDynamic; the VBAR slots appear on load.
    inputs = e2e.inputs(SPEC, torch.bfloat16, device)

    def patch(model):
        return linear_patch.patch_linear_model(model, settings, skip="", min_tokens=1)

    def lora(model, seed=1):
        clone = model.clone()
        added = clone.add_patches(lora_patches(clone, seed), 1.0)
        assert added, "no LoRA key matched the model"
        return clone

    def expect(what, ours, reference, bar=BAR):
        rel = rel_l2(ours, reference)
        linear = call_stats.snapshot().get("kinds", {}).get("linear", {})
        paths, reasons = dict(linear.get("paths", {})), dict(linear.get("reasons", {}))
        streamed = sum(v for k, v in paths.items() if k.endswith("(dynamic VRAM)"))
        ok = rel <= bar and streamed > 0 and not reasons and bool(torch.isfinite(ours).all())
        print(f"[{weights}] {what}: rel L2 {rel:.2e} (bar {bar}), Linear served {linear.get('served', 0)} "
              f"({paths}), handed back {linear.get('handed_back', 0)} {reasons} -> {'ok' if ok else 'FAILED'}",
              flush=True)
        if not ok:
            failures.append(f"{weights} {what}: rel L2 {rel:.3g}, served on the dynamic-VRAM route {streamed}, "
                            f"handed back {reasons}")

    reference = run(e2e, base, inputs, device)
    streamed_modules = STREAMED_MODULES.get(id(base.model), 0)
    print(f"[{weights}] unpatched: {streamed_modules} modules streamed from the VBAR", flush=True)
    if not streamed_modules:
        failures.append(f"{weights}: no module has a VBAR slot: dynamic VRAM is not on")
    call_stats.reset()
    expect("patched", run(e2e, patch(base), inputs, device), reference)

    lora_reference = run(e2e, lora(base), inputs, device)
    effect = rel_l2(lora_reference, reference)
    print(f"[{weights}] LoRA moves the unpatched output by rel L2 {effect:.3f}", flush=True)
    if effect < LORA_MIN_EFFECT:
        failures.append(f"{weights}: the LoRA patch moved the output by {effect:.3g} only (< {LORA_MIN_EFFECT})")
    call_stats.reset()
    expect("LoRA before our patch", run(e2e, patch(lora(base)), inputs, device), lora_reference)
    call_stats.reset()
    expect("LoRA after our patch", run(e2e, lora(patch(base)), inputs, device), lora_reference)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH", str(ROOT / ".ext" / "ComfyUI-0.29.0")))
    ap.add_argument("--weights", nargs="+", default=["bf16", "fp8", "fp8-scaled"],
                    choices=["bf16", "fp8", "fp8-scaled"])
    args = ap.parse_args()

    sys.path.insert(0, args.comfyui)
    e2e = _e2e()
    aimdo = e2e.start_aimdo()  # before torch, as ComfyUI's main.py
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("check_dynamic_vram needs a CUDA GPU: dynamic VRAM (comfy-aimdo) manages CUDA memory")
    e2e.enable_dynamic_vram(aimdo)
    e2e.load_pack()
    import comfy.model_patcher

    assert comfy.model_patcher.CoreModelPatcher is comfy.model_patcher.ModelPatcherDynamic
    # With an index: comfy-aimdo's VBAR takes load_device.index, and torch.device("cuda") has none.
    device = torch.device("cuda", torch.cuda.current_device())
    failures: list[str] = []
    for weights in args.weights:
        try:
            check_weights(e2e, weights, device, failures)
        except Exception as e:  # one broken kind must not hide the others
            failures.append(f"{weights}: {type(e).__name__}: {e}")
            print(f"[{weights}] FAILED: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        torch.cuda.empty_cache()
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures), flush=True)
        return 1
    print(f"\nall checks passed ({', '.join(args.weights)}; bar rel L2 {BAR})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
