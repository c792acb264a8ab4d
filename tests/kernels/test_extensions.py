"""The extension API (kernels/core/extensions.py): validation, priority order, constraints, the guard.

An extension here is PyTorch SDPA (what the example pack registers) or a deliberately broken
function. Tolerance for an extension's output through kernels.attention against SDPA called
directly: exact (atol 0) for float32, 1e-3 for float16/bfloat16 (the same SDPA call; the only
difference allowed is the output copy into empty_output's layout, which is exact, so any
non-zero difference means the call was not handed through unchanged). The tolerance is
stated for the low-precision dtypes only because CPU SDPA may pick a different kernel for a
non-contiguous view.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import triton_accel
from triton_accel import kernels
from triton_accel.kernels.core import extensions
from triton_accel.kernels.core.device import DeviceInfo
from triton_accel.kernels.core.extensions import ExtensionCallError
from triton_accel.kernels.core.registry import BackendUnavailableError, Constraints

CPU = {"device_types": ["cpu"]}
TOL = {torch.float32: 0.0, torch.float16: 1e-3, torch.bfloat16: 1e-3}


def sdpa(q, k, v, attn_mask=None, scale=None, is_causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal,
                                          enable_gqa=k.shape[1] != q.shape[1])


@pytest.fixture(autouse=True)
def _clean():
    yield
    for entry in extensions.list_extensions():
        extensions.unregister(entry["name"])
    extensions.reset_counts()
    kernels.clear_caches()


def _qkv(b=1, h=2, lq=24, lk=24, d=64, hk=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    hk = hk or h
    return (torch.randn(b, h, lq, d, generator=g).to(dtype), torch.randn(b, hk, lk, d, generator=g).to(dtype),
            torch.randn(b, hk, lk, d, generator=g).to(dtype))


# ---- validation -----------------------------------------------------------------------------

BAD_REGISTRATIONS = {
    "uppercase-name": (dict(name="MyAttn"), "name"),
    "empty-name": (dict(name=""), "name"),
    "prefixed-name": (dict(name="ext:mine"), "name"),
    "long-name": (dict(name="a" * 49), "name"),
    "name-with-newline": (dict(name="mine\n"), "name"),
    "ours-fp8": (dict(name="fp8"), "Triton Accel's own"),
    "ours-triton": (dict(name="triton"), "Triton Accel's own"),
    "ours-backend": (dict(name="torch_sdpa"), "Triton Accel's own"),
    "ours-mode-auto": (dict(name="auto"), "Triton Accel's own"),
    "ours-path": (dict(name="pytorch"), "Triton Accel's own"),
    "fn-not-callable": (dict(fn=42), "callable"),
    "fn-wrong-signature": (dict(fn=lambda q: q), "fn must accept"),
    "priority-bool": (dict(priority=True), "priority"),
    "priority-float": (dict(priority=1.5), "priority"),
    "priority-too-high": (dict(priority=1001), "priority"),
    "lossy-not-bool": (dict(lossy="yes"), "lossy"),
    "label-two-lines": (dict(label="a\nb"), "label"),
    "constraints-unknown-key": (dict(constraints={"head_dim": (1, 64)}), "unknown constraint 'head_dim'"),
    "constraints-not-a-dict": (dict(constraints=[("dtypes", "fp16")]), "constraints must be"),
    "dtype-int8": (dict(constraints={"dtypes": ["int8"]}), "dtype 'int8'"),
    "dtypes-empty": (dict(constraints={"dtypes": []}), "must not be empty"),
    "dtypes-a-string": (dict(constraints={"dtypes": "float16"}), "must be a collection"),
    "device-type-gpu": (dict(constraints={"device_types": ["gpu"]}), "device type 'gpu'"),
    "device-with-index": (dict(constraints={"device_types": ["cuda:0"]}), "device type 'cuda:0'"),
    "vendor-unknown": (dict(constraints={"vendors": ["nvidea"]}), "vendors ['nvidea']"),
    "capability-range-reversed": (dict(constraints={"min_capability": (9, 0), "max_capability": (8, 9)}), "> max"),
    "capability-not-pair": (dict(constraints={"min_capability": 8.9}), "min_capability must be a pair"),
    "head-dims-reversed": (dict(constraints={"head_dims": (128, 64)}), "head_dims"),
    "head-dims-zero": (dict(constraints={"head_dims": (0, 64)}), "head_dims"),
    "mask-kind-unknown": (dict(constraints={"masks": ["float"]}), "masks ['float']"),
    "gqa-not-bool": (dict(constraints={"gqa": 1}), "gqa must be"),
}


@pytest.mark.parametrize("case", list(BAD_REGISTRATIONS))
def test_invalid_registrations_raise_value_error_with_the_reason(case):
    override, words = BAD_REGISTRATIONS[case]
    args = {"name": "mine", "fn": sdpa, "constraints": CPU, **override}
    with pytest.raises(ValueError, match=None) as info:
        extensions.register_attention(**args)
    assert words in str(info.value), str(info.value)
    assert extensions.list_extensions() == []


def test_constraints_accept_strings_and_our_constraints_class():
    extensions.register_attention("strings", sdpa, constraints={"dtypes": ["bf16", "torch.float16"],
                                                                 "device_types": ("cpu", "cuda")})
    extensions.register_attention("ours", sdpa, constraints=Constraints(device_types=frozenset({"cpu"}),
                                                                        head_dims=(1, 128)))
    listed = {e["name"]: e["constraints"] for e in extensions.list_extensions()}
    assert listed["strings"]["dtypes"] == ["bfloat16", "float16"] and listed["strings"]["device_types"] == ["cpu",
                                                                                                            "cuda"]
    assert listed["ours"]["head_dims"] == [1, 128]


def test_a_name_of_another_pack_is_refused_the_same_pack_replaces_it():
    first = extensions.register_attention("shared", sdpa, constraints=CPU, pack="pack_a")
    with pytest.raises(ValueError, match="already registered by 'pack_a'"):
        extensions.register_attention("shared", sdpa, constraints=CPU, pack="pack_b")
    assert extensions.register_attention("shared", sdpa, constraints=CPU, priority=5, pack="pack_a") == first
    assert [(e["pack"], e["priority"]) for e in extensions.list_extensions()] == [("pack_a", 5)]


def test_pack_defaults_to_the_calling_module():
    extensions.register_attention("caller", sdpa, constraints=CPU)
    assert extensions.list_extensions()[0]["pack"] == __name__.split(".")[0]


def test_the_package_forwards_the_api():
    """`import triton_accel` reaches the API whether that name holds the package or the API module."""
    assert triton_accel.register_attention is extensions.register_attention
    assert triton_accel.list_extensions is extensions.list_extensions
    assert triton_accel.API_VERSION == extensions.API_VERSION == 1
    with pytest.raises(AttributeError):
        triton_accel.no_such_name  # noqa: B018


# ---- priority and selection -----------------------------------------------------------------

def test_priority_orders_extensions_highest_first():
    for name, priority in (("low", -10), ("high", 50), ("mid", 0), ("mid2", 0)):
        extensions.register_attention(name, sdpa, constraints=CPU, priority=priority)
    assert extensions.paths_by_priority() == ("ext:high", "ext:mid", "ext:mid2", "ext:low")
    assert [e["name"] for e in extensions.list_extensions()] == ["high", "mid", "mid2", "low"]
    assert extensions.unregister("ext:mid") and not extensions.unregister("mid")
    assert extensions.paths_by_priority() == ("ext:high", "ext:mid2", "ext:low")


def test_an_extension_is_never_picked_by_priority_alone():
    called = []

    def spy(q, k, v, attn_mask=None, scale=None, is_causal=False):
        called.append(1)
        return sdpa(q, k, v, attn_mask, scale, is_causal)

    extensions.register_attention("eager", spy, constraints=CPU, priority=1000)
    q, k, v = _qkv()
    kernels.attention(q, k, v)  # backend=None: our registry's own choice
    assert called == []
    kernels.attention(q, k, v, backend="ext:eager")
    assert called == [1]


DEVICES = {
    "cpu": DeviceInfo("cpu", "cpu", "cpu", None, "cpu"),
    "rtx3090": DeviceInfo("cuda", "nvidia", "NVIDIA GeForce RTX 3090", (8, 6), "sm86"),
    "h200": DeviceInfo("cuda", "nvidia", "NVIDIA H200", (9, 0), "sm90"),
    "rtx5090": DeviceInfo("cuda", "nvidia", "NVIDIA GeForce RTX 5090", (12, 0), "sm120"),
    "mi300": DeviceInfo("cuda", "amd", "AMD Instinct MI300X", None, "gfx942"),
}
# constraints -> the devices they admit
DEVICE_CASES = [
    ({"device_types": ["cuda"], "min_capability": (8, 9), "max_capability": (9, 0)}, {"h200", "mi300"}),
    ({"device_types": ["cuda"], "vendors": ["nvidia"], "min_capability": (8, 0)}, {"rtx3090", "h200", "rtx5090"}),
    ({"device_types": ["cuda"], "vendors": ["amd"]}, {"mi300"}),
    ({"device_types": ["cpu", "cuda"], "max_capability": (8, 6)}, {"cpu", "rtx3090", "mi300"}),
]


@pytest.mark.parametrize("constraints, admitted", DEVICE_CASES,
                         ids=["sm89-sm90", "nvidia-sm80+", "amd", "cpu-upto-sm86"])
def test_device_constraints_capability_range_and_vendor(constraints, admitted):
    path = extensions.register_attention("dev", sdpa, constraints=constraints)
    got = {name for name, info in DEVICES.items() if extensions.device_refusal(path, info) is None}
    assert got == admitted
    assert extensions.paths_by_priority(DEVICES["h200"]) == ((path,) if "h200" in admitted else ())
    if "rtx5090" not in admitted and constraints.get("max_capability"):
        assert "> supported" in extensions.device_refusal(path, DEVICES["rtx5090"])


CALL_CASES = {
    # name: (constraints, call kwargs for _qkv / mask / causal, words of the refusal or None)
    "dtype-refused": ({"dtypes": ["float16"]}, {}, "dtype torch.float32"),
    "head-dim-refused": ({"head_dims": (1, 32)}, {}, "head dim 64 outside 1..32"),
    "mask-refused": ({"masks": ["none"]}, {"mask": "bool"}, "bool masks not supported"),
    "gqa-refused": ({"gqa": False}, {"hk": 1}, "grouped-query"),
    "causal-refused": ({"causal": False}, {"causal": True}, "is_causal not supported"),
    "all-accepted": ({}, {"mask": "additive", "hk": 1, "causal": True}, None),
}


@pytest.mark.parametrize("case", list(CALL_CASES))
def test_call_constraints_filter_what_the_extension_is_offered(case):
    constraints, call, words = CALL_CASES[case]
    path = extensions.register_attention("calls", sdpa, constraints={**CPU, **constraints})
    q, k, v = _qkv(hk=call.get("hk"))
    mask = {None: None, "bool": torch.ones(1, 1, 24, 24, dtype=torch.bool),
            "additive": torch.zeros(1, 1, 24, 24)}[call.get("mask")]
    ok, reason = kernels.attention_support(q, k, v, mask, is_causal=call.get("causal", False), backend=path)
    refusal = extensions.call_refusal(path, q, k, v, mask, call.get("causal", False))
    if words is None:
        assert ok and refusal is None, reason
    else:
        assert not ok and words in reason and words in refusal, (reason, refusal)
        with pytest.raises(BackendUnavailableError, match=words):
            kernels.attention(q, k, v, attn_mask=mask, is_causal=call.get("causal", False), backend=path)


SHAPES = {"flux-like": dict(h=4, lq=40, lk=40, d=128), "cross-77": dict(h=2, lq=32, lk=77, d=64),
          "gqa-6-2": dict(h=6, hk=2, lq=20, lk=20, d=96), "head-dim-40": dict(h=8, lq=16, lk=16, d=40)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("edge", ["plain", "additive-mask", "causal"])
def test_registered_extension_serves_calls_by_name(dtype, shape, edge):
    path = extensions.register_attention("sdpa-ext", sdpa, constraints={**CPU, "dtypes": ["fp32", "fp16", "bf16"]})
    q, k, v = _qkv(dtype=dtype, **SHAPES[shape])
    mask = torch.randn(1, 1, q.shape[2], k.shape[2]).to(dtype) if edge == "additive-mask" else None
    causal = edge == "causal"
    out = kernels.attention(q, k, v, attn_mask=mask, is_causal=causal, backend=path)
    ref = sdpa(q, k, v, mask, None, causal)
    assert out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=0 if dtype == torch.float32 else 1e-3)
    assert extensions.list_extensions()[0]["served"] == 1


# ---- the guard: a failing extension raises ExtensionCallError, remembered per signature -------

def _broken(kind):
    calls = []

    def fn(q, k, v, attn_mask=None, scale=None, is_causal=False):
        calls.append(1)
        out = sdpa(q, k, v, attn_mask, scale, is_causal)
        if kind == "raises":
            raise RuntimeError("CUDA error: an illegal memory access\nmore lines")
        if kind == "wrong-shape":
            return out[..., :-1]
        if kind == "wrong-dtype":
            return out.double()
        if kind == "nan":
            out[0, 0, 0, 0] = math.nan
            return out
        if kind == "inf":
            out[0, 1, 2, 3] = math.inf
            return out
        if kind == "not-a-tensor":
            return out.numpy()
        return out

    return fn, calls


BROKEN = {"raises": "raised RuntimeError: CUDA error: an illegal memory access", "wrong-shape": "returned shape",
          "wrong-dtype": "returned dtype torch.float64", "nan": "NaN or Inf", "inf": "NaN or Inf",
          "not-a-tensor": "returned ndarray"}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_failures_raise_extension_call_error_and_are_remembered(kind):
    fn, calls = _broken(kind)
    path = extensions.register_attention("broken", fn, constraints=CPU)
    q, k, v = _qkv()
    with pytest.raises(ExtensionCallError) as info:
        kernels.attention(q, k, v, backend=path)
    assert BROKEN[kind] in info.value.reason and "more lines" not in info.value.reason
    assert extensions.known_failure(path, q, k, v) == info.value.reason
    with pytest.raises(ExtensionCallError):
        kernels.attention(q, k, v, backend=path)
    assert len(calls) == 1, "a signature that failed is not tried again"
    entry = extensions.list_extensions()[0]
    assert entry["served"] == 0 and entry["handed_back"] == {info.value.reason: 2}
    # Another signature is tried afresh; a re-registration forgets the failures.
    q2, k2, v2 = _qkv(lq=8, lk=8)
    with pytest.raises(ExtensionCallError):
        kernels.attention(q2, k2, v2, backend=path)
    extensions.register_attention("broken", sdpa, constraints=CPU)
    assert extensions.known_failure(path, q, k, v) is None
    torch.testing.assert_close(kernels.attention(q, k, v, backend=path), sdpa(q, k, v), atol=0, rtol=0)


def test_the_value_check_runs_once_per_signature():
    """NaN on a later call of a signature that passed is not caught here (a check per call would
    synchronise the GPU): the nodes' auto guard and the first-call check are the contract."""
    state = {"n": 0}

    def late_nan(q, k, v, attn_mask=None, scale=None, is_causal=False):
        state["n"] += 1
        out = sdpa(q, k, v)
        if state["n"] > 1:
            out[0, 0, 0, 0] = math.nan
        return out

    path = extensions.register_attention("late", late_nan, constraints=CPU)
    q, k, v = _qkv()
    kernels.attention(q, k, v, backend=path)
    assert torch.isnan(kernels.attention(q, k, v, backend=path)).any()


def test_unregistered_extension_is_refused_by_name():
    path = extensions.register_attention("gone", sdpa, constraints=CPU)
    q, k, v = _qkv()
    kernels.attention(q, k, v, backend=path)  # its decision is remembered by the dispatcher
    extensions.unregister("gone")
    with pytest.raises((ExtensionCallError, BackendUnavailableError)):
        kernels.attention(q, k, v, backend=path)
    assert kernels.attention_support(q, k, v, backend=path) == (False, f"unknown backend {path!r}")


def test_re_registering_with_narrower_constraints_takes_effect_at_once():
    path = extensions.register_attention("narrowed", sdpa, constraints=CPU)
    q, k, v = _qkv()
    kernels.attention(q, k, v, backend=path)  # remembered by the dispatcher
    extensions.register_attention("narrowed", sdpa, constraints={**CPU, "head_dims": (1, 32)})
    with pytest.raises(BackendUnavailableError, match="head dim 64 outside 1..32"):
        kernels.attention(q, k, v, backend=path)


def test_calls_from_many_threads_while_the_extension_is_replaced():
    """MultiGPU work units call attention from a thread per GPU; a pack may re-register meanwhile.
    Every call either serves (SDPA's exact output) or raises one of the two documented errors."""
    import threading

    path = extensions.register_attention("threaded", sdpa, constraints=CPU, pack="p")
    q, k, v = _qkv(lq=16, lk=16, d=32)
    ref = sdpa(q, k, v)
    unexpected, served = [], []

    def caller():
        for _ in range(25):
            try:
                out = kernels.attention(q, k, v, backend=path)
            except (ExtensionCallError, BackendUnavailableError):
                continue
            except Exception as e:  # noqa: BLE001 - the test reports anything else
                unexpected.append(repr(e))
                continue
            served.append(torch.equal(out, ref))

    threads = [threading.Thread(target=caller) for _ in range(6)]
    for t in threads:
        t.start()
    for i in range(25):
        extensions.register_attention("threaded", sdpa, constraints=CPU, priority=i, pack="p")
        if i % 5 == 0:
            extensions.unregister("threaded")
            extensions.register_attention("threaded", sdpa, constraints=CPU, pack="p")
    for t in threads:
        t.join()
    assert unexpected == [] and served and all(served)


# ---- Linear extensions (register_linear) ----------------------------------------------------
#
# Tolerance for a Linear extension through run_linear against F.linear called directly: exact
# (atol 0) — the guard hands the extension's own output back unchanged, so any difference means
# the call was altered on the way.

def f_linear(x, weight, bias):
    return F.linear(x, weight, bias)


def _xwb(tokens=24, k=64, n=48, lead=(2,), dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, tokens, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


BAD_LINEAR_REGISTRATIONS = {
    "ours-linear-mode": (dict(name="fp8_weight_only"), "Triton Accel's own"),
    "ours-linear-method": (dict(name="int8_w8a8"), "Triton Accel's own"),
    "ours-linear-word": (dict(name="linear"), "Triton Accel's own"),
    "fn-attention-signature": (dict(fn=lambda x: x), "fn must accept fn(x, weight, bias)"),
    "attention-key": (dict(constraints={"head_dims": (1, 64)}), "unknown constraint 'head_dims'"),
    "in-features-reversed": (dict(constraints={"in_features": (128, 64)}), "in_features"),
    "out-features-zero": (dict(constraints={"out_features": (0, 64)}), "out_features must be a pair"),
    "multiple-zero": (dict(constraints={"in_features_multiple_of": 0}), "in_features_multiple_of must be"),
    "multiple-float": (dict(constraints={"out_features_multiple_of": 8.0}), "out_features_multiple_of must be"),
    "min-tokens-bool": (dict(constraints={"min_tokens": True}), "min_tokens must be"),
    "dtype-fp8": (dict(constraints={"dtypes": ["float8_e4m3fn"]}), "dtype 'float8_e4m3fn'"),
    "vendor-unknown": (dict(constraints={"vendors": ["nvidea"]}), "vendors ['nvidea']"),
    "priority-too-low": (dict(priority=-1001), "priority"),
}


@pytest.mark.parametrize("case", list(BAD_LINEAR_REGISTRATIONS))
def test_invalid_linear_registrations_raise_value_error_with_the_reason(case):
    override, words = BAD_LINEAR_REGISTRATIONS[case]
    args = {"name": "mine", "fn": f_linear, "constraints": CPU, **override}
    with pytest.raises(ValueError) as info:
        extensions.register_linear(**args)
    assert words in str(info.value), str(info.value)
    assert extensions.list_extensions() == []


def test_one_name_space_for_both_kinds_and_unregister_covers_both():
    attn = extensions.register_attention("shared-name", sdpa, constraints=CPU, pack="p")
    with pytest.raises(ValueError, match="already registered as attention"):
        extensions.register_linear("shared-name", f_linear, constraints=CPU, pack="p")
    lin = extensions.register_linear("lin", f_linear, constraints=CPU, priority=3, pack="p")
    listed = {e["path"]: e for e in extensions.list_extensions()}
    assert listed[attn]["kind"] == "attention" and listed[lin]["kind"] == "linear"
    assert listed[lin]["constraints"] == {"device_types": ["cpu"], "vendors": None, "min_capability": None,
                                          "max_capability": None, "fp8": False,
                                          "dtypes": ["bfloat16", "float16", "float32"],
                                          "in_features": [1, 1 << 20], "out_features": [1, 1 << 20],
                                          "in_features_multiple_of": 1, "out_features_multiple_of": 1,
                                          "min_tokens": 1}
    assert [e["path"] for e in extensions.list_extensions("linear")] == [lin]
    assert extensions.paths_by_priority() == (attn,) and extensions.paths_by_priority(kind="linear") == (lin,)
    # A Linear extension is no attention backend, and the other way round.
    q, k, v = _qkv()
    with pytest.raises(BackendUnavailableError):
        kernels.attention(q, k, v, backend=lin)
    x, w, b = _xwb()
    with pytest.raises(BackendUnavailableError, match="unknown Linear extension"):
        extensions.run_linear(attn, x, w, b)
    assert extensions.unregister(lin) and extensions.unregister("shared-name")
    assert extensions.list_extensions() == []


def test_the_package_forwards_register_linear():
    assert triton_accel.register_linear is extensions.register_linear
    assert triton_accel.reset_counts is extensions.reset_counts
    assert triton_accel.LinearConstraints is extensions.LinearConstraints
    assert triton_accel.API_VERSION == 1  # register_linear is an addition: hasattr(api, "register_linear")


LINEAR_DEVICE_CASES = [
    ({"device_types": ["cuda"], "min_capability": (8, 9)}, {"h200", "rtx5090", "mi300"}),
    ({"device_types": ["cuda"], "vendors": ["nvidia"], "max_capability": (8, 6)}, {"rtx3090"}),
    # fp8: FP8 tensor cores on GPUs (gpu_rules: sm_89+, OCP e4m3 on AMD); the CPU is not judged by
    # tensor cores (registry.Constraints' rule for attention too).
    ({"device_types": ["cpu", "cuda"], "fp8": True}, {"cpu", "h200", "rtx5090"}),
]


@pytest.mark.parametrize("constraints, admitted", LINEAR_DEVICE_CASES, ids=["sm89+", "nvidia-upto-sm86", "fp8"])
def test_linear_device_constraints(constraints, admitted):
    path = extensions.register_linear("dev", f_linear, constraints=constraints)
    got = {name for name, info in DEVICES.items() if extensions.device_refusal(path, info) is None}
    assert got == admitted
    assert extensions.paths_by_priority(DEVICES["h200"], kind="linear") == ((path,) if "h200" in admitted else ())


LINEAR_CALL_CASES = {
    # name: (constraints, _xwb kwargs, words of the refusal or None)
    "dtype-refused": ({"dtypes": ["bf16"]}, {}, "dtype torch.float32 not supported"),
    "in-range": ({"in_features": (1, 32)}, {}, "in_features 64 outside 1..32"),
    "out-range": ({"out_features": (64, 128)}, {}, "out_features 48 outside 64..128"),
    "in-multiple": ({"in_features_multiple_of": 128}, {}, "in_features 64 is not a multiple of 128"),
    "out-multiple": ({"out_features_multiple_of": 32}, {}, "out_features 48 is not a multiple of 32"),
    "min-tokens-all-leading-dims": ({"min_tokens": 49}, {"tokens": 24, "lead": (2,)}, "48 tokens < min_tokens 49"),
    "accepted": ({"in_features_multiple_of": 16, "out_features_multiple_of": 16, "min_tokens": 48}, {}, None),
}


@pytest.mark.parametrize("case", list(LINEAR_CALL_CASES))
def test_linear_call_constraints_filter_what_the_extension_is_offered(case):
    constraints, call, words = LINEAR_CALL_CASES[case]
    fn_calls = []
    path = extensions.register_linear("calls", lambda x, w, b: fn_calls.append(1) or F.linear(x, w, b),
                                      constraints={**CPU, **constraints})
    x, w, b = _xwb(**call)
    refusal = extensions.linear_call_refusal(path, x, w, b)
    if words is None:
        assert refusal is None
        torch.testing.assert_close(extensions.run_linear(path, x, w, b), F.linear(x, w, b), atol=0, rtol=0)
        assert fn_calls == [1]
    else:
        assert refusal is not None and words in refusal, refusal
        assert extensions.linear_shape_refusal(path, x, tuple(w.shape), True) == refusal
        with pytest.raises(BackendUnavailableError, match=words):
            extensions.run_linear(path, x, w, b)
        assert fn_calls == []


def test_linear_inputs_the_extension_is_never_offered():
    path = extensions.register_linear("inputs", f_linear, constraints=CPU)
    x, w, b = _xwb()
    for args, words in (((x, w.half(), b), "the weight must be in x's dtype"), ((x, w, b[:-1]), "bias must be"),
                        ((x[..., :-1], w, b), "do not make a Linear call")):
        with pytest.raises(BackendUnavailableError, match=words):
            extensions.run_linear(path, *args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [dict(tokens=24, k=64, n=48), dict(tokens=1, k=32, n=96, lead=()),
                                   dict(tokens=7, k=40, n=24, lead=(2, 3))], ids=["2d-batch", "one-token", "4d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_registered_linear_serves_calls_by_name(dtype, shape, bias):
    path = extensions.register_linear("f-linear", f_linear, constraints={**CPU, "dtypes": ["fp32", "fp16", "bf16"]})
    x, w, b = _xwb(dtype=dtype, bias=bias, **shape)
    out = extensions.run_linear(path, x, w, b)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=0, rtol=0)
    assert out.shape == (*x.shape[:-1], w.shape[0]) and out.dtype == dtype
    assert extensions.list_extensions()[0]["served"] == 1


def _broken_linear(kind):
    calls = []

    def fn(x, weight, bias):
        calls.append(1)
        out = F.linear(x, weight, bias)
        if kind == "raises":
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED\nmore lines")
        if kind == "wrong-shape":
            return out[..., :-1]
        if kind == "wrong-dtype":
            return out.double()
        if kind == "wrong-device":
            return out.to("meta")
        if kind == "nan":
            out[0, 0, 0] = math.nan
            return out
        if kind == "inf":
            out[1, 2, 3] = -math.inf
            return out
        if kind == "not-a-tensor":
            return out.tolist()
        return out

    return fn, calls


BROKEN_LINEAR = {"raises": "raised RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED", "wrong-shape": "returned shape",
                 "wrong-dtype": "returned dtype torch.float64", "wrong-device": "returned a tensor on meta",
                 "nan": "NaN or Inf", "inf": "NaN or Inf", "not-a-tensor": "returned list"}


@pytest.mark.parametrize("kind", list(BROKEN_LINEAR))
def test_linear_failures_raise_extension_call_error_and_are_remembered(kind):
    fn, calls = _broken_linear(kind)
    path = extensions.register_linear("broken", fn, constraints=CPU)
    x, w, b = _xwb()
    with pytest.raises(ExtensionCallError) as info:
        extensions.run_linear(path, x, w, b)
    assert BROKEN_LINEAR[kind] in info.value.reason and "more lines" not in info.value.reason
    assert extensions.linear_call_refusal(path, x, w, b) == info.value.reason
    with pytest.raises(ExtensionCallError):
        extensions.run_linear(path, x, w, b)
    assert len(calls) == 1, "a signature that failed is not tried again"
    entry = extensions.list_extensions()[0]
    assert entry["served"] == 0 and entry["handed_back"] == {info.value.reason: 2}
    # Another signature is tried afresh; a re-registration forgets the failures.
    x2, _, _ = _xwb(tokens=5)
    with pytest.raises(ExtensionCallError):
        extensions.run_linear(path, x2, w, b)
    assert len(calls) == 2
    extensions.register_linear("broken", f_linear, constraints=CPU)
    assert extensions.linear_call_refusal(path, x, w, b) is None
    torch.testing.assert_close(extensions.run_linear(path, x, w, b), F.linear(x, w, b), atol=0, rtol=0)


def test_reset_counts_zeroes_both_kinds():
    attn = extensions.register_attention("a", sdpa, constraints=CPU)
    lin = extensions.register_linear("l", _broken_linear("nan")[0], constraints=CPU)
    q, k, v = _qkv()
    kernels.attention(q, k, v, backend=attn)
    x, w, b = _xwb()
    with pytest.raises(ExtensionCallError):
        extensions.run_linear(lin, x, w, b)
    counts = {e["path"]: (e["served"], sum(e["handed_back"].values())) for e in extensions.list_extensions()}
    assert counts == {attn: (1, 0), lin: (0, 1)}
    extensions.reset_counts()
    assert all(e["served"] == 0 and e["handed_back"] == {} for e in extensions.list_extensions())


def test_linear_calls_from_many_threads_while_the_extension_is_replaced():
    """MultiGPU work units call Linear layers from a thread per GPU; a pack may re-register
    meanwhile. Every call either serves (F.linear's exact output) or raises one of the two
    documented errors, and nothing else."""
    import threading

    path = extensions.register_linear("threaded", f_linear, constraints=CPU, pack="p")
    x, w, b = _xwb(tokens=8, k=32, n=16)
    ref = F.linear(x, w, b)
    unexpected, served = [], []

    def caller():
        for _ in range(40):
            try:
                out = extensions.run_linear(path, x, w, b)
            except (ExtensionCallError, BackendUnavailableError):
                continue
            except Exception as e:  # noqa: BLE001 - the test reports anything else
                unexpected.append(repr(e))
                continue
            served.append(torch.equal(out, ref))

    threads = [threading.Thread(target=caller) for _ in range(6)]
    for t in threads:
        t.start()
    for i in range(40):
        extensions.register_linear("threaded", f_linear, constraints=CPU, priority=i, pack="p")
        if i % 5 == 0:
            extensions.unregister("threaded")
            extensions.register_linear("threaded", f_linear, constraints=CPU, pack="p")
    for t in threads:
        t.join()
    assert unexpected == [] and served and all(served)
