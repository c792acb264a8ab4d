"""What a device is and what it can do, as plain data.

Kept free of Triton so the registry can explain itself on machines without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from . import cache_registry, env_settings


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cuda", "xpu", "cpu", ...
    vendor: str  # "nvidia", "amd", "intel", "cpu", "other"
    name: str
    capability: tuple[int, int] | None  # (major, minor) on NVIDIA; gfx arch lives in `arch` on AMD
    arch: str  # "sm90", "gfx942", "xpu", "cpu"; kernel_common.arch_family maps it to a config family


def triton_version() -> str | None:
    try:
        import triton
    except Exception:
        return None
    return getattr(triton, "__version__", "unknown")


def triton_import_error() -> str | None:
    """Why Triton cannot be imported, or None when it can."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # ImportError, but also broken installs raising anything
        return f"Triton is not installed ({type(e).__name__}: {e})" if isinstance(e, ImportError) else (
            f"Triton failed to import: {type(e).__name__}: {e}")
    return None


def interpreter_enabled() -> bool:
    return env_settings.interpreter_enabled()


@lru_cache(maxsize=None)
def _cuda_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    if getattr(torch.version, "hip", None):
        arch = getattr(props, "gcnArchName", "gfx").split(":")[0]
        return DeviceInfo("cuda", "amd", props.name, (props.major, props.minor), arch)
    return DeviceInfo("cuda", "nvidia", props.name, (props.major, props.minor), f"sm{props.major}{props.minor}")


cache_registry.register("kernels.core.device.cuda_info", _cuda_info.cache_clear)


def _xpu_name(index: int | None) -> str:
    # torch.xpu exists in torch >= 2.4 (Intel GPUs); a build without it still names the vendor.
    try:
        return torch.xpu.get_device_name(index if index is not None else 0)
    except Exception:
        return "Intel XPU"


def describe(device: torch.device | str | None = None) -> DeviceInfo:
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_info(index)
    if device.type == "cpu":
        return DeviceInfo("cpu", "cpu", "cpu", None, "cpu")
    if device.type == "xpu":  # Intel GPUs: gpu_rules sends them to PyTorch (INTEL_UNSUPPORTED)
        return DeviceInfo("xpu", "intel", _xpu_name(device.index), None, "xpu")
    return DeviceInfo(device.type, "other", device.type, None, device.type)
