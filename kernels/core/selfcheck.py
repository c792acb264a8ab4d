"""A tiny kernel compiled and run once per device: does Triton really work here?

Import, compile (a C compiler, the CUDA toolchain, the Python headers) and launch are
where broken installs fail, so all three are exercised; the result is cached per device
for the life of the process.
"""
from __future__ import annotations

import logging
import threading

import torch

from . import cache_registry
from . import device as _device

log = logging.getLogger("triton_accel.kernels.core.selfcheck")  # not __name__: the clone's folder name

_results: dict[str, tuple[bool, str]] = {}
_lock = threading.Lock()
cache_registry.register("kernels.core.selfcheck.results", _results.clear)


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _axpb_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m)
        tl.store(out_ptr + offs, x * 2.0 + 1.0, mask=m)

    return _axpb_kernel


def _run(device: torch.device) -> tuple[bool, str]:
    from .kernel_common import LAUNCH_OPTIONS  # here: an import line above _kernel() would move its line numbers

    err = _device.triton_import_error()
    if err:
        return False, err
    if device.type == "cpu" and not _device.interpreter_enabled():
        return False, "Triton runs CPU tensors only through TRITON_INTERPRET=1"
    try:
        kernel = _kernel()
        x = torch.arange(100, dtype=torch.float32, device=device)
        out = torch.full_like(x, float("nan"))
        kernel[(2,)](x, out, x.numel(), BLOCK=64, **LAUNCH_OPTIONS)
        if device.type != "cpu":
            torch.cuda.synchronize(device)
        if not torch.equal(out.cpu(), x.cpu() * 2 + 1):
            return False, "Triton ran a test kernel but produced wrong numbers"
    except Exception as e:  # compile errors, DLL errors, driver errors all end up here
        log.warning("Triton self-check failed on %s", device, exc_info=True)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return False, f"Triton failed to run a test kernel: {type(e).__name__}: {first[:300]}"
    return True, "Triton compiled and ran a test kernel"


def triton_works(device: torch.device | str) -> tuple[bool, str]:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    with _lock:
        if key not in _results:
            _results[key] = _run(device)
        return _results[key]
