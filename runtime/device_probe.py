"""Probe the facts of one device (what kernels/core/gpu_rules.py decides from). Cached per device."""
from __future__ import annotations

import threading

import torch

from .. import kernels
from ..kernels.core import cache_registry
from ..kernels.core import selfcheck
from ..kernels.attention.dispatch import fp8_kernels_available
from ..kernels.core.gpu_rules import BACKEND_OF_PATH, Facts

_cache: dict[str, Facts] = {}
_lock = threading.Lock()
cache_registry.register("runtime.device_probe", _cache.clear)


def _normalise(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def implemented_paths() -> frozenset[str]:
    """Attention paths this build ships and can run at all (Triton importable)."""
    paths = set()
    for path, name in BACKEND_OF_PATH.items():
        impl = kernels.registry.get("attention", name)
        if impl is not None and not impl.unavailable:
            paths.add(path)
    return frozenset(paths)


def cached_facts(device) -> Facts | None:
    """The facts probe() found for this device, if it ran already (nothing is launched)."""
    with _lock:
        return _cache.get(str(_normalise(device)))


def probe(device, selfcheck_kernel: bool = True) -> Facts:
    """selfcheck_kernel=False: no test kernel (and nothing cached), for the startup line and
    the status route, which must not compile or launch anything on the user's GPU."""
    device = _normalise(device)
    key = str(device)
    with _lock:
        if key in _cache:
            return _cache[key]
    info = kernels.describe(device)
    vram = 0
    if device.type == "cuda":
        vram = torch.cuda.get_device_properties(device).total_memory
    vendor = {"nvidia": "nvidia", "amd": "amd", "cpu": "cpu"}.get(info.vendor, "intel" if device.type == "xpu" else "other")
    triton_version = kernels.triton_version()
    triton_error = kernels.triton_import_error()
    if triton_error is None and triton_version is not None and selfcheck_kernel:
        # Only where our kernels could run: CUDA/ROCm GPUs, CPU tensors under the interpreter
        # (an Intel XPU is refused by gpu_rules whatever a test kernel would do there).
        runs_ours = device.type == "cuda" or (device.type == "cpu" and kernels.interpreter_enabled())
        ok, message = selfcheck.triton_works(device) if runs_ours else (True, "")
        triton_error = None if ok else message
    arch = info.arch
    if vendor == "nvidia" and info.capability:
        arch = f"sm_{info.capability[0]}{info.capability[1]}"
    facts = Facts(
        device=key, vendor=vendor, name=info.name, capability=info.capability if vendor == "nvidia" else None,
        arch=arch, vram_bytes=vram, torch_version=torch.__version__.split("+")[0], torch_cuda=torch.version.cuda,
        triton_version=triton_version, triton_error=triton_error,
        interpreter=kernels.interpreter_enabled(), implemented=implemented_paths(),
        fp8_kernels=fp8_kernels_available(device),  # which FP8 kernel runs: Gluon, INT8 Q.K + FP8 P.V
    )
    if selfcheck_kernel:
        with _lock:
            _cache[key] = facts
    return facts


def summary(facts: Facts) -> str:
    parts = [facts.name or facts.device]
    if facts.vendor == "nvidia" and facts.capability:
        parts.append(f"sm_{facts.capability[0]}{facts.capability[1]}")
    elif facts.arch and facts.arch != parts[0]:
        parts.append(facts.arch)
    if facts.vram_bytes:
        parts.append(f"{facts.vram_bytes / 2**30:.0f} GiB")
    parts.append(f"torch {facts.torch_version}")
    parts.append(f"Triton {facts.triton_version}" if facts.triton_version else "no Triton")
    return ", ".join(parts)
