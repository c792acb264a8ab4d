"""The extension API (kernels/extensions.py): validation, priority order, constraints, the guard.

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
from triton_accel.kernels import extensions
from triton_accel.kernels.device import DeviceInfo
from triton_accel.kernels.extensions import ExtensionCallError
from triton_accel.kernels.registry import BackendUnavailableError, Constraints

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
