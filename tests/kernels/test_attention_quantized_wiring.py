"""The quantized attention backends as kernels.attention serves them (issue 11): registry names,
which kernel of the FP8 path takes which call, refusals with their reasons, the precision=
alias, and the defensive loading of kernel files that may be absent from a build.

Numerics run on the Triton interpreter at small shapes (1, 2, 40, 64): 40 tokens give partial
32-row tiles. Tolerance, vs the float32 reference on "outlier" inputs
(attention_fp8_full.accuracy_inputs: what real DiT activations look like), for fp16 and bf16:
rel. L2 <= 0.03 (issue 11's outlier target) for every quantized kernel; the FP8 Q.K kernel,
whose P.V stays in 16 bits, also <= 0.03. The kernels' own files test their accuracy in depth;
here the point is that the call reached the intended kernel and came back right.
"""
from __future__ import annotations

import importlib
import logging
import types

import pytest
import torch

from triton_accel import kernels
from triton_accel.kernels.core import gpu_rules
from triton_accel.kernels.core.gpu_rules import FP8_KERNEL_FULL, FP8_KERNEL_GLUON, FP8_KERNEL_INT8_FP8PV, FP8_KERNEL_QK

A = importlib.import_module("triton_accel.kernels.attention.dispatch")  # the module (kernels.attention is the function)
full = importlib.import_module("triton_accel.kernels.attention.fp8_full")

REL_L2 = 0.03
DTYPES = [torch.float16, torch.bfloat16]
SHAPE = (1, 2, 40, 64)


def _inputs(dtype, shape=SHAPE, kv_heads=None, seed=0):
    q, k, v = full.accuracy_inputs("outlier", shape, dtype=dtype, seed=seed)
    if kv_heads is not None:
        k, v = k[:, :kv_heads].contiguous(), v[:, :kv_heads].contiguous()
    return q, k, v


def _rel_l2(out, q, k, v, mask=None, is_causal=False):
    ref = kernels.attention_ref(q, k, v, mask, None, is_causal).float()
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.fixture(autouse=True)
def _fresh():
    kernels.core.stats.reset()
    kernels.clear_caches()
    yield
    kernels.clear_caches()


def test_backend_names_and_aliases():
    for name in ("triton_fp8", "triton_int8"):
        impl = kernels.registry.get("attention", name)
        assert impl is not None and impl.priority < 0, name  # lossy: never chosen by priority
    assert A.BACKEND_ALIASES["fp8"] == "triton_fp8" and A.BACKEND_ALIASES["int8"] == "triton_int8"
    assert gpu_rules.BACKEND_OF_PATH[gpu_rules.PATH_TRITON_INT8] == "triton_int8"
    q, k, v = _inputs(torch.float16)
    # Unnamed calls never take a lossy backend.
    assert kernels.registry.select("attention", kernels.call_facts(q, k, v)).name not in ("triton_fp8", "triton_int8")


# name -> (mask, is_causal, kv_heads, head dim, the FP8 kernel, words its refusals must name)
ROUTES = {
    "plain": (None, False, None, 64, FP8_KERNEL_FULL, []),
    "bool-mask": ("bool", False, None, 64, FP8_KERNEL_QK, ["mask"]),
    "additive-mask": ("additive", False, None, 64, FP8_KERNEL_QK, ["mask"]),
    "causal": (None, True, None, 64, FP8_KERNEL_QK, ["is_causal"]),
    "gqa": (None, False, 1, 64, FP8_KERNEL_QK, ["GQA"]),
    "head-dim-256": (None, False, None, 256, FP8_KERNEL_QK, ["head dim 256"]),
}


@pytest.mark.parametrize("case", list(ROUTES))
def test_fp8_path_routes_each_call_to_the_kernel_that_serves_it(case):
    mask_kind, is_causal, kv_heads, d, kernel, words = ROUTES[case]
    q, k, v = _inputs(torch.float16, (1, 2, 40, d), kv_heads)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(40, 40, generator=torch.Generator().manual_seed(1)) > 0.2
        mask[:, 0] = True
    elif mask_kind == "additive":
        mask = torch.randn(1, 1, 40, 40, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    got, refusals = A.fp8_route(q, k, v, mask, is_causal)
    assert got == kernel, refusals
    for word in words:
        assert any(word in why for why in refusals.values()), refusals
    out = kernels.attention(q, k, v, attn_mask=mask, is_causal=is_causal, backend="fp8")
    assert kernels.core.stats.counts().get(f"triton_fp8.{kernel}") == 1
    assert _rel_l2(out, q, k, v, mask, is_causal) <= REL_L2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int8_backend_serves_plain_and_gqa_calls(dtype):
    for kv_heads in (None, 1):
        q, k, v = _inputs(dtype, kv_heads=kv_heads)
        assert kernels.attention_support(q, k, v, backend="int8") == (True, "ok")
        out = kernels.attention(q, k, v, backend="int8")
        assert out.dtype == dtype and out.shape == q.shape
        assert _rel_l2(out, q, k, v) <= REL_L2
    assert kernels.core.stats.counts().get("triton_int8") == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_full_fp8_kernel_serves_the_plain_call(dtype):
    q, k, v = _inputs(dtype)
    out = kernels.attention(q, k, v, backend="triton_fp8")
    assert kernels.core.stats.counts().get(f"triton_fp8.{FP8_KERNEL_FULL}") == 1
    assert _rel_l2(out, q, k, v) <= REL_L2


# Calls no kernel of a quantized path serves: the nodes then take the next candidate (FP16/BF16).
REFUSED = {
    "fp8-float32": ("fp8", dict(dtype=torch.float32), "dtype torch.float32"),
    "fp8-head-dim-300": ("fp8", dict(d=300), "head dim 300"),
    "int8-mask": ("int8", dict(mask=True), "masks"),
    "int8-causal": ("int8", dict(is_causal=True), "is_causal"),
    "int8-head-dim-256": ("int8", dict(d=256), "head dim 256"),
    "int8-float32": ("int8", dict(dtype=torch.float32), "dtype torch.float32"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_calls_say_why(case):
    backend, kw, words = REFUSED[case]
    d = kw.get("d", 64)
    q, k, v = (torch.randn(1, 2, 40, d, dtype=kw.get("dtype", torch.float16)) for _ in range(3))
    mask = torch.ones(40, 40, dtype=torch.bool) if kw.get("mask") else None
    ok, reason = kernels.attention_support(q, k, v, mask, kw.get("is_causal", False), backend=backend)
    assert not ok and words in reason, reason
    with pytest.raises(kernels.BackendUnavailableError, match=words):
        kernels.attention(q, k, v, attn_mask=mask, is_causal=kw.get("is_causal", False), backend=backend)


def test_precision_is_a_thin_alias_of_backend():
    q, k, v = _inputs(torch.float16)
    assert torch.equal(kernels.attention(q, k, v, precision="int8"), kernels.attention(q, k, v, backend="int8"))
    assert torch.equal(kernels.attention(q, k, v, precision="fp16"), kernels.attention(q, k, v, backend="triton"))
    assert A.backend_of_precision("bf16") == "triton_attention" and A.backend_of_precision("fp8") == "triton_fp8"
    assert A.backend_of_precision("int8", backend="triton_int8") == "triton_int8"
    with pytest.raises(ValueError, match="names backend"):
        kernels.attention(q, k, v, precision="fp8", backend="torch")
    with pytest.raises(ValueError, match="unknown precision"):
        kernels.attention(q, k, v, precision="fp4")


# ---- kernel files absent from a build, or offering other names ---------------------------

def test_a_missing_or_different_kernel_file_is_a_reason_not_an_import_error(monkeypatch):
    monkeypatch.setattr(A, "_modules", {})
    mod, why = A._kernel_module("attention_not_in_this_build", ("anything",))
    assert mod is None and "cannot be imported" in why
    mod, why = A._kernel_module("ref", ("attention_ref", "no_such_launcher"))
    assert mod is None and "lacks no_such_launcher" in why


def test_missing_int8_module_registers_an_unavailable_backend(monkeypatch):
    monkeypatch.setattr(A, "_modules", {"int8": (None, "kernels/attention/int8.py is not shipped")})
    impl = A.int8_implementation(None)
    assert impl.name == "triton_int8" and impl.unavailable == "kernels/attention/int8.py is not shipped"
    q, k, v = _inputs(torch.float16)
    assert impl.refusal(kernels.call_facts(q, k, v)) == "kernels/attention/int8.py is not shipped"
    assert A._int8_call_refusal(q, k, v, None, False) == "kernels/attention/int8.py is not shipped"
    # ...and the FP8 path loses its INT8-Q.K variant, with the same reason.
    assert A.fp8_kernel_refusals("cpu")[FP8_KERNEL_INT8_FP8PV] == "kernels/attention/int8.py is not shipped"


def test_gluon_setting_off_keeps_the_plain_triton_kernel(monkeypatch):
    monkeypatch.setenv("TRITON_ACCEL_GLUON", "off")
    if A._kernel_module("gluon_hopper", A.GLUON_NAMES)[0] is None:
        pytest.skip(A._kernel_module("gluon_hopper", A.GLUON_NAMES)[1])
    assert A.fp8_kernel_refusals("cpu")[FP8_KERNEL_GLUON] == "TRITON_ACCEL_GLUON is off"
    monkeypatch.setenv("TRITON_ACCEL_GLUON", "auto")
    assert "sm_90" in A.fp8_kernel_refusals("cpu")[FP8_KERNEL_GLUON]  # now the device is the reason


def test_an_optional_kernel_failing_on_its_first_call_hands_over_to_the_next(monkeypatch, caplog):
    """The INT8-Q.K FP8 variant is preferred (as on an RTX 4090) but raises: the full-FP8 kernel
    serves the call, one warning is logged, and later calls go straight to it."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(kwargs.get("pv"))
        raise RuntimeError("out of resources: shared memory")

    fake = types.SimpleNamespace(attention_int8=broken, call_refusal=lambda *a: None,
                                 device_refusal=lambda *a: None, registry_constraints=lambda *a: None)
    monkeypatch.setattr(A, "_modules", {**A._modules, "int8": (fake, None)})
    monkeypatch.setattr(A, "fp8_kernel_order",
                        lambda cap, optional: ((FP8_KERNEL_INT8_FP8PV,) if FP8_KERNEL_INT8_FP8PV in optional else ())
                        + (FP8_KERNEL_FULL, FP8_KERNEL_QK))
    q, k, v = _inputs(torch.float16)
    with caplog.at_level(logging.WARNING, logger="triton_accel.kernels.attention.dispatch"):
        first = kernels.attention(q, k, v, backend="fp8")
        second = kernels.attention(q, k, v, backend="fp8")
    assert calls == ["fp8"]
    assert kernels.core.stats.counts().get(f"triton_fp8.{FP8_KERNEL_FULL}") == 2
    assert len([r for r in caplog.records if FP8_KERNEL_INT8_FP8PV in r.getMessage()]) == 1
    assert torch.equal(first, second) and _rel_l2(first, q, k, v) <= REL_L2


def test_fp8_kernels_available_reads_each_module_once_per_device(monkeypatch):
    asked = []
    real = A.fp8_kernel_refusals
    monkeypatch.setattr(A, "fp8_kernel_refusals", lambda device: asked.append(device) or real(device))
    first = A.fp8_kernels_available("cpu")
    assert A.fp8_kernels_available(torch.device("cpu")) == first and len(asked) == 1
    assert FP8_KERNEL_GLUON not in first  # Gluon has no interpreter path


@pytest.mark.parametrize("value, allowed", [(None, True), ("auto", True), ("1", True), ("on", True),
                                            ("0", False), ("off", False), ("false", False), ("", False)],
                         ids=repr)
def test_gluon_setting_reads_like_every_switch(monkeypatch, value, allowed):
    from triton_accel.kernels.core import env_settings

    if value is None:
        monkeypatch.delenv(env_settings.GLUON, raising=False)
    else:
        monkeypatch.setenv(env_settings.GLUON, value)
    assert env_settings.gluon_allowed() is allowed
