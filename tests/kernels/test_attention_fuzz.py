"""Seeded randomized calls of kernels.attention: every case either matches a float64 reference
or raises our error type with a reason.

The first cases are named edges (EDGES: issue 10's negative scale over > 256 keys, fully
masked rows, fp16 near overflow, v's head dim differing, causal with Lq != Lk); the rest
draw (from a fixed seed, so a failure reproduces by its id): batch, heads and GQA
group, query/key lengths (1..300, causal with Lq != Lk too), head dims 1..128 (and 272 for
the over-the-limit refusal), a value head dim that may differ, dtype fp16/bf16/fp32, the
layout of each input (contiguous, a [B, L, H, D] view, a stride-2 head dim, a batch
expanded with stride 0), a mask of every broadcast the op accepts ([Lk], [1,1,1,Lk],
[B,1,1,Lk], [B,1,Lq,Lk], [B,H,Lq,Lk]; bool or additive, with -inf entries and fully masked
rows), a scale (default, 0, negative, 1e-6, huge, random), input magnitudes up to 100 and fp16
values near overflow (|v| ~ 3e4). Backend "triton" (the interpreter: small shapes) or None.
About one case in six is deliberately invalid (non-tensors, wrong rank, shapes that do not
line up, masks of the wrong kind, non-finite or non-numeric scales) and must raise
AttentionInputError whose reason names the problem; calls a backend cannot serve (backend
"triton" with v's head dim != q's or a head dim over 256) must raise BackendUnavailableError
with the reason.

Tolerances (relative L2 vs float64, the reference run on the same rounded inputs), per dtype:
fp32 1e-5, fp16 2e-3 (p rounded to fp16 before P.V), bf16 1e-2 (bf16 output rounding), plus
the error the fp32 score computation is allowed: 2**-22 * |scale| * max(|q| |k|^T) (+ the
largest |mask|), which only matters for huge scales and magnitudes, where softmax is sharp.

TRITON_ACCEL_FUZZ_CASES=N runs N cases (default 240, ~60 s on two CPU cores).
"""
from __future__ import annotations

import importlib
import math
import os
import random

import pytest
import torch

import triton_accel  # noqa: F401  (loaded by conftest under this name)

K = importlib.import_module("triton_accel.kernels")

SEED = 20261202
N_CASES = int(os.environ.get("TRITON_ACCEL_FUZZ_CASES", "240"))
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (1, 3, 8, 16, 24, 32, 40, 64, 80, 96, 128)
MASK_SHAPES = ("lk", "1_1_1_lk", "b_1_1_lk", "b_1_lq_lk", "b_h_lq_lk")
BAD_KINDS = ("q_list", "k_none", "v_scalar", "mask_list", "rank3", "batch_differs", "heads_not_multiple",
             "k_head_dim", "mask_int", "mask_shape", "scale_nan", "scale_inf", "scale_str", "dtypes_differ",
             "kv_length_differs", "int_tensors")


def _scale(rng: random.Random, D: int):
    kind = rng.choice(["default", "default", "zero", "negative", "tiny", "huge", "random"])
    return kind, {"default": None, "zero": 0.0, "negative": -rng.uniform(0.05, 1.0), "tiny": 1e-6,
                  "huge": rng.uniform(5.0, 20.0) / math.sqrt(D), "random": rng.uniform(0.01, 0.5)}[kind]


def draw_case(index: int) -> dict:
    rng = random.Random(SEED * 100003 + index)
    hkv = rng.choice([1, 2])
    c = dict(index=index, backend=rng.choice(["triton", "triton", None]), dtype=rng.choice(DTYPES),
             B=rng.choice([1, 2]), Hkv=hkv, H=hkv * rng.choice([1, 1, 2, 3]),
             Lq=rng.choice([1, 2, 7, 16, 17, 33, 48]), Lk=rng.choice([1, 5, 16, 31, 64, 77, 130, 272]),
             D=rng.choice(HEAD_DIMS), causal=rng.random() < 0.25,
             mask=rng.choice([None, None] + list(MASK_SHAPES)), mask_bool=rng.random() < 0.5,
             dead_rows=rng.random() < 0.3, neg_inf=rng.random() < 0.4,
             layouts=[rng.choice(["contig", "contig", "blhd", "dstride", "bexpand"]) for _ in range(3)],
             magnitude=rng.choice([1.0, 1.0, 1.0, 10.0, 100.0]), v_near_overflow=rng.random() < 0.1,
             bad=rng.choice(BAD_KINDS) if rng.random() < 0.17 else None)
    c["Dv"] = c["D"] if rng.random() < 0.85 else rng.choice(HEAD_DIMS)
    if rng.random() < 0.04:
        c["D"] = c["Dv"] = 272  # over the Triton kernels' limit
        c["Lq"], c["Lk"] = min(c["Lq"], 7), min(c["Lk"], 16)
    c["scale_kind"], c["scale"] = _scale(rng, c["D"])
    c["seed"] = rng.randrange(1 << 30)
    return c


def case_id(c: dict) -> str:
    name = "bad-" + c["bad"] if c["bad"] else f"{str(c['dtype'])[6:]}-{c['backend'] or 'auto'}"
    return f"case{c['index']:04d}-{name}"


def _tensor(shape, layout, dtype, gen, magnitude):
    B, H, L, D = shape
    if layout == "blhd":  # ComfyUI's [B, L, H*D] storage viewed as [B, H, L, D]
        t = torch.randn(B, L, H, D, generator=gen).transpose(1, 2)
    elif layout == "dstride":  # head dim with stride 2
        t = torch.randn(B, H, L, 2 * D, generator=gen)[..., ::2]
    elif layout == "bexpand":  # one batch entry seen B times (stride 0)
        t = torch.randn(1, H, L, D, generator=gen).expand(B, H, L, D)
    else:
        t = torch.randn(B, H, L, D, generator=gen)
    t = t * magnitude
    return t.to(dtype) if layout != "bexpand" else t[:1].to(dtype).expand(B, H, L, D)


def _mask(c, gen):
    B, H, Lq, Lk = c["B"], c["H"], c["Lq"], c["Lk"]
    shape = {"lk": (Lk,), "1_1_1_lk": (1, 1, 1, Lk), "b_1_1_lk": (B, 1, 1, Lk), "b_1_lq_lk": (B, 1, Lq, Lk),
             "b_h_lq_lk": (B, H, Lq, Lk)}[c["mask"]]
    if c["mask_bool"]:
        m = torch.rand(shape, generator=gen) > 0.3
        if c["dead_rows"] and len(shape) == 4 and shape[2] == Lq:
            m[..., Lq // 2, :] = False
        return m
    m = torch.randn(shape, generator=gen) * 2.0
    if c["neg_inf"]:
        m[torch.rand(shape, generator=gen) < 0.3] = float("-inf")
    if c["dead_rows"] and len(shape) == 4 and shape[2] == Lq:
        m[..., Lq // 2, :] = float("-inf")
    return m.to(c["dtype"] if c["index"] % 2 else torch.float32)  # q's dtype or fp32


def build(c):
    gen = torch.Generator().manual_seed(c["seed"])
    dt, mag = c["dtype"], c["magnitude"]
    q = _tensor((c["B"], c["H"], c["Lq"], c["D"]), c["layouts"][0], dt, gen, mag)
    k = _tensor((c["B"], c["Hkv"], c["Lk"], c["D"]), c["layouts"][1], dt, gen, mag)
    v = _tensor((c["B"], c["Hkv"], c["Lk"], c["Dv"]), c["layouts"][2], dt, gen, 1.0)
    if c["v_near_overflow"] and dt == torch.float16:
        v = (v.float() * 3e4 / v.float().abs().amax().clamp_min(1e-6)).to(dt)
    mask = _mask(c, gen) if c["mask"] else None
    return q, k, v, mask


def make_bad(c, q, k, v, mask):
    """(args, kwargs, words the reason must contain) of an invalid call."""
    kw = dict(attn_mask=mask, scale=c["scale"], is_causal=c["causal"])
    B, Lq, Lk = c["B"], c["Lq"], c["Lk"]
    kind = c["bad"]
    if kind == "q_list":
        return ([1.0], k, v), kw, "q must be a"
    if kind == "k_none":
        return (q, None, v), kw, "k must be a"
    if kind == "v_scalar":
        return (q, k, 2.0), kw, "v must be a"
    if kind == "mask_list":
        return (q, k, v), dict(kw, attn_mask=[[True] * Lk]), "attn_mask must be a tensor"
    if kind == "rank3":
        return (q[0], k, v), kw, "q must be [B, H, L, D]"
    if kind == "batch_differs":
        return (q, torch.cat([k, k]), torch.cat([v, v])), kw, "batch sizes differ"
    if kind == "heads_not_multiple":
        q3 = q[:, :1].expand(B, 3, Lq, q.shape[-1])
        k2, v2 = (t[:, :1].expand(B, 2, Lk, t.shape[-1]) for t in (k, v))
        return (q3, k2, v2), dict(kw, attn_mask=None), "q heads 3 are not a multiple of k/v heads 2"
    if kind == "k_head_dim":
        return (q, torch.cat([k, k], dim=-1), v), kw, "k head dim"
    if kind == "mask_int":
        return (q, k, v), dict(kw, attn_mask=torch.ones(Lk, dtype=torch.int32)), "bool or floating point"
    if kind == "mask_shape":
        return (q, k, v), dict(kw, attn_mask=torch.ones(Lq + 1, Lk + 2, dtype=torch.bool)), "does not broadcast"
    if kind == "scale_nan":
        return (q, k, v), dict(kw, scale=float("nan")), "scale must be finite"
    if kind == "scale_inf":
        return (q, k, v), dict(kw, scale=float("-inf")), "scale must be finite"
    if kind == "scale_str":
        return (q, k, v), dict(kw, scale="1/8"), "scale must be a number"
    if kind == "dtypes_differ":
        other = torch.float32 if q.dtype != torch.float32 else torch.float16
        return (q, k.to(other), v), kw, "dtypes differ"
    if kind == "kv_length_differs":
        return (q, k, torch.cat([v, v], dim=2)), kw, "disagree on heads or length"
    if kind == "int_tensors":
        return (q.to(torch.int32), k.to(torch.int32), v.to(torch.int32)), dict(kw, attn_mask=None), "floating point"
    raise AssertionError(kind)


def allowed_error(c, q, k, mask) -> float:
    """TOL[dtype] plus the fp32 score error: sharp softmaxes (huge scales and magnitudes)
    amplify the rounding of q.k and of the mask into the weights."""
    scale = c["scale"] if c["scale"] is not None else 1.0 / math.sqrt(c["D"])
    qa, ka = q.double().abs(), k.double().abs()
    if ka.shape[1] != qa.shape[1]:
        ka = ka.repeat_interleave(qa.shape[1] // ka.shape[1], dim=1)
    worst = abs(scale) * (qa @ ka.transpose(-1, -2)).amax().item()
    if mask is not None and mask.dtype != torch.bool:
        finite = mask[torch.isfinite(mask)]
        worst += finite.abs().max().item() if finite.numel() else 0.0
    return TOL[c["dtype"]] + 2.0 ** -22 * worst


# Named edges first (then random draws): each fixes a few fields of the drawn case.
_NO_MASK = dict(mask=None, causal=False, bad=None, Dv=None)
EDGES = [
    # issue 10.1: negative scale past the short-key kernel (> 256 keys), no mask: full key tiles
    dict(_NO_MASK, backend="triton", dtype=torch.float16, Lk=272, D=64, scale_kind="negative", scale=-1.0),
    dict(_NO_MASK, backend=None, dtype=torch.float32, Lk=272, D=40, scale_kind="negative", scale=-0.3),
    dict(_NO_MASK, backend="triton", dtype=torch.bfloat16, Lk=130, D=32, scale_kind="negative", scale=-0.7),
    dict(_NO_MASK, backend="triton", dtype=torch.float16, Lk=77, D=64, scale_kind="negative", scale=-2.0),
    dict(_NO_MASK, backend="triton", dtype=torch.float16, Lk=272, D=16, scale_kind="zero", scale=0.0),
    dict(_NO_MASK, backend="triton", dtype=torch.float32, Lk=130, D=64, scale_kind="huge", scale=2.0),
    dict(_NO_MASK, backend="triton", dtype=torch.float16, Lk=64, D=8, scale_kind="tiny", scale=1e-6),
    # fully masked rows, bool and additive (-inf), through both backends
    dict(backend="triton", dtype=torch.float16, mask="b_1_lq_lk", mask_bool=True, dead_rows=True, bad=None, Dv=None),
    dict(backend=None, dtype=torch.float32, mask="b_h_lq_lk", mask_bool=False, dead_rows=True, neg_inf=True,
         bad=None, Dv=None),
    # fp16 values near overflow, large magnitudes
    dict(_NO_MASK, backend="triton", dtype=torch.float16, v_near_overflow=True, magnitude=10.0),
    dict(_NO_MASK, backend="triton", dtype=torch.float32, magnitude=100.0),
    # issue 10.2: v's head dim differs (None serves it through SDPA; "triton" refuses with a reason)
    dict(_NO_MASK, backend=None, dtype=torch.float32, D=8, Dv=1),
    dict(_NO_MASK, backend="triton", dtype=torch.float16, D=8, Dv=16),
    # causal with Lq != Lk, GQA
    dict(backend="triton", dtype=torch.float16, causal=True, Lq=33, Lk=77, H=4, Hkv=2, mask=None, bad=None, Dv=None),
    dict(backend="triton", dtype=torch.float32, causal=True, Lq=48, Lk=16, mask="lk", bad=None, Dv=None),
]


def edge_case(index: int) -> dict:
    c = draw_case(index)
    c.update(EDGES[index])
    if c["Dv"] is None:
        c["Dv"] = c["D"]
    return c


CASES = [edge_case(i) if i < len(EDGES) else draw_case(i) for i in range(N_CASES)]


def test_case_mix_covers_the_brief():
    """The seeded draw really contains every kind of case this file promises."""
    if N_CASES < 200:
        pytest.skip("fewer cases asked for than the mix check needs")
    seen = {key: {c[key] if not isinstance(c[key], list) else tuple(c[key]) for c in CASES}
            for key in ("dtype", "backend", "mask", "scale_kind", "bad", "mask_bool", "causal")}
    assert set(DTYPES) <= seen["dtype"] and {"triton", None} <= seen["backend"]
    assert set(MASK_SHAPES) <= seen["mask"] and {True, False} <= seen["mask_bool"]
    assert {"zero", "negative", "tiny", "huge"} <= seen["scale_kind"]
    assert len(seen["bad"] - {None}) >= 10 and True in seen["causal"]
    assert any(c["H"] != c["Hkv"] for c in CASES) and any(c["Dv"] != c["D"] for c in CASES)
    assert any(c["D"] > 256 for c in CASES) and any(c["causal"] and c["Lq"] != c["Lk"] for c in CASES)
    assert {"blhd", "dstride", "bexpand"} <= {lay for c in CASES for lay in c["layouts"]}
    assert any(c["scale_kind"] == "negative" and c["Lk"] > 256 and not c["mask"] and not c["bad"] for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_fuzz(case):
    q, k, v, mask = build(case)
    backend = case["backend"]
    if case["bad"]:
        args, kw, words = make_bad(case, q, k, v, mask)
        with pytest.raises(K.AttentionInputError) as e:
            K.attention(*args, backend=backend, **kw)
        assert words in e.value.reason, e.value.reason
        return
    call = dict(attn_mask=mask, scale=case["scale"], is_causal=case["causal"], backend=backend)
    if backend == "triton" and (case["Dv"] != case["D"] or case["D"] > 256):
        with pytest.raises(K.BackendUnavailableError) as e:
            K.attention(q, k, v, **call)
        assert "head dim" in e.value.reason, e.value.reason
        return
    K.stats.reset()
    out = K.attention(q, k, v, **call)
    ran = K.stats.counts()
    if backend == "triton":
        assert ran.get("triton_attention") == 1, ran
    ref = K.attention_ref(q, k, v, mask, case["scale"], case["causal"], compute_dtype=torch.float64)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), f"non-finite output ({ran})"
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item() if ref.norm() > 0 else \
        out.double().abs().max().item()
    tol = allowed_error(case, q, k, mask)
    assert err <= tol, f"rel L2 {err:.3e} > {tol:.3e} ({ran})"
