"""Triton Accel example extension: another node pack registers its own attention and Linear.

Copy (or symlink) this folder into ComfyUI/custom_nodes/ next to Triton Accel. It registers
- PyTorch's scaled_dot_product_attention as Triton Accel attention backend "ext:example-sdpa":
  choose `ext:example-sdpa` as the mode of a Triton Accel Settings node to force it, or leave
  the mode on `auto`, which times it against ComfyUI's attention on GPUs and keeps it only where
  it is faster and gives the same result;
- a float32-accumulating torch Linear as "ext:example-linear": choose it as the Settings node's
  `linear` (with a Triton Accel Patch Linear or Patch node) to force it. In `auto` it ranks below
  Triton Accel's own Linear (priority 10 < 100), so it serves only calls those refuse.
The Triton Accel side panel lists both.

ComfyUI loads custom-node folders in no fixed order, so the registration is written once, as
`register_triton_accel(api)`, and runs whichever of the two packs loads second:
- Triton Accel already loaded: `import triton_accel` works (it publishes its API under that
  name whatever its own folder is called), and this file calls the function itself;
- Triton Accel not loaded yet: the import fails, and Triton Accel calls register_triton_accel
  of every pack loaded before it when it loads;
- Triton Accel not installed: nothing happens; this pack's own nodes (none here) still work.
See docs/extension_api.md in Triton Accel.
"""
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("triton_accel_example_ext")

NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}

EXTENSION_NAME = "example-sdpa"
# What this implementation serves; Triton Accel checks every call against it and hands the rest
# to ComfyUI's attention. Diffusion models never send causal calls, so this one leaves them out.
CONSTRAINTS = {
    "device_types": ["cuda", "cpu"],
    "dtypes": ["float16", "bfloat16", "float32"],
    "head_dims": (1, 256),
    "masks": ["none", "bool", "additive"],
    "gqa": True,
    "causal": False,
}


def sdpa_attention(q, k, v, attn_mask=None, scale=None, is_causal=False):
    """[B, H, Lq, D] x [B, Hk, Lk, D] -> [B, H, Lq, Dv], q's dtype and device (Triton Accel checks)."""
    if k.shape[1] != q.shape[1]:
        # Grouped-query attention: SDPA's enable_gqa needs torch 2.5, repeat works on any torch.
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal)


LINEAR_NAME = "example-linear"
# What the Linear serves: the same dtypes on CUDA and the CPU, layers whose feature counts are
# multiples of 8 (as tensor-core GEMMs like them), and calls of at least one token.
LINEAR_CONSTRAINTS = {
    "device_types": ["cuda", "cpu"],
    "dtypes": ["float16", "bfloat16", "float32"],
    "in_features": (8, 65536),
    "out_features": (8, 65536),
    "in_features_multiple_of": 8,
    "out_features_multiple_of": 8,
    "min_tokens": 1,
}


def fp32_linear(x, weight, bias):
    """x [..., in] @ weight[out, in].T + bias, accumulated in float32 and cast back to x's dtype.
    weight and bias come in x's dtype (Triton Accel casts them as ComfyUI does)."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


def register_triton_accel(api):
    """Called by this file or by Triton Accel, whichever loads second; `api` is triton_accel."""
    path = api.register_attention(EXTENSION_NAME, sdpa_attention, constraints=CONSTRAINTS, priority=10,
                                  lossy=False, label="PyTorch SDPA (example pack)",
                                  pack="triton_accel_example_ext")
    log.info("Triton Accel example extension: registered %s (torch %s)", path, torch.__version__)
    # register_linear came after register_attention (same API_VERSION): ask for it by name.
    if hasattr(api, "register_linear"):
        linear_path = api.register_linear(LINEAR_NAME, fp32_linear, constraints=LINEAR_CONSTRAINTS, priority=10,
                                          lossy=False, label="torch Linear, fp32 accumulation (example pack)",
                                          pack="triton_accel_example_ext")
        log.info("Triton Accel example extension: registered %s", linear_path)
    else:
        log.info("Triton Accel example extension: this Triton Accel has no register_linear; attention only")


def _register_if_triton_accel_is_loaded():
    try:
        import triton_accel
    except ImportError:
        log.info("Triton Accel example extension: Triton Accel is not loaded yet; it registers this pack "
                 "when it loads (or is not installed)")
        return
    if getattr(triton_accel, "API_VERSION", 0) < 1:
        log.warning("Triton Accel example extension: this Triton Accel has no extension API (API_VERSION)")
        return
    try:
        register_triton_accel(triton_accel)
    except Exception:  # a broken registration must not stop ComfyUI from loading this pack
        log.exception("Triton Accel example extension: registration failed")


_register_if_triton_accel_is_loaded()
