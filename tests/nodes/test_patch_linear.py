"""TritonAccelPatchLinear without ComfyUI: fake Linear modules and a fake ModelPatcher.

`ComfyLinear` restates comfy.ops.disable_weight_init.Linear (weight_function / bias_function
applied per call, comfy_cast_weights casting to the input's device and dtype) and
`FakePatcher` restates what the patch uses of ComfyUI's ModelPatcher: clone() shares the
model and the object-patch backup, patch_model() installs object patches and runs the
ON_LOAD callbacks, detach() restores them and runs ON_DETACH. Kernels run on the CPU through
TRITON_INTERPRET=1 (tests/conftest.py).

Tolerances (rel. L2 against float32 F.linear with the unquantised weight):
- one fp8_w8a8 layer: < 0.06 (e4m3 weights per channel and activations per token: ~0.03-0.04
  on Gaussian data), int8_w8a8 < 0.02, fp8_weight_only < 0.06 (e4m3 weight rounding only);
- the whole tiny model, forced fp8 vs unpatched: < 0.08 (errors of 4 quantised layers add).
Activation dtypes float32 / float16 / bfloat16: the rounding of the half types (2^-8 for
bf16) is far below the quantisation error, so the bounds are the same.
"""
from __future__ import annotations

import gc
import importlib
import uuid
import warnings

import pytest
import torch
import torch.nn.functional as F
from triton_accel import kernels
from triton_accel.kernels.core import extensions
from triton_accel.kernels.linear.dispatch import linear_ref
from triton_accel.runtime import call_stats
from triton_accel.nodes import patch_nodes
from triton_accel.runtime import (activation_marks, fused_activations, guards, linear_common, linear_layer,
                                  linear_patch, linear_state)
from triton_accel.runtime import settings as settings_mod
from triton_accel.runtime.settings import AccelSettings
from triton_accel.nodes.settings_node import TritonAccelSettings

LAYER_TOL = {"fp8": 0.06, "int8": 0.02, "fp8_weight_only": 0.06}
MODEL_TOL = 0.08
FORCED = {mode: AccelSettings("off", linear_mode=mode) for mode in ("fp8", "int8", "fp8_weight_only")}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The real weight preparation with the float32 reference matmul: for the tests of the patch's
# bookkeeping (what is prepared when, what is freed), where the interpreter's minutes per
# model forward would buy nothing. The tests of served calls run the kernels.
REF_BACKEND = linear_common.LinearBackend(kernels.prepare_weight, lambda x, p, b, dt: linear_ref(x, p, b).to(dt),
                               kernels.linear_refusal, kernels.LinearInputError)


# ---- fakes ----------------------------------------------------------------------------------

class ComfyLinear(torch.nn.Linear):
    """comfy.ops.disable_weight_init.Linear, as far as the patch can tell."""

    comfy_cast_weights = False
    weight_function = []
    bias_function = []

    def forward(self, x):
        if self.comfy_cast_weights or self.weight_function or self.bias_function:
            weight = self.weight.to(device=x.device, dtype=x.dtype)
            bias = None if self.bias is None else self.bias.to(device=x.device, dtype=x.dtype)
            for f in self.weight_function:
                weight = f(weight)
            for f in self.bias_function:
                bias = f(bias)
            return F.linear(x, weight, bias)
        return super().forward(x)


class Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.img_mod = torch.nn.Module()
        self.img_mod.lin = ComfyLinear(dim, 2 * dim)
        self.qkv = ComfyLinear(dim, 3 * dim)
        self.proj = ComfyLinear(dim, dim)
        self.mlp = torch.nn.Sequential(ComfyLinear(dim, 4 * dim), torch.nn.GELU(), ComfyLinear(4 * dim, dim))

    def forward(self, x, vec):
        shift, scale = self.img_mod.lin(vec).chunk(2, dim=-1)
        h = x * (1 + scale[:, None]) + shift[:, None]
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v))
        return x + self.mlp(x)


class TinyDiT(torch.nn.Module):
    """Flux-like names: img_in, time_in, blocks.N.{img_mod.lin, qkv, proj, mlp.0, mlp.2}, final_layer."""

    def __init__(self, dim=64, channels=32):
        super().__init__()
        self.img_in = ComfyLinear(channels, dim)
        self.time_in = torch.nn.Module()
        self.time_in.in_layer = ComfyLinear(16, dim)
        self.blocks = torch.nn.ModuleList([Block(dim)])
        self.final_layer = torch.nn.Module()
        self.final_layer.linear = ComfyLinear(dim, channels)

    def forward(self, x, t):
        vec = self.time_in.in_layer(t)
        x = self.img_in(x)
        for block in self.blocks:
            x = block(x, vec)
        return self.final_layer.linear(x)


class BaseModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.diffusion_model = TinyDiT()


def _resolve(obj, name):
    *path, last = name.split(".")
    for part in path:
        obj = getattr(obj, part)
    return obj, last


class FakePatcher:
    """What patch_linear uses of comfy.model_patcher.ModelPatcher, with its semantics."""

    def __init__(self, model, backup=None):
        self.model = model
        self.load_device = torch.device("cpu")
        self.object_patches = {}
        self.object_patches_backup = {} if backup is None else backup
        self.model_options = {"transformer_options": {}}
        self.callbacks = {}
        self.patches_uuid = uuid.uuid4()

    def clone(self):
        n = FakePatcher(self.model, self.object_patches_backup)
        n.object_patches = self.object_patches.copy()
        n.model_options = {"transformer_options": dict(self.model_options["transformer_options"])}
        n.callbacks = {k: {k1: list(c1) for k1, c1 in c.items()} for k, c in self.callbacks.items()}
        n.patches_uuid = self.patches_uuid
        return n

    def add_object_patch(self, name, obj):
        self.object_patches[name] = obj

    def get_model_object(self, name):
        if name in self.object_patches:
            return self.object_patches[name]
        if name in self.object_patches_backup:
            return self.object_patches_backup[name]
        obj, last = _resolve(self.model, name)
        return getattr(obj, last)

    def add_callback_with_key(self, call_type, key, callback):
        self.callbacks.setdefault(call_type, {}).setdefault(key, []).append(callback)

    def _callbacks(self, call_type):
        return [cb for cbs in self.callbacks.get(call_type, {}).values() for cb in cbs]

    def patch_model(self):
        for name, obj in self.object_patches.items():
            owner, last = _resolve(self.model, name)
            old = getattr(owner, last)
            setattr(owner, last, obj)
            self.object_patches_backup.setdefault(name, old)
        for cb in self._callbacks("on_load_after"):
            cb(self, None, 0, False, True)
        return self.model

    def detach(self, unpatch_all=True):
        if unpatch_all:
            for name, old in self.object_patches_backup.items():
                owner, last = _resolve(self.model, name)
                setattr(owner, last, old)
            self.object_patches_backup.clear()
        for cb in self._callbacks("on_detach_after"):
            cb(self, unpatch_all)


@pytest.fixture(autouse=True)
def _fresh_counters():
    call_stats.reset()
    kernels.core.stats.reset()


def _linear_stats() -> dict:
    return call_stats.snapshot()["kinds"].get("linear", {"served": 0, "handed_back": 0, "reasons": {}, "paths": {}})


def _rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _inputs(tokens=64, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, tokens, 32, generator=gen).to(dtype), torch.randn(2, 16, generator=gen).to(dtype)


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return BaseModel().to(dtype)


# ---- skip patterns --------------------------------------------------------------------------

# (family, layer name, skipped by the default patterns?) from the real models' module names.
DEFAULT_SKIP_CASES = [
    ("flux", "img_in", True), ("flux", "txt_in", True), ("flux", "time_in.in_layer", True),
    ("flux", "vector_in.out_layer", True), ("flux", "guidance_in.in_layer", True),
    ("flux", "double_blocks.0.img_mod.lin", True), ("flux", "single_blocks.3.modulation.lin", True),
    ("flux", "final_layer.linear", True), ("flux", "final_layer.adaLN_modulation.1", True),
    ("flux", "double_blocks.0.img_attn.qkv", False), ("flux", "double_blocks.0.txt_mlp.2", False),
    ("flux", "single_blocks.37.linear1", False), ("flux", "single_blocks.0.linear2", False),
    ("wan21", "text_embedding.0", True), ("wan21", "time_embedding.2", True), ("wan21", "time_projection.1", True),
    ("wan21", "head.head", True), ("wan21", "img_emb.proj.1", True),
    ("wan21", "blocks.0.self_attn.q", False), ("wan21", "blocks.39.cross_attn.v", False),
    ("wan21", "blocks.0.ffn.0", False),
    ("sd15", "time_embed.0", True), ("sd15", "input_blocks.1.0.emb_layers.1", True),
    ("sd15", "input_blocks.1.1.transformer_blocks.0.attn1.to_q", False),
    ("sd15", "output_blocks.5.1.transformer_blocks.0.ff.net.0.proj", False),
    ("sdxl", "label_emb.0.0", True), ("sdxl", "output_blocks.8.1.proj_out", False),
    ("hunyuan_video", "txt_in.individual_token_refiner.blocks.0.mlp.fc1", True),
    ("hunyuan_video", "double_blocks.0.img_attn_qkv", False), ("hunyuan_video", "double_blocks.0.img_mod.linear", True),
    ("qwen_image", "proj_out", True), ("qwen_image", "norm_out.linear", True),
    ("qwen_image", "transformer_blocks.0.img_mod.1", True),
    ("qwen_image", "time_text_embed.timestep_embedder.linear_1", True),
    ("qwen_image", "transformer_blocks.0.attn.to_q", False),
    ("sd3", "x_block.adaLN_modulation.1", True), ("sd3", "joint_blocks.0.x_block.attn.qkv", False),
]


@pytest.mark.parametrize("family,name,skipped", DEFAULT_SKIP_CASES,
                         ids=[f"{f}-{n}" for f, n, _ in DEFAULT_SKIP_CASES])
def test_default_skip_patterns(family, name, skipped):
    assert (linear_common.SkipPatterns.parse("auto").match(name) is not None) == skipped


@pytest.mark.parametrize("text,name,expect", [
    ("", "img_in", None),  # empty: nothing skipped, not even the defaults
    ("auto, double_blocks.1.*", "double_blocks.1.img_attn.qkv", "double_blocks.1.*"),
    ("auto, double_blocks.1.*", "double_blocks.10.img_attn.qkv", None),
    ("re:single_blocks\\.(1|2)\\..*", "single_blocks.2.linear1", "re:single_blocks\\.(1|2)\\..*"),
    ("re:single_blocks\\.(1|2)\\..*", "single_blocks.12.linear1", None),
    ("  Blocks.0.QKV ", "blocks.0.qkv", "blocks.0.qkv"),  # case-insensitive globs, spaces trimmed
])
def test_custom_skip_patterns(text, name, expect):
    assert linear_common.SkipPatterns.parse(text).match(name) == expect


def test_bad_regex_is_refused_with_the_pattern():
    with pytest.raises(ValueError, match="re:blocks\\.\\("):
        linear_common.SkipPatterns.parse("auto, re:blocks.(")


# ---- calls handed back ----------------------------------------------------------------------

def _layer(settings=FORCED["fp8"], skip="", min_tokens=4, name="blocks.0.qkv", module=None, backend=None):
    label = f"Fake #{uuid.uuid4().hex[:8]}"  # unique: states of earlier tests may still be alive
    state = linear_state.LinearPatchState(settings, linear_common.SkipPatterns.parse(skip), min_tokens, backend, label=label)
    torch.manual_seed(1)
    module = module if module is not None else ComfyLinear(32, 48)
    calls = []

    def previous(*args, **kwargs):
        calls.append((args, kwargs))
        return module.__class__.forward(module, *args, **kwargs)

    layer = linear_layer.LinearLayer(state, name, module, previous)
    state.layers.append(layer)
    return layer, calls


class FakeQuantizedTensor(torch.Tensor):
    """Stands for comfy's QuantizedTensor: a tensor subclass that nn.Parameter keeps."""


def _meta_weight(module):
    module.weight = torch.nn.Parameter(torch.empty(module.weight.shape, device="meta"), requires_grad=False)


HAND_BACK_CASES = {
    # name: (how to set the layer / call up, reason the stats must show)
    "skip-pattern": ({"skip": "blocks.*"}, None, "name matches skip pattern 'blocks.*'"),
    "few-tokens": ({"min_tokens": 64}, None, "fewer than 64 tokens: quantising cannot pay"),
    "lora-lowvram-weight-function": ({}, "weight_function", linear_common.REASON_WEIGHT_FUNCTION),
    "comfy-quantized-layer": ({}, "layout_type", linear_common.REASON_QUANTIZED),
    "quantized-tensor-weight": ({}, "tensor_subclass", linear_common.REASON_QUANTIZED),
    "quantized-input": ({}, "input_subclass", linear_common.REASON_INPUT_TYPE),
    "offloaded-weight": ({}, "meta_weight", linear_common.REASON_OFFLOADED),
    "dynamic-vram-weight": ({}, "vbar_weight", linear_common.REASON_DYNAMIC_VRAM),
    "float64-input": ({}, "float64", "input dtype torch.float64 is not float16/bfloat16/float32"),
    "e5m2-weight": ({}, "e5m2", "weight dtype torch.float8_e5m2 is not"),
    "extra-argument": ({}, "extra_arg", linear_common.REASON_ARGUMENTS),
    "mode-off": ({"settings": AccelSettings("off", linear_mode="off")}, None, "off: ComfyUI's own Linear layers"),
    "auto-on-cpu": ({"settings": AccelSettings("auto")}, None, "PyTorch Linear: no GPU"),
    "features-not-multiple-of-16": ({"module": ComfyLinear(24, 48)}, "k24", "in_features must be a positive multiple"),
}


@pytest.mark.parametrize("case", list(HAND_BACK_CASES))
def test_hand_back_goes_to_original_forward_with_reason(case):
    layer_kwargs, setup, reason = HAND_BACK_CASES[case]
    layer, calls = _layer(**layer_kwargs)
    module = layer.module
    x = torch.randn(2, 8, module.in_features)
    args = (x,)
    if setup == "weight_function":
        module.weight_function = [lambda w: w * 1.5]
    elif setup == "layout_type":
        module.layout_type = "TensorCoreFP8Layout"
    elif setup == "tensor_subclass":
        module.weight = torch.nn.Parameter(module.weight.detach().as_subclass(FakeQuantizedTensor), requires_grad=False)
    elif setup == "input_subclass":
        args = (x.as_subclass(FakeQuantizedTensor),)
    elif setup in ("meta_weight", "vbar_weight"):
        _meta_weight(module)
        if setup == "vbar_weight":
            module._v = object()  # ComfyUI 0.29's dynamic VRAM buffer
        layer.previous = lambda *a, **k: calls.append((a, k)) or torch.zeros(2, 8, 48)
    elif setup == "float64":
        args = (x.double(),)
        module.double()
    elif setup == "e5m2":
        module.weight = torch.nn.Parameter(module.weight.detach().to(torch.float8_e5m2), requires_grad=False)
        layer.previous = lambda *a, **k: calls.append((a, k)) or torch.zeros(2, 8, 48)
    elif setup == "extra_arg":
        layer.previous = lambda *a, **k: calls.append((a, k)) or torch.zeros(2, 8, 48)
        args = (x, "extra")
    out = layer(*args)
    stats = _linear_stats()
    assert len(calls) == 1, "the original forward was not called exactly once"
    assert stats["served"] == 0 and stats["handed_back"] == 1, stats
    assert any(r.startswith(reason) for r in stats["reasons"]), stats["reasons"]
    if setup == "weight_function":  # the LoRA applied on the fly reaches the output
        assert torch.allclose(out, F.linear(x, module.weight * 1.5, module.bias))
    assert kernels.core.stats.counts().get("triton_linear_fp8_w8a8", 0) == 0


def test_min_tokens_counts_rows_of_every_leading_dim():
    layer, _ = _layer(min_tokens=16)
    layer(torch.randn(2, 8, 32))  # 16 rows: served
    layer(torch.randn(1, 15, 32))  # 15 rows: handed back
    stats = _linear_stats()
    assert (stats["served"], stats["handed_back"]) == (1, 1), stats


# ---- served calls ---------------------------------------------------------------------------

def _method_available(mode):
    method = {"fp8": "fp8_w8a8", "int8": "int8_w8a8", "fp8_weight_only": "fp8_weight_only"}[mode]
    refusal = kernels.linear_refusal(method, "cpu")
    if refusal:
        pytest.fail(f"{method} refused on the CPU interpreter: {refusal}")
    return method


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("mode", ["fp8", "int8", "fp8_weight_only"])
@pytest.mark.parametrize("shape", [(1, 64, 32), (2, 77, 32), (160, 32)], ids=["1x64", "2x77-text", "160-2d"])
def test_served_layer_matches_linear(mode, dtype, shape):
    method = _method_available(mode)
    layer, calls = _layer(settings=FORCED[mode])
    module = layer.module.to(dtype)
    x = torch.randn(*shape).to(dtype)
    first = layer(x)  # the guard's call: both ways, ours kept when it agrees
    second = layer(x)
    ref = F.linear(x.float(), module.weight.float(), module.bias.float())
    stats = _linear_stats()
    assert stats["served"] == 2 and stats["paths"] == {method: 2}, stats
    assert len(calls) == 1, "only the guard's call may run the original forward"
    assert first.dtype == dtype and first.shape == (*shape[:-1], 48)
    assert torch.equal(first, second)
    assert _rel_l2(second, ref) < LAYER_TOL[mode]


def test_module_attr_answers_as_getattr():
    """linear_common.module_attr skips nn.Module.__getattr__'s exception for missing names; for every other
    kind of name it must give what getattr gives."""
    class WithProperty(ComfyLinear):
        layout_type = None  # class attribute

        @property
        def quant_format(self):
            return "int8"

    module = WithProperty(4, 4)
    module.scale_weight = torch.nn.Parameter(torch.ones(()), requires_grad=False)
    module.register_buffer("_v", torch.zeros(1))
    module.child = torch.nn.Identity()
    module.note = "set on the instance"
    for name in ("weight", "bias", "scale_weight", "_v", "child", "note", "layout_type", "quant_format",
                 "weight_function", "comfy_cast_weights", "missing", "forward"):
        expected = getattr(module, name, "default")
        got = linear_common.module_attr(module, name, "default")
        assert got is expected or (callable(expected) and got == expected), name
    module.layout_type = "set later"  # an instance attribute over the class one
    assert linear_common.module_attr(module, "layout_type") == "set later"


def test_served_call_reads_the_module_without_nn_module_getattr():
    """Host time: nn.Module.__getattr__ costs ~1.5 us a read (and raises and catches for a name
    the module lacks); a Flux step makes ~600 served Linear calls, each reading the weight, the
    bias and ComfyUI's per-layer attributes. The served path reads them through module_attr
    (instance dict, parameter tables), never through __getattr__; the call must still be ours."""
    class Counting(ComfyLinear):
        reads: list = []

        def __getattr__(self, name):
            Counting.reads.append(name)
            return super().__getattr__(name)

    layer, calls = _layer(settings=FORCED["fp8"], module=Counting(32, 48))
    x = torch.randn(2, 8, 32)
    layer(x), layer(x)  # the guard's call (ComfyUI's forward runs too), then a served one
    Counting.reads.clear()
    out = layer(x)
    stats = _linear_stats()
    assert stats["served"] == 3 and len(calls) == 1, stats
    assert Counting.reads == [], f"served call read {Counting.reads} through nn.Module.__getattr__"
    assert out.shape == (2, 8, 48)


def test_served_layer_repeats_a_remembered_call_until_the_weight_changes():
    """kernels.linear remembers a served call's signature (its DirectCall, real on CUDA) on the
    prepared weight: the layer's calls must give it the same key every time (the module's
    Parameter bias included), and a changed weight (a new prepared weight) must not reuse it."""
    klinear = importlib.import_module("triton_accel.kernels.linear.dispatch")

    class Remembered:
        def __init__(self, out):
            self.out, self.calls = out, 0

        def __call__(self, x, bias, act_out=None):
            self.calls += 1
            return self.out

    layer, calls = _layer(settings=FORCED["fp8"])
    module = layer.module.to(torch.bfloat16)
    x = torch.randn(2, 8, 32).to(torch.bfloat16)
    layer(x), layer(x)  # the guard's call, then a served one
    prepared = layer.entries[str(x.device)].prepared
    key = klinear._direct_key(x, layer.bias_for(x), x.dtype, None, 0)
    assert list(prepared._direct) == [key]  # one signature, the layer's
    made = torch.full((16, 48), 7.0, dtype=torch.bfloat16)
    fake = prepared._direct[key] = Remembered(made)
    call_stats.reset()
    kernels.core.stats.reset()
    assert torch.equal(layer(x), made.view(2, 8, 48)) and fake.calls == 1
    assert _linear_stats()["served"] == 1 and kernels.core.stats.counts()[klinear.DIRECT_COUNTER] == 1
    with torch.no_grad():
        module.weight.mul_(2.0)  # a new weight version: prepared again, nothing remembered
    out = layer(x)
    assert fake.calls == 1 and not torch.equal(out, made.view(2, 8, 48))
    assert layer.entries[str(x.device)].prepared is not prepared


def test_forced_fp8_model_matches_unpatched_and_input_model_untouched():
    torch.manual_seed(0)
    base = FakePatcher(BaseModel())
    x, t = _inputs()
    expected = base.model.diffusion_model(x, t)
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="auto", min_tokens=16)
    assert base.object_patches == {}, "the input model was modified"
    assert sorted(k for k in patched.object_patches) == sorted(
        f"diffusion_model.{n}.forward" for n in ("img_in", "time_in.in_layer", "blocks.0.img_mod.lin", "blocks.0.qkv",
                                                  "blocks.0.proj", "blocks.0.mlp.0", "blocks.0.mlp.2",
                                                  "final_layer.linear"))
    patched.patch_model()
    out = patched.model.diffusion_model(x, t)
    stats = _linear_stats()
    assert stats["served"] == 4, stats  # qkv, proj, mlp.0, mlp.2
    assert stats["handed_back"] == 4, stats  # img_in, time_in, img_mod (by name), final_layer
    assert kernels.core.stats.counts().get("triton_linear_fp8_w8a8", 0) >= 4
    err = _rel_l2(out, expected)
    assert 0 < err < MODEL_TOL, err
    patched.detach()
    restored = base.model.diffusion_model(x, t)
    assert torch.equal(restored, expected), "unpatching did not restore ComfyUI's Linear"


def test_fp8_checkpoint_weights_with_scale_weight_used_as_is():
    """ComfyUI's scaled FP8 layers (0.3.x scaled_fp8_ops): e4m3 weight and a per-tensor scale_weight."""
    _method_available("fp8")
    layer, calls = _layer(settings=FORCED["fp8"])
    module = layer.module
    w = module.weight.detach()
    scale = w.abs().max() / 448.0
    module.weight = torch.nn.Parameter((w / scale).to(torch.float8_e4m3fn), requires_grad=False)
    module.scale_weight = torch.nn.Parameter(scale.reshape(()).float(), requires_grad=False)
    dequantised = module.weight.float() * module.scale_weight
    layer.previous = lambda x: calls.append(x) or F.linear(x, dequantised.to(x.dtype), module.bias.to(x.dtype))
    x = torch.randn(2, 64, 32)
    out = layer(x)
    entry = layer.entries["cpu"]
    assert entry.prepared.weight.data_ptr() == module.weight.data_ptr(), "the FP8 weight was re-quantised"
    assert entry.nbytes() == 48 * 4, "only the per-channel scales are extra memory"
    assert _linear_stats()["served"] == 1
    assert _rel_l2(out, F.linear(x, dequantised, module.bias)) < 0.05  # activation rounding only


# ---- quality guard --------------------------------------------------------------------------

def _broken_backend(kind):
    good = linear_common.default_backend()

    def run(x, prepared, bias, out_dtype):
        out = good.run(x, prepared, bias, out_dtype)
        if kind == "scaled":
            return out * 1.2
        if kind == "nan":
            out = out.clone()
            out.view(-1)[0] = float("nan")
            return out
        raise RuntimeError("deliberately broken kernel")

    return linear_common.LinearBackend(good.prepare, run, good.refusal, good.input_error)


@pytest.mark.parametrize("kind,reason", [("scaled", "rel. L2 0.2"), ("nan", "NaN/Inf in our output"),
                                         ("raises", "kernel error: RuntimeError: deliberately broken kernel")])
def test_guard_sends_a_broken_layer_back_for_good(kind, reason):
    layer, calls = _layer(backend=_broken_backend(kind))
    x = torch.randn(2, 32, 32)
    expected = F.linear(x, layer.module.weight, layer.module.bias)
    first = layer(x)
    second = layer(x)
    assert torch.equal(first, expected) and torch.equal(second, expected), "a rejected output reached the model"
    assert len(calls) == 2
    report = linear_state.fallback_report()
    mine = [r for r in report if r["model"] == layer.state.label]
    assert len(mine) == 1 and mine[0]["layer"] == "blocks.0.qkv" and reason in mine[0]["reason"], report
    stats = _linear_stats()
    assert stats["served"] == 0 and stats["handed_back"] == 2, stats
    assert "cpu" not in layer.entries, "the rejected layer's prepared weight was kept"
    text = TritonAccelSettings().configure("off", "cpu", "fp8")["ui"]["text"][0]
    assert "quality guard" in text or "kernel error" in text, text
    from triton_accel.nodes.routes import stats_payload

    assert mine[0] in stats_payload()["linear_fallbacks"]


def test_guard_passes_a_good_layer_and_runs_once_per_weight_version():
    layer, calls = _layer()
    x = torch.randn(2, 32, 32)
    for _ in range(3):
        layer(x)
    assert len(calls) == 1
    with torch.no_grad():
        layer.module.weight.mul_(2.0)  # a new weight version: prepared again, checked again
    layer(x)
    assert len(calls) == 2
    assert guards.guard_failure(torch.ones(4), torch.ones(4), 0.05) is None
    assert "rel. L2" in guards.guard_failure(torch.ones(4) * 1.1, torch.ones(4), 0.05)


# ---- preparing weights: all together, once per weight version ------------------------------

class CountingBackend:
    def __init__(self):
        good = REF_BACKEND
        self.prepared = []
        self.backend = linear_common.LinearBackend(self._prepare, good.run, good.refusal, good.input_error)
        self._good = good

    def _prepare(self, weight, method, scale=None):
        self.prepared.append(weight.shape)
        return self._good.prepare(weight, method, scale)


def test_first_call_prepares_every_layer_once_with_one_log_line(caplog):
    counting = CountingBackend()
    base = FakePatcher(_model())
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="auto", min_tokens=16, backend=counting.backend)
    patched.patch_model()
    x, t = _inputs()
    with caplog.at_level("INFO", logger="triton_accel"):
        patched.model.diffusion_model(x, t)
        patched.model.diffusion_model(x, t)
    assert len(counting.prepared) == 4, counting.prepared  # the 4 layers not skipped by name
    lines = [r.getMessage() for r in caplog.records if "prepared 4 layers" in r.getMessage()]
    assert len(lines) == 1 and "fp8_w8a8" in lines[0] and "MiB" in lines[0], caplog.text
    patched.detach()


@pytest.mark.parametrize("change", ["new-parameter", "in-place-tracked", "in-place-data-with-reload"])
def test_weight_change_invalidates_prepared_weight(change):
    """LoRA merged by ComfyUI: a new Parameter (set_attr_param), an in-place op that bumps the
    version counter, or `param.data.copy_` (copy_to_param: no version bump) followed by a load
    with new weight patches (a new patches_uuid, seen through ON_LOAD)."""
    counting = CountingBackend()
    base = FakePatcher(_model())
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="", min_tokens=1, backend=counting.backend)
    patched.patch_model()
    layer = patched.object_patches["diffusion_model.blocks.0.proj.forward"]
    module = layer.module
    x = torch.randn(2, 64, 64)
    before = layer(x)
    n_prepared = len(counting.prepared)
    delta = torch.randn_like(module.weight) * 0.5
    if change == "new-parameter":
        module.weight = torch.nn.Parameter(module.weight.detach() + delta, requires_grad=False)
    elif change == "in-place-tracked":
        with torch.no_grad():
            module.weight.add_(delta)
    else:
        module.weight.data.copy_(module.weight.detach() + delta)
        lora = patched.clone()
        lora.patches_uuid = uuid.uuid4()  # what add_patches does
        lora.patch_model()
    after = layer(x)
    assert len(counting.prepared) > n_prepared, "the changed weight was not prepared again"
    ref = F.linear(x, module.weight, module.bias)
    assert _rel_l2(after, ref) < LAYER_TOL["fp8"]
    assert _rel_l2(before, ref) > 0.2, "the test's weight change is too small to tell"
    patched.detach()


def test_unchanged_weights_are_not_prepared_again():
    counting = CountingBackend()
    base = FakePatcher(_model())
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="", min_tokens=1, backend=counting.backend)
    patched.patch_model()
    x, t = _inputs()
    patched.model.diffusion_model(x, t)
    n = len(counting.prepared)
    for _ in range(3):
        patched.model.diffusion_model(x, t)
    patched.patch_model()  # loaded again with the same weight patches
    patched.model.diffusion_model(x, t)
    assert len(counting.prepared) == n == 8
    patched.detach()


# ---- lifetime: unpatch, garbage collection, 20 cycles ---------------------------------------

def _live_tensor_bytes() -> tuple[int, int]:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some torch objects warns about deprecations
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu")


def test_unpatch_frees_prepared_weights_and_restores_forward():
    base = FakePatcher(_model())
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="", min_tokens=1, backend=REF_BACKEND)
    state = patched.triton_accel_linear
    patched.patch_model()
    patched.model.diffusion_model(*_inputs())
    assert state.prepared_bytes() > 0
    patched.detach(unpatch_all=False)  # a clone deleted while loaded: keeps them
    assert state.prepared_bytes() > 0
    patched.detach(unpatch_all=True)
    assert state.prepared_bytes() == 0
    for module in base.model.diffusion_model.modules():
        assert not isinstance(module.__dict__.get("forward"), linear_layer.LinearLayer)


def test_garbage_collected_clone_frees_prepared_weights():
    base = FakePatcher(_model())
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="", min_tokens=1, backend=REF_BACKEND)
    state = patched.triton_accel_linear
    patched.patch_model()
    patched.model.diffusion_model(*_inputs())
    assert state.prepared_bytes() > 0
    del patched
    gc.collect()
    assert state.prepared_bytes() == 0


def test_twenty_patch_unpatch_cycles_do_not_grow_memory():
    base = FakePatcher(_model())
    x, t = _inputs()
    counts = []
    for cycle in range(20):
        patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="", min_tokens=1, backend=REF_BACKEND)
        patched.patch_model()
        patched.model.diffusion_model(x, t)
        assert patched.triton_accel_linear.prepared_bytes() > 0
        patched.detach()
        del patched
        if cycle in (1, 19):  # after the first cycles' one-time allocations, and at the end
            counts.append(_live_tensor_bytes())
    assert counts[1] == counts[0], f"live CPU tensors (count, bytes) grew over 20 cycles: {counts[0]} -> {counts[1]}"
    live = [s for s in list(linear_state._live_states) if s.layers and s.layers[0].module is base.model.diffusion_model.img_in]
    assert len(live) <= 1, f"{len(live)} patch states of this model still alive"


def test_repatching_a_patched_clone_wraps_comfyuis_forward_not_ours():
    base = FakePatcher(_model())
    first = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="", min_tokens=1, backend=REF_BACKEND)
    second = linear_patch.patch_linear_model(first, FORCED["fp8"], skip="", min_tokens=1)
    layer = second.object_patches["diffusion_model.blocks.0.qkv.forward"]
    assert not isinstance(layer.previous, linear_layer.LinearLayer)


# ---- the nodes ------------------------------------------------------------------------------

def test_combined_node_patches_attention_and_linear_under_one_label():
    from triton_accel.runtime.attention_patch import OVERRIDE_KEY

    base = FakePatcher(_model())
    result = patch_nodes.TritonAccelPatch().patch(base, "auto", 64, AccelSettings("fp16", linear_mode="fp8"))
    patched = result["result"][0]
    override = patched.model_options["transformer_options"][OVERRIDE_KEY]
    assert patched.triton_accel_linear.label == override.label
    assert len(patched.object_patches) == 8
    text = result["ui"]["text"][0]
    assert "8 Linear layers patched (4 skipped by name" in text and "fp8 forced" in text, text
    assert base.object_patches == {} and OVERRIDE_KEY not in base.model_options["transformer_options"]


class WrapperFakePatcher(FakePatcher):
    """FakePatcher with ModelPatcher's wrapper table, which step graphs need."""

    def __init__(self, model, backup=None):
        super().__init__(model, backup)
        self.wrappers = {}

    def clone(self):
        n = WrapperFakePatcher(self.model, self.object_patches_backup)
        base = FakePatcher.clone(self)
        n.__dict__.update({k: v for k, v in base.__dict__.items() if k != "wrappers"})
        n.wrappers = {t: {k: list(fns) for k, fns in by_key.items()} for t, by_key in self.wrappers.items()}
        return n

    def add_wrapper_with_key(self, wrapper_type, key, fn):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(fn)

    def remove_wrappers_with_key(self, wrapper_type, key):
        self.wrappers.get(wrapper_type, {}).pop(key, None)


@pytest.mark.parametrize("wrappers", [False, True], ids=["no-wrapper-api", "wrapper-api"])
def test_patch_nodes_say_what_they_installed(wrappers):
    """Each patch node's last line names what it put on the clone; the step graphs only where
    ComfyUI has model wrappers. The combined node's clone carries one StepGraphs with the
    Linear state, as patch_model then patch_linear_model leave it."""
    from triton_accel.runtime import step_graph
    from triton_accel.runtime.attention_patch import patch_model

    make = WrapperFakePatcher if wrappers else FakePatcher
    graphs = ", step graphs" if wrappers else ""
    settings = AccelSettings("fp16", linear_mode="fp8")
    result = patch_nodes.TritonAccelPatch().patch(make(_model()), "auto", 64, settings)
    patched = result["result"][0]
    assert result["ui"]["text"][0].splitlines()[-1] == f"installs: attention, Linear{graphs}"
    linear = patch_nodes.TritonAccelPatchLinear().patch(make(_model()), "auto", 64, settings)
    assert linear["ui"]["text"][0].splitlines()[-1] == f"installs: Linear{graphs}"
    attention = patch_nodes.TritonAccelPatchAttention().patch(make(_model()), settings)
    assert attention["ui"]["text"][0].splitlines()[-1] == f"installs: attention{graphs}"
    if wrappers:
        graph = step_graph.current(patched)
        assert graph.linear_states == (patched.triton_accel_linear,) and graph.label == patched.triton_accel_linear.label
        chained = linear_patch.patch_linear_model(patch_model(make(_model()), settings), settings, "auto", 64)
        assert {t: sorted(k) for t, k in patched.wrappers.items()} == \
            {t: sorted(k) for t, k in chained.wrappers.items()}
        assert sorted(patched.object_patches) == sorted(chained.object_patches)
    else:
        assert step_graph.current(patched) is None


def test_linear_node_without_settings_is_auto():
    result = patch_nodes.TritonAccelPatchLinear().patch(FakePatcher(_model()))
    text = result["ui"]["text"][0]
    assert "PyTorch Linear: no GPU" in text, text


def test_settings_node_shows_both_decisions():
    text = TritonAccelSettings().configure("fp16", "cpu", "int8")["ui"]["text"][0]
    assert "fp16 forced on the CPU" in text and "Linear: int8 forced on the CPU" in text, text
    with pytest.raises(ValueError, match="unknown Linear mode"):
        AccelSettings("auto", linear_mode="fp4")


# ---- fused activations ----------------------------------------------------------------------
# A Linear feeding nn.GELU(approximate="tanh") gets the GELU in its GEMM epilogue; the GELU
# module's forward passes what our kernel activated and runs on everything else. Tolerance of
# the fused model against the unpatched one: MODEL_TOL (the quantisation's; the GELU itself is
# computed in fp32 either way).

class SingleStreamBlock(torch.nn.Module):
    """Flux's single block: linear1's output split into [3 * hidden | MLP], mlp_act on the MLP
    part only, then torch.cat: fused with a contiguous copy where FP8 W8A8 runs it and
    patch_linear_model(copy_activations=True) asks for it (fused_activations.fusable_with_copy)."""

    def __init__(self, hidden=48, mlp_ratio=2.0, yak_mlp=False):
        super().__init__()
        self.hidden_size = hidden
        self.mlp_hidden_dim = self.mlp_hidden_dim_first = int(hidden * mlp_ratio)
        self.yak_mlp = yak_mlp
        self.linear1 = ComfyLinear(hidden, hidden * 3 + self.mlp_hidden_dim_first)
        self.linear2 = ComfyLinear(hidden + self.mlp_hidden_dim, hidden)
        self.mlp_act = torch.nn.GELU(approximate="tanh")

    def forward(self, x):
        qkv, mlp = torch.split(self.linear1(x), [3 * self.hidden_size, self.mlp_hidden_dim_first], dim=-1)
        q, k, v = qkv.chunk(3, dim=-1)
        attn = F.scaled_dot_product_attention(q, k, v)
        return x + self.linear2(torch.cat((attn, self.mlp_act(mlp)), 2))


class FusableDiT(torch.nn.Module):
    def __init__(self, dim=48):
        super().__init__()
        self.double_mlp = torch.nn.Sequential(ComfyLinear(dim, 2 * dim), torch.nn.GELU(approximate="tanh"),
                                              ComfyLinear(2 * dim, dim))
        self.single_blocks = torch.nn.ModuleList([SingleStreamBlock(dim)])

    def forward(self, x):
        x = x + self.double_mlp(x)
        for block in self.single_blocks:
            x = block(x)
        return x


class FusableModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.diffusion_model = FusableDiT()


@pytest.fixture
def gelu_calls(monkeypatch):
    """Counts nn.GELU forwards that ran (installed before the models' forwards are captured)."""
    calls = []
    original = torch.nn.GELU.forward

    def forward(self, x):
        calls.append(tuple(x.shape))
        return original(self, x)

    monkeypatch.setattr(torch.nn.GELU, "forward", forward)
    return calls


def _fusable(seed=0):
    torch.manual_seed(seed)
    base = FakePatcher(FusableModel())
    x = torch.randn(2, 40, 48)
    with torch.no_grad():
        expected = base.model.diffusion_model(x)
    return base, x, expected


def test_fusable_activations_found_in_real_block_shapes():
    # In place: the Sequential MLP. With a contiguous copy: the single block, whose GELU feeds
    # torch.cat (slower on the strided slice of linear1 than the GELU pass costs).
    assert fused_activations.fusable_activations(FusableModel().diffusion_model) == [("double_mlp.0", "double_mlp.1", 0)]
    assert fused_activations.fusable_with_copy(FusableModel().diffusion_model) == [
        ("single_blocks.0.linear1", "single_blocks.0.mlp_act", 144)]
    # exact GELU (approximate="none", SD-style blocks) is not what the epilogue computes
    assert fused_activations.fusable_activations(BaseModel().diffusion_model) == []
    assert fused_activations.fusable_with_copy(BaseModel().diffusion_model) == []


@pytest.mark.parametrize("variant", ["yak_mlp", "wider_first_half", "silu", "other_class", "linear1_size"])
def test_single_blocks_whose_mlp_takes_another_slice_are_left_alone(variant):
    block = SingleStreamBlock(48, yak_mlp=variant == "yak_mlp")
    if variant == "wider_first_half":
        block.mlp_hidden_dim_first = 2 * block.mlp_hidden_dim
    elif variant == "silu":
        block.mlp_act = torch.nn.SiLU()
    elif variant == "linear1_size":
        block.linear1 = ComfyLinear(48, 48 * 3 + block.mlp_hidden_dim + 16)
    root = torch.nn.Module()
    if variant == "other_class":
        block.__class__ = type("OtherBlock", (SingleStreamBlock,), {})
    root.block = block
    assert fused_activations.fusable_with_copy(root) == []


@pytest.mark.parametrize("copies", [False, True], ids=["no_copy", "default_copy"])
@pytest.mark.parametrize("mode", ["fp8", "int8", "fp8_weight_only"])
def test_gelu_runs_in_the_gemm_and_the_model_matches_unpatched(mode, copies, gelu_calls):
    method = _method_available(mode)
    base, x, expected = _fusable()
    gelu_calls.clear()
    patched = linear_patch.patch_linear_model(base, FORCED[mode], skip="", min_tokens=16, copy_activations=copies)
    state = patched.triton_accel_linear
    assert state.fused_activations == 1 + copies and state.copied_activations == copies
    act_patches = {"diffusion_model.double_mlp.1.forward"}
    if copies:
        act_patches.add("diffusion_model.single_blocks.0.mlp_act.forward")
    assert {k for k, v in patched.object_patches.items() if isinstance(v, fused_activations.FusedActivation)} == act_patches
    text = linear_patch.patched_linear_text(patched, FORCED[mode])
    assert f"{1 + copies} GELU activations run in our GEMM's epilogue" in text
    assert ("1 of them, whose output is concat" in text) == copies
    patched.patch_model()
    kernels.core.stats.reset()
    with torch.no_grad():
        first = patched.model.diffusion_model(x)  # the guard's call
        second = patched.model.diffusion_model(x)
    stats = _linear_stats()
    assert stats["served"] == 8 and stats["paths"] == {method: 8}, stats
    # Never a GELU on an output our kernel activated. With copies FP8 W8A8 fuses the single
    # block's too; otherwise (and for the other methods) that one stays ComfyUI's GELU.
    copied = copies and mode == "fp8"
    assert gelu_calls == ([] if copied else [(2, 40, 96)] * 2), gelu_calls
    assert kernels.core.stats.counts().get("linear_epilogue_activation", 0) == (4 if copied else 2)
    assert torch.equal(first, second)
    err = _rel_l2(second, expected)
    assert 0 < err < MODEL_TOL, err
    patched.detach()
    with torch.no_grad():
        assert torch.equal(base.model.diffusion_model(x), expected)


def test_handed_back_calls_keep_comfyuis_gelu(gelu_calls):
    _method_available("fp8")
    base, x, expected = _fusable()
    gelu_calls.clear()
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="", min_tokens=10 ** 6)
    patched.patch_model()
    with torch.no_grad():
        out = patched.model.diffusion_model(x)
    assert _linear_stats()["served"] == 0
    assert len(gelu_calls) == 2
    assert torch.equal(out, expected)
    patched.detach()


def test_guard_failure_with_a_fused_activation_hands_back_unactivated(gelu_calls):
    broken = linear_common.LinearBackend(kernels.prepare_weight,
                              lambda x, p, b, dt, **kw: torch.full((*x.shape[:-1], p.out_features), 7.0, dtype=dt),
                              kernels.linear_refusal, kernels.LinearInputError)
    base, x, expected = _fusable()
    gelu_calls.clear()
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="", min_tokens=16, backend=broken)
    patched.patch_model()
    with torch.no_grad():
        out = patched.model.diffusion_model(x)
    assert torch.equal(out, expected)
    assert len(gelu_calls) == 2
    assert _linear_stats()["handed_back"] == 4
    patched.detach()


def _recording_backend(graphs: list):
    """A torch.compile backend that keeps dynamo's graphs and runs them as they are."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend


def _compiled_ops(graphs) -> int:
    return sum(1 for gm in graphs for node in gm.graph.nodes
               if "triton_accel" in str(node.target) and linear_layer.COMPILED_OP in str(node.target))


def _activated_ops(graphs) -> int:
    """patched_linear ops recorded with the GELU in them (FusedSequential)."""
    return sum(1 for gm in graphs for node in gm.graph.nodes
               if linear_layer.COMPILED_OP in str(node.target) and node.args[2:] == (True,))


def _run_compiled(patched, x, graphs: list):
    """The patched model compiled with the recording backend (fullgraph: a graph break fails),
    run once without gradients. Dynamo's recompile limit counts per code object across tests,
    so its caches are reset first."""
    torch.compiler.reset()
    model = torch.compile(patched.model.diffusion_model, fullgraph=True, backend=_recording_backend(graphs))
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("backend", ["record", "eager", "aot_eager"])
def test_torch_compile_serves_every_layer_through_one_op(gelu_calls, backend, monkeypatch):
    """TorchCompileModel compiles the model before its first call: the trace must not bake in
    a hand-back (the weights are not prepared yet) nor break the graph at our bookkeeping. With
    fullgraph=True any graph break fails the compile. Each layer is one patched_linear op that
    serves at run time. The Sequential MLP's Linear + GELU are one activated op (FusedSequential:
    the GELU in our epilogue, as eager); the single block's GELU, which feeds torch.cat, runs as
    traced. The op is registered without torch.library.custom_op's wrapper
    (compiled_ops.define), which also kept dynamo out of the op's body: it must still run only on
    real tensors, never traced."""
    _method_available("fp8")
    run_times = []
    compiled_call = linear_layer.LinearLayer.compiled_call

    def spied(self, x, activated=False):
        run_times.append(torch.compiler.is_compiling() or type(x) is not torch.Tensor)
        return compiled_call(self, x, activated)

    monkeypatch.setattr(linear_layer.LinearLayer, "compiled_call", spied)
    base, x, expected = _fusable()
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="", min_tokens=16, copy_activations=True)
    patched.patch_model()
    graphs = []
    torch.compiler.reset()  # dynamo's per-code-object recompile limit spans tests
    model = torch.compile(patched.model.diffusion_model, fullgraph=True,
                          backend=_recording_backend(graphs) if backend == "record" else backend)
    layers = len(patched.triton_accel_linear.layers)
    assert layers == 4
    before = len(gelu_calls)
    with torch.no_grad():
        first = model(x)  # traced before any weight was prepared
        first_stats = _linear_stats()
        gelus = len(gelu_calls) - before
        second = model(x)  # (a re-trace here: the fixture's GELU counter is guarded on)
        eager = patched.model.diffusion_model(x)
    if backend == "record":
        assert graphs and all(_compiled_ops([gm]) == layers for gm in graphs)
    assert first_stats["served"] == layers and first_stats["handed_back"] == 0, first_stats
    assert _linear_stats()["served"] == 3 * layers, _linear_stats()
    assert first_stats["paths"] == {"fp8_w8a8": layers}
    assert run_times == [False] * (2 * layers), run_times  # two compiled calls, real tensors only
    assert gelus == 1  # the single block's, as traced; double_mlp's ran in our epilogue
    assert _rel_l2(first, expected) < 0.05  # FP8 W8A8 through 4 layers (measured ~0.02)
    assert torch.equal(first, second)
    assert _rel_l2(first, eager) < 0.01  # the eager call fuses its GELUs: output rounding apart
    patched.detach()


def test_torch_compile_fused_op_applies_comfyuis_gelu_where_it_hands_back():
    """The activated op of a Sequential's Linear + GELU: a call our kernel does not serve at run
    time (here: each layer sent back by a quality guard that failed after the trace) goes to
    ComfyUI's Linear, and then the GELU module's own forward applies the activation: the
    compiled model equals the unpatched one."""
    _method_available("fp8")
    base, x, expected = _fusable()
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="", min_tokens=16)
    patched.patch_model()
    for each in patched.triton_accel_linear.layers:  # read at run time only: the trace records the op
        each.fallbacks[settings_mod.device_key(x.device)] = "quality guard: rel. L2 1.0 (test)"
    layer = next(layer for layer in patched.triton_accel_linear.layers if layer.name == "double_mlp.0")
    applied = []
    forward = layer.activation_forward
    layer.activation_forward = lambda t: applied.append(tuple(t.shape)) or forward(t)
    graphs = []
    out = _run_compiled(patched, x, graphs)
    assert _compiled_ops(graphs) == 4 and _activated_ops(graphs) == 1  # the Sequential's pair: one op
    stats = _linear_stats()
    assert stats["served"] == 0 and stats["handed_back"] == 4, stats
    assert applied == [(2, 40, 96)]  # ComfyUI's GELU forward, once, on ComfyUI's Linear output
    assert torch.equal(out, expected)  # no GELU missing, none applied twice
    patched.detach()


def test_torch_compile_traces_calls_under_min_tokens_as_comfyui():
    """A static token count under min_tokens is handed back whatever happens at run time, so it
    is traced as ComfyUI's Linear (the Sequential's pair as it is): no op in the graph, nothing
    counted, the compiled model equal to the unpatched one. A Linear extension (it might take
    such calls) registered after the compile re-traces with the op, as do symbolic shapes, whose
    count is known only at run time; both hand back at run time."""
    _method_available("fp8")
    base, x, expected = _fusable()
    longer = torch.randn(2, x.shape[1] + 8, x.shape[2])
    with torch.no_grad():
        expected_longer = base.model.diffusion_model(longer)  # unpatched
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="", min_tokens=x.shape[0] * x.shape[1] + 1)
    patched.patch_model()
    graphs = []
    torch.compiler.reset()
    model = torch.compile(patched.model.diffusion_model, fullgraph=True, backend=_recording_backend(graphs))
    with torch.no_grad():
        out = model(x)
    assert len(graphs) == 1 and _compiled_ops(graphs) == 0 and _activated_ops(graphs) == 0
    assert _linear_stats()["served"] == 0 and _linear_stats()["handed_back"] == 0
    assert torch.equal(out, expected)
    path = extensions.register_linear(f"t{uuid.uuid4().hex[:8]}", lambda x, w, b: F.linear(x, w, b),
                                     constraints={"device_types": ["cpu"]})
    try:
        with torch.no_grad():
            again = model(x)  # the guard on extensions.linear_count() fails: a second trace
        assert len(graphs) == 2 and _compiled_ops(graphs[1:]) == 4
        assert _linear_stats()["handed_back"] == 4 and _linear_stats()["served"] == 0
        assert torch.equal(again, expected)
    finally:
        extensions.unregister(path)
    graphs.clear()
    call_stats.reset()
    torch.compiler.reset()
    model = torch.compile(patched.model.diffusion_model, fullgraph=True, dynamic=True,
                          backend=_recording_backend(graphs))
    with torch.no_grad():
        out = model(x)
        assert _compiled_ops(graphs) == 0 and torch.equal(out, expected)
        out = model(longer)  # over min_tokens: dynamo's guard on the symbolic count re-traces
        assert _compiled_ops(graphs) == 4 and _linear_stats()["served"] == 4
        assert _rel_l2(out, expected_longer) < 0.05  # FP8 W8A8 through 4 layers (~0.02)
    patched.detach()


def test_torch_compile_traces_the_sequential_as_it_is_under_another_patch():
    """Another node's patch installed over our GELU patch: FusedSequential records no fused op
    (that node's forward would be skipped), the Sequential is traced as it is."""
    _method_available("fp8")
    base, x, expected = _fusable()
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="", min_tokens=16)
    seen = []

    def other(t):
        seen.append(tuple(t.shape))
        return F.gelu(t, approximate="tanh")

    patched.add_object_patch("diffusion_model.double_mlp.1.forward", other)
    patched.patch_model()
    graphs = []
    out = _run_compiled(patched, x, graphs)
    assert _activated_ops(graphs) == 0
    assert seen  # traced, so it ran (at least) at trace time
    assert _linear_stats()["served"] == 4
    assert _rel_l2(out, expected) < 0.05
    patched.detach()


def test_torch_compile_traces_skipped_layers_and_autograd_calls_as_comfyui():
    _method_available("fp8")
    base, x, expected = _fusable()
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="single_blocks.*", min_tokens=16)
    patched.patch_model()
    graphs = []
    out = _run_compiled(patched, x, graphs)
    assert _compiled_ops(graphs) == 2  # double_mlp.0 and .2; the single block's two are ComfyUI's
    assert _linear_stats()["served"] == 2
    assert _rel_l2(out, expected) < 0.05
    torch.compiler.reset()
    graphs.clear()
    call_stats.reset()
    with torch.enable_grad():
        y = x.clone().requires_grad_(True)
        out = torch.compile(patched.model.diffusion_model, fullgraph=True, backend=_recording_backend(graphs))(y)
        out.sum().backward()
    assert _compiled_ops(graphs) == 0 and y.grad is not None
    patched.detach()


def test_torch_compile_with_dynamic_shapes_serves_each_length():
    """dynamic=True (what dynamo falls back to after a resolution change): the op's fake takes
    symbolic token counts, and each length is served at run time."""
    _method_available("fp8")
    base, x, _ = _fusable()
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="", min_tokens=16)
    patched.patch_model()
    graphs = []
    torch.compiler.reset()  # dynamo's per-code-object recompile limit spans tests
    model = torch.compile(patched.model.diffusion_model, fullgraph=True, dynamic=True,
                          backend=_recording_backend(graphs))
    with torch.no_grad():
        for tokens in (40, 56):
            out = model(x[:, :1].expand(2, tokens, 48).contiguous() + torch.randn(2, tokens, 48))
            assert out.shape == (2, tokens, 48)
    assert len(graphs) == 1  # one symbolic graph for both lengths
    assert _linear_stats()["served"] == 8
    patched.detach()


def test_calls_autograd_records_go_to_comfyui():
    """Our kernels have no backward: a call autograd records (a gradient through the model, as a
    training or guidance node asks for) goes to ComfyUI's Linear, and the gradient is right."""
    layer, calls = _layer(settings=FORCED["fp8"])
    x = torch.randn(2, 64, 32, requires_grad=True)
    with torch.enable_grad():
        layer(x).square().sum().backward()
        x_ref = x.detach().clone().requires_grad_(True)
        layer.module.__class__.forward(layer.module, x_ref).square().sum().backward()
    assert len(calls) == 1
    assert _linear_stats()["reasons"] == {linear_common.REASON_AUTOGRAD: 1}
    assert torch.equal(x.grad, x_ref.grad)


def test_compiled_op_names_a_freed_layer_with_a_reason():
    layer, _ = _layer(settings=FORCED["fp8"])
    token = layer.token
    assert linear_layer._layer(token) is layer
    del layer
    import gc
    gc.collect()
    with pytest.raises(RuntimeError, match="no longer exists"):
        linear_layer._layer(token)


def test_repatching_unwraps_our_activation_patch():
    base, _, _ = _fusable()
    first = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="")
    second = linear_patch.patch_linear_model(first, FORCED["fp8"], skip="")
    patch = second.object_patches["diffusion_model.double_mlp.1.forward"]
    assert isinstance(patch, fused_activations.FusedActivation) and not isinstance(patch.previous, fused_activations.FusedActivation)
    seq = second.object_patches["diffusion_model.double_mlp.forward"]
    assert isinstance(seq, fused_activations.FusedSequential) and not isinstance(seq.previous, fused_activations.FusedSequential)
    assert seq.layer.state is second.triton_accel_linear and seq.layer.name == "double_mlp.0"
    # a skipped Linear leaves its activation to ComfyUI (the clone's inherited patch runs it)
    third = linear_patch.patch_linear_model(first, FORCED["fp8"], skip="double_mlp.*, single_blocks.*", copy_activations=True)
    assert third.triton_accel_linear.fused_activations == 0
    for name in ("double_mlp.0", "single_blocks.0.linear1"):
        layer = next(layer for layer in third.triton_accel_linear.layers if layer.name == name)
        assert layer.activation is None


def test_single_block_mlp_gets_the_contiguous_copy():
    """FP8 W8A8: linear1's kernel writes the GELU'd MLP columns into its output and into a
    contiguous copy; the GELU patch hands the copy to the block (so its torch.cat stays
    vectorised) when asked for exactly those columns, and the strided slice otherwise."""
    _method_available("fp8")
    base, x, _ = _fusable()
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="", min_tokens=16, copy_activations=True)
    patched.patch_model()
    layer = patched.object_patches["diffusion_model.single_blocks.0.linear1.forward"]
    gelu = patched.object_patches["diffusion_model.single_blocks.0.mlp_act.forward"]
    assert layer.activation_copy
    with torch.no_grad():
        layer(x)  # the guard's call
        out = layer(x)
    qkv, mlp = torch.split(out, [144, 96], dim=-1)
    assert not mlp.is_contiguous()
    passed = gelu(mlp)
    assert passed.is_contiguous() and passed.shape == mlp.shape and torch.equal(passed, mlp)
    assert gelu(qkv) is not None and not torch.equal(gelu(qkv), qkv)  # not activated: ComfyUI's GELU runs
    tail = mlp[..., 8:]  # activated columns, but not the copied block: the slice passes as it is
    assert activation_marks.activated_copy(tail) is None and gelu(tail) is tail
    patched.detach()


def test_copy_layer_without_a_copying_method_leaves_the_gelu_to_comfyui(gelu_calls):
    """INT8 (no activation_out): the single block's linear1 runs unfused, its guard compares
    against ComfyUI's unactivated output, and the block's GELU runs as in ComfyUI."""
    _method_available("int8")
    base, x, expected = _fusable()
    patched = linear_patch.patch_linear_model(base, FORCED["int8"], skip="", min_tokens=16, copy_activations=True)
    patched.patch_model()
    layer = patched.object_patches["diffusion_model.single_blocks.0.linear1.forward"]
    assert layer.activation_copy and not layer.fuses("int8_w8a8") and layer.fuses("fp8_w8a8")
    gelu_calls.clear()
    with torch.no_grad():
        layer(x), layer(x)
    assert _linear_stats()["served"] == 2 and gelu_calls == []
    patched.detach()


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_is_activated_follows_views_of_the_marked_output(grad_mode):
    """Under torch.inference_mode (how ComfyUI runs its samplers) views record no _base: the
    mark must still be found from them, through the storage they share."""
    context = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()
    with context:
        _check_marks_follow_views()


def _check_marks_follow_views():
    assert activation_marks.storage_marks_work()
    out2d = torch.randn(6, 40)
    view = out2d.reshape(2, 3, 40)
    activation_marks.mark_activated(view, 16)
    assert not activation_marks.is_activated(view)  # columns 0-15 are not activated
    qkv, mlp = torch.split(view, [16, 24], dim=-1)
    assert activation_marks.is_activated(mlp) and not activation_marks.is_activated(qkv)
    assert activation_marks.is_activated(view[..., 20:]) and not activation_marks.is_activated(view[..., 8:])
    assert not activation_marks.is_activated(mlp.contiguous()) and not activation_marks.is_activated(mlp.float() * 1)
    assert not activation_marks.is_activated(view[:1, :, 16:]), "fewer rows than the kernel wrote: not the same call's output"
    whole = torch.randn(4, 32)
    activation_marks.mark_activated(whole, 0)
    assert activation_marks.is_activated(whole) and activation_marks.is_activated(whole.view(2, 2, 32))
    assert not activation_marks.is_activated(whole.t()) and not activation_marks.is_activated(torch.randn(4, 32))
    wide = torch.randn(2, 3, 40)
    copy = torch.randn(2, 3, 24)
    activation_marks.mark_activated(wide, 16, copy)
    qkv, mlp = torch.split(wide, [16, 24], dim=-1)
    del wide  # the split's views alone keep the storage (and its mark)
    assert activation_marks.activated_copy(mlp) is not None and torch.equal(activation_marks.activated_copy(mlp), copy)
    assert activation_marks.activated_copy(qkv) is None and activation_marks.activated_copy(mlp[..., 8:]) is None


def test_marked_storages_are_held_until_their_activation_reads_them():
    """A marked output's storage (its Python object, which carries the mark) is held until
    FusedActivation reads it, at most MAX_HELD_MARKS of them: a ComfyUI server once lost the
    mark of a storage nobody else held from Python, and the single block's GELU ran twice."""
    activation_marks._held_marks.clear()
    with torch.inference_mode():
        outs = [torch.randn(2, 3, 40) for _ in range(activation_marks.MAX_HELD_MARKS + 2)]
        for out in outs:
            activation_marks.mark_activated(out, 16)
        assert activation_marks.held_marks() == activation_marks.MAX_HELD_MARKS  # the oldest are dropped
        last = outs[-1]
        _, mlp = torch.split(last, [16, 24], dim=-1)
        act = fused_activations.FusedActivation("act", torch.nn.GELU(approximate="tanh"), lambda t: pytest.fail("GELU ran twice"))
        assert act(mlp) is mlp
        assert activation_marks.held_marks() == activation_marks.MAX_HELD_MARKS - 1  # read: released
        other = torch.randn(2, 3, 24)
        assert torch.equal(act.__class__("act", None, lambda t: t * 2)(other), other * 2)  # unmarked: the module's
        assert activation_marks.held_marks() == activation_marks.MAX_HELD_MARKS - 1
    activation_marks._held_marks.clear()


@pytest.mark.parametrize("copies", [False, True], ids=["no_copy", "default_copy"])
def test_fused_model_under_inference_mode_matches_no_grad(copies, gelu_calls):
    """ComfyUI samples under torch.inference_mode: every fused GELU (the Sequential's, and the
    single block's through its copy) must run exactly once there too, giving what the same
    patch gives under no_grad (bit for bit) and the unpatched model within MODEL_TOL."""
    _method_available("fp8")
    base, x, expected = _fusable()
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="", min_tokens=16, copy_activations=copies)
    patched.patch_model()
    with torch.no_grad():
        patched.model.diffusion_model(x)  # the guard's call
        under_no_grad = patched.model.diffusion_model(x)
    gelu_calls.clear()
    with torch.inference_mode():
        under_inference = patched.model.diffusion_model(x)
    assert gelu_calls == ([] if copies else [(2, 40, 96)])
    assert torch.equal(under_inference, under_no_grad)
    assert _rel_l2(under_inference, expected) < MODEL_TOL
    patched.detach()


def test_torch_compile_without_our_op_traces_comfyuis_linear(monkeypatch, caplog):
    """A torch whose custom-op registration refuses ours: the pack still loads (a warning with
    the reason) and compiled graphs trace ComfyUI's Linear, unpatched."""
    def refuse():
        raise ValueError("unsupported type in schema")
    monkeypatch.setattr(linear_layer, "_register_compiled_op", refuse)
    with caplog.at_level("WARNING", logger="triton_accel"):
        error = linear_layer._compiled_op_error()
    assert error == "ValueError: unsupported type in schema" and "could not be registered" in caplog.text
    monkeypatch.setattr(linear_layer, "COMPILED_OP_ERROR", error)
    base, x, expected = _fusable()
    patched = linear_patch.patch_linear_model(base, FORCED["fp8"], skip="", min_tokens=16)
    patched.patch_model()
    graphs = []
    with torch.no_grad():
        torch.compiler.reset()  # dynamo's per-code-object recompile limit spans tests
        out = torch.compile(patched.model.diffusion_model, fullgraph=True, backend=_recording_backend(graphs))(x)
    assert _compiled_ops(graphs) == 0 and _linear_stats()["served"] == 0
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    patched.detach()


def test_calls_inside_a_cuda_graph_capture_go_to_comfyui(monkeypatch):
    """A replay would run our kernel on the prepared weight captured, not on a weight ComfyUI
    changed in place since (a LoRA re-applied): captured calls go to ComfyUI's Linear."""
    layer, calls = _layer(settings=FORCED["fp8"])
    monkeypatch.setattr(linear_layer.compiled_ops, "capturing", lambda t: True)
    with torch.no_grad():
        layer(torch.randn(2, 64, 32))
    assert len(calls) == 1 and _linear_stats()["reasons"] == {linear_common.REASON_CAPTURING: 1}


@pytest.mark.parametrize("change", ["none", "weight_object", "weight_in_place_new_storage", "weights_token",
                                    "weight_function", "few_tokens", "fallback", "extension_generation",
                                    "autograd", "input_dtype", "entry_dropped"])
def test_steady_calls_skip_the_checks_until_what_they_read_changes(monkeypatch, change):
    """After a served call on a guarded entry, the next calls of that layer take the steady path
    (no entry_for) while everything entry_for read is unchanged; any change sends the call
    through the checked path, which serves or hands back as it always did."""
    layer, calls = _layer(settings=FORCED["fp8"])
    state, module = layer.state, layer.module
    checked = []
    real = state.entry_for
    monkeypatch.setattr(state, "entry_for", lambda *a, **k: checked.append(1) or real(*a, **k))
    x = torch.randn(2, 8, 32)
    layer(x), layer(x)  # the guard's call, then a served one that remembers the steady facts
    assert len(checked) == 2 and layer._steady is not None
    ref = layer(x)
    assert len(checked) == 2 and _linear_stats()["served"] == 3
    assert _rel_l2(ref, torch.nn.functional.linear(x, module.weight, module.bias)) < 0.05
    if change == "weight_object":
        module.weight = torch.nn.Parameter(module.weight.detach().clone() * 2)
    elif change == "weight_in_place_new_storage":
        module.weight.data = module.weight.data.clone()
    elif change == "weights_token":
        state.weights_token = "another patches_uuid"
    elif change == "weight_function":
        module.weight_function = [lambda w: w * 2]
    elif change == "few_tokens":
        x = torch.randn(1, 2, 32)
    elif change == "fallback":
        layer.fallbacks["cuda:0"] = "quality guard (fp8): on another device"
    elif change == "extension_generation":
        monkeypatch.setattr(linear_layer.extensions, "generation", lambda: -7)
    elif change == "autograd":
        x = x.clone().requires_grad_(True)
    elif change == "input_dtype":
        x = x.to(torch.bfloat16)
    elif change == "entry_dropped":
        layer.entries.clear()
    before = len(calls)
    if change == "autograd":
        with torch.enable_grad():
            out = layer(x)
    else:
        out = layer(x)
    assert len(checked) == (2 if change == "none" else 3), change
    # ComfyUI's Linear runs for a call handed back, and beside ours where the checked path
    # found a new weight version (the guard runs again)
    comfy_ran = change in ("weight_function", "few_tokens", "autograd", "weight_object",
                           "weight_in_place_new_storage", "weights_token", "entry_dropped")
    assert len(calls) == before + comfy_ran, change
    assert out.shape == (*x.shape[:-1], 48)
