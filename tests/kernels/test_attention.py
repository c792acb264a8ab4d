"""Interpreter correctness of kernels.attention (backend="triton") against the float32
reference, over named shapes that cover what diffusion models send.

TRITON_INTERPRET=1 is set by tests/conftest.py before triton is imported, so the kernel
runs on CPU tensors through Triton's interpreter. Tolerances (relative L2 vs fp32):
- fp16: 2e-3  (PyTorch SDPA's own fp16 error is ~3e-4; p is rounded to fp16 before P@V)
- fp32: 1e-5  (the interpreter's fp32 dots are exact numpy products)
- bf16: 1e-2  (computed in fp32 under the interpreter, whose bf16 dots are wrong; the output
               is rounded to bf16, ~4e-3. The GPU's real bf16 path is checked by
               benchmarks/gpu_check.py and benchmarks/run.py)
Every test asserts through the counters that the Triton implementation really ran.
"""
from __future__ import annotations

import importlib
import math

import pytest
import torch

import triton_accel  # noqa: F401  (loaded by conftest under this name)

K = importlib.import_module("triton_accel.kernels")
TOL = {torch.float16: 2e-3, torch.float32: 1e-5, torch.bfloat16: 1e-2}

# name: (B, H, Hkv, Lq, Lk, D)
SHAPES = {
    "d1": (1, 2, 2, 17, 19, 1),
    "d8": (1, 2, 2, 21, 33, 8),
    "d40_sd15": (2, 2, 2, 37, 45, 40),
    "d64": (1, 2, 2, 48, 64, 64),
    "d80_sd15": (1, 2, 2, 33, 29, 80),
    "d96_lumina_gqa": (1, 6, 2, 20, 23, 96),
    "d128": (1, 2, 2, 35, 50, 128),
    "d160_sd15_padded": (1, 1, 1, 18, 35, 160),
    "d256": (1, 1, 1, 17, 20, 256),
    "one_token": (1, 2, 2, 1, 1, 64),
    "one_query_many_keys": (1, 2, 2, 1, 70, 64),
    "cross_attn_77": (2, 2, 2, 40, 77, 40),
    "lq_gt_lk": (1, 2, 2, 70, 9, 64),
    "gqa_24_8": (1, 24, 8, 9, 18, 32),
}


def rel_l2(out, ref):
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def rand(*shape, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def qkv(B, H, Hkv, Lq, Lk, D, dtype, seed=0):
    return (rand(B, H, Lq, D, dtype=dtype, seed=seed), rand(B, Hkv, Lk, D, dtype=dtype, seed=seed + 1),
            rand(B, Hkv, Lk, D, dtype=dtype, seed=seed + 2))


def run_triton(q, k, v, **kw):
    K.stats.reset()
    out = K.attention(q, k, v, backend="triton", **kw)
    assert K.stats.counts().get("triton_attention") == 1, f"Triton path did not run: {K.stats.counts()}"
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_shapes(name, dtype):
    q, k, v = qkv(*SHAPES[name], dtype)
    out = run_triton(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_l2(out, K.attention_ref(q, k, v)) < TOL[dtype]


def test_bf16_output_dtype_and_accuracy():
    q, k, v = qkv(1, 2, 2, 30, 41, 64, torch.bfloat16)
    out = run_triton(q, k, v)
    assert out.dtype == torch.bfloat16
    assert rel_l2(out, K.attention_ref(q, k, v)) < TOL[torch.bfloat16]


def test_scale_and_causal():
    q, k, v = qkv(1, 2, 2, 40, 40, 64, torch.float16)
    out = run_triton(q, k, v, scale=0.3, is_causal=True)
    assert rel_l2(out, K.attention_ref(q, k, v, None, 0.3, True)) < TOL[torch.float16]


def test_causal_lq_ne_lk_is_top_left_like_sdpa():
    q, k, v = qkv(1, 2, 2, 12, 30, 32, torch.float32)
    out = run_triton(q, k, v, is_causal=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel_l2(out, sdpa.float()) < 1e-5


@pytest.mark.parametrize("mask_kind", ["bool_row", "additive_row", "full_bool", "full_additive", "lk_only"])
def test_masks(mask_kind):
    B, H, Lq, Lk, D = 2, 2, 19, 37, 64
    q, k, v = qkv(B, H, H, Lq, Lk, D, torch.float16)
    g = torch.Generator().manual_seed(3)
    if mask_kind == "bool_row":  # HunyuanVideo-style key padding
        m = torch.rand(B, 1, 1, Lk, generator=g) > 0.3
    elif mask_kind == "additive_row":  # Qwen-Image style [B,1,1,Lk] padding bias
        m = torch.zeros(B, 1, 1, Lk, dtype=torch.float16)
        m[..., -7:] = float("-inf")
        m[..., :5] = -3.0
    elif mask_kind == "full_bool":
        m = torch.rand(B, H, Lq, Lk, generator=g) > 0.5
        m[..., 0] = True
    elif mask_kind == "full_additive":
        m = torch.randn(B, H, Lq, Lk, generator=g).to(torch.float16)
    else:  # [Lk]: broadcast over batch, heads and queries
        m = torch.rand(Lk, generator=g) > 0.2
    out = run_triton(q, k, v, attn_mask=m)
    assert rel_l2(out, K.attention_ref(q, k, v, m)) < TOL[torch.float16]
    if m.dim() >= 2:  # SDPA itself rejects 1-D masks; we broadcast them like any other
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=m if m.dtype == torch.bool else m.float())
        assert rel_l2(out, sdpa) < TOL[torch.float16]


def test_mask_is_not_materialised(monkeypatch):
    """The launcher must hand the kernel a stride-0 view of a broadcast mask, never a copy."""
    at = importlib.import_module("triton_accel.kernels.attention.flash")
    seen = {}
    orig = at._attn_fwd

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen["mask"] = args[4]
                return orig[grid](*args, **kw)
            return launch
    monkeypatch.setattr(at, "_attn_fwd", Spy())
    q, k, v = qkv(1, 2, 2, 16, 24, 32, torch.float16)
    m = torch.zeros(1, 1, 1, 24, dtype=torch.float16)
    at.attention_triton(q, k, v, m)
    assert seen["mask"].untyped_storage().data_ptr() == m.untyped_storage().data_ptr()
    assert seen["mask"].stride()[1:3] == (0, 0)  # heads and queries broadcast


def test_fully_masked_rows_give_zeros_like_sdpa():
    """Chosen behaviour: a query row with every key masked outputs zeros (current SDPA does
    the same; older SDPA versions gave NaN)."""
    q, k, v = qkv(1, 2, 2, 10, 20, 32, torch.float32)
    m = torch.ones(1, 1, 10, 20, dtype=torch.bool)
    m[:, :, 3] = False
    madd = torch.zeros(1, 1, 10, 20)
    madd[:, :, 7] = float("-inf")
    for mask, row in ((m, 3), (madd, 7)):
        out = run_triton(q, k, v, attn_mask=mask)
        assert torch.isfinite(out).all()
        assert out[:, :, row].abs().max() == 0
        assert rel_l2(out, K.attention_ref(q, k, v, mask)) < 1e-5


@pytest.mark.parametrize("D", [40, 64])
def test_non_contiguous_views_of_blhd(D):
    """ComfyUI hands [B, L, H*D] tensors; their [B, H, L, D] views must work without copies
    and the output keeps q's memory layout."""
    B, L, Lk, H = 2, 21, 30, 3
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, L, H * D, generator=g).half().view(B, L, H, D).transpose(1, 2)
    k = torch.randn(B, Lk, H * D, generator=g).half().view(B, Lk, H, D).transpose(1, 2)
    v = torch.randn(B, Lk, 2 * H * D, generator=g).half()[..., ::2].view(B, Lk, H, D).transpose(1, 2)  # stride-2 dim
    assert not q.is_contiguous() and v.stride(-1) == 2
    out = run_triton(q, k, v)
    assert out.stride() == torch.empty_like(q).stride()
    assert rel_l2(out, K.attention_ref(q, k, v)) < TOL[torch.float16]


def test_real_model_outliers():
    """A few channels 20-100x larger than the rest and a large common offset on K, as seen in
    real diffusion transformers; the online softmax must stay exact."""
    q, k, v = qkv(1, 2, 2, 40, 70, 64, torch.float16, seed=11)
    q[..., 3] *= 20
    q[..., 17] *= 50
    k[..., 3] *= 40
    k[..., 40] *= 100 / 10  # keep fp16 range: values up to ~400
    k += 30.0
    for t in (q, k):
        assert torch.isfinite(t).all()
    scale = 1 / math.sqrt(64) / 8
    out = run_triton(q, k, v, scale=scale)
    assert rel_l2(out, K.attention_ref(q, k, v, None, scale)) < TOL[torch.float16]


def test_backend_torch_and_none():
    q, k, v = qkv(1, 2, 2, 8, 9, 16, torch.float32)
    K.stats.reset()
    ref = K.attention(q, k, v, backend="torch")
    assert K.stats.counts() == {"torch_sdpa": 1}
    out = K.attention(q, k, v)  # None: best available; the interpreter makes Triton eligible
    assert K.stats.counts().get("triton_attention") == 1
    assert rel_l2(out, ref.float()) < 1e-5


def test_forced_triton_refusal_raises_with_reason():
    q = torch.randn(1, 2, 4, 300)  # head dim over 256
    with pytest.raises(K.BackendUnavailableError, match="head dim 300"):
        K.attention(q, q, q, backend="triton")
    ok, reason = K.attention_support(q, q, q)
    assert not ok and "head dim 300" in reason
    q2 = torch.randn(1, 2, 4, 64)
    assert K.attention_support(q2, q2, q2) == (True, "ok")
    ok, reason = K.attention_support(q2, q2[:, :, :, :32], q2)
    assert not ok and "head dim" in reason


def test_support_reasons_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 2, 4, 64)
    ok, reason = K.attention_support(q, q, q)
    assert not ok and "TRITON_INTERPRET" in reason


def test_bad_shapes_raise_input_error_with_reason():
    q = torch.randn(1, 3, 4, 16)
    kv = torch.randn(1, 2, 4, 16)
    with pytest.raises(K.AttentionInputError, match="multiple") as e:
        K.attention(q, kv, kv, backend="triton")
    assert isinstance(e.value, ValueError) and "multiple" in e.value.reason
    with pytest.raises(K.AttentionInputError, match="broadcast"):
        K.attention(q, q, q, attn_mask=torch.ones(5, 4, dtype=torch.bool))


def test_registry_explains_every_refusal():
    q = torch.randn(1, 2, 4, 64, dtype=torch.float64)
    call = K.call_facts(q, q, q)
    answers = K.registry.explain("attention", call)
    assert "float64" in answers["triton_attention"]
    assert answers["torch_sdpa"] is None


def test_custom_op_registered_once_and_fake():
    op = torch.ops.triton_accel.attention
    q, k, v = qkv(1, 2, 2, 8, 12, 32, torch.float16)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        out = op(fq, fk, fv, None, None, False, "triton")
        assert out.shape == q.shape and out.dtype == q.dtype


def test_second_import_under_another_name_shares_op_and_counters():
    import importlib.util
    import pathlib

    # By file, not `from conftest import`: another folder's conftest (tests/integration) may
    # already hold the name "conftest" in sys.modules.
    path = pathlib.Path(__file__).resolve().parents[1] / "conftest.py"
    spec = importlib.util.spec_from_file_location("triton_accel_tests_root_conftest", path)
    root_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root_conftest)
    load_pack = root_conftest.load_pack

    other = load_pack("triton_accel_second_copy")
    K2 = importlib.import_module(other.__name__ + ".kernels")
    assert K2 is not K
    q, k, v = qkv(1, 1, 1, 4, 4, 16, torch.float32)
    K.stats.reset()
    K2.attention(q, k, v, backend="triton")
    assert K.stats.counts().get("triton_attention") == 1  # one process-wide counter


def test_torch_compile_fullgraph():
    q, k, v = qkv(1, 2, 2, 16, 24, 32, torch.float32)

    def f(q, k, v):
        return K.attention(q * 1.0, k, v, backend="triton") + 1.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    K.stats.reset()
    out = compiled(q, k, v)
    assert K.stats.counts().get("triton_attention") == 1
    assert rel_l2(out - 1.0, K.attention_ref(q, k, v)) < 1e-5


def test_autotune_cache_roundtrip(tmp_path, monkeypatch):
    tuning = importlib.import_module("triton_accel.kernels.core.tuning")
    monkeypatch.setenv("TRITON_ACCEL_CACHE_DIR", str(tmp_path))
    tuning.clear_memory()
    info = K.describe("cpu")
    key = tuning.cache_key("attention", info, ("fp16", 64))
    assert "triton-" in key and "cpu" in key
    tuning.store(key, {"BLOCK_M": 64})
    tuning.clear_memory()
    assert tuning.cached(key) == {"BLOCK_M": 64}
    assert not list(tmp_path.glob(".tuning-*"))  # temp files renamed away (atomic write)
    calls = []
    monkeypatch.setenv("TRITON_ACCEL_AUTOTUNE", "1")
    monkeypatch.setattr(tuning, "autotune", lambda cands, run: (calls.append(1) or cands[1], {}))
    best = tuning.choose("attention", info, ("fp16", 128), {"d": 0}, candidates=lambda: [{"a": 1}, {"b": 2}],
                         run=lambda c: None)
    assert best == {"b": 2} and calls == [1]
    tuning.clear_memory()
    assert tuning.choose("attention", info, ("fp16", 128), {"d": 0}) == {"b": 2}  # from disk
    tuning.clear_memory()
