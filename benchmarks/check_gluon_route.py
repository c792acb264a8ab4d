"""On an sm_90 GPU: which kernel serves kernels.attention(backend="triton") at model shapes,
and its accuracy against SDPA, in ComfyUI's [B, L, H, D] view layout and contiguous layout.

    python benchmarks/check_gluon_route.py
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("triton_accel", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
pack = importlib.util.module_from_spec(spec)
sys.modules["triton_accel"] = pack
spec.loader.exec_module(pack)
kernels = importlib.import_module("triton_accel.kernels")

SHAPES = {"flux": (1, 24, 4608, 128), "wan_cross": (1, 40, 32760, 128, 512), "sd3_d64": (2, 24, 4429, 64)}


def main():
    for name, shape in SHAPES.items():
        b, h, lq, d = shape[:4]
        lk = shape[4] if len(shape) > 4 else lq
        for layout in ("comfy_view", "contiguous"):
            g = torch.Generator(device="cuda").manual_seed(0)
            if layout == "comfy_view":  # [B, L, H*D] viewed as [B, H, L, D], as ComfyUI's Flux/Wan hand it over
                q = torch.randn(b, lq, h, d, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                k, v = (torch.randn(b, lk, h, d, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                        for _ in range(2))
            else:
                q = torch.randn(b, h, lq, d, generator=g, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(b, h, lk, d, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            kernels.core.stats.reset()
            out = kernels.attention(q, k, v, backend="triton")
            ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
            rel = ((out.float() - ref).norm() / ref.norm()).item()
            print(f"{name:10} {layout:11} rel L2 {rel:.2e} kernels {dict(kernels.core.stats.counts())}", flush=True)
            assert rel < 1e-2, rel


if __name__ == "__main__":
    main()
