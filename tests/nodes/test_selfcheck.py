"""The Triton self-check runs a real kernel (through the interpreter on the CPU)."""
import torch

from triton_accel.kernels.core import selfcheck


def test_selfcheck_runs_a_kernel_on_the_cpu_interpreter():
    ok, message = selfcheck.triton_works(torch.device("cpu"))
    assert ok, message
    assert "ran a test kernel" in message


def test_selfcheck_refuses_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, message = selfcheck._run(torch.device("cpu"))
    assert not ok and "TRITON_INTERPRET" in message
