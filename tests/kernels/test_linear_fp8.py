"""FP8 W8A8 Linear (kernels/linear/fp8.py) on the Triton interpreter (CPU): semantics and accuracy.

Two yardsticks per case:
- vs linear_fp8_reference (the same per-token / per-channel e4m3 quantisation in fp32 torch):
  catches kernel bugs (tile order, partial tiles, K tail, scales, bias) with a tight
  tolerance, since the quantisation error is shared. FP8 dots are exact in the interpreter
  and the quantisation kernel rounds to e4m3 exactly there (EXACT_CAST), so what is left is
  fp32 summation order and the output's rounding (bf16: 2**-9 relative);
- vs the unquantised fp32 Linear: the accuracy a user gets, 0.022-0.031 rel. L2 measured with
  30x outlier channels in the activations (see TOL_FP32).
"""
from __future__ import annotations

import importlib

import pytest
import torch

lf = importlib.import_module("triton_accel.kernels.linear.fp8")
ref = importlib.import_module("triton_accel.kernels.linear.ref")

# rel L2 vs linear_fp8_reference, by output dtype: its rounding (bf16 2**-9, fp16 2**-11) plus
# fp32 summation order.
TOL_EMU = {torch.bfloat16: 6e-3, torch.float16: 2e-3, torch.float32: 1e-5}
# rel L2 vs the unquantised fp32 Linear. This is e4m3's own rounding, not the kernel's: 3
# mantissa bits give ~2.6 % rms relative error per operand, and random Gaussian data has no
# structure to average it away, so any W8A8 e4m3 Linear (torch._scaled_mm row-wise included)
# lands at 0.022-0.031 on these inputs (linear_fp8_reference measures the same); 0.035 holds
# that with margin and still fails a wrong scale (>= 0.3) or a dropped outlier channel.
TOL_FP32 = 0.035

# (M, K, N) with the interpreter's 16x32x32 tiles: partial row and column tiles, a K tail
# (K % 32 != 0), a single row, exact tiles with several tiles per persistent program.
SHAPES = {
    "partial_m_n": (37, 96, 80),
    "k_tail": (20, 48, 48),
    "one_token": (1, 64, 32),
    "exact_tiles": (64, 64, 96),
}


def rel_l2(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def activations(m, k, dtype, gen, outliers=True):
    """Random tokens with a few channels 30x larger than the rest, as in real diffusion models."""
    x = torch.randn(m, k, generator=gen)
    if outliers:
        x[:, torch.randperm(k, generator=gen)[:3]] *= 30.0
    return x.to(dtype)


def weights(n, k, gen):
    return torch.randn(n, k, generator=gen) * k ** -0.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_matches_reference_with_outlier_channels(dtype, shape):
    m, k, n = shape
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w, b = activations(m, k, dtype, gen), weights(n, k, gen).to(dtype), torch.randn(n, generator=gen)
    fw = lf.quantize_weight(w)
    out = lf.fp8_linear(x, fw, b.to(dtype))
    assert out.dtype == dtype and out.shape == (m, n)
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref.linear_fp8_reference(x, fw, b.to(dtype), torch.float32)) <= TOL_EMU[dtype]
    assert rel_l2(out, ref.linear_reference(x, w, b.to(dtype), torch.float32)) <= TOL_FP32


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_output_dtype_and_bias(out_dtype, with_bias):
    m, k, n = SHAPES["partial_m_n"]
    gen = torch.Generator().manual_seed(7)
    x, w = activations(m, k, torch.bfloat16, gen), weights(n, k, gen)
    # A bias far larger than x @ W.T: dropping or double-adding it cannot pass.
    b = (torch.randn(n, generator=gen) * 10).to(torch.bfloat16) if with_bias else None
    fw = lf.quantize_weight(w)
    out = lf.fp8_linear(x, fw, b, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    assert rel_l2(out, ref.linear_fp8_reference(x, fw, b, torch.float32)) <= TOL_EMU[out_dtype]
    assert rel_l2(out, ref.linear_reference(x, w, b, torch.float32)) <= TOL_FP32


@pytest.mark.parametrize("scale_kind", ["per_tensor", "per_channel", "none"])
def test_prequantized_fp8_weights(scale_kind):
    """ComfyUI's FP8 checkpoints: e4m3 weights with a scalar scale_weight (or none, or per channel)."""
    m, k, n = SHAPES["partial_m_n"]
    gen = torch.Generator().manual_seed(11)
    x, w = activations(m, k, torch.bfloat16, gen), weights(n, k, gen)
    if scale_kind == "per_tensor":
        scale = w.abs().max() / 448.0
    elif scale_kind == "per_channel":
        scale = w.abs().amax(dim=1) / 448.0
    else:
        scale = None
    w8 = (w / (scale[:, None] if scale_kind == "per_channel" else (scale if scale is not None else 1.0))
          ).to(torch.float8_e4m3fn)
    fw = lf.quantize_weight(w8, scale)
    assert fw.weight.dtype == torch.float8_e4m3fn and torch.equal(fw.weight.view(torch.uint8), w8.view(torch.uint8))
    dequant = w8.float() * (scale[:, None] if scale_kind == "per_channel" else (scale if scale is not None else 1.0))
    out = lf.fp8_linear(x, fw)
    assert rel_l2(out, ref.linear_fp8_reference(x, fw, None, torch.float32)) <= TOL_EMU[torch.bfloat16]
    assert rel_l2(out, ref.linear_reference(x, dequant, None, torch.float32)) <= TOL_FP32


def test_weight_quantisation_per_channel():
    gen = torch.Generator().manual_seed(3)
    w = weights(48, 64, gen)
    w[5] *= 1000.0  # one huge channel must not cost the others their resolution
    fw = lf.quantize_weight(w.to(torch.bfloat16))
    assert fw.weight.dtype == torch.float8_e4m3fn and fw.weight.is_contiguous()
    assert torch.allclose(fw.scale, w.to(torch.bfloat16).float().abs().amax(1) / 448.0)
    assert fw.weight.float().abs().amax(1).eq(448.0).all()  # every channel uses e4m3's full range
    assert rel_l2(fw.weight.float() * fw.scale[:, None], w) <= 0.03


def test_three_d_and_strided_input():
    """[B, L, K] input, and a column slice (row stride != K): leading dims kept, strides honoured."""
    gen = torch.Generator().manual_seed(5)
    k, n = 64, 48
    base = activations(2 * 9, 2 * k, torch.bfloat16, gen).reshape(2, 9, 2 * k)
    x = base[..., 8:8 + k]
    w = weights(n, k, gen)
    fw = lf.quantize_weight(w)
    out = lf.fp8_linear(x, fw)
    assert out.shape == (2, 9, n)
    assert rel_l2(out, ref.linear_fp8_reference(x.contiguous(), fw, None, torch.float32)) <= TOL_EMU[torch.bfloat16]


def test_zero_rows_and_empty_input():
    gen = torch.Generator().manual_seed(9)
    x = activations(5, 32, torch.bfloat16, gen)
    x[2] = 0
    fw = lf.quantize_weight(weights(16, 32, gen))
    b = torch.randn(16, generator=gen).to(torch.bfloat16)
    out = lf.fp8_linear(x, fw, b)
    assert torch.isfinite(out).all()
    assert torch.equal(out[2], b)  # a zero token gives exactly the bias, no NaN from its zero scale
    empty = lf.fp8_linear(x[:0], fw, b)
    assert empty.shape == (0, 16)


@pytest.mark.parametrize("k", [16, 4096, 16400], ids=["k16", "k4096_one_pass", "k16400_two_pass"])
def test_activation_quantisation_exact(k):
    """Per-token scale and e4m3 values equal torch's (one-pass rows and the two-pass loop)."""
    gen = torch.Generator().manual_seed(k)
    x = activations(3, k, torch.bfloat16, gen)
    x[1] *= 1e-3  # a quiet token keeps its own resolution
    q, s = lf.quantize_activation(x)
    q_ref, s_ref = ref.quantize_rows_reference(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())  # values: a tiny negative may become +0 or -0


@pytest.mark.parametrize("k, n", [(40, 32), (32, 24), (8, 16)], ids=["k40", "n24", "k8"])
def test_refuses_features_not_multiple_of_16(k, n):
    with pytest.raises(lf.Fp8LinearUnsupportedError, match="multiple of 16"):
        lf.quantize_weight(torch.randn(n, k))


@pytest.mark.parametrize("case", ["int_weight", "e5m2_weight", "bad_scale", "scale_on_float", "wrong_k",
                                  "int_input", "bad_bias", "int8_out"])
def test_refuses_bad_calls(case):
    gen = torch.Generator().manual_seed(1)
    w = weights(32, 32, gen)
    fw = lf.quantize_weight(w)
    x = activations(4, 32, torch.bfloat16, gen)
    errors = (lf.Fp8LinearUnsupportedError, ValueError, TypeError)
    with pytest.raises(errors):
        if case == "int_weight":
            lf.quantize_weight(torch.ones(32, 32, dtype=torch.int8))
        elif case == "e5m2_weight":
            lf.quantize_weight(w.to(torch.float8_e5m2))
        elif case == "bad_scale":
            lf.quantize_weight(w.to(torch.float8_e4m3fn), torch.ones(3))
        elif case == "scale_on_float":
            lf.quantize_weight(w, 0.5)
        elif case == "wrong_k":
            lf.fp8_linear(activations(4, 48, torch.bfloat16, gen), fw)
        elif case == "int_input":
            lf.fp8_linear(torch.ones(4, 32, dtype=torch.int32), fw)
        elif case == "bad_bias":
            lf.fp8_linear(x, fw, torch.zeros(31))
        elif case == "int8_out":
            lf.fp8_linear(x, fw, out_dtype=torch.int8)


def test_tma_only_for_aligned_tensors_and_triton_3_4(monkeypatch):
    """The TMA kernel needs 16-byte aligned bases and Triton 3.4+ host descriptors; else pointers."""
    w = torch.zeros(64, 32, dtype=torch.float8_e4m3fn)
    monkeypatch.setattr(lf._device, "triton_version", lambda: "3.6.0")
    assert lf._tma_usable(w, w[16:])  # 16 rows of 32 bytes further: still aligned
    assert not lf._tma_usable(w, w.view(-1)[1:].view(-1)[: 32 * 63].view(63, 32))  # one byte off
    monkeypatch.setattr(lf._device, "triton_version", lambda: "3.3.1")
    assert not lf._tma_usable(w)


def test_rebased_descriptor_is_the_one_the_constructor_builds():
    """DirectCall rebases the first call's validated TMA descriptors onto each call's fresh
    tensors instead of constructing (and checking) three a call: every field this Triton's
    TensorDescriptor has must come out as the constructor makes it, the base swapped."""
    TensorDescriptor = pytest.importorskip("triton.tools.tensor_descriptor").TensorDescriptor
    first, second = (torch.empty(64, 128, dtype=torch.float8_e4m3fn) for _ in range(2))
    template = TensorDescriptor(first, [64, 128], [128, 1], [32, 64])
    rebased = lf._rebased(template, second)
    built = TensorDescriptor(second, [64, 128], [128, 1], [32, 64])
    assert type(rebased) is TensorDescriptor and rebased.base is second and template.base is first
    assert {k: v for k, v in vars(rebased).items() if k != "base"} == {k: v for k, v in vars(built).items()
                                                                      if k != "base"}
    assert set(vars(rebased)) == set(vars(built))


def test_direct_call_keeps_no_call_tensor_alive(monkeypatch):
    """DirectCall keeps its first call's TMA descriptors as templates, without their bases: with
    them it held that call's output and e4m3 input for good, one pair per Linear layer (Wan 2.1
    14B ran out of an H100's memory, Flux 12B's peak went from 32 to 51 GiB). Launches stubbed
    on the CPU."""
    import gc
    import weakref

    pytest.importorskip("triton.tools.tensor_descriptor")
    dl = importlib.import_module("triton_accel.kernels.core.direct_launch")
    monkeypatch.setattr(dl, "lookup", lambda key: dl.Plan(None, (1,), (), True))
    monkeypatch.setattr(dl, "usable", lambda t: True)
    monkeypatch.setattr(dl, "launch", lambda plan, index, args: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    w = lf.Fp8LinearWeight(torch.zeros(256, 128, dtype=torch.float8_e4m3fn), torch.ones(256))
    call = lf.DirectCall("quant", "gemm", True, (64, 64, 64, 64), w, 64, 256, 128, torch.bfloat16, 0,
                         torch.device("cpu"), 0)
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    outs = [weakref.ref(call(x, None)) for _ in range(3)]
    gc.collect()
    assert all(ref() is None for ref in outs)
    assert call.templates is not None and all(d.base is None for d in call.templates)


# The split tail (tail_split): (tiles, programs, K tiles, cost) -> (split, tiles kept whole).
# Flux 1024² on 132 SMs with sm90's 128x256x128 tiles and cost, as measured on an H100
# (benchmarks/RESULTS.md, session 37): K = 12288 / 15360 split, K = 3072 not.
TAIL_PLANS = {
    "flux_mlp_down_4608": ((432, 132, 96, 12), (3, 396)),
    "flux_single_out_4608": ((432, 132, 120, 12), (3, 396)),
    "flux_text_mlp_down": ((48, 132, 96, 12), (2, 0)),
    "flux_proj_4608": ((432, 132, 24, 12), (1, 432)),
    "flux_mlp_up_4608": ((1728, 132, 24, 12), (1, 1728)),
    "flux_text_qkv": ((144, 132, 24, 12), (1, 144)),
    # Wan 2.1 14B's projections: 5120 tiles, the last wave 104 of 132 wide: no room for 2 slices.
    "wan_proj": ((5120, 132, 40, 12), (1, 5120)),
    "full_waves": ((264, 132, 96, 12), (1, 264)),
    "one_k_tile": ((40, 132, 1, 12), (1, 40)),
    "off": ((432, 132, 96, None), (1, 432)),
}


@pytest.mark.parametrize("case", list(TAIL_PLANS.values()), ids=list(TAIL_PLANS))
def test_tail_split_plans(case):
    (tiles, programs, k_tiles, cost), (split, whole) = case
    plan = lf.tail_split(tiles, programs, k_tiles, cost, 128, 256)
    assert (plan.split, plan.dp_tiles) == (split, whole)
    assert plan.workspace == (0 if split == 1 else (tiles - whole) * split * 128 * 256)
    if split > 1:
        # One slice per program at most, and whole waves before the tail.
        assert (tiles - whole) * split <= programs and whole % programs == 0


def test_tail_split_forced_stays_in_bounds():
    assert lf.tail_split(432, 132, 24, None, 128, 256, forced=3)[:2] == (3, 396)
    assert lf.tail_split(432, 132, 96, None, 128, 256, forced=8).split == 3  # 132 // 36 programs
    assert lf.tail_split(4, 3, 2, None, 16, 32, forced=5).split == 2  # 2 K tiles
    assert lf.tail_split(6, 3, 9, None, 16, 32, forced=4).split == 1  # full waves


# (M, K, N) on the interpreter's 3 programs and 16x32x32 tiles, each leaving a partial last wave:
# 4 tiles (3 whole + 1 split), 1 tile (fewer tiles than programs), 4 tiles with a K tail and
# partial row / column tiles.
TAIL_SHAPES = {
    "one_tile_left": (20, 192, 48),
    "fewer_tiles_than_programs": (1, 256, 32),
    "k_tail_partial_tiles": (30, 176, 48),
}


@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("shape", list(TAIL_SHAPES.values()), ids=list(TAIL_SHAPES))
def test_split_tail_matches_reference(monkeypatch, tma, split, shape):
    """The split tiles' partials summed by the last slice, then the same epilogue (row x
    channel scales, bias, GELU): as close to the emulation as whole tiles are, the counters
    zero again afterwards, and a repeat gives the same bits."""
    if tma:
        pytest.importorskip("triton.tools.tensor_descriptor")
    m, k, n = shape
    gen = torch.Generator().manual_seed(m + k + n + split)
    x, w = activations(m, k, torch.bfloat16, gen), weights(n, k, gen)
    b = (torch.randn(n, generator=gen) * 3).to(torch.bfloat16)
    fw = lf.quantize_weight(w)
    xq, xs = lf.quantize_activation(x)
    regions = []
    take = lf.tail_lock_region
    monkeypatch.setattr(lf, "tail_lock_region", lambda device: regions.append(take(device)) or regions[-1])
    base = dict(lf.LINEAR_FP8_CONFIGS["interpreter"], TMA=tma)
    for act, out_dtype in ((0, torch.float32), (lf.ACTIVATIONS["gelu_tanh"], torch.bfloat16)):
        whole = lf.fp8_gemm(xq, xs, fw, b, out_dtype, config=dict(base, SPLIT_TAIL=None), act=act, act_from=16)
        assert not regions
        cfg = dict(base, TAIL_SPLIT_K=split)
        out = lf.fp8_gemm(xq, xs, fw, b, out_dtype, config=cfg, act=act, act_from=16)
        assert len(regions) == 1, "the split path was not taken"
        assert int(regions.pop().abs().sum()) == 0, "arrival counters left non-zero"
        expect = ref.linear_fp8_reference(x, fw, b, torch.float32)
        if act:
            gelu = torch.nn.functional.gelu(expect, approximate="tanh")
            expect = torch.cat([expect[:, :16], gelu[:, 16:]], dim=1)
        assert rel_l2(out, expect) <= TOL_EMU[out_dtype]
        # Only fp32 summation order separates split from whole tiles.
        assert rel_l2(out, whole) <= (1e-6 if out_dtype == torch.float32 else 4e-3)
        assert torch.equal(out, lf.fp8_gemm(xq, xs, fw, b, out_dtype, config=cfg, act=act, act_from=16))
        regions.clear()


def test_split_tail_default_setting_and_activated_copy(monkeypatch):
    """The interpreter's shipped config splits a partial last wave; TRITON_ACCEL_SPLIT_TAIL=0
    keeps every tile whole; a call writing the activated copy (SPLIT_ACT) is never split."""
    env = importlib.import_module("triton_accel.kernels.core.env_settings")
    m, k, n = TAIL_SHAPES["one_tile_left"]
    gen = torch.Generator().manual_seed(3)
    x, w = activations(m, k, torch.bfloat16, gen), weights(n, k, gen)
    fw = lf.quantize_weight(w)
    xq, xs = lf.quantize_activation(x)
    calls = []
    take = lf.tail_lock_region
    monkeypatch.setattr(lf, "tail_lock_region", lambda device: calls.append(device) or take(device))
    plain = lf.fp8_gemm(xq, xs, fw, None, torch.bfloat16)
    assert len(calls) == 1
    monkeypatch.setenv(env.SPLIT_TAIL, "0")
    assert torch.allclose(lf.fp8_gemm(xq, xs, fw, None, torch.bfloat16).float(), plain.float(), rtol=8e-3, atol=1e-3)
    assert len(calls) == 1
    monkeypatch.delenv(env.SPLIT_TAIL)
    act_out = torch.empty(m, n - 16, dtype=torch.bfloat16)
    lf.fp8_gemm(xq, xs, fw, None, torch.bfloat16, act=lf.ACTIVATIONS["gelu_tanh"], act_from=16, act_out=act_out)
    assert len(calls) == 1


def test_tail_lock_regions_rotate_and_wait_for_capture(monkeypatch):
    """Each split launch takes the next region of counters (launches in flight on other streams
    do not share them), and inside a stream capture none is made (it would be zeroed only when
    the graph replays): the launch then keeps every tile whole."""
    monkeypatch.setattr(importlib.import_module("triton_accel.kernels.linear.tail_split"), "_tail_locks", {})
    first, second = lf.tail_lock_region(torch.device("cpu")), lf.tail_lock_region(torch.device("cpu"))
    assert first.data_ptr() != second.data_ptr() and int(first.abs().sum()) == 0
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert lf.tail_lock_region(torch.device("cuda", 0)) is None
