"""The short-key kernel (cross-attention to text tokens) and the routing between it and the
flash kernel, in the interpreter against the float32 reference.

Tolerances (relative L2 vs fp32), as in test_attention.py: fp16 2e-3 (SDPA's own ~3e-4;
p rounded to fp16 before P@V), fp32 1e-5, bf16 1e-2 (computed in fp32 under the
interpreter). The interpreter config walks the tile loop: 16-row tiles, two programs per
head, so every head's programs take several query tiles each.
"""
from __future__ import annotations

import importlib

import pytest
import torch

import triton_accel  # noqa: F401  (loaded by conftest under this name)

K = importlib.import_module("triton_accel.kernels")
sk = importlib.import_module("triton_accel.kernels.attention.short_kv")
at = importlib.import_module("triton_accel.kernels.attention.flash")
TOL = {torch.float16: 2e-3, torch.float32: 1e-5, torch.bfloat16: 1e-2}
CPU = K.describe("cpu")

# name: (B, H, Hkv, Lq, Lk, D) -- what SD1.5/SDXL/Wan cross-attention sends, scaled down in Lq
SHAPES = {
    "sd15_cross_d40_77": (2, 2, 2, 40, 77, 40),
    "sd15_cross_d80_77": (1, 2, 2, 33, 77, 80),
    "sd15_cross_d160_77": (1, 1, 1, 18, 77, 160),
    "sdxl_cross_d64_77": (2, 2, 2, 64, 77, 64),  # Lq a multiple of the tile: no row checks
    "keys_256_limit": (1, 2, 2, 20, 256, 64),
    "one_key": (1, 2, 2, 21, 1, 64),
    "one_query": (1, 2, 2, 1, 77, 64),
    "fewer_queries_than_tile": (1, 1, 1, 5, 9, 32),
    "head_dim_1": (1, 2, 2, 17, 19, 1),
    "gqa_24_8": (1, 24, 8, 9, 30, 32),
}


def rel_l2(out, ref):
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def qkv(B, H, Hkv, Lq, Lk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g).to(dtype) for s in ((B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, D)))


def run_api(q, k, v, **kw):
    K.stats.reset()
    out = K.attention(q, k, v, backend="triton", **kw)
    counts = K.stats.counts()
    assert counts.get("triton_attention") == 1, counts
    return out, counts.get("triton_attention.short_kv", 0) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_short_kv_shapes(name, dtype):
    q, k, v = qkv(*SHAPES[name], dtype)
    out, took_short = run_api(q, k, v)
    assert took_short, "the short-key kernel did not serve a call it should"
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_l2(out, K.attention_ref(q, k, v)) < TOL[dtype]


@pytest.mark.parametrize("name", ["sd15_cross_d40_77", "keys_256_limit", "gqa_24_8"])
def test_flash_kernel_agrees_at_short_keys(name):
    """Both kernels serve short keys (the flash kernel where the short one does not fit):
    they must agree with the reference and each other."""
    q, k, v = qkv(*SHAPES[name], torch.float16)
    flash = at.attention_triton(q, k, v)
    short = sk.attention_short_kv(q, k, v, None, CPU, interpreter=True)
    ref = K.attention_ref(q, k, v)
    assert rel_l2(flash, ref) < TOL[torch.float16] and rel_l2(short, ref) < TOL[torch.float16]
    assert rel_l2(short, flash.float()) < TOL[torch.float16]


def test_bf16():
    q, k, v = qkv(2, 3, 3, 50, 77, 64, torch.bfloat16)
    out, took_short = run_api(q, k, v)
    assert took_short and out.dtype == torch.bfloat16
    assert rel_l2(out, K.attention_ref(q, k, v)) < TOL[torch.bfloat16]


def test_views_of_blhd_and_negative_scale():
    """ComfyUI's [B, L, H*D] views, a strided head dim on v, and a negative scale (the max must
    be taken after scaling)."""
    B, L, Lk, H, D = 2, 37, 50, 4, 64
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, L, H * D, generator=g).half().view(B, L, H, D).transpose(1, 2)
    k = torch.randn(B, Lk, H * D, generator=g).half().view(B, Lk, H, D).transpose(1, 2)
    v = torch.randn(B, Lk, 2 * H * D, generator=g).half()[..., ::2].view(B, Lk, H, D).transpose(1, 2)
    for scale in (None, -0.3):
        out, took_short = run_api(q, k, v, scale=scale)
        assert took_short
        assert out.stride() == torch.empty_like(q).stride()
        assert rel_l2(out, K.attention_ref(q, k, v, None, scale)) < TOL[torch.float16]


def test_real_model_outliers():
    """Text-encoder keys carry a few huge channels and a common offset; the exact one-tile
    softmax must stay within fp16's error."""
    q, k, v = qkv(2, 2, 2, 40, 77, 64, torch.float16, seed=9)
    q[..., 3] *= 20
    q[..., 17] *= 50
    k[..., 3] *= 40
    k[..., 40] *= 10
    k += 30.0
    scale = 1 / 8 / 8
    out, took_short = run_api(q, k, v, scale=scale)
    assert took_short
    assert rel_l2(out, K.attention_ref(q, k, v, None, scale)) < TOL[torch.float16]


@pytest.mark.parametrize("case,expect_short", [
    ("plain_77", True),
    ("keys_257", False),
    ("bool_mask", False),
    ("additive_mask", False),
    ("causal", False),
])
def test_routing(case, expect_short):
    """Masked, causal and long-key calls go to the flash kernel, still correct."""
    Lk = 257 if case == "keys_257" else 77
    q, k, v = qkv(1, 2, 2, 20, Lk, 32, torch.float16)
    kw = {}
    if case == "bool_mask":
        kw["attn_mask"] = torch.rand(1, 1, 1, Lk, generator=torch.Generator().manual_seed(1)) > 0.3
    elif case == "additive_mask":
        kw["attn_mask"] = torch.zeros(1, 1, 1, Lk, dtype=torch.float16)
        kw["attn_mask"][..., -5:] = float("-inf")
    elif case == "causal":
        kw["is_causal"] = True
    out, took_short = run_api(q, k, v, **kw)
    assert took_short == expect_short
    ref = K.attention_ref(q, k, v, kw.get("attn_mask"), None, kw.get("is_causal", False))
    assert rel_l2(out, ref) < TOL[torch.float16]


def test_refusals_name_the_reason():
    q, k, v = qkv(1, 1, 1, 4, 77, 160, torch.float16)
    sm86 = K.DeviceInfo("cuda", "nvidia", "RTX 4090", (8, 9), "sm89")
    sm75 = K.DeviceInfo("cuda", "nvidia", "RTX 2080", (7, 5), "sm75")
    sm90 = K.DeviceInfo("cuda", "nvidia", "H200", (9, 0), "sm90")
    # d160 pads to 256: 2 x 128 keys x 256 x 2 bytes = 128 KB of K+V
    assert "128 KB" in sk.short_kv_refusal(q, k, v, None, False, sm86, False)
    assert "128 KB" in sk.short_kv_refusal(q, k, v, None, False, sm90, False)
    q2, k2, v2 = qkv(1, 1, 1, 4, 77, 64, torch.float16)
    assert sk.short_kv_refusal(q2, k2, v2, None, False, sm86, False) is None
    assert sk.short_kv_refusal(q2, k2, v2, None, False, sm90, False) is None
    assert "not enabled" in sk.short_kv_refusal(q2, k2, v2, None, False, sm75, False)
    assert "masked" in sk.short_kv_refusal(q2, k2, v2, torch.ones(1, 77, dtype=torch.bool), False, sm90, False)
    q3, k3, v3 = qkv(1, 1, 1, 4, 300, 64, torch.float16)
    assert "300 keys" in sk.short_kv_refusal(q3, k3, v3, None, False, sm90, False)


def test_torch_compile_fullgraph_short_keys():
    q, k, v = qkv(1, 2, 2, 16, 77, 32, torch.float32)
    compiled = torch.compile(lambda q, k, v: K.attention(q, k, v, backend="triton") * 2.0,
                             fullgraph=True, backend="aot_eager")
    K.stats.reset()
    out = compiled(q, k, v)
    assert K.stats.counts().get("triton_attention.short_kv") == 1
    assert rel_l2(out / 2.0, K.attention_ref(q, k, v)) < 1e-5
