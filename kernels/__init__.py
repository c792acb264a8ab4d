"""Plain torch + Triton kernels; knows nothing of ComfyUI.

Importable without Triton: the registry then records why the Triton implementations cannot
run and dispatch falls back to PyTorch. Invalid calls raise AttentionInputError (with
`.reason`); a backend asked for by name that cannot serve a call raises
BackendUnavailableError (with `.reason`).
"""
from .core import stats
from .attention.dispatch import OP_QUALNAME, attention, attention_support, call_facts, clear_caches
from .attention.checks import AttentionInputError
from .attention.ref import attention_ref
from .core.device import DeviceInfo, describe, interpreter_enabled, triton_import_error, triton_version
from .linear.dispatch import METHODS as LINEAR_METHODS
from .linear.dispatch import LinearInputError, PreparedLinearWeight, linear, linear_refusal, prepare_weight
from .core.registry import BackendUnavailableError, NoImplementationError, registry

__all__ = [
    "attention", "attention_support", "attention_ref", "call_facts", "stats", "registry",
    "AttentionInputError", "BackendUnavailableError", "NoImplementationError", "DeviceInfo", "describe",
    "interpreter_enabled", "triton_import_error", "triton_version", "OP_QUALNAME", "clear_caches",
    "linear", "prepare_weight", "linear_refusal", "LinearInputError", "PreparedLinearWeight", "LINEAR_METHODS",
]
