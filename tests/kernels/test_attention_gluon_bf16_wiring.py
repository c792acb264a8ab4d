"""How the "triton_attention" backend hands calls to the Gluon BF16 kernel (sm_90 only).

The kernel itself needs an H100/H200 (its figures: benchmarks/RESULTS.md);
here a stand-in module checks the wiring: who is asked, what happens when the kernel fails on
its first call (logged once, the device keeps the plain-Triton kernel) or after it has run
(a real error, raised), and the TRITON_ACCEL_GLUON switch.
"""
from __future__ import annotations

import importlib
import types

import pytest
import torch

from triton_accel.kernels import clear_caches

from triton_accel.kernels.core import stats

A = importlib.import_module("triton_accel.kernels.attention.dispatch")  # the module (kernels.attention is the function)


class _FakeGluon(types.SimpleNamespace):
    pass


class _Unsupported(RuntimeError):
    pass


def _fake(fail=None, refuse_call=None, refuse_device=None):
    calls = []

    def attention_gluon_bf16(q, k, v, scale=None):
        if refuse_call:  # as the real launcher: it checks the call before launching
            raise _Unsupported(refuse_call)
        calls.append(scale)
        if fail is not None:
            raise fail
        return torch.full_like(q, 7.0)

    mod = _FakeGluon(attention_gluon_bf16=attention_gluon_bf16, GluonUnsupportedError=_Unsupported,
                     gluon_bf16_refusal=lambda device: refuse_device,
                     call_refusal=lambda q, k, v, attn_mask=None, is_causal=False: refuse_call)
    return mod, calls


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 40, 64, generator=g, dtype=torch.float16) for _ in range(3))


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    clear_caches()
    stats.reset()
    yield
    clear_caches()


def _install(monkeypatch, mod):
    A._modules["gluon_hopper_bf16"] = (mod, None)


def test_missing_module_is_a_reason_not_an_error(qkv, monkeypatch):
    A._modules["gluon_hopper_bf16"] = (None, "kernels/attention/gluon_hopper_bf16.py cannot be imported")
    assert "cannot be imported" in A.gluon_bf16_refusal(*qkv)


def test_real_module_refuses_cpu_with_a_reason(qkv):
    reason = A.gluon_bf16_refusal(*qkv)
    assert reason and ("sm_90" in reason or "cuda" in reason.lower() or "Gluon" in reason or "Triton" in reason)


@pytest.mark.parametrize("off", ["0", "off", "false"])
def test_switch_off_refuses(qkv, monkeypatch, off):
    mod, _ = _fake()
    _install(monkeypatch, mod)
    monkeypatch.setenv("TRITON_ACCEL_GLUON", off)
    assert "TRITON_ACCEL_GLUON is off" in A.gluon_bf16_refusal(*qkv)


def test_accepted_call_runs_the_kernel_and_counts(qkv, monkeypatch):
    mod, calls = _fake()
    _install(monkeypatch, mod)
    assert A.gluon_bf16_refusal(*qkv) is None
    out = A._gluon_bf16(*qkv, 0.125)
    assert calls == [0.125] and torch.all(out == 7.0)
    assert stats.counts().get("triton_attention.gluon_bf16") == 1


def test_layout_refused_per_call_goes_to_flash_without_disabling(qkv, monkeypatch):
    mod, calls = _fake(refuse_call="q's strides are not 16-byte multiples")
    _install(monkeypatch, mod)
    assert A._gluon_bf16(*qkv, None) is None
    assert calls == [] and not A._gluon_bf16_disabled


def test_first_call_failure_disables_the_device_once(qkv, monkeypatch, caplog):
    mod, calls = _fake(fail=RuntimeError("PTX JIT compilation failed"))
    _install(monkeypatch, mod)
    with caplog.at_level("WARNING", logger="triton_accel.kernels.attention.dispatch"):
        assert A._gluon_bf16(*qkv, None) is None
    assert "PTX JIT" in A._gluon_bf16_disabled[qkv[0].device]
    assert "failed on its first call" in A.gluon_bf16_refusal(*qkv)
    assert sum("Gluon BF16" in r.getMessage() for r in caplog.records) == 1


def test_failure_after_a_success_is_raised(qkv, monkeypatch):
    mod, _ = _fake()
    _install(monkeypatch, mod)
    A._gluon_bf16(*qkv, None)
    mod.attention_gluon_bf16 = lambda q, k, v, scale=None: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("oom"))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        A._gluon_bf16(*qkv, None)


def test_interpreter_calls_never_route_to_gluon(qkv, monkeypatch):
    mod, calls = _fake()
    _install(monkeypatch, mod)
    out = A.attention(*qkv, backend="triton")
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.float() for t in qkv))
    assert calls == [] and (out.float() - ref).norm() / ref.norm() < 2e-3  # fp16: rounding of the inputs' dtype
    assert "triton_attention.gluon_bf16" not in stats.counts()
