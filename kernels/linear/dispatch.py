"""kernels.linear: quantised Linear layers (y = x @ W.T + b) through our Triton kernels.

Three methods (gpu_rules.select_linear_method says which one a device gets):
- "fp8_w8a8" (sm_89+, kernels/linear/fp8.py): e4m3 weights per output channel, e4m3
  activations per token, fp32 accumulation;
- "int8_w8a8" (sm_75+, kernels/linear/int8.py): int8 weights per output channel, int8
  activations per token after a block-Hadamard rotation along K (outlier channels), int32
  accumulation;
- "fp8_weight_only" (sm_80+, kernels/linear/fp8_weight_only.py): e4m3 weights dequantised in
  the GEMM, FP16/BF16 products, fp32 accumulation: half the weight bytes of BF16.

`prepare_weight` quantises a layer's weight once (or takes ComfyUI's FP8 weights and their
`scale_weight` as they are, where the method can); `linear` runs a call. Each method is the
custom op torch.ops.triton_accel.linear_<method> with a fake, so torch.compile traces it;
eager calls skip the dispatcher's round trip. Each method is also an implementation of the
registry op "linear", whose constraints answer `linear_refusal` and every call: a method
that cannot run raises BackendUnavailableError with the reason, never falls back silently.
Bad inputs raise LinearInputError (a ValueError) with `.reason`. Inference only: the ops have
no backward (the quantised weight is not a parameter).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from ..core import cache_registry, stats
from ..core import device as _device
from ..core.gpu_rules import (LINEAR_FP8_W8A8, LINEAR_FP8_WEIGHT_ONLY, LINEAR_INT8_W8A8, LINEAR_METHODS,
                        capability_refusal, linear_capability_refusal, min_capability_for, sm)
from ..core.registry import BackendUnavailableError, Implementation, registry

log = logging.getLogger("triton_accel.kernels.linear.dispatch")  # not __name__: the clone's folder name

OP = "linear"
METHODS = LINEAR_METHODS
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ALIGN_FEATURES = 16  # K and N: 16-byte rows for 8-bit tiles, whole MMA depths
IMPL_NAME = {m: f"triton_linear_{m}" for m in METHODS}
# Our methods' registry priority. Other packs' Linear extensions (kernels/core/extensions.py) rank
# against it in the Linear patch's auto: above it they are tried before ours, at or below it after.
PRIORITY = 100
# kernels.core.stats counter of launches with an activation in the epilogue (beside the method's own).
EPILOGUE_COUNTER = "linear_epilogue_activation"
# kernels.core.stats counter of calls that repeated an earlier call's launches (linear()'s DirectCall).
DIRECT_COUNTER = "linear_direct_call"


class LinearInputError(ValueError):
    """A Linear call or weight the kernels cannot take; `.reason` says why."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True)
class PreparedLinearWeight:
    """A Linear weight quantised for one method: `weight` [N, K] (float8_e4m3fn or int8, K
    contiguous), `scale` fp32 [N] (what one unit of `weight` is worth per output channel;
    int8 includes the rotation's 1/block), `rotation` the Hadamard block along K (int8; 0 = none)."""

    method: str
    out_features: int
    in_features: int
    source_dtype: torch.dtype
    device: torch.device
    weight: torch.Tensor
    scale: torch.Tensor
    rotation: int = 0
    # Call signature -> the kernels' DirectCall for it (False: the checked path serves it
    # always); linear()'s memo, never compared, copied or shown.
    _direct: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * self.scale.element_size()

    def to(self, device) -> "PreparedLinearWeight":
        device = torch.device(device)
        return replace(self, device=device, weight=self.weight.to(device), scale=self.scale.to(device))


# ---- registry: a Linear call's facts and what each method accepts ---------------------------

@dataclass(frozen=True)
class LinearCall:
    """The facts of one Linear call that constraints look at (no tensors kept)."""

    device: _device.DeviceInfo
    dtype: torch.dtype | None  # activation dtype; None: not known yet (a refusal asked per device)
    method: str


@dataclass(frozen=True)
class LinearConstraints:
    method: str
    dtypes: frozenset = frozenset(IN_DTYPES)

    def check(self, call: LinearCall) -> str | None:
        """The first reason this call is refused, or None when accepted."""
        dev = call.device
        if call.method != self.method:
            return f"prepared for {call.method}, this implementation runs {self.method}"
        if dev.type == "cpu":
            if not _device.interpreter_enabled():
                return "Linear kernels on CPU tensors need TRITON_INTERPRET=1 (tests only)"
        elif dev.type != "cuda":
            return f"device type {dev.type!r} not supported (needs CUDA, or CPU under the interpreter)"
        else:
            rule = linear_capability_refusal(self.method, dev.vendor, dev.capability, dev.name, dev.arch)
            if rule is not None:
                return rule.reason
            oldest = min_capability_for(_device.triton_version())
            if dev.capability < oldest:
                return (f"the installed Triton {_device.triton_version()} compiles for {sm(oldest)}+ "
                        f"({dev.name} is {sm(dev.capability)})")
        if call.dtype is not None:
            if call.dtype not in self.dtypes:
                return f"activation dtype {call.dtype} not supported (float16, bfloat16, float32)"
            if dev.type == "cuda":
                refusal = capability_refusal(dev.vendor, dev.capability, dev.name,
                                             dtype=str(call.dtype).replace("torch.", ""))
                if refusal is not None:
                    return refusal.reason
        return None


def _method_module(method: str):
    if method == LINEAR_FP8_W8A8:
        from . import fp8 as mod
    elif method == LINEAR_INT8_W8A8:
        from . import int8 as mod
    elif method == LINEAR_FP8_WEIGHT_ONLY:
        from . import fp8_weight_only as mod
    else:
        raise LinearInputError(f"unknown Linear method {method!r}; expected one of {METHODS}")
    return mod


def _run_method(method: str, x2d, weight, scale, bias, rotation: int, out_dtype, act: int = 0, act_from: int = 0,
                **act_out):
    return _method_module(method).run_linear(x2d, weight, scale, bias, rotation, out_dtype, act=act,
                                             act_from=act_from, **act_out)


def _register_implementations() -> None:
    triton_error = _device.triton_import_error()
    for method in METHODS:
        if registry.get(OP, IMPL_NAME[method]) is None:
            registry.register(Implementation(
                name=IMPL_NAME[method], op=OP, fn=lambda *a, _m=method, **kw: _run_method(_m, *a, **kw),
                priority=PRIORITY,
                constraints=LinearConstraints(method), unavailable=triton_error))


_register_implementations()


def linear_refusal(method: str, device, dtype: torch.dtype | None = None) -> str | None:
    """Why `method` cannot run on `device` (for `dtype` activations, when given), or None."""
    if method not in METHODS:
        return f"unknown Linear method {method!r}; expected one of {METHODS}"
    return registry.get(OP, IMPL_NAME[method]).refusal(LinearCall(_device.describe(device), dtype, method))


# ---- preparing weights ----------------------------------------------------------------------

def _check_weight_layout(weight, method: str, weight_scale) -> None:
    """The checks that read no tensor values (no host sync)."""
    if method not in METHODS:
        raise LinearInputError(f"unknown Linear method {method!r}; expected one of {METHODS}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise LinearInputError(f"weight must be a 2-D tensor [out_features, in_features]; got {shape}")
    if weight.dtype not in IN_DTYPES + (torch.float8_e4m3fn,):
        raise LinearInputError(f"weight dtype {weight.dtype} not supported (float16, bfloat16, float32, "
                               "float8_e4m3fn)")
    n, k = weight.shape
    for name, v in (("in_features", k), ("out_features", n)):
        if v == 0 or v % ALIGN_FEATURES:
            raise LinearInputError(f"{name} must be a positive multiple of {ALIGN_FEATURES} (8-bit tiles, "
                                   f"MMA depth); got {v}")
    if weight_scale is not None:
        if weight.dtype != torch.float8_e4m3fn:
            raise LinearInputError("weight_scale is only for float8_e4m3fn weights (ComfyUI's scale_weight)")
        s = torch.as_tensor(weight_scale)
        if s.numel() not in (1, n):
            raise LinearInputError(f"weight_scale must be a scalar or have {n} values; got {s.numel()}")


def _check_weight(weight, method: str, weight_scale) -> None:
    _check_weight_layout(weight, method, weight_scale)
    if weight_scale is not None:
        s = torch.as_tensor(weight_scale).float()
        if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
            raise LinearInputError("weight_scale must be finite and positive")
    if weight.dtype != torch.float8_e4m3fn and not bool(torch.isfinite(weight).all()):
        raise LinearInputError("weight has NaN or Inf values")


def prepare_weight(weight: torch.Tensor, method: str, weight_scale=None) -> PreparedLinearWeight:
    """Quantise an nn.Linear weight [N, K] for `method` (once per layer), on the weight's device.

    float8_e4m3fn weights with ComfyUI's per-tensor `scale_weight` (or one scale per channel)
    are used as they are by fp8_w8a8 and fp8_weight_only; int8_w8a8 dequantises them first.
    """
    _check_weight(weight, method, weight_scale)
    q, s, rotation = _method_module(method).prepare(weight, weight_scale)
    n, k = weight.shape
    return PreparedLinearWeight(method=method, out_features=n, in_features=k, source_dtype=weight.dtype,
                                device=weight.device, weight=q, scale=s, rotation=rotation)


def prepare_weight_per_call(weight: torch.Tensor, method: str, weight_scale=None) -> PreparedLinearWeight:
    """prepare_weight for a weight that serves one call and is dropped (ComfyUI's dynamic VRAM
    casts each layer's weight per call into a transient buffer: keeping a quantised copy would
    pin the memory dynamic VRAM exists to bound).

    Only the checks that read no values: a NaN/Inf test or a scale test would sync the host with
    the GPU on every call (the patch's quality guard compares the first call of each weight
    version with ComfyUI's instead). FP8 methods take float8_e4m3fn weights as they are and
    quantise 16/32-bit ones with the fused row kernel (one pass) where the device runs it; int8
    runs its usual preparation (rotation in torch: several passes, the costly one per call).
    """
    _check_weight_layout(weight, method, weight_scale)
    if weight.dtype == torch.float8_e4m3fn and weight_scale is None:
        # A unit scale made on the device: a Python 1.0 would be copied from the host, a copy
        # that blocks the host on every call.
        weight_scale = torch.ones((), dtype=torch.float32, device=weight.device)
    # Triton launches on the current device, which need not be the weight's.
    with torch.cuda.device(weight.device) if weight.is_cuda else contextlib.nullcontext():
        if method in (LINEAR_FP8_W8A8, LINEAR_FP8_WEIGHT_ONLY) and weight.dtype != torch.float8_e4m3fn:
            from . import fp8 as linear_fp8
            from ..core.kernel_common import fp8_device_refusal

            if fp8_device_refusal(weight.device, "FP8 Linear") is None:
                w = linear_fp8.quantize_weight_rows(weight)
                q, s, rotation = w.weight, w.scale, 0
            else:  # weight-only on sm_80/86 has no e4m3 conversion instruction: torch quantises
                q, s, rotation = _method_module(method).prepare(weight, weight_scale)
        else:
            q, s, rotation = _method_module(method).prepare(weight, weight_scale)
    n, k = weight.shape
    return PreparedLinearWeight(method=method, out_features=n, in_features=k, source_dtype=weight.dtype,
                                device=weight.device, weight=q, scale=s, rotation=rotation)


# ---- calls ----------------------------------------------------------------------------------

def activation_code(activation: str | None, activation_from: int, out_features: int) -> int:
    """The kernels' ACT code for `activation` (None, or a key of ACTIVATIONS) applied to output
    columns >= activation_from; LinearInputError for an unknown one or a column out of range."""
    from .fp8 import ACTIVATIONS

    if activation is None:
        return 0
    if activation not in ACTIVATIONS:
        raise LinearInputError(f"unknown activation {activation!r}; expected None or one of {sorted(ACTIVATIONS)}")
    if not 0 <= int(activation_from) < out_features:
        raise LinearInputError(f"activation_from must be in [0, {out_features}); got {activation_from}")
    return ACTIVATIONS[activation]


def _check_call(x, prepared, bias, out_dtype) -> torch.dtype:
    if not isinstance(prepared, PreparedLinearWeight):
        raise LinearInputError("prepared must come from prepare_weight()")
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise LinearInputError("x must be a tensor [..., in_features]")
    if x.shape[-1] != prepared.in_features:
        raise LinearInputError(f"x has {x.shape[-1]} input features, the weight {prepared.in_features}")
    if x.dtype not in IN_DTYPES:
        raise LinearInputError(f"x dtype {x.dtype} not supported (float16, bfloat16, float32)")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in IN_DTYPES:
        raise LinearInputError(f"out_dtype {out_dtype} not supported (float16, bfloat16, float32)")
    if x.device != prepared.weight.device:
        raise LinearInputError(f"x is on {x.device}, the prepared weight on {prepared.weight.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (prepared.out_features,):
            got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise LinearInputError(f"bias must have shape ({prepared.out_features},); got {got}")
        if bias.device != x.device:
            raise LinearInputError(f"bias is on {bias.device}, x on {x.device}")
        if bias.dtype not in IN_DTYPES:
            raise LinearInputError(f"bias dtype {bias.dtype} not supported")
    return out_dtype


# (device, dtype, method, interpreter) -> the implementation the registry accepted: a call's
# host time stays a dict lookup (refused calls raise and are not kept).
_decisions: dict = {}
cache_registry.register("kernels.linear.decisions", _decisions.clear)


def _dispatch(method: str, x, weight, scale, bias, rotation: int, out_dtype, act: int = 0, act_from: int = 0,
              act_out=None):
    key = (x.device, x.dtype, method, False if x.is_cuda else _device.interpreter_enabled())
    impl = _decisions.get(key)
    if impl is None:
        impl = registry.select(OP, LinearCall(_device.describe(x.device), x.dtype, method), name=IMPL_NAME[method])
        _decisions[key] = impl
    stats.increment(impl.name)
    if act:
        stats.increment(EPILOGUE_COUNTER)
    k = x.shape[-1]
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1 or (x2d.shape[0] > 1 and x2d.stride(0) != k):
        x2d = x2d.contiguous()
    b = bias.contiguous() if bias is not None else None
    act_kw = dict(act=act, act_from=act_from) if act else {}
    if act_out is not None:
        act_kw["act_out"] = act_out.view(x2d.shape[0], act_out.shape[-1])
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        with torch.cuda.device(x.device):  # Triton launches on the current device
            out = impl.fn(x2d, weight, scale, b, rotation, out_dtype, **act_kw)
    else:
        out = impl.fn(x2d, weight, scale, b, rotation, out_dtype, **act_kw)
    return out.reshape(*x.shape[:-1], weight.shape[0])


# Signatures remembered per prepared weight: a layer sees one or two (cond and uncond batches).
DIRECT_CALLS_PER_WEIGHT = 8


# Tensor types a remembered call may take: plain tensors, and the bias as the nn.Parameter a
# Linear module holds. Other subclasses (ComfyUI's QuantizedTensor) dispatch their own ops.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _direct_key(x, bias, out_dtype, activation, activation_from, activation_out=None) -> tuple | None:
    if (type(x) not in _PLAIN_TENSORS or (bias is not None and type(bias) not in _PLAIN_TENSORS)
            or (activation_out is not None and type(activation_out) not in _PLAIN_TENSORS)):
        return None
    b = None if bias is None else (bias.shape, bias.dtype, bias.device, bias.stride(), bias.data_ptr() % 16)
    a = None if activation_out is None else (activation_out.shape, activation_out.dtype, activation_out.device,
                                             activation_out.stride())
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16, out_dtype, activation, activation_from, b, a)


def _direct_call(method: str, x, weight, scale, bias, rotation: int, out_dtype, act: int = 0, act_from: int = 0,
                 act_out=None):
    """The kernels' DirectCall for a call that linear() just served, or None (checked path always)."""
    if method != LINEAR_FP8_W8A8 or not x.is_cuda:
        return None
    from . import fp8 as linear_fp8

    return linear_fp8.direct_call(x, weight, scale, bias, out_dtype, act, act_from, act_out)


def _shared_dispatch(method, x, weight, scale, bias, rotation, out_dtype, act: int = 0, act_from: int = 0,
                     act_out=None):
    # The pack may be imported twice under different names; the ops are registered by the
    # first copy, so every copy dispatches through that one's function.
    extra = {} if act_out is None else {"act_out": act_out}
    return stats.shared().linear_dispatch(method, x, weight, scale, bias, rotation, out_dtype, act, act_from, **extra)


def _op_registered(method: str) -> bool:
    try:
        getattr(torch.ops.triton_accel, f"linear_{method}")
    except (AttributeError, RuntimeError):
        return False
    return True


def _register_op(method: str) -> None:
    @torch.library.custom_op(f"triton_accel::linear_{method}", mutates_args=())
    def linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                  rotation: int, out_dtype: torch.dtype, act: int = 0, act_from: int = 0) -> torch.Tensor:
        return _shared_dispatch(method, x, weight, scale, bias, rotation, out_dtype, act, act_from)

    @linear_op.register_fake
    def _(x, weight, scale, bias, rotation, out_dtype, act=0, act_from=0):
        return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)


def _register_ops() -> None:
    state = stats.shared()
    if getattr(state, "linear_dispatch", None) is None:
        state.linear_dispatch = _dispatch
        # The direct-launch plans live in the copy whose _dispatch runs the kernels: its
        # DirectCalls too.
        state.linear_direct_call = _direct_call
    for method in METHODS:
        if not _op_registered(method):
            _register_op(method)


_register_ops()


def linear(x: torch.Tensor, prepared: PreparedLinearWeight, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, activation: str | None = None,
           activation_from: int = 0, activation_out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias for x [..., K] with a weight from prepare_weight: [..., N] in out_dtype
    (default x's dtype). `activation` ("gelu_tanh": nn.GELU(approximate="tanh")) is applied in
    the GEMM's epilogue to output columns >= activation_from (a fused projection whose tail
    feeds an MLP). `activation_out` (methods in ACTIVATION_OUT_METHODS, eager calls): a
    contiguous [..., N - activation_from] tensor of the output dtype that receives a copy of
    the activated columns, for a consumer that needs them contiguous (a torch.cat); the output
    keeps them too. Raises LinearInputError for bad inputs and
    BackendUnavailableError (with the reason) where the method cannot run on x's device."""
    compiling = torch.compiler.is_compiling()
    key = direct = None
    if not compiling and type(prepared) is PreparedLinearWeight:
        # A call with the signature of one served before (same weight, input layout, output
        # dtype, epilogue, bias and copy layouts) needs none of the checks: it repeats that
        # call's launches.
        key = _direct_key(x, bias, out_dtype, activation, activation_from, activation_out)
        direct = prepared._direct.get(key) if key is not None else None
        if direct:
            out = direct(x, bias, activation_out)
            if out is not None:
                stats.increment(IMPL_NAME[prepared.method])
                stats.increment(DIRECT_COUNTER)
                if activation is not None:
                    stats.increment(EPILOGUE_COUNTER)
                return out.view(*x.shape[:-1], prepared.out_features)
    out_dtype = _check_call(x, prepared, bias, out_dtype)
    act = activation_code(activation, activation_from, prepared.out_features)
    if activation_out is not None:
        _check_activation_out(x, prepared, act, int(activation_from), activation_out, out_dtype, compiling)
    args = (prepared.method, x, prepared.weight, prepared.scale, bias, prepared.rotation, out_dtype)
    if act:
        args += (act, int(activation_from))
    if compiling:
        op = getattr(torch.ops.triton_accel, f"linear_{prepared.method}")
        return op(*args[1:])
    # Eager calls skip the dispatcher round trip of the custom op (tens of microseconds).
    extra = {} if activation_out is None else {"act_out": activation_out}
    out = _shared_dispatch(*args, **extra)
    if direct is None and key is not None:
        memo = prepared._direct
        if len(memo) >= DIRECT_CALLS_PER_WEIGHT:
            memo.clear()
        make = getattr(stats.shared(), "linear_direct_call", None)
        memo[key] = (make(*args, **extra) if make is not None else None) or False
    return out


# Methods whose kernels can write activation_out (the FP8 W8A8 kernels' SPLIT_ACT epilogue).
ACTIVATION_OUT_METHODS = (LINEAR_FP8_W8A8,)


def _check_activation_out(x, prepared, act: int, first: int, act_out, out_dtype, compiling: bool) -> None:
    if prepared.method not in ACTIVATION_OUT_METHODS:
        raise LinearInputError(f"activation_out: only {', '.join(ACTIVATION_OUT_METHODS)} writes the activated "
                               f"copy; {prepared.method} writes one output")
    if compiling:
        raise LinearInputError("activation_out is written in place: not traceable by torch.compile")
    if not act:
        raise LinearInputError("activation_out needs an activation")
    want = (*x.shape[:-1], prepared.out_features - first)
    if not isinstance(act_out, torch.Tensor) or tuple(act_out.shape) != want:
        got = tuple(act_out.shape) if isinstance(act_out, torch.Tensor) else type(act_out).__name__
        raise LinearInputError(f"activation_out must have shape {want}; got {got}")
    if act_out.dtype != out_dtype or act_out.device != x.device or not act_out.is_contiguous():
        raise LinearInputError(f"activation_out must be a contiguous {out_dtype} tensor on {x.device}")




def linear_ref(x: torch.Tensor, prepared: PreparedLinearWeight, bias: torch.Tensor | None = None,
               activation: str | None = None, activation_from: int = 0) -> torch.Tensor:
    """float32 x @ W.T + bias with the prepared weight dequantised (rotation undone), then
    `activation` on columns >= activation_from: what the kernels compute before their own
    activation quantisation. For tests."""
    w = prepared.weight.float() * prepared.scale.float()[:, None]
    if prepared.rotation:
        from .int8 import hadamard_blocks

        w = hadamard_blocks(w, prepared.rotation)  # H is symmetric: W H H = W * block
    y = x.float() @ w.T
    y = y + bias.float() if bias is not None else y
    if activation_code(activation, activation_from, prepared.out_features):
        y[..., activation_from:] = torch.nn.functional.gelu(y[..., activation_from:], approximate="tanh")
    return y


__all__ = ["METHODS", "ACTIVATION_OUT_METHODS", "LinearInputError", "PreparedLinearWeight", "LinearCall", "LinearConstraints",
           "prepare_weight", "prepare_weight_per_call", "linear", "linear_refusal", "linear_ref", "activation_code", "BackendUnavailableError", "OP"]
