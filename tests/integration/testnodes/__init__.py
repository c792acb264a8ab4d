"""Test-only ComfyUI nodes for the Triton Accel integration tests (never shipped with the pack).

The integration fixture copies this folder into the temporary ComfyUI's custom_nodes as
`triton_accel_testnodes`. Nodes:

- TritonAccelTestConditioning: random CONDITIONING of any shape (no text encoder needed),
  with optional pooled output and a padding attention_mask (HunyuanVideo reads it).
- TritonAccelTestEmptyLatent: zero latent [1, C, H, W] or [1, C, T, H, W].
- TritonAccelTestSpyOverride: installs, on a clone, a foreign `optimized_attention_override`
  that records what it receives (shapes, dtypes, kwargs) and then calls `func` unchanged.
- TritonAccelTestAttentionProbe: calls ComfyUI's `optimized_attention` (the wrap_attn path)
  directly with a model's transformer_options, for calls the pack must hand back (fp32 with
  low_precision_attention=False, head dim > 256, ...) and reports the error against an fp64
  reference.
- TritonAccelTestFusedNorms: runs TritonAccelPatchAttention or TritonAccelPatch with
  TRITON_ACCEL_FUSED_NORMS set (optionally after adding a pass-through attn1 patch).
Routes: GET /triton_accel_test/spy -> recorded calls per tag, POST /triton_accel_test/spy/reset.
"""
import json
import threading

import torch

_lock = threading.Lock()
_spy = {}  # tag -> {"count": n, "signatures": {signature: count}}


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}:{str(value.dtype).replace('torch.', '')}"
    if hasattr(value, "take") and not isinstance(value, (dict, list, tuple)):
        return f"{type(value).__name__}"
    if isinstance(value, dict):
        return "dict"
    if isinstance(value, (int, float, bool, str, type(None))):
        return repr(value)
    return type(value).__name__


def _signature(args, kwargs):
    parts = [_describe(a) for a in args]
    parts += [f"{k}={_describe(kwargs[k])}" for k in sorted(kwargs)]
    return "(" + ", ".join(parts) + ")"


def make_spy(tag, perturb=0.0, drop_mask=False):
    """A pass-through override that records its calls. perturb / drop_mask deliberately make
    attention wrong (output * (1 + perturb); mask ignored) so a test can show that the
    latent comparison would notice such an error."""
    def spy_override(func, *args, **kwargs):
        sig = _signature(args, kwargs)
        with _lock:
            entry = _spy.setdefault(tag, {"count": 0, "signatures": {}, "funcs": {}})
            entry["count"] += 1
            entry["signatures"][sig] = entry["signatures"].get(sig, 0) + 1
            name = getattr(func, "__name__", repr(func))
            entry["funcs"][name] = entry["funcs"].get(name, 0) + 1
        if drop_mask:
            if len(args) > 4:  # (q, k, v, heads, mask, ...)
                args = args[:4] + (None,) + args[5:]
            else:
                kwargs["mask"] = None
        out = func(*args, **kwargs)
        if perturb:
            out = out * (1.0 + perturb)
        return out

    spy_override.triton_accel_test_tag = tag
    return spy_override


class TritonAccelTestConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31}),
            "tokens": ("INT", {"default": 8, "min": 1, "max": 4096}),
            "dim": ("INT", {"default": 64, "min": 1, "max": 16384}),
            "pooled_dim": ("INT", {"default": 0, "min": 0, "max": 16384}),
            "masked_tokens": ("INT", {"default": 0, "min": 0, "max": 4096}),
        }}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "Triton Accel tests"

    def make(self, seed, tokens, dim, pooled_dim, masked_tokens):
        gen = torch.Generator().manual_seed(seed)
        cond = torch.randn((1, tokens, dim), generator=gen)
        extra = {}
        if pooled_dim:
            extra["pooled_output"] = torch.randn((1, pooled_dim), generator=gen)
        if masked_tokens:
            mask = torch.ones((1, tokens), dtype=torch.int64)
            mask[:, tokens - masked_tokens:] = 0
            extra["attention_mask"] = mask
        return ([[cond, extra]],)


class TritonAccelTestEmptyLatent:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "channels": ("INT", {"default": 4, "min": 1, "max": 256}),
            "frames": ("INT", {"default": 0, "min": 0, "max": 256}),
            "height": ("INT", {"default": 8, "min": 1, "max": 1024}),
            "width": ("INT", {"default": 8, "min": 1, "max": 1024}),
        }}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "make"
    CATEGORY = "Triton Accel tests"

    def make(self, channels, frames, height, width):
        shape = [1, channels, height, width] if frames == 0 else [1, channels, frames, height, width]
        return ({"samples": torch.zeros(shape)},)


class TritonAccelTestSpyOverride:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "tag": ("STRING", {"default": "spy"})},
                "optional": {"perturb": ("FLOAT", {"default": 0.0, "min": -1.0, "max": 1.0, "step": 0.0001}),
                             "drop_mask": ("BOOLEAN", {"default": False})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "Triton Accel tests"

    def patch(self, model, tag, perturb=0.0, drop_mask=False):
        m = model.clone()
        to = m.model_options.setdefault("transformer_options", {})
        to = dict(to)
        to["optimized_attention_override"] = make_spy(tag, perturb, drop_mask)
        m.model_options["transformer_options"] = to
        return (m,)


class TritonAccelTestAttentionProbe:
    """One direct call of ComfyUI's optimized_attention with the model's transformer_options."""

    CASES = ["fp32_full_precision", "head_dim_512", "fp32_plain", "fp16_plain", "bf16_plain"]

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL",),
            "case": (cls.CASES,),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31}),
        }}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "probe"
    OUTPUT_NODE = True
    CATEGORY = "Triton Accel tests"

    def probe(self, model, case, seed):
        from comfy.ldm.modules import attention as comfy_attention

        gen = torch.Generator().manual_seed(seed)
        heads, head_dim, length = 2, 64, 16
        kwargs = {}
        if case == "fp32_full_precision":
            kwargs["low_precision_attention"] = False
        elif case == "head_dim_512":
            head_dim = 512
        dtype = {"fp16_plain": torch.float16, "bf16_plain": torch.bfloat16}.get(case, torch.float32)
        q, k, v = (torch.randn((1, length, heads * head_dim), generator=gen).to(dtype) for _ in range(3))
        to = dict(model.model_options.get("transformer_options", {}))
        out = comfy_attention.optimized_attention(q, k, v, heads, transformer_options=to, **kwargs)

        def split(t):
            return t.double().view(1, length, heads, head_dim).transpose(1, 2)
        ref = torch.nn.functional.scaled_dot_product_attention(split(q), split(k), split(v))
        ref = ref.transpose(1, 2).reshape(1, length, heads * head_dim)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        report = {"case": case, "shape": list(q.shape), "heads": heads, "head_dim": head_dim,
                  "kwargs": sorted(kwargs), "out_shape": list(out.shape), "out_dtype": str(out.dtype),
                  "rel_l2": err, "override": getattr(to.get("optimized_attention_override"), "__name__", None)}
        return {"ui": {"probe": [report]}, "result": (model,)}


class TritonAccelTestFusedNorms:
    """One of the pack's patch nodes run with TRITON_ACCEL_FUSED_NORMS=fused_norms (all, the
    default: Wan blocks, Flux-layer QKNorms and blocks; qk: no Flux-layer blocks; blocks: Wan
    blocks only; off: none) and TRITON_ACCEL_FUSED_ROPE=fused_rope (the variables are read when
    the node patches), optionally with a pass-through attn1 patch of "another node" added
    first (calls carrying one must go to ComfyUI's block forward)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "node": (["TritonAccelPatchAttention", "TritonAccelPatch"],),
                             "attn1_patch": ("BOOLEAN", {"default": False}),
                             "fused_norms": (["all", "qk", "blocks", "off"], {"default": "all"})},
                "optional": {"settings": ("TRITON_ACCEL_SETTINGS",),
                             "fused_rope": ("BOOLEAN", {"default": True})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "Triton Accel tests"

    def patch(self, model, node, attn1_patch, fused_norms="all", settings=None, fused_rope=True):
        import os

        import nodes

        if attn1_patch:
            model = model.clone()
            model.set_model_attn1_patch(lambda args: args["x"])
        values = {"TRITON_ACCEL_FUSED_NORMS": fused_norms, "TRITON_ACCEL_FUSED_ROPE": "1" if fused_rope else "0"}
        before = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            kwargs = {"settings": settings} if settings is not None else {}
            if node == "TritonAccelPatch":
                kwargs.update(skip="auto", min_tokens=1)
            out = nodes.NODE_CLASS_MAPPINGS[node]().patch(model, **kwargs)
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        return out["result"] if isinstance(out, dict) else out


class _CpuGraphs:
    """CUDA graphs' contract on the CPU (a recording reads its static inputs and writes the
    output tensors it returned; a replay refills them), for the pack's step_graph in a CPU
    server: it shows which calls of a real sampler would be recorded and replayed."""

    @staticmethod
    def supports(device):
        return True

    @staticmethod
    def capturing(device):
        return False

    @staticmethod
    def room(device, need):
        return True

    @staticmethod
    def capture(fn, pool):
        out = fn()
        return (fn, out), out, pool

    @staticmethod
    def replay(graph):
        fn, out = graph
        fresh = fn()
        if isinstance(out, (list, tuple)):
            for o, f in zip(out, fresh):
                o.copy_(f)
        else:
            out.copy_(fresh)


class TritonAccelTestStepGraph:
    """Turns the pack's step graphs on (TRITON_ACCEL_STEP_GRAPH=1 in this server from now on;
    off by default) and, with cpu_stand_in, gives this (patched) model's step graphs a CPU
    stand-in for torch.cuda's graphs (_CpuGraphs), where the CPU server otherwise refuses them
    ("not a CUDA call")."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "cpu_stand_in": ("BOOLEAN", {"default": True})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "Triton Accel tests"

    def patch(self, model, cpu_stand_in=True):
        import os
        import sys

        os.environ["TRITON_ACCEL_STEP_GRAPH"] = "1"
        if not cpu_stand_in:
            return (model,)
        module = next(m for name, m in list(sys.modules.items())
                      if name.endswith(".runtime.step_graph") and hasattr(m, "StepGraphs"))
        graphs = module.current(model)
        if graphs is None:
            raise RuntimeError("no Triton Accel step graphs on this model")
        graphs.backend = _CpuGraphs
        return (model,)


NODE_CLASS_MAPPINGS = {
    "TritonAccelTestStepGraph": TritonAccelTestStepGraph,
    "TritonAccelTestFusedNorms": TritonAccelTestFusedNorms,
    "TritonAccelTestConditioning": TritonAccelTestConditioning,
    "TritonAccelTestEmptyLatent": TritonAccelTestEmptyLatent,
    "TritonAccelTestSpyOverride": TritonAccelTestSpyOverride,
    "TritonAccelTestAttentionProbe": TritonAccelTestAttentionProbe,
}


def _register_routes():
    try:
        from aiohttp import web
        from server import PromptServer
    except Exception:
        return
    routes = PromptServer.instance.routes

    @routes.get("/triton_accel_test/spy")
    async def get_spy(request):
        with _lock:
            return web.json_response(json.loads(json.dumps(_spy)))

    @routes.post("/triton_accel_test/spy/reset")
    async def reset_spy(request):
        with _lock:
            _spy.clear()
        return web.json_response({"ok": True})


_register_routes()
