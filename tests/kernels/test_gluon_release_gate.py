"""The Gluon Hopper kernels run only on the Triton minors where they ran right on a GPU.

Gluon is experimental: on a minor where a kernel only compiles (tests/compile, tests/versions)
its output can still be wrong (session 45: the FP8 kernel under Triton 3.9's front end on an H100,
benchmarks/RESULTS.md). gpu_rules.GLUON_GPU_VERIFIED lists the minors each kernel was checked
on; anything else is refused with a reason the Settings node shows, and the FP8 path's next
kernel (the plain-Triton full-FP8 one) serves.
"""
from __future__ import annotations

import importlib

import pytest
import torch

rules = importlib.import_module("triton_accel.kernels.core.gpu_rules")
glu = importlib.import_module("triton_accel.kernels.attention.gluon_hopper")
glb = importlib.import_module("triton_accel.kernels.attention.gluon_hopper_bf16")
device_mod = importlib.import_module("triton_accel.kernels.core.device")
A = importlib.import_module("triton_accel.kernels.attention.dispatch")
H100 = device_mod.DeviceInfo("cuda", "nvidia", "NVIDIA H100 80GB HBM3", (9, 0), "sm90")

CASES = [(kernel, f"{a}.{b}.0", True) for kernel, minors in rules.GLUON_GPU_VERIFIED.items() for a, b in minors]
CASES += [(kernel, version, False) for kernel in rules.GLUON_GPU_VERIFIED
          for version in ("3.4.0", "3.7.1", "3.8.0", "3.9.0")]


def test_each_kernel_is_verified_on_the_device_release():
    assert set(rules.GLUON_GPU_VERIFIED) == {"fp8", "bf16"}
    assert (3, 6) in rules.GLUON_GPU_VERIFIED["fp8"] and (3, 6) in rules.GLUON_GPU_VERIFIED["bf16"]


@pytest.mark.parametrize("kernel, version, runs", CASES, ids=[f"{k}-{v}" for k, v, _ in CASES])
def test_release_rule(kernel, version, runs):
    rule = rules.gluon_release_refusal(kernel, version)
    if runs:
        assert rule is None
        return
    assert rule is not None and version in rule.reason and "plain-Triton" in rule.reason, rule
    assert rule.code == "GLUON_NOT_RUN_ON_TRITON", rule
    for a, b in rules.GLUON_GPU_VERIFIED[kernel]:
        assert f"{a}.{b}" in rule.reason, rule


@pytest.fixture
def on_h100(monkeypatch):
    if glu.gluon_api_refusal() is not None:
        pytest.skip(f"installed Triton refused first: {glu.gluon_api_refusal()}")
    monkeypatch.setattr(device_mod, "describe", lambda device=None: H100)

    def with_triton(version):
        monkeypatch.setattr(device_mod, "triton_version", lambda: version)
        glu._api_refusal_for.cache_clear()
        A._fp8_optional.clear()
    yield with_triton
    glu._api_refusal_for.cache_clear()
    A._fp8_optional.clear()


@pytest.mark.parametrize("kernel, version, runs", CASES, ids=[f"{k}-{v}" for k, v, _ in CASES])
def test_an_h100_runs_each_gluon_kernel_only_where_it_was_checked(on_h100, kernel, version, runs):
    on_h100(version)
    refusal = glu.gluon_refusal(torch.device("cuda", 0)) if kernel == "fp8" else glb.gluon_bf16_refusal(
        torch.device("cuda", 0))
    expected = rules.gluon_release_refusal(kernel, version)
    assert refusal == (None if runs else expected.reason)


def test_a_refused_gluon_fp8_kernel_hands_the_fp8_path_to_the_plain_triton_kernel(on_h100):
    on_h100("3.8.0")  # a minor the FP8 kernel has not run on
    refusals = A.fp8_kernel_refusals(torch.device("cuda", 0))
    assert refusals[rules.FP8_KERNEL_GLUON] == rules.gluon_release_refusal("fp8", "3.8.0").reason
    optional = A.fp8_kernels_available(torch.device("cuda", 0))
    assert rules.FP8_KERNEL_GLUON not in optional
    assert rules.fp8_kernel_order((9, 0), optional)[0] == rules.FP8_KERNEL_FULL
    on_h100("3.6.0")
    optional = A.fp8_kernels_available(torch.device("cuda", 0))
    assert rules.fp8_kernel_order((9, 0), optional)[0] == rules.FP8_KERNEL_GLUON
