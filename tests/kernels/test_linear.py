"""kernels.linear (the public Linear API) for every method on the Triton interpreter (CPU).

Shapes are Flux/Wan-like but small ((M, K, N) = (37, 256, 384)), with odd M, 3-D x, one
token, no tokens. Activations carry outlier channels (a few channels 30x the rest in every
token, as diffusion models' do). Tolerances (rel. L2), each against the float32 computation
a user compares with:
- fp8_w8a8 <= 0.035 vs the unquantised fp32 Linear: e4m3's 3 mantissa bits on both operands
  give 0.022-0.031 on Gaussian data (tests/kernels/test_linear_fp8.py explains it);
- int8_w8a8 <= 0.03 vs the unquantised fp32 Linear, with outlier channels (the issue's bar;
  the Hadamard rotation gives ~0.01; without it 0.03-0.08, see test_int8_rotation_*);
- fp8_weight_only <= 0.01 vs linear_ref (x times the dequantised e4m3 weight in fp32): only
  the output's rounding is left (bf16 2^-9 relative); the weight's own e4m3 rounding is the
  method's definition, checked separately against the unquantised Linear (<= 0.035).
"""
from __future__ import annotations

import importlib

import pytest
import torch

kernels = importlib.import_module("triton_accel.kernels")
L = importlib.import_module("triton_accel.kernels.linear.dispatch")
li = importlib.import_module("triton_accel.kernels.linear.int8")
registry_mod = importlib.import_module("triton_accel.kernels.core.registry")
lref = importlib.import_module("triton_accel.kernels.linear.ref")

METHODS = ("fp8_w8a8", "int8_w8a8", "fp8_weight_only")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TOL_VS_FP32 = {"fp8_w8a8": 0.035, "int8_w8a8": 0.03, "fp8_weight_only": 0.035}
TOL_WEIGHT_ONLY_VS_REF = 0.01
# (leading dims of x, K, N): Flux-like, odd M over 3-D x, one token, no tokens.
SHAPES = {"flux_like": ((37,), 256, 384), "odd_m_3d": ((3, 13), 128, 96), "one_token": ((1,), 64, 32),
          "no_tokens": ((0,), 64, 32)}


def rel_l2(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def activations(lead, k, dtype, gen, outliers=3, factor=30.0):
    x = torch.randn(*lead, k, generator=gen)
    if outliers:
        x[..., torch.randperm(k, generator=gen)[:outliers]] *= factor
    return x.to(dtype)


def weights(n, k, gen):
    return torch.randn(n, k, generator=gen) * k ** -0.5


def fp32_linear(x, w, b=None):
    y = x.float() @ w.float().T
    return y + b.float() if b is not None else y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method", METHODS)
def test_accuracy_with_outlier_channels(method, dtype):
    lead, k, n = SHAPES["flux_like"]
    gen = torch.Generator().manual_seed(12)
    x, w, b = activations(lead, k, dtype, gen), weights(n, k, gen), torch.randn(n, generator=gen).to(dtype)
    prepared = kernels.prepare_weight(w.to(dtype), method)
    out = kernels.linear(x, prepared, b)
    assert out.dtype == dtype and out.shape == (*lead, n)
    assert torch.isfinite(out).all()
    assert rel_l2(out, fp32_linear(x, w.to(dtype), b)) <= TOL_VS_FP32[method]
    if method == "fp8_weight_only":
        assert rel_l2(out, L.linear_ref(x, prepared, b)) <= TOL_WEIGHT_ONLY_VS_REF


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("shape", [SHAPES[s] for s in ("odd_m_3d", "one_token", "no_tokens")],
                         ids=["odd_m_3d", "one_token", "no_tokens"])
@pytest.mark.parametrize("method", METHODS)
def test_shapes_and_bias(method, shape, with_bias):
    lead, k, n = shape
    gen = torch.Generator().manual_seed(k + n)
    x, w = activations(lead, k, torch.bfloat16, gen, outliers=2), weights(n, k, gen)
    # A bias far larger than x @ W.T: dropping or double-adding it cannot pass.
    b = (torch.randn(n, generator=gen) * 10).to(torch.bfloat16) if with_bias else None
    out = kernels.linear(x, kernels.prepare_weight(w, method), b)
    assert out.shape == (*lead, n) and out.dtype == torch.bfloat16
    if x.numel():
        assert rel_l2(out, fp32_linear(x, w, b)) <= TOL_VS_FP32[method]


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method", METHODS)
def test_out_dtype(method, out_dtype):
    lead, k, n = SHAPES["odd_m_3d"]
    gen = torch.Generator().manual_seed(5)
    x, w, b = activations(lead, k, torch.bfloat16, gen), weights(n, k, gen), torch.randn(n, generator=gen)
    out = kernels.linear(x, kernels.prepare_weight(w, method), b, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (*lead, n)
    assert rel_l2(out, fp32_linear(x, w, b)) <= TOL_VS_FP32[method]


# Output columns >= activation_from get GELU (tanh) in the GEMM's epilogue. Against the same
# kernel's fp32 output with torch's GELU applied afterwards (same quantised operands): fp32 out
# <= 1e-5 relative (exp2 vs tanh formulation), bf16/fp16 out within their rounding (2^-8 /
# 2^-11 relative, plus an absolute floor for GELU's near-zero negative tail); the columns
# before activation_from bit-identical to the call without activation.
ACT_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (8e-3, 2e-3), torch.float16: (1e-3, 1e-3)}


@pytest.mark.parametrize("act_from", [0, 40, 64], ids=["all_columns", "mid_tile", "tile_edge"])
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method", METHODS)
def test_gelu_epilogue(method, out_dtype, act_from):
    lead, k, n = (3, 13), 128, 96
    gen = torch.Generator().manual_seed(21)
    x, w, b = activations(lead, k, torch.bfloat16, gen), weights(n, k, gen), torch.randn(n, generator=gen)
    prepared = kernels.prepare_weight(w, method)
    plain = kernels.linear(x, prepared, b, out_dtype=torch.float32)
    kernels.core.stats.reset()
    ours = kernels.linear(x, prepared, b, out_dtype=out_dtype, activation="gelu_tanh", activation_from=act_from)
    # the kernel with its epilogue, not a torch fallback
    assert kernels.core.stats.counts() == {f"triton_linear_{method}": 1, L.EPILOGUE_COUNTER: 1}
    assert ours.dtype == out_dtype and ours.shape == (*lead, n)
    expect = plain.clone()
    expect[..., act_from:] = torch.nn.functional.gelu(plain[..., act_from:], approximate="tanh")
    rtol, atol = ACT_TOL[out_dtype]
    torch.testing.assert_close(ours.float(), expect, rtol=rtol, atol=atol)
    same_dtype = kernels.linear(x, prepared, b, out_dtype=out_dtype)
    assert torch.equal(ours[..., :act_from], same_dtype[..., :act_from])
    # The activation did run: GELU sends the many negative outputs near zero.
    assert (plain[..., act_from:] < -1).any() and (ours[..., act_from:].float() > -0.2).all()
    ref = L.linear_ref(x, prepared, b, activation="gelu_tanh", activation_from=act_from)
    assert rel_l2(ours, ref) <= TOL_VS_FP32[method]


def test_gelu_epilogue_traces_under_torch_compile():
    gen = torch.Generator().manual_seed(22)
    x, w = activations((2, 7), 64, torch.bfloat16, gen), weights(48, 64, gen)
    prepared = kernels.prepare_weight(w, "fp8_w8a8")
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: kernels.linear(t, prepared, activation="gelu_tanh", activation_from=16),
                             backend="aot_eager", fullgraph=True)
    out = compiled(x)
    assert torch.equal(out, kernels.linear(x, prepared, activation="gelu_tanh", activation_from=16))


def test_zero_token_gives_the_bias():
    # A row of zeros: the amax floor keeps its scale finite, and the output is exactly the bias.
    gen = torch.Generator().manual_seed(3)
    x, w = activations((5,), 64, torch.float32, gen), weights(32, 64, gen)
    x[2] = 0
    b = torch.randn(32, generator=gen)
    for method in METHODS:
        out = kernels.linear(x, kernels.prepare_weight(w, method), b)
        assert torch.equal(out[2], b), method


# ComfyUI's FP8 checkpoints: float8_e4m3fn weights with a per-tensor scale_weight.
@pytest.mark.parametrize("scale_kind", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("method", METHODS)
def test_comfyui_fp8_weights(method, scale_kind):
    lead, k, n = SHAPES["odd_m_3d"]
    gen = torch.Generator().manual_seed(9)
    w = weights(n, k, gen)
    if scale_kind == "per_tensor":
        scale = w.abs().max() / 448.0
        w8 = (w / scale).to(torch.float8_e4m3fn)
        w_deq = w8.float() * scale
    else:
        scale = w.abs().amax(dim=1) / 448.0
        w8 = (w / scale[:, None]).to(torch.float8_e4m3fn)
        w_deq = w8.float() * scale[:, None]
    prepared = kernels.prepare_weight(w8, method, weight_scale=scale)
    assert prepared.source_dtype == torch.float8_e4m3fn
    if method != "int8_w8a8":
        # Taken as-is: the same e4m3 bytes, the checkpoint's scale broadcast per channel.
        assert torch.equal(prepared.weight.view(torch.uint8), w8.view(torch.uint8))
        assert torch.equal(prepared.scale, torch.as_tensor(scale, dtype=torch.float32).expand(n))
    x, b = activations(lead, k, torch.bfloat16, gen), torch.randn(n, generator=gen)
    out = kernels.linear(x, prepared, b)
    assert rel_l2(out, fp32_linear(x, w_deq, b)) <= (TOL_WEIGHT_ONLY_VS_REF if method == "fp8_weight_only"
                                                     else TOL_VS_FP32[method])


# The outlier treatment: plain per-token / per-channel INT8 fails the 0.03 bar on
# activations with outlier channels at a Flux-like K; the block-Hadamard rotation passes it.
# Measured here: plain 0.071, rotated 0.014 (K 3072, 3 channels x30); plain 0.031, rotated
# 0.009 (K 256).
def test_int8_rotation_meets_the_bar_where_plain_int8_fails():
    gen = torch.Generator().manual_seed(0)
    m, k, n = 16, 3072, 64
    x, w = activations((m,), k, torch.bfloat16, gen), weights(n, k, gen)
    ref = fp32_linear(x, w)
    errors = {}
    for rotate in (False, True):
        q, s, block = li.quantize_weight(w, rotate=rotate)
        errors[rotate] = rel_l2(li.run_linear(x, q, s, None, block, torch.float32), ref)
    assert errors[False] > 0.05, errors  # plain INT8: the outliers set every row's step
    assert errors[True] <= TOL_VS_FP32["int8_w8a8"], errors
    assert kernels.prepare_weight(w, "int8_w8a8").rotation == 128  # the public API rotates


# The INT8 kernels against linear_int8_reference (the same rotation, rounding and scales in
# torch): the quantisation error is shared and the int products are exact, so only fp32
# rounding of the scales and the rotation's sums is left (measured: 0.0, bit-identical int8
# codes); rel. L2 <= 1e-4 with fp32 output fails a 2 % scale error (0.02) or any tile bug.
# The ids: Flux-like K with a 128 block, K 96 (32 block, partial tiles), no rotation.
@pytest.mark.parametrize("case", [((37, 256, 384), 128), ((21, 96, 48), 32), ((37, 256, 384), 0)],
                         ids=["block128", "block32_partial", "plain"])
def test_int8_matches_its_emulation(case):
    (m, k, n), rotation = case
    gen = torch.Generator().manual_seed(m + k)
    x, w, b = activations((m,), k, torch.bfloat16, gen), weights(n, k, gen), torch.randn(n, generator=gen)
    q, s, block = li.quantize_weight(w, rotate=bool(rotation))
    assert block == rotation
    out = li.run_linear(x, q, s, b, block, torch.float32)
    assert rel_l2(out, lref.linear_int8_reference(x, q, s, block, b, torch.float32)) <= 1e-4


def test_int8_hadamard_blocks_are_orthogonal():
    for block in li.HADAMARD_BLOCKS:
        h = li.hadamard_blocks(torch.eye(block), block)
        assert torch.equal(h @ h.T, block * torch.eye(block))
    assert li.hadamard_block_for(5120) == 128 and li.hadamard_block_for(96) == 32 and li.hadamard_block_for(48) == 16


def test_fast_path_runs_and_is_counted(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    x, w = activations((9,), 64, torch.bfloat16, gen), weights(32, 64, gen)
    for method in METHODS:
        prepared = kernels.prepare_weight(w, method)
        kernels.core.stats.reset()
        kernels.linear(x, prepared)
        assert kernels.core.stats.counts() == {f"triton_linear_{method}": 1}
    # Where a method cannot run it raises with the reason: never a silent fallback.
    monkeypatch.setattr(L._device, "interpreter_enabled", lambda: False)
    kernels.core.stats.reset()
    with pytest.raises(registry_mod.BackendUnavailableError, match="TRITON_INTERPRET"):
        kernels.linear(x, kernels.prepare_weight(w, "fp8_w8a8"))
    assert kernels.core.stats.counts() == {}


@pytest.mark.parametrize("method", METHODS)
def test_torch_compile_traces_the_op(method):
    gen = torch.Generator().manual_seed(2)
    x, w, b = activations((2, 7), 64, torch.bfloat16, gen), weights(48, 64, gen), torch.randn(48, generator=gen)
    prepared = kernels.prepare_weight(w, method)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: kernels.linear(t, prepared, b, out_dtype=torch.float32),
                             backend="aot_eager", fullgraph=True)
    kernels.core.stats.reset()
    out = compiled(x)
    assert kernels.core.stats.counts() == {f"triton_linear_{method}": 1}
    assert torch.equal(out, kernels.linear(x, prepared, b, out_dtype=torch.float32))


def test_prepared_weight_bytes_and_move():
    w = weights(64, 128, torch.Generator().manual_seed(4))
    for method in METHODS:
        p = kernels.prepare_weight(w, method)
        assert (p.method, p.out_features, p.in_features, p.source_dtype) == (method, 64, 128, torch.float32)
        assert p.nbytes() == 64 * 128 + 64 * 4  # 8-bit weight + fp32 channel scales
        moved = p.to("cpu")
        assert moved.device == torch.device("cpu")
        assert torch.equal(moved.weight.view(torch.uint8), p.weight.view(torch.uint8))


def _bad_calls():
    gen = torch.Generator().manual_seed(6)
    w = weights(32, 64, gen)
    good = kernels.prepare_weight(w, "fp8_w8a8")
    x = torch.randn(4, 64)
    nan_w = w.clone()
    nan_w[0, 0] = float("nan")
    w8 = w.to(torch.float8_e4m3fn)
    return {
        "unknown_method": (lambda: kernels.prepare_weight(w, "fp4"), "unknown Linear method"),
        "weight_1d": (lambda: kernels.prepare_weight(w[0], "fp8_w8a8"), "2-D"),
        "weight_int": (lambda: kernels.prepare_weight(w.to(torch.int32), "int8_w8a8"), "weight dtype"),
        "k_not_16": (lambda: kernels.prepare_weight(torch.randn(32, 40), "int8_w8a8"), "in_features"),
        "n_not_16": (lambda: kernels.prepare_weight(torch.randn(20, 64), "fp8_weight_only"), "out_features"),
        "nan_weight": (lambda: kernels.prepare_weight(nan_w, "fp8_w8a8"), "NaN"),
        "scale_for_float": (lambda: kernels.prepare_weight(w, "fp8_w8a8", torch.tensor(1.0)), "weight_scale"),
        "scale_wrong_size": (lambda: kernels.prepare_weight(w8, "fp8_w8a8", torch.ones(3)), "32 values"),
        "scale_negative": (lambda: kernels.prepare_weight(w8, "fp8_weight_only", torch.tensor(-1.0)), "positive"),
        "x_wrong_k": (lambda: kernels.linear(torch.randn(4, 32), good), "input features"),
        "x_int": (lambda: kernels.linear(x.to(torch.int8), good), "x dtype"),
        "x_scalar": (lambda: kernels.linear(torch.tensor(1.0), good), "tensor"),
        "not_prepared": (lambda: kernels.linear(x, w), "prepare_weight"),
        "bias_shape": (lambda: kernels.linear(x, good, torch.zeros(31)), "bias must have shape"),
        "out_dtype": (lambda: kernels.linear(x, good, out_dtype=torch.int32), "out_dtype"),
        "activation_unknown": (lambda: kernels.linear(x, good, activation="relu"), "unknown activation"),
        "activation_from_past_n": (lambda: kernels.linear(x, good, activation="gelu_tanh", activation_from=32),
                                   "activation_from"),
    }


BAD = _bad_calls()


@pytest.mark.parametrize("case", list(BAD.values()), ids=list(BAD))
def test_bad_inputs_raise_with_reason(case):
    call, words = case
    with pytest.raises(kernels.LinearInputError) as e:
        call()
    assert words in e.value.reason
    assert isinstance(e.value, ValueError)


def test_public_names():
    assert kernels.LINEAR_METHODS == METHODS
    assert kernels.linear_refusal("fp8_w8a8", "cpu") is None  # the interpreter is on in tests
    for method in METHODS:
        assert hasattr(torch.ops.triton_accel, f"linear_{method}")


# ---- linear()'s DirectCall memo (the launches themselves are checked on the GPU:
# benchmarks/host_overhead.py compares every DirectCall output with the checked path's, bit for bit)

class _FakeDirect:
    """Stands for linear_fp8.DirectCall: returns `result` (None: "not verified yet")."""

    def __init__(self, result):
        self.result, self.calls = result, 0

    def __call__(self, x, bias, act_out=None):
        self.calls += 1
        return self.result


def _direct_case(gen_seed=21, lead=(3, 5), k=64, n=32):
    gen = torch.Generator().manual_seed(gen_seed)
    x, w = activations(lead, k, torch.bfloat16, gen), weights(n, k, gen)
    return x, kernels.prepare_weight(w, "fp8_w8a8")


def test_direct_memo_on_the_cpu_keeps_the_checked_path():
    """The interpreter has no direct launches: the signature is remembered as 'checked path
    always' (False) after the first call, and every call runs (and counts) the checked path."""
    x, prepared = _direct_case()
    kernels.core.stats.reset()
    first = kernels.linear(x, prepared)
    assert list(prepared._direct.values()) == [False]
    second = kernels.linear(x, prepared)
    assert torch.equal(first, second)
    assert kernels.core.stats.counts() == {"triton_linear_fp8_w8a8": 2}


@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_direct_memo_serves_the_remembered_signature_and_counts_it(activation):
    x, prepared = _direct_case()
    kw = dict(activation=activation, activation_from=8) if activation else {}
    key = L._direct_key(x, None, None, activation, 8 if activation else 0)
    made = torch.arange(15 * 32, dtype=torch.bfloat16).reshape(15, 32)
    fake = prepared._direct[key] = _FakeDirect(made)
    kernels.core.stats.reset()
    out = kernels.linear(x, prepared, **kw)
    assert fake.calls == 1 and torch.equal(out, made.view(3, 5, 32))  # the DirectCall's output, reshaped
    expected = {"triton_linear_fp8_w8a8": 1, L.DIRECT_COUNTER: 1}
    if activation:
        expected[L.EPILOGUE_COUNTER] = 1
    assert kernels.core.stats.counts() == expected


def test_direct_memo_takes_a_modules_parameter_bias():
    """A Linear module's bias is an nn.Parameter (the node passes it as it is): such calls are
    remembered like plain-tensor ones; a tensor subclass is not."""
    x, prepared = _direct_case()
    bias = torch.nn.Parameter(torch.randn(32).to(torch.bfloat16), requires_grad=False)
    assert L._direct_key(x, bias, None, None, 0) is not None
    assert L._direct_key(torch.nn.Parameter(x, requires_grad=False), None, None, None, 0) is not None

    class Sub(torch.Tensor):
        pass

    assert L._direct_key(x.as_subclass(Sub), None, None, None, 0) is None
    made = torch.ones(15, 32, dtype=torch.bfloat16)
    fake = prepared._direct[L._direct_key(x, bias, None, None, 0)] = _FakeDirect(made)
    assert torch.equal(kernels.linear(x, prepared, bias), made.view(3, 5, 32)) and fake.calls == 1


def test_direct_memo_falls_back_when_the_direct_call_declines():
    """A DirectCall whose plans are not verified yet returns None: the checked path serves the
    call, and the memo keeps the DirectCall for the next one."""
    x, prepared = _direct_case()
    key = L._direct_key(x, None, None, None, 0)
    fake = prepared._direct[key] = _FakeDirect(None)
    kernels.core.stats.reset()
    out = kernels.linear(x, prepared)
    assert fake.calls == 1 and prepared._direct[key] is fake
    assert torch.equal(out, kernels.linear(torch.clone(x), prepared))
    assert kernels.core.stats.counts().get(L.DIRECT_COUNTER, 0) == 0


@pytest.mark.parametrize("change", ["out_dtype", "bias", "activation", "activation_from", "dtype", "tokens",
                                    "strided", "misaligned"])
def test_direct_memo_is_not_used_for_another_signature(change):
    x, prepared = _direct_case()
    fake = prepared._direct[L._direct_key(x, None, None, None, 0)] = _FakeDirect(torch.zeros(15, 32))
    kw = {}
    if change == "out_dtype":
        kw["out_dtype"] = torch.float32
    elif change == "bias":
        kw["bias"] = torch.randn(32)
    elif change == "activation":
        kw = dict(activation="gelu_tanh", activation_from=0)
    elif change == "activation_from":
        kw = dict(activation=None, activation_from=4)
    elif change == "dtype":
        x = x.half()
    elif change == "tokens":
        x = x[:2]
    elif change == "strided":
        x = torch.cat([x, x], dim=-1)[..., :64]
    elif change == "misaligned":
        x = torch.cat([torch.zeros(1, dtype=x.dtype), x.flatten()])[1:].view(3, 5, 64)
    out = kernels.linear(x, prepared, **kw)
    assert fake.calls == 0
    assert out.abs().sum() > 0  # the checked path's result, not the fake's zeros


def test_direct_memo_is_bounded_and_never_shared_by_a_moved_copy():
    x, prepared = _direct_case()
    for i in range(L.DIRECT_CALLS_PER_WEIGHT + 3):
        kernels.linear(x.reshape(-1, 64)[: 1 + i], prepared)
    assert 0 < len(prepared._direct) <= L.DIRECT_CALLS_PER_WEIGHT
    moved = prepared.to("cpu")
    assert moved._direct == {} and moved._direct is not prepared._direct
    assert moved == prepared  # the memo takes no part in comparisons


def test_direct_call_keys_are_the_checked_paths_keys(monkeypatch):
    """linear_fp8.direct_call rebuilds the direct-launch keys that quantize_activation and
    fp8_gemm record; a key that drifted would leave every call on the checked path (or, worse,
    pick another call's plan). Recorded on the CPU with the launches' key bookkeeping forced on."""
    lf = importlib.import_module("triton_accel.kernels.linear.fp8")
    recorded = []

    def spy(make):
        def keyed(*args):
            recorded.append(make(*args))
            return recorded[-1]
        return keyed

    # The interpreter's launches return no compiled kernel, so nothing is recorded as a plan:
    # the keys are taken where both paths build them.
    monkeypatch.setattr(lf.direct_launch, "usable", lambda t: True)
    monkeypatch.setattr(lf.direct_launch, "lookup", lambda key: None)
    monkeypatch.setattr(lf, "_quant_key", spy(lf._quant_key))
    monkeypatch.setattr(lf, "_gemm_key", spy(lf._gemm_key))
    gen = torch.Generator().manual_seed(5)
    for bias, act, out_dtype in ((None, 0, torch.bfloat16), (torch.randn(48, generator=gen).to(torch.bfloat16), 1,
                                                            torch.bfloat16), (None, 1, torch.float32)):
        x, w = activations((2, 9), 64, torch.bfloat16, gen), weights(48, 64, gen)
        prepared = kernels.prepare_weight(w, "fp8_w8a8")
        recorded.clear()
        lf.run_linear(x.reshape(-1, 64), prepared.weight, prepared.scale, bias, 0, out_dtype, act=act, act_from=16)
        quant_key, gemm_key = recorded
        assert quant_key[0] == "fp8_quant_rows" and gemm_key[0] == "fp8_gemm"
        monkeypatch.setitem(lf._gemm_layouts, gemm_key, (False, None, lf.TailSplit(1, 1, 0)))
        direct = lf.direct_call(x, prepared.weight, prepared.scale, bias, out_dtype, act, 16)
        assert direct is not None
        assert (direct.quant_key, direct.gemm_key) == (quant_key, gemm_key)
    # Layouts the checked path would copy first get no DirectCall.
    assert lf.direct_call(x.transpose(0, 1), prepared.weight, prepared.scale, None, torch.bfloat16) is None
    assert lf.direct_call(x[:0], prepared.weight, prepared.scale, None, torch.bfloat16) is None


def _recorded_direct_launches(monkeypatch):
    """linear_fp8 with direct launches recorded on the CPU instead of run: (module, [stream
    handle the launches see, settable], [(plan, args)] launched)."""
    lf = importlib.import_module("triton_accel.kernels.linear.fp8")
    monkeypatch.setattr(lf.direct_launch, "usable", lambda t: True)
    monkeypatch.setattr(lf.direct_launch, "lookup", lambda key: key[0])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    stream = [7]
    monkeypatch.setattr(lf.direct_launch, "current_stream", lambda index: stream[0])
    launched = []
    monkeypatch.setattr(lf.direct_launch, "launch", lambda plan, index, args: launched.append((plan, args)))
    return lf, stream, launched


def test_quantize_once_shares_one_quantisation_between_the_layers_that_read_x(monkeypatch):
    """Inside quantize_once(x) (Wan's q, k and v in the fused block), DirectCalls on x quantise it
    once and the GEMMs read the same e4m3 rows; per key and stream. Outside the block, or for
    another tensor (even an equal one), every call quantises; nothing is kept after the block.
    The launches are recorded on the CPU, not run (benchmarks/host_overhead.py checks DirectCall
    outputs on the GPU). Under torch.inference_mode, as ComfyUI samples."""
    lf, stream, launched = _recorded_direct_launches(monkeypatch)
    gen = torch.Generator().manual_seed(9)
    calls = []
    for n in (48, 48, 32):  # q, k, v of one width; another width reads the same activation too
        prepared = kernels.prepare_weight(weights(n, 64, gen), "fp8_w8a8")
        gemm_key = lf._gemm_key(torch.device("cpu"), 18, n, 64, torch.bfloat16, False, 0, 0, None,
                                lf.Fp8LinearWeight(prepared.weight, prepared.scale), 0, 64, 0, 0, torch.float32, None)
        monkeypatch.setitem(lf._gemm_layouts, gemm_key, (False, None, lf.TailSplit(1, 1, 0)))
        calls.append(lf.direct_call(activations((2, 9), 64, torch.bfloat16, gen), prepared.weight, prepared.scale,
                                    None, torch.bfloat16))
    assert all(c is not None for c in calls)

    def quantisations():
        return [args for plan, args in launched if plan == "fp8_quant_rows"]

    def gemm_inputs():
        return [args[0] for plan, args in launched if plan == "fp8_gemm"]

    with torch.inference_mode():
        x = activations((2, 9), 64, torch.bfloat16, gen)
        for call in calls:  # no block: three quantisations
            call(x, None)
        assert len(quantisations()) == 3
        launched.clear()
        with lf.quantize_once(x):
            for call in calls:
                call(x, None)
            assert len(quantisations()) == 1 and len(gemm_inputs()) == 3
            assert len({t.data_ptr() for t in gemm_inputs()}) == 1  # one e4m3 tensor read three times
            assert quantisations()[0][0].data_ptr() == x.data_ptr()
            calls[0](x.clone(), None)  # equal values, another tensor
            assert len(quantisations()) == 2
            stream[0] = 8
            calls[1](x, None)
            assert len(quantisations()) == 3
            calls[2](x, None)
            assert len(quantisations()) == 3
        assert lf._QUANTIZE_ONCE.get() is None
        calls[0](x, None)
        assert len(quantisations()) == 4


def test_quantize_once_with_rows_made_elsewhere(monkeypatch):
    """quantize_once(x, rows) (a fused norm kernel wrote x's e4m3 rows beside x): DirectCalls on x
    read those rows, launch no quantisation and count as readers; on another stream than the
    one the rows were written on, or with rows of another shape, they quantise as before."""
    lf, stream, launched = _recorded_direct_launches(monkeypatch)
    monkeypatch.setattr(lf, "_stream_of", lambda x: 7)  # the rows' stream (x is a CPU tensor here)
    gen = torch.Generator().manual_seed(11)
    prepared = kernels.prepare_weight(weights(48, 64, gen), "fp8_w8a8")
    gemm_key = lf._gemm_key(torch.device("cpu"), 18, 48, 64, torch.bfloat16, False, 0, 0, None,
                            lf.Fp8LinearWeight(prepared.weight, prepared.scale), 0, 64, 0, 0, torch.float32, None)
    monkeypatch.setitem(lf._gemm_layouts, gemm_key, (False, None, lf.TailSplit(1, 1, 0)))
    x = activations((2, 9), 64, torch.bfloat16, gen)
    call = lf.direct_call(x, prepared.weight, prepared.scale, None, torch.bfloat16)
    rows = (torch.zeros(18, 64, dtype=torch.float8_e4m3fn), torch.ones(18))
    with torch.inference_mode():
        with lf.quantize_once(x, rows) as scope:
            call(x, None)
            call(x, None)
            assert [plan for plan, _ in launched] == ["fp8_gemm", "fp8_gemm"] and scope.used == 2
            assert all(args[0] is rows[0] and args[4] is rows[1] for _, args in launched)  # x, its scales
            stream[0] = 8
            call(x, None)
            assert [plan for plan, _ in launched][2:] == ["fp8_quant_rows", "fp8_gemm"] and scope.used == 2
        launched.clear()
        stream[0] = 7
        with lf.quantize_once(x, (rows[0][:9], rows[1][:9])) as scope:
            call(x, None)
            assert [plan for plan, _ in launched] == ["fp8_quant_rows", "fp8_gemm"] and scope.used == 0


# ---- activation_out: the activated columns also written, contiguous (Flux's single blocks) --
# Same kernel, same epilogue: the output must equal the activation-only call bit for bit and
# the copy must equal the output's activated columns bit for bit (the CPU runs the pointer
# kernel's masked copy; the TMA one is compile-tested and checked on the GPU by
# benchmarks/host_overhead.py).

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("first", [40, 64, 0], ids=["mid_tile", "tile_edge", "all_columns"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_activation_out_copies_the_activated_columns(dtype, first, with_bias):
    gen = torch.Generator().manual_seed(first + 3)
    lead, k, n = (3, 13), 128, 160
    x, w = activations(lead, k, dtype, gen), weights(n, k, gen)
    b = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    prepared = kernels.prepare_weight(w.to(dtype), "fp8_w8a8")
    side = torch.full((*lead, n - first), float("nan"), dtype=dtype)
    kernels.core.stats.reset()
    out = kernels.linear(x, prepared, b, activation="gelu_tanh", activation_from=first, activation_out=side)
    plain = kernels.linear(x, prepared, b, activation="gelu_tanh", activation_from=first)
    assert torch.equal(out, plain)
    assert torch.equal(side, out[..., first:])
    assert kernels.core.stats.counts()[L.EPILOGUE_COUNTER] == 2


def _bad_activation_out():
    gen = torch.Generator().manual_seed(8)
    x, w = activations((6,), 64, torch.bfloat16, gen), weights(96, 64, gen)
    fp8 = kernels.prepare_weight(w, "fp8_w8a8")
    good = dict(activation="gelu_tanh", activation_from=32)
    side = torch.empty(6, 64, dtype=torch.bfloat16)
    return {
        "int8_method": (lambda: kernels.linear(x, kernels.prepare_weight(w, "int8_w8a8"), activation_out=side,
                                               **good), "only fp8_w8a8"),
        "no_activation": (lambda: kernels.linear(x, fp8, activation_out=side), "needs an activation"),
        "wrong_width": (lambda: kernels.linear(x, fp8, activation_out=torch.empty(6, 96, dtype=torch.bfloat16),
                                               **good), r"shape \(6, 64\)"),
        "wrong_dtype": (lambda: kernels.linear(x, fp8, activation_out=side.float(), **good), "contiguous"),
        "strided": (lambda: kernels.linear(x, fp8, activation_out=torch.empty(6, 128, dtype=torch.bfloat16)[:, ::2],
                                           **good), "contiguous"),
        "not_a_tensor": (lambda: kernels.linear(x, fp8, activation_out=[0.0] * 64, **good), "shape"),
    }


BAD_ACTIVATION_OUT = _bad_activation_out()


@pytest.mark.parametrize("case", list(BAD_ACTIVATION_OUT.values()), ids=list(BAD_ACTIVATION_OUT))
def test_activation_out_bad_inputs_raise_with_reason(case):
    call, words = case
    with pytest.raises(kernels.LinearInputError, match=words):
        call()


def test_activation_out_is_part_of_the_remembered_signature():
    x, prepared = _direct_case()
    side = torch.empty(3, 5, 16, dtype=torch.bfloat16)
    plain_key = L._direct_key(x, None, None, "gelu_tanh", 16)
    split_key = L._direct_key(x, None, None, "gelu_tanh", 16, side)
    assert plain_key != split_key
    assert L._direct_key(x, None, None, "gelu_tanh", 16, side.as_subclass(torch.nn.Parameter)) is not None
    fake = prepared._direct[plain_key] = _FakeDirect(torch.zeros(15, 32, dtype=torch.bfloat16))
    kernels.linear(x, prepared, activation="gelu_tanh", activation_from=16, activation_out=side)
    assert fake.calls == 0  # a call with the copy never takes the plain call's launches
