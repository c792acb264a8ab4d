"""kernels.attention.dispatch's contract where it was broken (issue 10), each case against a reference:

1. negative scale over several key tiles (the running max was taken of unscaled scores:
   all inf/NaN with > 256 keys and no mask), in the flash kernel, the short-key kernel and FP8;
2. v's head dim different from q's through backend=None / "torch", eager, fake and compiled;
3. gradients: inputs that require grad get SDPA's gradients (they were silently dropped);
4. non-tensor q / mask and a non-number scale raise AttentionInputError with a reason;
plus the single error type, the registry's GPU rules coming from gpu_rules.py, and
clear_caches() emptying every module-level cache of kernels/.

Tolerances (relative L2 vs a float64 reference): fp16 2e-3, fp32 1e-5, as test_attention.py;
gradients (float32 math in the backward vs SDPA's float64 gradient): 1e-4 for fp32 inputs,
3e-3 for fp16 inputs (grads rounded to fp16).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil

import pytest
import torch

import triton_accel  # noqa: F401  (loaded by conftest under this name)

K = importlib.import_module("triton_accel.kernels")
attention_mod = importlib.import_module("triton_accel.kernels.attention.dispatch")
checks = importlib.import_module("triton_accel.kernels.attention.checks")
fp8 = importlib.import_module("triton_accel.kernels.attention.fp8")
gpu_rules = importlib.import_module("triton_accel.kernels.core.gpu_rules")
cache_registry = importlib.import_module("triton_accel.kernels.core.cache_registry")
F = torch.nn.functional


def rel_l2(out, ref):
    assert torch.isfinite(out).all(), "non-finite output"
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def ref64(q, k, v, mask=None, scale=None, causal=False):
    return K.attention_ref(q, k, v, mask, scale, causal, compute_dtype=torch.float64)


# ---- 1. negative scale ----------------------------------------------------------------------

@pytest.mark.parametrize("scale", [-1.0, -0.125, 0.0, 1e-6])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager_rescale", "lazy_rescale"])
def test_flash_negative_and_tiny_scale_over_many_key_tiles(scale, lazy):
    """Issue 10.1's call: 272 keys (past the short-key kernel), no mask, so full key tiles take
    the hot path. Before the fix every output was inf/NaN for scale -1."""
    q, k, v = (rand(1, 1, n, 64, dtype=torch.float16, seed=i) for i, n in enumerate((16, 272, 272)))
    at = importlib.import_module("triton_accel.kernels.attention.flash")
    cfg = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, LAZY=lazy)
    out = at.attention_triton(q, k, v, scale=scale, config=cfg)
    assert rel_l2(out, ref64(q, k, v, None, scale)) < 2e-3
    K.stats.reset()
    api = K.attention(q, k, v, scale=scale, backend="triton")
    assert K.stats.counts().get("triton_attention") == 1
    assert rel_l2(api, ref64(q, k, v, None, scale)) < 2e-3


def test_short_kv_negative_scale():
    q, k, v = (rand(1, 2, n, 32, dtype=torch.float16, seed=i) for i, n in enumerate((20, 77, 77)))
    K.stats.reset()
    out = K.attention(q, k, v, scale=-2.0, backend="triton")
    assert K.stats.counts().get("triton_attention.short_kv") == 1
    assert rel_l2(out, ref64(q, k, v, None, -2.0)) < 2e-3


def test_fp8_negative_scale():
    q, k, v = (rand(1, 1, n, 64, dtype=torch.float16, seed=i) for i, n in enumerate((16, 272, 272)))
    out = fp8.attention_fp8(q, k, v, scale=-0.5)
    assert rel_l2(out, fp8.attention_fp8_emulated(q, k, v, scale=-0.5)) < 5e-3


# ---- 2. v head dim != q head dim ------------------------------------------------------------

@pytest.mark.parametrize("backend", [None, "torch", "reference"])
def test_value_head_dim_differs(backend):
    q, k, v = rand(1, 2, 5, 8, seed=1), rand(1, 2, 6, 8, seed=2), rand(1, 2, 6, 1, seed=3)
    out = K.attention(q, k, v, backend=backend)
    sdpa = F.scaled_dot_product_attention(q, k, v)
    assert out.shape == sdpa.shape == (1, 2, 5, 1)
    assert rel_l2(out, sdpa) < 1e-5


def test_value_head_dim_differs_keeps_q_layout():
    """[B, L, H, D] storage viewed as [B, H, L, D], as ComfyUI sends: the output keeps that order."""
    q = rand(2, 7, 3, 16, seed=1).transpose(1, 2)
    k, v = rand(2, 3, 9, 16, seed=2), rand(2, 3, 9, 24, seed=3)
    out = K.attention(q, k, v)
    assert out.shape == (2, 3, 7, 24)
    assert out.transpose(1, 2).is_contiguous()
    assert rel_l2(out, ref64(q, k, v)) < 1e-5


def test_value_head_dim_differs_fake_and_compiled():
    q, k, v = rand(1, 2, 5, 8, seed=1), rand(1, 2, 6, 8, seed=2), rand(1, 2, 6, 4, seed=3)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        assert torch.ops.triton_accel.attention(fq, fk, fv, None, None, False, None).shape == (1, 2, 5, 4)
    compiled = torch.compile(lambda q, k, v: K.attention(q, k, v) * 2.0, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    assert out.shape == (1, 2, 5, 4)
    assert rel_l2(out / 2.0, ref64(q, k, v)) < 1e-5


def test_triton_refuses_value_head_dim_with_reason():
    q, k, v = rand(1, 2, 5, 8), rand(1, 2, 6, 8), rand(1, 2, 6, 4)
    with pytest.raises(K.BackendUnavailableError) as e:
        K.attention(q, k, v, backend="triton")
    assert "value head dim 4 != query head dim 8" in e.value.reason


# ---- 3. gradients ---------------------------------------------------------------------------

def _grads(fn, tensors, grad_out):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out, [t.grad for t in leaves]


GRAD_CASES = {
    # name: (B, H, Hkv, Lq, Lk, D, Dv, mask kind, causal)
    "plain": (1, 2, 2, 7, 9, 16, 16, None, False),
    "gqa_causal": (1, 4, 2, 9, 9, 8, 8, None, True),
    "bool_mask_dead_row": (2, 2, 2, 6, 11, 16, 16, "bool", False),
    "additive_mask_grad": (1, 2, 2, 5, 7, 8, 8, "additive", False),
    "value_dim_differs": (1, 2, 2, 5, 6, 8, 3, None, False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_gradients_match_sdpa(name, backend, dtype):
    B, H, Hkv, Lq, Lk, D, Dv, mask_kind, causal = GRAD_CASES[name]
    q, k, v = rand(B, H, Lq, D, seed=1), rand(B, Hkv, Lk, D, seed=2), rand(B, Hkv, Lk, Dv, seed=3)
    tensors = [q.to(dtype), k.to(dtype), v.to(dtype)]
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, Lq, Lk, generator=torch.Generator().manual_seed(4)) > 0.3
        mask[0, 0, 2] = False  # a fully masked row: zero output, zero gradient
    elif mask_kind == "additive":
        mask = rand(B, 1, Lq, Lk, seed=5)
        tensors.append(mask.to(dtype))
    grad_out = rand(B, H, Lq, Dv, seed=6)

    def ours(q, k, v, m=mask):
        return K.attention(q, k, v, attn_mask=m, is_causal=causal, backend=backend)

    def sdpa(q, k, v, m=mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=H != Hkv)

    out, g_ours = _grads(ours, tensors, grad_out)
    assert out.requires_grad and out.dtype == dtype
    _, g_ref = _grads(sdpa, [t.double() for t in tensors],
                      grad_out.double())
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    for name_, a, b in zip("qkvm", g_ours, g_ref):
        assert a is not None and a.dtype == dtype, name_
        assert rel_l2(a, b) < tol, (name_, rel_l2(a, b))


def test_gradients_under_torch_compile():
    q, k, v = rand(1, 2, 6, 8, seed=1), rand(1, 2, 7, 8, seed=2), rand(1, 2, 7, 8, seed=3)
    grad_out = rand(1, 2, 6, 8, seed=4)
    compiled = torch.compile(lambda q, k, v: K.attention(q, k, v, backend="triton"), backend="aot_eager")
    _, g_ours = _grads(compiled, [q, k, v], grad_out)
    _, g_ref = _grads(F.scaled_dot_product_attention, [q.double(), k.double(), v.double()], grad_out.double())
    for a, b in zip(g_ours, g_ref):
        assert rel_l2(a, b) < 1e-4


def test_no_grad_calls_stay_off_the_op(monkeypatch):
    """Inference (no input requires grad) keeps the eager fast path: no dispatcher round trip."""
    q = rand(1, 1, 4, 8)
    calls = []
    monkeypatch.setattr(attention_mod, "_shared_dispatch",
                        lambda *a: calls.append(1) or attention_mod._dispatch(*a))
    K.attention(q, q, q)
    assert calls == [1]
    with torch.no_grad():
        K.attention(q.requires_grad_(), q, q)
    assert calls == [1, 1]


# ---- 4. bad inputs --------------------------------------------------------------------------

def _bad_calls():
    q, kv = rand(1, 2, 4, 8), rand(1, 2, 6, 8)
    return {
        "q_list": (([1.0], kv, kv), {}, "q must be a [B, H, L, D] tensor"),
        "k_none": ((q, None, kv), {}, "k must be a [B, H, L, D] tensor"),
        "v_int": ((q, kv, 3), {}, "v must be a [B, H, L, D] tensor"),
        "mask_list": ((q, kv, kv), {"attn_mask": [[True] * 6]}, "attn_mask must be a tensor"),
        "mask_int_dtype": ((q, kv, kv), {"attn_mask": torch.ones(6, dtype=torch.int64)}, "bool or floating"),
        "mask_shape": ((q, kv, kv), {"attn_mask": torch.ones(3, 6, dtype=torch.bool)}, "does not broadcast"),
        "scale_str": ((q, kv, kv), {"scale": "0.1"}, "scale must be a number"),
        "scale_tensor": ((q, kv, kv), {"scale": torch.tensor([0.1, 0.2])}, "scale must be a number"),
        "scale_nan": ((q, kv, kv), {"scale": float("nan")}, "scale must be finite"),
        "scale_inf": ((q, kv, kv), {"scale": float("inf")}, "scale must be finite"),
        "rank3": ((q[0], kv, kv), {}, "q must be [B, H, L, D]"),
        "int_inputs": ((q.long(), kv.long(), kv.long()), {}, "floating point"),
        "dtypes_differ": ((q, kv.half(), kv), {}, "dtypes differ"),
        "heads": ((rand(1, 3, 4, 8), kv, kv), {}, "not a multiple"),
    }


BAD = _bad_calls()


@pytest.mark.parametrize("backend", [None, "triton", "torch"])
@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_raise_our_error_with_reason(name, backend):
    args, kw, words = BAD[name]
    with pytest.raises(K.AttentionInputError) as e:
        K.attention(*args, backend=backend, **kw)
    assert isinstance(e.value, ValueError) and words in e.value.reason, e.value.reason
    ok, reason = K.attention_support(*args[:3], attn_mask=kw.get("attn_mask"))
    if "scale" not in kw:
        assert not ok and words in reason


# ---- the registry's GPU rules are gpu_rules.py's --------------------------------------------

def _call(cap, dtype=torch.float16, name="GPU"):
    info = K.DeviceInfo("cuda", "nvidia", name, cap, f"sm{cap[0]}{cap[1]}")
    return attention_mod.Call(device=info, dtype=dtype, head_dim=64, head_dim_v=64, q_heads=2, kv_heads=2,
                              mask="none", is_causal=False)


def test_registry_minimum_capability_follows_gpu_rules():
    impl = K.registry.get("attention", "triton_attention")
    assert impl.constraints.min_capability == gpu_rules.min_capability_for(K.triton_version())
    for version, cap in (("3.2.0", (7, 5)), ("3.3.1", (8, 0)), ("3.9.0", (8, 0))):
        assert gpu_rules.min_capability_for(version) == cap


def test_registry_bf16_and_fp8_refusals_are_gpu_rules_words():
    c = K.registry.get("attention", "triton_attention").constraints
    turing = (7, 5)
    from dataclasses import replace
    c75 = replace(c, min_capability=(7, 5))  # as with Triton <= 3.2
    want = gpu_rules.capability_refusal("nvidia", turing, "T4", dtype="bfloat16").reason
    assert c75.check(_call(turing, torch.bfloat16, "T4")) == want
    assert c75.check(_call(turing, torch.float16, "T4")) is None
    fp8c = K.registry.get("attention", "triton_fp8").constraints
    assert fp8c.check(_call((8, 6), name="RTX 3090")) == gpu_rules.capability_refusal(
        "nvidia", (8, 6), "RTX 3090", fp8=True).reason
    assert fp8c.check(_call((8, 9))) is None


def test_registry_names_match_gpu_rules_paths():
    names = {i.name for i in K.registry.implementations("attention")}
    assert names == {"triton_attention", "triton_fp8", "triton_int8", "torch_sdpa", "reference_fp32"}
    assert set(gpu_rules.BACKEND_OF_PATH.values()) <= names


def test_no_eligibility_sm_numbers_outside_gpu_rules():
    """Capability tuples (a GPU's eligibility) live in gpu_rules.py only; config tables name
    arch families as strings ("sm90"), which is fine."""
    import re
    from pathlib import Path

    root = Path(K.__file__).parent
    pattern = re.compile(r"\(\s*[5-9]\s*,\s*[0-9]\s*\)|capability\s*[<>]=?\s*\(")
    offenders = []
    for path in root.rglob("*.py"):
        if path.name in ("gpu_rules.py", "install_config.py"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if pattern.search(code) and "min_capability_for" not in code:
                offenders.append(f"{path.name}:{n}: {line.strip()}")
    assert not offenders, offenders


# ---- every module-level cache is cleared by clear_caches ------------------------------------

def _kernel_modules():
    pkg = importlib.import_module("triton_accel.kernels")
    for info in pkgutil.walk_packages(pkg.__path__, prefix="triton_accel.kernels."):
        yield importlib.import_module(info.name)


def test_clear_caches_empties_every_module_level_cache():
    sentinel = object()
    dicts, lru = [], []
    for mod in _kernel_modules():
        if mod.__name__.endswith(".cache_registry"):
            continue  # the registry of clearers itself
        for attr, val in vars(mod).items():
            if isinstance(val, dict) and not attr.isupper() and attr.startswith("_") and not attr.startswith("__"):
                val[sentinel] = 1
                dicts.append((mod, attr))
            elif isinstance(val, functools._lru_cache_wrapper) and inspect.getmodule(val) is mod:
                lru.append((mod, attr, val))
    assert len(dicts) >= 6, dicts  # routes, refusals, decisions, fitted, fp8 configs, plans, selfcheck
    K.clear_caches()
    left = [f"{m.__name__}.{a}" for m, a in dicts if sentinel in (getattr(m, a) or {})]
    assert not left, f"module-level caches not registered with cache_registry: {left}"
    registered = list(cache_registry._clearers.values())
    for mod, attr, fn in lru:
        assert any(c == fn.cache_clear for c in registered), f"{mod.__name__}.{attr} (lru_cache) not registered"


def test_clear_caches_forgets_decisions():
    q = rand(1, 1, 4, 8)
    K.attention(q, q, q)
    assert attention_mod._decisions
    K.clear_caches()
    assert not attention_mod._decisions and not attention_mod._routes


def test_input_error_is_one_type_everywhere():
    assert issubclass(checks.AttentionInputError, ValueError)
    assert K.AttentionInputError is checks.AttentionInputError
    assert issubclass(fp8.FP8UnsupportedError, K.BackendUnavailableError)
    e = checks.AttentionInputError("why", op="x")
    assert e.reason == "why" and str(e) == "x: why"


# ---- one arch-family mapping for every kernel's config tables -------------------------------

@pytest.mark.parametrize("arch, flash, short, fp8_table", [
    ("sm75", "default", "default", "default"), ("sm80", "sm80", "sm80", "default"),
    ("sm86", "sm86", "sm86", "default"), ("sm87", "sm86", "sm86", "default"),
    ("sm89", "sm86", "sm86", "sm89"), ("sm90", "sm90", "sm90", "sm90"), ("sm100", "sm90", "sm90", "sm90"),
    ("sm120", "sm86", "sm86", "sm89"), ("sm121", "sm86", "sm86", "sm89"), ("gfx942", "hip", "hip", "default"),
    ("gfx1100", "hip", "hip", "default"), ("hip", "hip", "hip", "default"), ("sm61", "default", "default", "default"),
])
def test_arch_family_picks_each_kernels_table(arch, flash, short, fp8_table):
    """The tables each kernel had before the shared mapping, arch by arch."""
    at = importlib.import_module("triton_accel.kernels.attention.flash")
    sk = importlib.import_module("triton_accel.kernels.attention.short_kv")
    kc = importlib.import_module("triton_accel.kernels.core.kernel_common")
    assert at.ATTENTION_CONFIGS[kc.family_in(at.ATTENTION_CONFIGS, kc.arch_family(arch))] is at.ATTENTION_CONFIGS[flash]
    info = K.DeviceInfo("cuda", "nvidia", arch, None, arch)
    assert sk.config_family(info, False) == short
    assert fp8.FP8_ATTENTION_CONFIGS[fp8.config_family(arch)] is fp8.FP8_ATTENTION_CONFIGS[fp8_table]


def test_direct_launch_constexpr_order_matches_the_kernel():
    """The direct launch appends the constexprs in _CONSTEXPR_ORDER after the runtime
    arguments: it must be the kernel's own order, and every one must get a value."""
    at = importlib.import_module("triton_accel.kernels.attention.flash")
    params = list(inspect.signature(at._attn_fwd.fn).parameters.values())
    names = [p.name for p in params if "constexpr" in str(p.annotation)]
    assert tuple(names) == at._CONSTEXPR_ORDER
    assert {"NEGATIVE_SCALE", "HEAD_DIM", "BLOCK_D"} <= set(names)
    launched = {}
    real = at._attn_fwd

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.update(kw)
                return real[grid](*args, **kw)
            return launch

    at._attn_fwd = Spy()
    try:
        at.attention_triton(rand(1, 1, 4, 8), rand(1, 1, 4, 8), rand(1, 1, 4, 8))
    finally:
        at._attn_fwd = real
    assert set(names) <= set(launched), set(names) - set(launched)
    runtime = [p.name for p in params if "constexpr" not in str(p.annotation)]
    q = rand(1, 2, 4, 8)
    assert len(at._runtime_args(q, q, q, q, q, 0.5, (0, 0, 0, 0), 2, 2, 4, 4)) == len(runtime)
