"""kernels.attention(..., return_lse=True): the log-sum-exp output, under the interpreter.

lse is float32 [B, H, Lq], the natural-log logsumexp of each row's scaled, masked scores;
checked against attention_ref(..., return_lse=True) in float64 on the same (rounded) inputs.
Tolerances:
- lse, absolute: fp32 2e-5, fp16 1e-4, bf16 1e-4 (the kernel's m and l are fp32 whatever the
  inputs; bf16 runs in fp32 under the interpreter, see test_attention.py). lse is O(log Lk +
  |scores|), so these are ~1e-5 relative;
- out, relative L2: test_attention.py's TOL (fp32 1e-5, fp16 2e-3, bf16 1e-2);
- quantized paths (fp8: full-FP8 kernel; int8: INT8 Q.K with FP16 or FP8 P.V), on Gaussian
  inputs whose K has a mean offset of 3 per channel (what the quantisers' K smoothing takes
  out and key_mean_shift() puts back): lse within 0.05 absolute (measured 0.007-0.021 here),
  and attention split over two key halves and merged within 0.08 rel. L2 of float64, as the
  kernels alone are held to (test_attention_fp8_full.py).
Splitting the keys in two and merging (sequence_parallel.merge_partials) must reproduce the
single call: that is what the LSE is for.
"""
from __future__ import annotations

import importlib

import pytest
import torch

import triton_accel  # noqa: F401  (loaded by conftest under this name)

K = importlib.import_module("triton_accel.kernels")
A = importlib.import_module("triton_accel.kernels.attention.dispatch")
SP = importlib.import_module("triton_accel.kernels.attention.sequence_parallel")
INT8 = importlib.import_module("triton_accel.kernels.attention.int8")

LSE_TOL = {torch.float32: 2e-5, torch.float16: 1e-4, torch.bfloat16: 1e-4}
OUT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
QUANT_LSE_TOL = 0.05
QUANT_MERGE_TOL = 0.08

# name: (B, H, Hkv, Lq, Lk, D): short key sets (which the short-key kernel serves without
# return_lse), padded head dims, GQA, more queries than keys, one query.
SHAPES = {
    "d32": (1, 2, 2, 37, 45, 32),
    "short_kv_77": (2, 2, 2, 24, 77, 64),
    "d80_padded": (1, 2, 2, 19, 33, 80),
    "gqa_6_2": (1, 6, 2, 20, 23, 32),
    "lq_gt_lk": (1, 2, 2, 40, 9, 16),
    "one_query": (1, 2, 2, 1, 50, 32),
}
# mask kind -> (attn_mask builder or None, is_causal)
MASKS = ["none", "bool", "additive", "causal", "bool_fully_masked_row"]


def rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def inputs(name, dtype, seed=0):
    B, H, Hkv, Lq, Lk, D = SHAPES[name]
    return rand(B, H, Lq, D, dtype=dtype, seed=seed), rand(B, Hkv, Lk, D, dtype=dtype, seed=seed + 1), \
        rand(B, Hkv, Lk, D, dtype=dtype, seed=seed + 2)


def make_mask(kind, q, k):
    """(attn_mask, is_causal) for the mask kind; a fully masked row where the kind says so."""
    B, H, Lq, Lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    g = torch.Generator().manual_seed(7)
    if kind == "none":
        return None, False
    if kind == "causal":
        return None, True
    if kind == "additive":
        return torch.randn(B, 1, Lq, Lk, generator=g).to(q.dtype), False
    mask = torch.rand(B, H, Lq, Lk, generator=g) > 0.3
    mask[..., 0] = True  # every row keeps a key ...
    if kind == "bool_fully_masked_row":
        mask[:, :, Lq // 2, :] = False  # ... except this one
    return mask, False


def rel_l2(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def exact(q, k, v, mask, causal, scale=None):
    return K.attention_ref(q, k, v, mask, scale, causal, compute_dtype=torch.float64, return_lse=True)


def check_lse(lse, ref_lse, tol):
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    dead = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), dead), "-inf rows differ"
    assert torch.isfinite(lse[~dead]).all()
    if (~dead).any():
        assert (lse[~dead].double() - ref_lse[~dead]).abs().max().item() < tol


# fp16: every shape x every mask kind; bf16 and fp32 (the same kernel in fp32 under the
# interpreter): three shapes x the kinds that change the kernel's bookkeeping.
MATRIX = ([(torch.float16, name, m) for name in SHAPES for m in MASKS]
          + [(dt, name, m) for dt in (torch.bfloat16, torch.float32) for name in ("d32", "short_kv_77", "gqa_6_2")
             for m in ("none", "causal", "bool_fully_masked_row")])


@pytest.mark.parametrize("dtype,name,mask_kind", MATRIX,
                         ids=[f"{str(d)[6:]}-{n}-{m}" for d, n, m in MATRIX])
def test_triton_lse_matches_float64(dtype, name, mask_kind):
    q, k, v = inputs(name, dtype)
    mask, causal = make_mask(mask_kind, q, k)
    K.stats.reset()
    out, lse = K.attention(q, k, v, mask, is_causal=causal, backend="triton", return_lse=True)
    counts = K.stats.counts()
    assert counts.get("triton_attention.flash_lse") == 1, f"the flash kernel did not serve it: {counts}"
    ref, ref_lse = exact(q, k, v, mask, causal)
    check_lse(lse, ref_lse, LSE_TOL[dtype])
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_l2(out, ref) < OUT_TOL[dtype]
    if mask_kind == "bool_fully_masked_row":
        row = q.shape[2] // 2
        assert torch.isneginf(lse[:, :, row]).all() and (out[:, :, row] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
def test_negative_and_zero_scale(dtype):
    q, k, v = inputs("d32", dtype)
    for scale in (-0.3, 0.0):
        out, lse = K.attention(q, k, v, scale=scale, backend="triton", return_lse=True)
        ref, ref_lse = exact(q, k, v, None, False, scale)
        check_lse(lse, ref_lse, LSE_TOL[dtype])
        assert rel_l2(out, ref) < OUT_TOL[dtype]


@pytest.mark.parametrize("mask_kind", ["none", "bool_fully_masked_row", "additive"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
def test_split_keys_and_merge_reproduces_full_attention(dtype, mask_kind):
    """Two halves of the keys (the second one alone holding every allowed key of some rows,
    so the first half's lse is -inf there) merge into the single call's out and lse."""
    q, k, v = inputs("d32", dtype)
    mask, _ = make_mask(mask_kind, q, k)
    cut = 20
    if mask is not None and mask.dtype == torch.bool:
        mask[:, :, :5, :cut] = False  # rows 0-4: nothing allowed in the first half
    halves = []
    for sl in (slice(0, cut), slice(cut, None)):
        m = None if mask is None else mask[..., sl]
        halves.append(K.attention(q, k[:, :, sl], v[:, :, sl], m, backend="triton", return_lse=True))
    out, lse = SP.merge_partials([h[0] for h in halves], [h[1] for h in halves])
    if mask is not None and mask.dtype == torch.bool:
        assert torch.isneginf(halves[0][1][:, :, :5]).all()
    full_out, full_lse = K.attention(q, k, v, mask, backend="triton", return_lse=True)
    ref, ref_lse = exact(q, k, v, mask, False)
    check_lse(lse, ref_lse, LSE_TOL[dtype])
    assert torch.equal(torch.isneginf(lse), torch.isneginf(full_lse))
    assert rel_l2(out, ref) < OUT_TOL[dtype]
    assert rel_l2(out, full_out) < OUT_TOL[dtype]


def test_empty_key_set_gives_minus_inf_and_zeros():
    q = rand(1, 2, 5, 16, dtype=torch.float16, seed=0)
    k = torch.zeros(1, 2, 0, 16, dtype=torch.float16)
    out, lse = K.attention(q, k, k, backend="triton", return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all() and lse.shape == (1, 2, 5)


def test_reference_lse_is_logsumexp():
    q, k, v = inputs("gqa_6_2", torch.float32)
    mask, _ = make_mask("bool_fully_masked_row", q, k)
    _, lse = K.attention_ref(q, k, v, mask, return_lse=True, compute_dtype=torch.float64)
    kk = k.double().repeat_interleave(3, dim=1)
    scores = (q.double() @ kk.transpose(-1, -2) / 32 ** 0.5).masked_fill(~mask, float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(scores, dim=-1), atol=1e-12)


# ---- the router: paths that cannot give an LSE -------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "reference", None])
def test_cpu_paths_without_kernel_lse_use_the_float32_reference(backend):
    q, k, v = inputs("d32", torch.float32)
    out, lse = K.attention(q, k, v, backend=backend, return_lse=True)
    ref, ref_lse = exact(q, k, v, None, False)
    check_lse(lse, ref_lse, LSE_TOL[torch.float32])
    assert rel_l2(out, ref) < OUT_TOL[torch.float32]


@pytest.mark.parametrize("backend", ["fp8", "int8"])
def test_quantized_paths_refuse_masks_with_return_lse(backend):
    q, k, v = inputs("d32", torch.float16)
    mask, _ = make_mask("bool", q, k)
    with pytest.raises(K.BackendUnavailableError):
        K.attention(q, k, v, mask, backend=backend, return_lse=True)


def test_fp8_lse_route_skips_kernels_without_lse():
    q, k, v = inputs("d32", torch.float16)
    kernel, refusals = A.fp8_lse_route(q, k, v)
    assert kernel in A.LSE_FP8_KERNELS
    mask, _ = make_mask("bool", q, k)
    kernel, refusals = A.fp8_lse_route(q, k, v, mask)
    assert kernel is None and any(why == A.NO_LSE for why in refusals.values()), refusals


def test_existing_op_schema_unchanged():
    schema = str(torch.ops.triton_accel.attention.default._schema)
    assert schema == ("triton_accel::attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float? scale, "
                      "bool is_causal, str? backend) -> Tensor"), schema


def test_lse_op_fake_and_compiled():
    q, k, v = inputs("d32", torch.float16)
    eager_out, eager_lse = K.attention(q, k, v, backend="triton", return_lse=True)
    compiled = torch.compile(lambda q, k, v: K.attention(q, k, v, backend="triton", return_lse=True),
                             fullgraph=True, backend="aot_eager")
    out, lse = compiled(q, k, v)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fo, fl = torch.ops.triton_accel.attention_lse(fq, fk, fv, None, None, False, "triton")
        assert fo.shape == q.shape and fl.shape == q.shape[:3] and fl.dtype == torch.float32


def test_lse_gradients_match_float64_autograd():
    q, k, v = (t.requires_grad_() for t in inputs("gqa_6_2", torch.float32))
    mask, _ = make_mask("bool_fully_masked_row", q, k)
    out, lse = K.attention(q, k, v, mask, backend="triton", return_lse=True)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad([out, lse], [q, k, v], [g_out, g_lse])
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    r_out, r_lse = K.attention_ref(*leaves, mask, compute_dtype=torch.float64, return_lse=True)
    live = ~torch.isneginf(r_lse)
    loss = (r_out * g_out.double()).sum() + (r_lse[live] * g_lse.double()[live]).sum()
    ref_grads = torch.autograd.grad(loss, leaves)
    for g, rg in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        assert rel_l2(g, rg) < 1e-5


# ---- quantized paths -------------------------------------------------------------------------

def quant_inputs(seed=0, hkv=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 40, 64, generator=g)
    k = torch.randn(1, hkv, 70, 64, generator=g) + 3.0  # a mean the quantisers smooth away
    v = torch.randn(1, hkv, 70, 64, generator=g)
    return q.half(), k.half(), v.half()


QUANT = {
    "fp8_full": lambda q, k, v, **kw: K.attention(q, k, v, backend="fp8", return_lse=True, **kw),
    "int8_fp16pv": lambda q, k, v, **kw: K.attention(q, k, v, backend="int8", return_lse=True, **kw),
    "int8_fp8pv": lambda q, k, v, **kw: INT8.attention_int8(q, k, v, pv="fp8", return_lse=True, **kw),
}


@pytest.mark.parametrize("path", list(QUANT))
def test_quantized_lse_and_merge(path):
    q, k, v = quant_inputs()
    K.stats.reset()
    out, lse = QUANT[path](q, k, v)
    if path == "fp8_full":  # on CPU the FP8 path's LSE kernel is the full-FP8 one
        assert K.stats.counts().get("triton_fp8.fp8_full") == 1, K.stats.counts()
    ref, ref_lse = exact(q, k, v, None, False)
    assert (lse.double() - ref_lse).abs().max().item() < QUANT_LSE_TOL
    halves = [QUANT[path](q, k[:, :, sl], v[:, :, sl]) for sl in (slice(0, 33), slice(33, None))]
    merged, merged_lse = SP.merge_partials([h[0] for h in halves], [h[1] for h in halves])
    assert (merged_lse.double() - ref_lse).abs().max().item() < QUANT_LSE_TOL
    assert rel_l2(merged, ref) < QUANT_MERGE_TOL
    assert rel_l2(merged, ref) < 2 * rel_l2(out, ref) + 1e-3


def test_int8_lse_with_gqa():
    q, k, v = quant_inputs(seed=1, hkv=1)
    _, lse = QUANT["int8_fp16pv"](q, k, v)
    _, ref_lse = exact(q, k, v, None, False)
    assert (lse.double() - ref_lse).abs().max().item() < QUANT_LSE_TOL
