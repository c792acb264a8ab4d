"""Plain torch + Triton kernels; knows nothing of ComfyUI.

Importable without Triton: the registry then records why the Triton implementations cannot
run and dispatch falls back to PyTorch.
"""
from . import stats
from .attention import OP_QUALNAME, attention, attention_support, call_facts, clear_caches
from .attention_ref import attention_ref
from .device import DeviceInfo, describe, interpreter_enabled, triton_import_error, triton_version
from .registry import BackendUnavailableError, NoImplementationError, registry


def backends_report() -> dict:
    """Every implementation and why it is unavailable here, if it is (for logs and UI)."""
    return registry.describe()


__all__ = [
    "attention", "attention_support", "attention_ref", "call_facts", "stats", "registry",
    "BackendUnavailableError", "NoImplementationError", "DeviceInfo", "describe",
    "interpreter_enabled", "triton_import_error", "triton_version", "OP_QUALNAME", "backends_report",
    "clear_caches",
]
