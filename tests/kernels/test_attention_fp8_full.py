"""Full-FP8 attention (Q.K^T and P.V in e4m3) on the Triton interpreter: accuracy and edges.

Yardstick: the float32 reference. The tolerances are issue 11's targets:
- "outlier" inputs (kernels.attention.fp8_full.accuracy_inputs: large per-channel K offsets,
  Q and V outlier channels): cosine >= 0.9995 and rel. L2 <= 0.03;
- "gauss" inputs: cosine >= 0.998 and rel. L2 <= 0.06. Zero-mean random V averages to a
  small output, so each e4m3 rounding (Q, K, P and V: ~2-3% relative each) shows at full
  size; naive per-tensor FP8 lands in the same place (measured 0.047-0.054 here, 0.052-0.060
  on the H200 at Flux/Wan/HunyuanVideo shapes).
Naive per-tensor FP8 (one scale per tensor, no smoothing) must fail the outlier inputs, and
so must our kernel without the outlier channels' residual operand (n_outlier=0): those two
tests are what the smoothing and the side operand are for.
The interpreter's FP8 dots are exact and its fp32 -> e4m3 cast is replaced by exact rounding
(EXACT_CAST), so these tests check the quantisation scheme and the kernel's indexing; Hopper's
short fp8 accumulator is measured by benchmarks/fp8_attention_bench.py on the GPU.
"""
from __future__ import annotations

import importlib

import pytest
import torch

full = importlib.import_module("triton_accel.kernels.attention.fp8_full")
quant = importlib.import_module("triton_accel.kernels.attention.fp8_quant")
device_mod = importlib.import_module("triton_accel.kernels.core.device")
registry_mod = importlib.import_module("triton_accel.kernels.core.registry")

# (cosine >=, rel. L2 <=) vs float32, per input kind: issue 11's targets, for fp16 and bf16
# alike (the kernel reads either into fp32 before quantising; the output rounding to the
# input dtype is ~1e-3, far under these).
TOL = {"outlier": (0.9995, 0.03), "gauss": (0.998, 0.06)}

# name: (B, H, Lq, Lk, D). Interpreter tiles are 32x32, so every case has partial tiles
# except d128_whole_tiles.
ACCURACY_CASES = {
    "d128_whole_tiles": (1, 1, 192, 192, 128),
    "d64_partial_tiles": (1, 2, 200, 200, 64),
    "d128_lq_ne_lk": (1, 1, 70, 150, 128),
}


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def passes(out, ref, kind):
    cos_min, rel_max = TOL[kind]
    return cosine(out, ref) >= cos_min and rel_l2(out, ref) <= rel_max


def inputs(kind, B, H, Lq, Lk, D, dtype, seed=0):
    q, _, _ = full.accuracy_inputs(kind, (B, H, Lq, D), dtype, seed=seed)
    _, k, v = full.accuracy_inputs(kind, (B, H, Lk, D), dtype, seed=seed + 1)
    return q, k, v


@pytest.mark.parametrize("kind", ["gauss", "outlier"])
@pytest.mark.parametrize("case", list(ACCURACY_CASES))
def test_accuracy_vs_float32_fp16(case, kind):
    q, k, v = inputs(kind, *ACCURACY_CASES[case], torch.float16)
    out = full.attention_fp8_full(q, k, v)
    ref = full.attention_fp8_full_ref(q, k, v)
    assert out.dtype == torch.float16 and out.shape == q.shape
    cos_min, rel_max = TOL[kind]
    assert cosine(out, ref) >= cos_min and rel_l2(out, ref) <= rel_max, (cosine(out, ref), rel_l2(out, ref))


@pytest.mark.parametrize("kind", ["gauss", "outlier"])
def test_accuracy_vs_float32_bf16(kind):
    q, k, v = inputs(kind, *ACCURACY_CASES["d64_partial_tiles"], torch.bfloat16, seed=5)
    out = full.attention_fp8_full(q, k, v)
    ref = full.attention_fp8_full_ref(q, k, v)
    assert out.dtype == torch.bfloat16
    assert passes(out, ref, kind), (cosine(out, ref), rel_l2(out, ref))


def test_naive_per_tensor_fp8_fails_outlier_inputs_ours_passes():
    q, k, v = inputs("outlier", *ACCURACY_CASES["d128_whole_tiles"], torch.float16, seed=2)
    ref = full.attention_fp8_full_ref(q, k, v)
    naive = full.attention_fp8_per_tensor(q, k, v)
    assert not passes(naive, ref, "outlier"), (cosine(naive, ref), rel_l2(naive, ref))
    assert rel_l2(naive, ref) > 3 * TOL["outlier"][1]  # K's offsets set its one scale: far off
    assert passes(full.attention_fp8_full(q, k, v), ref, "outlier")


def test_outlier_channel_residual_is_what_passes_outlier_inputs():
    q, k, v = inputs("outlier", *ACCURACY_CASES["d64_partial_tiles"], torch.float16, seed=3)
    ref = full.attention_fp8_full_ref(q, k, v)
    without = full.attention_fp8_full(q, k, v, n_outlier=0)
    assert not passes(without, ref, "outlier"), (cosine(without, ref), rel_l2(without, ref))
    assert passes(full.attention_fp8_full(q, k, v), ref, "outlier")


# name: (B, H, Lq, Lk, D, layout)
EDGE_CASES = {
    "keys_fewer_than_one_tile": (1, 2, 33, 5, 64, "bhld"),
    "single_query": (1, 2, 1, 40, 64, "bhld"),
    "head_dim_40_padded": (2, 1, 45, 45, 40, "bhld"),
    "head_dim_8": (1, 2, 20, 19, 8, "bhld"),
    "blhd_view": (2, 2, 30, 30, 64, "blhd"),
}


@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_edge_shapes_and_layouts(case):
    B, H, Lq, Lk, D, layout = EDGE_CASES[case]
    q, k, v = inputs("gauss", B, H, Lq, Lk, D, torch.float16, seed=11)
    if layout == "blhd":  # [B, L, H, D] storage viewed as [B, H, L, D]: strided heads and rows
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        assert not q.is_contiguous()
    out = full.attention_fp8_full(q, k, v)
    ref = full.attention_fp8_full_ref(q, k, v)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert passes(out, ref, "gauss"), (cosine(out, ref), rel_l2(out, ref))


def test_constant_values_come_back_exactly():
    """V's mean is added back in fp32 and (v - mean) is zero: any P gives V's rows back, a
    check of the smoothing's bookkeeping that quantisation noise cannot hide."""
    q, k, _ = inputs("outlier", 1, 2, 50, 70, 64, torch.float16, seed=4)
    v = (torch.randn(1, 2, 1, 64) * 20).expand(1, 2, 70, 64).to(torch.float16).contiguous()
    out = full.attention_fp8_full(q, k, v)
    assert torch.allclose(out.float(), v[:, :, :1].float().expand_as(out), rtol=2e-3, atol=2e-3)


def test_quantized_operands_are_padded_with_zeros_and_scaled():
    q, k, v = inputs("outlier", 1, 1, 40, 50, 40, torch.float16, seed=6)
    qkv = quant.quantize_qkv(q, k, v, 0.125, 32, 32, exact_cast=True)
    assert qkv.q8.shape == (1, 64, 64) and qkv.k8.shape == (1, 64, 64) and qkv.vt8.shape == (1, 64, 64)
    assert (qkv.q8.float()[:, 40:] == 0).all() and (qkv.q8.float()[:, :, 40:] == 0).all()
    assert (qkv.k8.float()[:, 50:] == 0).all() and (qkv.vt8.float()[:, :, 50:] == 0).all()
    assert qkv.k8.float().abs().amax() == 448 and qkv.vt8.float().abs().amax() == 448
    k_mean = k.float().mean(dim=2)[0]
    # vmean is V's mean less VT8's mean rounding error: the de-quantised V averages to V's mean.
    v_mean = v.float().mean(dim=2)[0, 0]
    vd = qkv.vt8.float()[0, :40, :50].T * qkv.sv[0, :40] + qkv.vmean[0, :40]
    assert torch.allclose(vd.mean(0), v_mean, atol=1e-5)
    assert ((qkv.vmean[0, :40] - v_mean).abs() <= 16 * qkv.sv[0, :40]).all()  # half e4m3's widest step
    # K was centred: de-quantised K + mean is K again, to e4m3's 2**-4 relative step.
    kd = qkv.k8.float()[0, :50, :40] * qkv.sk[0].repeat_interleave(32)[:50, None] + k_mean
    assert rel_l2(kd, k[0, 0].float()) < 0.03
    # V_MEAN_FIX=0 (the sweep's comparison) hands over V's exact mean and the same operands.
    plain = quant.quantize_qkv(q, k, v, 0.125, 32, 32, exact_cast=True, tuning=dict(V_MEAN_FIX=0))
    assert torch.allclose(plain.vmean[0, :40], v_mean, atol=1e-6) and (plain.vmean[0, 40:] == 0).all()
    assert torch.equal(plain.vt8.float(), qkv.vt8.float()) and not torch.equal(plain.vmean, qkv.vmean)


@pytest.mark.parametrize("tuning", [dict(STATS_ROWS=64), dict(STATS_ROWS=64, STATS_SUB=16, STATS_WARPS=8),
                                    dict(STATS_ROWS=128, STATS_STAGES=1), dict(QUANT_WARPS=8)],
                         ids=["rows64", "rows64_sub16_w8", "unpipelined", "quant_w8"])
def test_launch_shapes_give_the_same_operands(tuning):
    """QUANT_TUNING's launch shapes move work between programs, never change the result: the
    statistics are sums and extrema (the same sums in another order agree to rounding, and the
    K mean feeds every quantised K value, so compare those with a tolerance)."""
    q, k, v = inputs("outlier", 1, 2, 300, 300, 64, torch.float16, seed=9)
    base = quant.quantize_qkv(q, k, v, 0.1, 32, 32, exact_cast=True)
    other = quant.quantize_qkv(q, k, v, 0.1, 32, 32, exact_cast=True, tuning=tuning)
    for name in ("q8", "qs", "sq"):  # Q is not centred: no sum involved, the same bytes
        assert torch.equal(getattr(base, name).float(), getattr(other, name).float()), name
    for name in ("sv", "vmean", "sk"):
        assert torch.allclose(getattr(base, name), getattr(other, name), rtol=1e-5, atol=1e-6), name
    for name in ("k8", "vt8"):  # a mean one ulp off may move a rounding, rarely
        assert (getattr(base, name).float() != getattr(other, name).float()).float().mean() < 0.01, name


def test_q_sampling_ranks_the_same_outlier_channels_and_passes():
    """Q_SAMPLE reads Q's statistics in one chunk of Q_SAMPLE (they only rank the outlier
    channels, which are the same channels in every token): the accuracy on outlier inputs
    stays."""
    q, k, v = inputs("outlier", 1, 1, 512, 512, 64, torch.float16, seed=10)
    cfg = full.default_config(q.device)
    scale = 64 ** -0.5
    whole = quant.quantize_qkv(q, k, v, scale, cfg["BLOCK_M"], cfg["BLOCK_N"], exact_cast=True,
                               tuning=dict(STATS_ROWS=64))
    sampled = quant.quantize_qkv(q, k, v, scale, cfg["BLOCK_M"], cfg["BLOCK_N"], exact_cast=True,
                                 tuning=dict(STATS_ROWS=64, Q_SAMPLE=4))
    # Q, K, V themselves are the same bytes (Q_SAMPLE touches only the channel ranking)...
    for name in ("q8", "sq", "k8", "sk", "vt8", "sv", "vmean"):
        assert torch.equal(getattr(whole, name).float(), getattr(sampled, name).float()), name
    # ...and the ranking still finds the channels that matter: past the 4 outlier channels it
    # orders noise, so the side operands may differ there, the accuracy not.
    ref = full.attention_fp8_full_ref(q, k, v)
    errs = [rel_l2(full.attention_fp8_full_quantized(x, q.shape, k.shape[2], q.dtype, q.device, cfg), ref)
            for x in (whole, sampled)]
    assert errs[1] <= TOL["outlier"][1] and errs[1] <= 1.2 * errs[0], errs


def test_qk_stride_samples_only_long_sequences():
    """The statistics read 1 row in QK_STRIDE of Q and K only where that still leaves
    QK_MIN_ROWS rows (Flux's 4608 tokens: 576); shorter sequences read every row."""
    tune = quant.QUANT_TUNING
    assert quant.qk_stride(4608, 4608, tune) == 8 and quant.qk_stride(32760, 32760, tune) == 8
    assert quant.qk_stride(2047, 4608, tune) == 1 and quant.qk_stride(4608, 1000, tune) == 1
    assert quant.qk_stride(4608, 4608, dict(tune, QK_STRIDE=1)) == 1


def test_k_mean_comes_from_the_sampled_rows_and_v_stays_exact():
    """With QK_STRIDE = 4, K's centring vector is the mean of rows 0, 4, 8, ... only: rows that
    equal it quantise to exact zeros, the others do not (a mean over every row would move all of
    them). V's mean and scale, Q and its block scales are those of the unsampled statistics, bit
    for bit (V's scale must bound every value; Q is not centred)."""
    B, H, L, D = 1, 2, 300, 64
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(B, H, L, D, generator=gen).half()
    k = torch.randn(B, H, L, D, generator=gen)
    v = torch.randn(B, H, L, D, generator=gen).half()
    sampled = torch.arange(L) % 4 == 0
    k[:, :, sampled] = 5.0 * torch.randn(B, H, 1, D, generator=gen)  # one vector per head
    k = k.half()
    tune = dict(QK_STRIDE=4, QK_MIN_ROWS=8, STATS_ROWS=64)
    assert quant.qk_stride(L, L, dict(quant.QUANT_TUNING, **tune)) == 4
    got = quant.quantize_qkv(q, k, v, 0.1, 32, 32, exact_cast=True, tuning=tune)
    every = quant.quantize_qkv(q, k, v, 0.1, 32, 32, exact_cast=True, tuning=dict(tune, QK_STRIDE=1))
    k8 = got.k8.float()[:, :L, :D]
    assert (k8[:, sampled] == 0).all()
    assert (k8[:, ~sampled].abs().amax(-1) > 0).all()
    assert not (every.k8.float()[:, :L][:, sampled] == 0).all()
    for name in ("q8", "sq", "vt8", "sv", "vmean"):
        assert torch.equal(getattr(got, name).float(), getattr(every, name).float()), name


@pytest.mark.parametrize("kind", ["outlier", "gauss"])
def test_sampled_statistics_keep_the_accuracy(kind):
    """The whole FP8 attention with the sampled statistics (QK_STRIDE = 8: 32 query and 256 key
    rows read of 256 and 2048) against float32: within issue 11's bars and within 10 % of the
    error with every row read."""
    q, k, v = inputs(kind, 1, 1, 256, 2048, 64, torch.float16, seed=13)
    cfg = full.default_config(q.device)
    ref = full.attention_fp8_full_ref(q, k, v)
    errs = []
    for stride in (8, 1):
        tune = dict(QK_STRIDE=stride, QK_MIN_ROWS=32)
        assert quant.qk_stride(256, 2048, dict(quant.QUANT_TUNING, **tune)) == stride
        x = quant.quantize_qkv(q, k, v, 64 ** -0.5, cfg["BLOCK_M"], cfg["BLOCK_N"], exact_cast=True, tuning=tune)
        errs.append(rel_l2(full.attention_fp8_full_quantized(x, q.shape, k.shape[2], q.dtype, q.device, cfg), ref))
    assert errs[0] <= TOL[kind][1] and errs[0] <= 1.1 * errs[1], errs


def test_tuning_must_be_powers_of_two():
    q, k, v = inputs("gauss", 1, 1, 40, 40, 64, torch.float16)
    with pytest.raises(ValueError, match="powers of two"):
        quant.quantize_qkv(q, k, v, 0.1, 32, 32, tuning=dict(STATS_ROWS=96))


@pytest.mark.parametrize("what, kwargs, message", [
    ("mask", dict(attn_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool)), "masks are not supported"),
    ("causal", dict(is_causal=True), "is_causal is not supported"),
])
def test_refuses_mask_and_causal(what, kwargs, message):
    q, k, v = inputs("gauss", 1, 1, 8, 8, 64, torch.float16)
    with pytest.raises(full.FP8FullUnsupportedError, match=message):
        full.attention_fp8_full(q, k, v, **kwargs)


def test_refuses_gqa_float32_and_wide_heads():
    q, k, v = inputs("gauss", 1, 4, 8, 8, 64, torch.float16)
    with pytest.raises(full.FP8FullUnsupportedError, match="no GQA"):
        full.attention_fp8_full(q, k[:, :2], v[:, :2])
    with pytest.raises(full.FP8FullUnsupportedError, match="float16 or bfloat16"):
        full.attention_fp8_full(q.float(), k.float(), v.float())
    q, k, v = inputs("gauss", 1, 1, 8, 8, 160, torch.float16)
    with pytest.raises(full.FP8FullUnsupportedError, match="head dim 160 outside 1..128"):
        full.attention_fp8_full(q, k, v)


@pytest.mark.parametrize("cc, ok", [((7, 5), False), ((8, 0), False), ((8, 6), False), ((8, 9), True),
                                    ((9, 0), True), ((12, 0), True)])
def test_device_refusal_below_sm89(monkeypatch, cc, ok):
    info = device_mod.DeviceInfo("cuda", "nvidia", f"gpu sm{cc[0]}{cc[1]}", cc, f"sm{cc[0]}{cc[1]}")
    monkeypatch.setattr(full._device, "describe", lambda device=None: info)
    reason = full.device_refusal(torch.device("cuda", 0))
    if ok:
        assert reason is None
    else:
        assert reason == f"FP8 tensor cores need sm_89+ (gpu sm{cc[0]}{cc[1]} is sm_{cc[0]}{cc[1]})"


@pytest.mark.parametrize("change, refusal", [
    (dict(mask="bool"), "bool masks not supported"),
    (dict(is_causal=True), "is_causal not supported"),
    (dict(kv_heads=8), "grouped-query attention not supported"),
    (dict(head_dim=256, head_dim_v=256), "head dim 256 outside 1..128"),
    (dict(dtype=torch.float32), "dtype torch.float32 not supported"),
    (dict(device=device_mod.DeviceInfo("cuda", "nvidia", "RTX 3090", (8, 6), "sm86")),
     "FP8 tensor cores need sm_89+ (RTX 3090 is sm_86)"),
    (dict(), None),
])
def test_registry_constraints_say_what_is_served(change, refusal):
    fields = dict(device=device_mod.DeviceInfo("cuda", "nvidia", "NVIDIA H200", (9, 0), "sm90"),
                  dtype=torch.bfloat16, head_dim=128, head_dim_v=128, q_heads=24, kv_heads=24, mask="none",
                  is_causal=False)
    fields.update(change)
    assert full.registry_constraints().check(registry_mod.Call(**fields)) == refusal


def test_v_rounding_bias_is_taken_out_of_the_mean():
    """bf16 V's e4m3 rounding errors share a sign per channel (both grids are fixed for a
    channel's scale and mean), and attention passes a per-channel offset of V straight to the
    output while a flat softmax's output shrinks like 1/sqrt(keys): at long sequences that bias
    was the largest part of the Gaussian error (HunyuanVideo's 0.0605 rel. L2 on the H100 against
    issue 11's 0.06). vmean carries the correction: the output against float32 with it, and with
    V's exact mean put back (the uncorrected operands), at 16384 keys. The stored V is summed in
    one fixed order, so a second quantisation gives the same bits."""
    q, k, v = inputs("gauss", 1, 1, 32, 16384, 64, torch.bfloat16, seed=14)
    cfg = full.default_config(q.device)
    ref = full.attention_fp8_full_ref(q, k, v)
    x = quant.quantize_qkv(q, k, v, 64 ** -0.5, cfg["BLOCK_M"], cfg["BLOCK_N"], exact_cast=True)
    again = quant.quantize_qkv(q, k, v, 64 ** -0.5, cfg["BLOCK_M"], cfg["BLOCK_N"], exact_cast=True)
    assert torch.equal(x.vmean, again.vmean)
    exact = torch.zeros_like(x.vmean)
    exact[:, :64] = v.float().mean(dim=2)[0]
    fixed, biased = (rel_l2(full.attention_fp8_full_quantized(y, q.shape, k.shape[2], q.dtype, q.device, cfg), ref)
                     for y in (x, x._replace(vmean=exact)))
    # Seeds 14-17 (d64 and d128, 16384 and 32768 keys) gave 0.87-0.93 of the biased error.
    assert fixed <= TOL["gauss"][1] and fixed <= 0.95 * biased, (fixed, biased)
