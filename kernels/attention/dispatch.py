"""kernels.attention: a drop-in for torch SDPA on [B, H, L, D] tensors, dispatched through
the registry, exposed as the custom op torch.ops.triton_accel.attention.

Semantics follow torch.nn.functional.scaled_dot_product_attention, plus: k/v may have fewer
heads than q (GQA, whenever q's head count is a multiple of theirs); v's head dim may differ
from q's (the output takes v's); a mask may be any shape that broadcasts to [B, H, Lq, Lk]
and may be combined with is_causal (top-left aligned, as SDPA's); fully masked query rows
give zeros (what SDPA gives on current PyTorch); any finite scale, negative and zero included.
backend=None picks the best implementation that accepts the call; backend="triton" runs our
kernel or raises BackendUnavailableError with the reason; backend="torch" runs PyTorch SDPA.
Quantized backends, lossy, so only ever run when named (the nodes time them against ComfyUI's
attention and keep one only where it agrees):
- "triton_fp8" ("fp8", NVIDIA sm_89+): per call the first kernel of gpu_rules.fp8_kernel_order()
  that accepts it: on sm_90 the warp-specialised Gluon kernel (TRITON_ACCEL_GLUON), on sm_89 /
  sm_120 INT8 Q.K with FP8 P.V (attention_int8, pv="fp8"), then full FP8 (attention_fp8_full),
  all three without masks, causal, GQA (Gluon, full) or head dims over 128; every other call
  the FP8 Q.K kernel (attention_fp8.py: masks, GQA, causal, head dims to 256). fp8_route() says
  which kernel a call gets and why the others refused it;
- "triton_int8" ("int8", NVIDIA sm_75+): INT8 Q.K, FP16 P.V (attention_int8, pv="fp16"); no
  mask, no causal, head dims to 128, GQA.
precision= is a thin alias of backend=: "fp8" -> "triton_fp8", "int8" -> "triton_int8",
"fp16" / "bf16" -> "triton" (the dtype still comes from the inputs).
Invalid calls raise AttentionInputError (a ValueError) with the reason, whatever the backend.

return_lse=True returns (out, lse): lse float32 [B, H, Lq], the natural-log logsumexp of each
query row's scaled, masked scores, so attentions over disjoint key sets merge exactly
(kernels.attention.sequence_parallel.merge_partials). A row whose keys are all masked has lse = -inf and
out = 0. Served by our flash kernel (the short-key and Gluon kernels are skipped for it), the
"fp8" path's full-FP8 and INT8-Q.K/FP8-P.V kernels, the "int8" kernel (quantized paths: the
logsumexp of the scores as they were quantized) and the float32 reference. Any other path
(PyTorch SDPA, an extension's implementation) gets out and lse from the float32 reference on
CPU and is refused (BackendUnavailableError) elsewhere; "auto" takes our flash kernel, or the
reference on CPU. Traced through its own op, torch.ops.triton_accel.attention_lse.

Gradients: the op has a backward (torch.library.register_autograd) that recomputes the
attention in float32 PyTorch math and differentiates it, so inputs that require grad get
SDPA's gradients. It materialises the [B, H, Lq, Lk] scores: fine for fine-tuning small
models and tests, not memory-efficient for video-sized training.
"""
from __future__ import annotations

import importlib
import logging
import math
from typing import Optional, Tuple

import torch

from . import short_kv as _short_kv
from . import flash as _at
from ..core import cache_registry, env_settings, stats, tuning
from ..core import device as _device
from .checks import AttentionInputError, attention_input_error, check_attention_inputs, check_scale
from .ref import attention_ref
from ..core.gpu_rules import (FP8_KERNEL_FULL, FP8_KERNEL_GLUON, FP8_KERNEL_INT8_FP8PV, FP8_KERNEL_QK, OPTIONAL_FP8_KERNELS,
                        fp8_kernel_order, min_capability_for)
from ..core.kernel_common import interpreter_upcast, is_out_of_resources, shape_class
from ..core.registry import BackendUnavailableError, Call, Constraints, Implementation, NoImplementationError, registry

log = logging.getLogger("triton_accel.kernels.attention.dispatch")  # not __name__: the clone's folder name

OP = "attention"
OP_QUALNAME = "triton_accel::attention"
OP_LSE_QUALNAME = "triton_accel::attention_lse"
BACKEND_ALIASES = {"triton": "triton_attention", "fp8": "triton_fp8", "int8": "triton_int8", "torch": "torch_sdpa",
                   "sdpa": "torch_sdpa", "reference": "reference_fp32"}
# attention(precision=...) is only another way to name a backend.
BACKEND_OF_PRECISION = {"fp8": "triton_fp8", "int8": "triton_int8", "fp16": "triton_attention",
                        "bf16": "triton_attention"}
ANY_DTYPE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
ANY_DEVICE = frozenset({"cuda", "cpu", "mps", "xpu"})


# ---- call facts and checks ----------------------------------------------------------------

def _mask_kind(attn_mask) -> str:
    return "none" if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "additive")


def call_facts(q, k, v, attn_mask=None, is_causal=False) -> Call:
    return Call(
        device=_device.describe(q.device), dtype=q.dtype, head_dim=q.shape[-1], head_dim_v=v.shape[-1],
        q_heads=q.shape[1], kv_heads=k.shape[1], mask=_mask_kind(attn_mask), is_causal=bool(is_causal),
    )


def attention_support(q, k, v, attn_mask=None, is_causal=False, backend: str = "triton") -> tuple[bool, str]:
    """Can `backend` (default: our Triton kernel) serve this call? (ok, reason)."""
    err = attention_input_error(q, k, v, attn_mask)
    if err:
        return False, err
    name = BACKEND_ALIASES.get(backend, backend)
    impl = registry.get(OP, name)
    if impl is None:
        return False, f"unknown backend {backend!r}"
    reason = impl.refusal(call_facts(q, k, v, attn_mask, is_causal))
    if reason is None and name in _CALL_REFUSALS:
        reason = _CALL_REFUSALS[name](q, k, v, attn_mask, is_causal)
    return (reason is None), (reason or "ok")


def empty_output(q, v, device=None):
    """The output every path returns: q.shape[:-1] + (v's head dim,), laid out as
    torch.empty_like(q) lays out q (the custom op's fake promises this layout)."""
    if v.shape[-1] == q.shape[-1]:
        return torch.empty_like(q, device=device)
    st = torch.empty_like(q, device="meta").stride()
    order = sorted(range(4), key=lambda d: (-st[d], d))  # outermost dim first
    shape = (*q.shape[:-1], v.shape[-1])
    out = torch.empty([shape[d] for d in order], dtype=q.dtype, device=device or q.device)
    return out.permute([order.index(d) for d in range(4)])


# ---- implementations ----------------------------------------------------------------------

def _torch_sdpa(q, k, v, attn_mask=None, scale=None, is_causal=False):
    kw = {}
    if k.shape[1] != q.shape[1]:
        kw["enable_gqa"] = True
    if attn_mask is not None:
        # SDPA wants a 4-d-broadcastable mask of q's dtype (or bool), and rejects a mask with
        # is_causal on CUDA; our contract takes any broadcastable float mask and both at once.
        B, H, Lq, Lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        attn_mask = attn_mask.expand(B, H, Lq, Lk) if attn_mask.dim() < 2 else attn_mask
        if attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
            attn_mask = attn_mask.to(q.dtype)
        if is_causal:
            causal = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril()
            attn_mask = (attn_mask & causal if attn_mask.dtype == torch.bool
                         else attn_mask.masked_fill(~causal, float("-inf")))
            is_causal = False
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, **kw)


def _reference(q, k, v, attn_mask=None, scale=None, is_causal=False):
    return attention_ref(q, k, v, attn_mask, scale, is_causal).to(q.dtype)


def _route_key(q, k, attn_mask, is_causal, interpreter) -> tuple:
    """The facts that decide which kernel and config serve a call (and nothing else)."""
    return (q.device, q.dtype, q.shape[-1], k.shape[2], k.shape[1] != q.shape[1],
            None if attn_mask is None else attn_mask.dtype, bool(is_causal), interpreter)


def _triton(q, k, v, attn_mask=None, scale=None, is_causal=False):
    # The interpreter only ever runs CPU tensors; CUDA calls skip the environment lookup.
    interpreter = not q.is_cuda and _device.interpreter_enabled()
    upcast = interpreter_upcast(q, k, v, attn_mask) if interpreter else None
    if upcast is not None:
        return _triton(*upcast, scale, is_causal).to(q.dtype)
    # Which kernel and config serve a call depends only on these facts; remembering the answer
    # keeps the per-call host cost (it decides how fast small eager calls are) to a dict lookup.
    rkey = _route_key(q, k, attn_mask, is_causal, interpreter)
    route = _routes.get(rkey)
    if route is None:
        route = _route(rkey, q, k, v, attn_mask, scale, is_causal, interpreter)
        _routes[rkey] = route
    kind, info_or_config = route
    if kind == "gluon_bf16":
        out = _gluon_bf16(q, k, v, scale)
        if out is not None:
            return out
        route = _flash_route(rkey, q, k, v, attn_mask, scale, is_causal, interpreter)
        kind, info_or_config = route
        if _gluon_bf16_disabled.get(q.device):
            _routes[rkey] = route
    if kind == "short_kv":
        try:
            out = _short_kv.attention_short_kv(q, k, v, scale, info_or_config, interpreter)
            stats.increment("triton_attention.short_kv")
            return out
        except Exception as e:
            # A GPU with less shared memory than its arch's budget assumes: the flash kernel
            # steps its tiles down instead. Anything else is a real error.
            if not is_out_of_resources(e):
                raise
            _short_kv_refusals[rkey] = f"does not fit: {str(e).splitlines()[0]}"
            route = _route(rkey, q, k, v, attn_mask, scale, is_causal, interpreter)
            _routes[rkey] = route
            info_or_config = route[1]
    return _at.attention_triton(q, k, v, attn_mask, scale, is_causal, config=info_or_config)


def _route(rkey, q, k, v, attn_mask, scale, is_causal, interpreter):
    """("short_kv", device info) or ("flash", config) for the call signature rkey."""
    info = _device.describe(q.device)
    refusal = _short_kv_refusals.get(rkey)
    if refusal is None:
        refusal = _short_kv.short_kv_refusal(q, k, v, attn_mask, is_causal, info, interpreter)
    if refusal is None:
        return "short_kv", info
    _short_kv_refusals[rkey] = refusal
    if not interpreter and q.is_cuda and gluon_bf16_refusal(q, k, v, attn_mask, is_causal) is None:
        return "gluon_bf16", None
    return _flash_route(rkey, q, k, v, attn_mask, scale, is_causal, interpreter)


def _flash_route(rkey, q, k, v, attn_mask, scale, is_causal, interpreter):
    """("flash", config): the plain-Triton flash kernel, its config tuned per shape class."""
    info = _device.describe(q.device)
    D, Lk = q.shape[-1], k.shape[2]
    mask = "none" if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "add")
    cls = shape_class(q.dtype, D, Lk, mask, is_causal, gqa=k.shape[1] != q.shape[1])
    config = _at.default_config(info, D, Lk, interpreter)
    if not interpreter:
        def run(cfg):
            return _at.attention_triton(q, k, v, attn_mask, scale, is_causal, config=cfg)

        config = tuning.choose("attention", info, cls, config,
                               candidates=lambda: list(_at.AUTOTUNE_SPACE), run=run)
    return "flash", config


# ---- the warp-specialised Gluon BF16/FP16 kernel (sm_90) behind "triton_attention" ----------
# Measured on the H200 (benchmarks/RESULTS.md): 0.95-1.17x SDPA-cuDNN
# at Flux/Wan/Hunyuan, head dim 256 and GQA, where the plain-Triton kernel gives 0.53-0.91x.
# It serves unmasked, non-causal calls whose tensors TMA can read in place; everything else,
# and every GPU but sm_90, keeps the plain-Triton kernels below.
GLUON_BF16_NAMES = ("attention_gluon_bf16", "gluon_bf16_refusal", "call_refusal", "GluonUnsupportedError")
_gluon_bf16_disabled: dict = {}  # device -> why the kernel failed on its first call there
_gluon_bf16_ok: dict = {}  # device -> True once a call has succeeded there


def gluon_bf16_refusal(q, k, v, attn_mask=None, is_causal=False) -> str | None:
    """Why the Gluon BF16 kernel does not serve this call (None: it does)."""
    mod, why = _kernel_module("gluon_hopper_bf16", GLUON_BF16_NAMES)
    if why:
        return why
    if not env_settings.gluon_allowed():
        return f"{env_settings.GLUON} is off"
    disabled = _gluon_bf16_disabled.get(q.device)
    if disabled:
        return disabled
    return _asked(mod.gluon_bf16_refusal, q.device) or _asked(mod.call_refusal, q, k, v, attn_mask, is_causal)


def _gluon_bf16(q, k, v, scale):
    """The Gluon kernel's output, or None when this call must take the flash kernel instead
    (a layout TMA cannot read, which the route key does not capture; or a first-call failure
    on this device, logged once and remembered)."""
    mod = _modules["gluon_hopper_bf16"][0]
    try:
        # The launcher checks the call itself (strides included) and raises
        # GluonUnsupportedError for one it cannot read: that call takes the flash kernel.
        out = mod.attention_gluon_bf16(q, k, v, scale=scale)
    except mod.GluonUnsupportedError:
        return None
    except Exception as e:
        if _gluon_bf16_ok.get(q.device):
            raise  # it ran here before: a real error, not an unsupported Triton or driver
        _gluon_bf16_disabled[q.device] = f"failed on its first call: {type(e).__name__}: {str(e)[:200]}"
        log.warning("Triton Accel: the Gluon BF16 attention kernel failed on %s (%s); using the plain-Triton "
                    "kernel there", q.device, _gluon_bf16_disabled[q.device])
        return None
    _gluon_bf16_ok[q.device] = True
    stats.increment("triton_attention.gluon_bf16")
    return out


_routes: dict = {}  # route key -> ("short_kv", device info), ("gluon_bf16", None) or ("flash", config)
_short_kv_refusals: dict = {}  # route key -> why the short-key kernel does not serve it
# Diffusion models repeat the same few attention calls thousands of times; remembering the
# decision per call signature keeps validation and selection off the hot path (they cost
# tens of microseconds, as much as a small cross-attention kernel).
_decisions: dict = {}
_MAX_DECISIONS = 4096
_fp8_routes: dict = {}  # FP8 call signature -> the kernel of the FP8 path that serves it
_fp8_optional: dict = {}  # device -> the optional FP8 kernels that run there
for _name, _cache in (("routes", _routes), ("short_kv_refusals", _short_kv_refusals), ("decisions", _decisions),
                      ("fp8_routes", _fp8_routes), ("fp8_optional", _fp8_optional),
                      ("gluon_bf16_disabled", _gluon_bf16_disabled), ("gluon_bf16_ok", _gluon_bf16_ok)):
    cache_registry.register(f"kernels.attention.{_name}", _cache.clear)


def forget_decisions() -> None:
    """Forget the remembered per-call decisions (an extension was replaced or removed: they
    hold its old constraints)."""
    _decisions.clear()


def clear_caches() -> None:
    """Forget every remembered decision, route, config and launch plan of the pack (after
    changing env vars or the registry): every module-level cache registers with cache_registry."""
    cache_registry.clear_all()


# ---- quantized backends: "triton_fp8" (four kernels) and "triton_int8" --------------------
# Kernel files written by separate work may be absent from a build or may not offer the names
# used here: they are loaded on first use, and a missing one leaves its backend (or its FP8
# variant) unavailable with the reason, never an import error of the pack.
INT8_NAMES = ("attention_int8", "call_refusal", "device_refusal", "registry_constraints")
GLUON_NAMES = ("attention_gluon_fp8", "gluon_refusal", "call_refusal")
FP8_FULL_NAMES = ("attention_fp8_full", "call_refusal")
_modules: dict = {}  # module name -> (module or None, why not)
cache_registry.register("kernels.attention.kernel_modules", _modules.clear)


def _kernel_module(module: str, names: tuple):
    """(module, None), or (None, why) when kernels/attention/<module>.py is absent, fails to import or lacks `names`."""
    found = _modules.get(module)
    if found is None:
        try:
            mod = importlib.import_module(f".{module}", __package__)
        except Exception as e:  # absent, or it needs something this Triton lacks
            found = (None, f"kernels/attention/{module}.py cannot be imported here ({type(e).__name__}: {e})")
        else:
            missing = [n for n in names if not callable(getattr(mod, n, None))]
            found = (None, f"kernels/attention/{module}.py lacks {', '.join(missing)}") if missing else (mod, None)
        _modules[module] = found
    return found


def _asked(fn, *args) -> str | None:
    """A kernel module's refusal function, whose own failure is a refusal too (never raised in a sampler)."""
    try:
        return fn(*args)
    except Exception as e:
        return f"{getattr(fn, '__qualname__', fn)} failed: {type(e).__name__}: {e}"


def fp8_kernel_refusals(device) -> dict:
    """Why each of gpu_rules.OPTIONAL_FP8_KERNELS cannot run on `device` (None: it can)."""
    device = torch.device(device)
    gluon, why_gluon = _kernel_module("gluon_hopper", GLUON_NAMES)
    if gluon is not None and not env_settings.gluon_allowed():
        why_gluon = f"{env_settings.GLUON} is off"
    int8, why_int8 = _kernel_module("int8", INT8_NAMES)
    return {FP8_KERNEL_GLUON: why_gluon or _asked(gluon.gluon_refusal, device),
            FP8_KERNEL_INT8_FP8PV: why_int8 or _asked(int8.device_refusal, device, "fp8")}


def fp8_kernels_available(device) -> frozenset:
    """The optional FP8 kernels that can run on `device` (what the Settings node's facts carry)."""
    key = str(torch.device(device))
    found = _fp8_optional.get(key)
    if found is None:
        found = frozenset(name for name, why in fp8_kernel_refusals(device).items() if why is None)
        _fp8_optional[key] = found
    return found


def _fp8_call_refusal(kernel: str, q, k, v, attn_mask, is_causal) -> str | None:
    if kernel == FP8_KERNEL_QK:
        return None  # the registry's constraints for "triton_fp8" are this kernel's
    if k.shape[2] == 0 or q.shape[2] == 0:
        return "empty sequence"
    module, names = {FP8_KERNEL_GLUON: ("gluon_hopper", GLUON_NAMES),
                     FP8_KERNEL_INT8_FP8PV: ("int8", INT8_NAMES),
                     FP8_KERNEL_FULL: ("fp8_full", FP8_FULL_NAMES)}[kernel]
    mod, why = _kernel_module(module, names)
    return why or _asked(mod.call_refusal, q, k, v, attn_mask, is_causal)


def fp8_route(q, k, v, attn_mask=None, is_causal=False) -> tuple:
    """(kernel, {refused kernel: why}): which of the FP8 path's kernels serves this call, taking
    gpu_rules.fp8_kernel_order() for the device and the first whose limits accept the call."""
    info = _device.describe(q.device)
    capability = info.capability if info.vendor == "nvidia" else None
    refusals = {}
    for kernel in fp8_kernel_order(capability, fp8_kernels_available(q.device)):
        reason = _fp8_call_refusal(kernel, q, k, v, attn_mask, is_causal)
        if reason is None:
            return kernel, refusals
        refusals[kernel] = reason
    raise AssertionError("fp8_kernel_order always ends with the FP8 Q.K kernel")


def _run_fp8_kernel(kernel, q, k, v, attn_mask, scale, is_causal):
    if kernel == FP8_KERNEL_QK:
        from . import fp8 as attention_fp8

        return attention_fp8.registry_fn(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal)
    if kernel == FP8_KERNEL_FULL:
        return _kernel_module("fp8_full", FP8_FULL_NAMES)[0].attention_fp8_full(q, k, v, None, scale)
    if kernel == FP8_KERNEL_GLUON:
        return _kernel_module("gluon_hopper", GLUON_NAMES)[0].attention_gluon_fp8(q, k, v, scale=scale)
    return _kernel_module("int8", INT8_NAMES)[0].attention_int8(q, k, v, None, scale, False, pv="fp8")


def _fp8(q, k, v, attn_mask=None, scale=None, is_causal=False):
    rkey = (q.device, q.dtype, q.shape[-1], v.shape[-1], k.shape[1] != q.shape[1],
            None if attn_mask is None else attn_mask.dtype, bool(is_causal), k.shape[2] == 0 or q.shape[2] == 0)
    kernel = _fp8_routes.get(rkey)
    if kernel is not None:
        stats.increment(f"triton_fp8.{kernel}")
        return _run_fp8_kernel(kernel, q, k, v, attn_mask, scale, is_causal)
    kernel, refusals = fp8_route(q, k, v, attn_mask, is_causal)
    try:
        out = _run_fp8_kernel(kernel, q, k, v, attn_mask, scale, is_causal)
    except Exception as e:
        # An optional kernel that fails on its first call here (a Triton whose Gluon compiles
        # differently, a GPU short of shared memory) leaves the FP8 path to the next kernel.
        if kernel not in OPTIONAL_FP8_KERNELS:
            raise
        log.warning("Triton Accel: %s failed on %s (%s: %s); the FP8 path uses the next kernel there",
                    kernel, q.device, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        _fp8_optional[str(q.device)] = fp8_kernels_available(q.device) - {kernel}
        return _fp8(q, k, v, attn_mask, scale, is_causal)
    log.debug("FP8 path on %s: %s (refused: %s)", q.device, kernel, refusals or "none")
    _fp8_routes[rkey] = kernel
    stats.increment(f"triton_fp8.{kernel}")
    return out


def _int8(q, k, v, attn_mask=None, scale=None, is_causal=False):
    mod = _kernel_module("int8", INT8_NAMES)[0]
    return mod.attention_int8(q, k, v, attn_mask, scale, is_causal, pv="fp16")


def _int8_call_refusal(q, k, v, attn_mask, is_causal) -> str | None:
    mod, why = _kernel_module("int8", INT8_NAMES)
    if why:
        return why
    return _asked(mod.call_refusal, q, k, v, attn_mask, is_causal) or _asked(mod.device_refusal, q.device, "fp16")


# Per-call limits of a backend beyond what its registry Constraints can say (the INT8 kernel's
# checks on the tensors themselves); attention_support and named dispatch both ask them.
_CALL_REFUSALS = {"triton_int8": _int8_call_refusal}


def int8_implementation(triton_error) -> Implementation:
    """The "triton_int8" registry entry: attention_int8 with FP16 P.V, or unavailable with the reason."""
    int8, why = _kernel_module("int8", INT8_NAMES)
    constraints = Constraints(device_types=frozenset({"cuda"}))
    if int8 is not None:
        try:
            constraints = int8.registry_constraints()
        except Exception as e:
            why = f"kernels/attention/int8.py registry_constraints() failed: {type(e).__name__}: {e}"
    return Implementation(name="triton_int8", op=OP, fn=_int8, priority=-50, constraints=constraints,
                          unavailable=triton_error or why)


def _register_quantized(triton_error) -> None:
    # Lossy, so never picked by priority: only by name ("fp8", "int8"), which the nodes do after
    # timing them against ComfyUI's attention and checking the outputs agree.
    from . import fp8 as _fp8_qk

    registry.register(Implementation(
        name="triton_fp8", op=OP, fn=_fp8, priority=-50,
        constraints=_fp8_qk.registry_constraints(), unavailable=triton_error,
    ))
    registry.register(int8_implementation(triton_error))


def _register_implementations() -> None:
    if registry.get(OP, "torch_sdpa") is not None:
        return
    triton_error = _device.triton_import_error()
    registry.register(Implementation(
        name="triton_attention", op=OP, fn=_triton, priority=100,
        constraints=Constraints(
            device_types=frozenset({"cuda", "cpu"}), cpu_needs_interpreter=True,
            min_capability=min_capability_for(_device.triton_version()), head_dims=(1, 256)),
        unavailable=triton_error,
    ))
    _register_quantized(triton_error)
    registry.register(Implementation(
        name="torch_sdpa", op=OP, fn=_torch_sdpa, priority=0,
        constraints=Constraints(device_types=ANY_DEVICE, dtypes=ANY_DTYPE, head_dims=(1, 1 << 20),
                                same_head_dim_v=False),
    ))
    registry.register(Implementation(
        name="reference_fp32", op=OP, fn=_reference, priority=-100,
        constraints=Constraints(device_types=ANY_DEVICE, dtypes=ANY_DTYPE, head_dims=(1, 1 << 20),
                                same_head_dim_v=False),
    ))


_register_implementations()


# ---- the log-sum-exp output (return_lse=True) ---------------------------------------------
# Only kernels whose epilogue writes m + log(l) can give it; the others are skipped by these
# routes, never asked for a logsumexp they would have to guess.
LSE_FP8_KERNELS = (FP8_KERNEL_INT8_FP8PV, FP8_KERNEL_FULL)
NO_LSE = "cannot return the log-sum-exp (return_lse=True)"
_lse_routes: dict = {}  # route key -> ("flash", config) of the flash kernel for LSE calls
_fp8_lse_routes: dict = {}  # FP8 call signature -> (kernel or None, {refused kernel: why})
for _name, _cache in (("lse_routes", _lse_routes), ("fp8_lse_routes", _fp8_lse_routes)):
    cache_registry.register(f"kernels.attention.{_name}", _cache.clear)


def _triton_lse(q, k, v, attn_mask=None, scale=None, is_causal=False):
    interpreter = not q.is_cuda and _device.interpreter_enabled()
    upcast = interpreter_upcast(q, k, v, attn_mask) if interpreter else None
    if upcast is not None:
        out, lse = _triton_lse(*upcast, scale, is_causal)
        return out.to(q.dtype), lse
    rkey = _route_key(q, k, attn_mask, is_causal, interpreter)
    route = _lse_routes.get(rkey)
    if route is None:
        route = _flash_route(rkey, q, k, v, attn_mask, scale, is_causal, interpreter)
        _lse_routes[rkey] = route
    stats.increment("triton_attention.flash_lse")
    return _at.attention_triton(q, k, v, attn_mask, scale, is_causal, config=route[1], return_lse=True)


def fp8_lse_route(q, k, v, attn_mask=None, is_causal=False) -> tuple:
    """(kernel or None, {refused kernel: why}): fp8_route() over the FP8 kernels that return the LSE."""
    rkey = (q.device, q.dtype, q.shape[-1], v.shape[-1], k.shape[1] != q.shape[1],
            None if attn_mask is None else attn_mask.dtype, bool(is_causal), k.shape[2] == 0 or q.shape[2] == 0)
    found = _fp8_lse_routes.get(rkey)
    if found is None:
        info = _device.describe(q.device)
        capability = info.capability if info.vendor == "nvidia" else None
        refusals, kernel = {}, None
        for candidate in fp8_kernel_order(capability, fp8_kernels_available(q.device)):
            reason = (_fp8_call_refusal(candidate, q, k, v, attn_mask, is_causal)
                      if candidate in LSE_FP8_KERNELS else NO_LSE)
            if reason is None:
                kernel = candidate
                break
            refusals[candidate] = reason
        found = _fp8_lse_routes[rkey] = (kernel, refusals)
    return found


def _fp8_lse_refusal(q, k, v, attn_mask, is_causal) -> str | None:
    kernel, refusals = fp8_lse_route(q, k, v, attn_mask, is_causal)
    return None if kernel else "; ".join(f"{name}: {why}" for name, why in refusals.items())


def _fp8_lse(q, k, v, attn_mask=None, scale=None, is_causal=False):
    kernel = fp8_lse_route(q, k, v, attn_mask, is_causal)[0]
    stats.increment(f"triton_fp8.{kernel}")
    if kernel == FP8_KERNEL_FULL:
        return _kernel_module("fp8_full", FP8_FULL_NAMES)[0].attention_fp8_full(
            q, k, v, None, scale, return_lse=True)
    return _kernel_module("int8", INT8_NAMES)[0].attention_int8(
        q, k, v, None, scale, False, pv="fp8", return_lse=True)


def _int8_lse(q, k, v, attn_mask=None, scale=None, is_causal=False):
    mod = _kernel_module("int8", INT8_NAMES)[0]
    return mod.attention_int8(q, k, v, attn_mask, scale, is_causal, pv="fp16", return_lse=True)


def _reference_lse(q, k, v, attn_mask=None, scale=None, is_causal=False):
    out, lse = attention_ref(q, k, v, attn_mask, scale, is_causal, return_lse=True)
    return out.to(q.dtype), lse


_LSE_FNS = {"triton_attention": _triton_lse, "triton_fp8": _fp8_lse, "triton_int8": _int8_lse,
            "reference_fp32": _reference_lse}
_LSE_REFUSALS = {"triton_fp8": _fp8_lse_refusal, "triton_int8": _int8_call_refusal}


def _select_lse(q, k, v, attn_mask, is_causal, backend) -> tuple:
    """(counter name, function returning (out, lse)) for a return_lse call, or raise with the reason."""
    facts = call_facts(q, k, v, attn_mask, is_causal)
    if backend in (None, "auto"):
        flash = registry.get(OP, "triton_attention")
        why = "not registered" if flash is None else flash.refusal(facts)
        if why is None:
            return flash.name, _triton_lse
        if q.device.type == "cpu":
            return "reference_fp32", _reference_lse
        raise NoImplementationError(OP, {"triton_attention": why, "other backends": f"{NO_LSE} in auto"})
    name = BACKEND_ALIASES.get(backend, backend)
    registry.select(OP, facts, name=name)  # raises with the reason when it cannot serve the call
    refusal = _LSE_REFUSALS.get(name)
    reason = refusal(q, k, v, attn_mask, is_causal) if refusal is not None else None
    if reason:
        raise BackendUnavailableError(OP, name, reason)
    fn = _LSE_FNS.get(name)
    if fn is not None:
        return name, fn
    if q.device.type == "cpu":
        return name, _reference_lse  # exact out and lse in float32 (tests, CPU runs)
    raise BackendUnavailableError(OP, name, f"{NO_LSE} on {q.device.type}; backends that can: "
                                            f"triton, fp8, int8, reference")


def _dispatch_lse(q, k, v, attn_mask, scale, is_causal, backend):
    try:
        key = ("lse", *_signature(q, k, v, attn_mask, is_causal, backend))
    except (AttributeError, TypeError):
        check_attention_inputs(q, k, v, attn_mask, scale)  # raises with the reason
        raise
    entry = _decisions.get(key)
    if entry is None:
        check_attention_inputs(q, k, v, attn_mask, scale)
        entry = _select_lse(q, k, v, attn_mask, is_causal, backend)
        if len(_decisions) > _MAX_DECISIONS:
            _decisions.clear()
        _decisions[key] = entry
    name, fn = entry
    stats.increment(name)
    out, lse = _on_q_device(fn, q, k, v, attn_mask, scale, is_causal)
    return (out if fn is _triton_lse else _promised_layout(out, q, v)), lse


# ---- dispatch and the custom op -----------------------------------------------------------

def _signature(q, k, v, attn_mask, is_causal, backend):
    m = None if attn_mask is None else (attn_mask.dtype, attn_mask.shape, attn_mask.stride(), attn_mask.device)
    return (q.device, q.dtype, q.shape, k.dtype, k.shape, v.dtype, v.shape, k.device, v.device, m,
            is_causal, backend, False if q.is_cuda else _device.interpreter_enabled())


def _dispatch(q, k, v, attn_mask, scale, is_causal, backend):
    try:
        key = _signature(q, k, v, attn_mask, is_causal, backend)
    except (AttributeError, TypeError):
        check_attention_inputs(q, k, v, attn_mask, scale)  # raises with the reason
        raise
    impl = _decisions.get(key)
    if impl is None:
        check_attention_inputs(q, k, v, attn_mask, scale)
        name = None if backend in (None, "auto") else BACKEND_ALIASES.get(backend, backend)
        impl = registry.select(OP, call_facts(q, k, v, attn_mask, is_causal), name=name)
        refusal = _CALL_REFUSALS.get(impl.name)
        reason = refusal(q, k, v, attn_mask, is_causal) if refusal is not None else None
        if reason:
            raise BackendUnavailableError(OP, impl.name, reason)
        if len(_decisions) > _MAX_DECISIONS:
            _decisions.clear()
        _decisions[key] = impl
    stats.increment(impl.name)
    out = _on_q_device(impl.fn, q, k, v, attn_mask, scale, is_causal)
    # The Triton launchers allocate with empty_like(q) themselves (and serve only v's head dim = q's).
    return out if impl.fn is _triton else _promised_layout(out, q, v)


def _on_q_device(fn, q, k, v, attn_mask, scale, is_causal):
    if q.is_cuda and q.device.index != torch.cuda.current_device():
        # Triton launches on the current device; on a rig with two GPUs the model on the
        # second one would otherwise hand device-1 pointers to a device-0 launch.
        with torch.cuda.device(q.device):
            return fn(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal)
    return fn(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal)


def _promised_layout(out, q, v):
    """`out`, or a copy of it, laid out as empty_output(q, v): the fakes promise that on every path."""
    if v.shape[-1] == q.shape[-1]:
        same = out.stride() == torch.empty_like(q, device="meta").stride()
    else:
        want = empty_output(q, v, device="meta")
        same = out.shape == want.shape and out.stride() == want.stride()
    if same:
        return out
    fixed = empty_output(q, v)
    fixed.copy_(out)
    return fixed


def _shared_dispatch(q, k, v, attn_mask, scale, is_causal, backend):
    return stats.shared().dispatch(q, k, v, attn_mask, scale, is_causal, backend)


def _shared_dispatch_lse(q, k, v, attn_mask, scale, is_causal, backend):
    return stats.shared().dispatch_lse(q, k, v, attn_mask, scale, is_causal, backend)


def _op_registered(name: str = "attention") -> bool:
    try:
        getattr(torch.ops.triton_accel, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _setup_backward(ctx, inputs, output):
    q, k, v, attn_mask, scale, is_causal, _backend = inputs
    ctx.save_for_backward(q, k, v, attn_mask)
    ctx.scale, ctx.is_causal = scale, is_causal


def _backward(ctx, grad_out):
    """Gradients of the forward's math, recomputed in float32 PyTorch (attention_ref): SDPA's
    gradients, fully masked rows included (zero)."""
    saved = ctx.saved_tensors  # q, k, v, attn_mask
    wants = [bool(w) and t is not None for t, w in zip(saved, ctx.needs_input_grad[:4], strict=True)]
    leaves = [t.detach().requires_grad_(w) if t is not None else None for t, w in zip(saved, wants, strict=True)]
    with torch.enable_grad():
        out = attention_ref(*leaves, ctx.scale, ctx.is_causal)
        needed = [t for t, w in zip(leaves, wants, strict=True) if w]
        grads = iter(torch.autograd.grad(out, needed, grad_out.float()))
    gq, gk, gv, gm = (next(grads) if w else None for w in wants)
    return gq, gk, gv, gm, None, None, None


def _backward_lse(ctx, grad_out, grad_lse):
    """The attention_lse op's gradients, recomputed in float32 like _backward's; the logsumexp's
    gradient is the softmax, zero for fully masked rows (their lse is -inf)."""
    saved = ctx.saved_tensors  # q, k, v, attn_mask
    wants = [bool(w) and t is not None for t, w in zip(saved, ctx.needs_input_grad[:4], strict=True)]
    leaves = [t.detach().requires_grad_(w) if t is not None else None for t, w in zip(saved, wants, strict=True)]
    with torch.enable_grad():
        out, lse = attention_ref(*leaves, ctx.scale, ctx.is_causal, return_lse=True)
        outputs, grads_in = [], []
        if grad_out is not None:
            outputs.append(out)
            grads_in.append(grad_out.float())
        if grad_lse is not None:
            outputs.append(lse)
            grads_in.append(torch.where(torch.isneginf(lse), 0.0, grad_lse.float()))
        needed = [t for t, w in zip(leaves, wants, strict=True) if w]
        grads = iter(torch.autograd.grad(outputs, needed, grads_in, allow_unused=True))
    gq, gk, gv, gm = (next(grads) if w else None for w in wants)
    return gq, gk, gv, gm, None, None, None


def _register_lse_op() -> None:
    state = stats.shared()
    if getattr(state, "dispatch_lse", None) is None:
        state.dispatch_lse = _dispatch_lse
    if _op_registered("attention_lse"):
        return  # another copy of the pack registered it in this process

    @torch.library.custom_op(OP_LSE_QUALNAME, mutates_args=())
    def attention_lse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                         scale: Optional[float], is_causal: bool,
                         backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
        return _shared_dispatch_lse(q, k, v, attn_mask, scale, is_causal, backend)

    @attention_lse_op.register_fake
    def _(q, k, v, attn_mask, scale, is_causal, backend):
        return empty_output(q, v), q.new_empty(q.shape[:3], dtype=torch.float32)

    attention_lse_op.register_autograd(_backward_lse, setup_context=_setup_backward)


def _register_op() -> None:
    _register_lse_op()
    state = stats.shared()
    if state.dispatch is None:
        state.dispatch = _dispatch
    if _op_registered():
        return  # another copy of the pack (other module name) registered it in this process

    @torch.library.custom_op(OP_QUALNAME, mutates_args=())
    def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                     scale: Optional[float], is_causal: bool, backend: Optional[str]) -> torch.Tensor:
        return _shared_dispatch(q, k, v, attn_mask, scale, is_causal, backend)

    @attention_op.register_fake
    def _(q, k, v, attn_mask, scale, is_causal, backend):
        return empty_output(q, v)

    attention_op.register_autograd(_backward, setup_context=_setup_backward)


_register_op()


def backend_of_precision(precision: str, backend=None):
    """The backend `precision` names ("fp8", "int8", "fp16"/"bf16"); a different explicit backend is an error."""
    name = BACKEND_OF_PRECISION.get(precision)
    if name is None:
        raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(BACKEND_OF_PRECISION)}")
    if backend is not None and BACKEND_ALIASES.get(backend, backend) != name:
        raise ValueError(f"precision={precision!r} names backend {name!r}, but backend={backend!r} was given")
    return name


def attention(q, k, v, attn_mask=None, scale=None, is_causal=False, backend=None, precision=None,
              return_lse=False):
    """softmax(q k^T * scale + mask) v for [B, H, L, D] tensors; with return_lse, (out, lse) with
    lse float32 [B, H, Lq] (-inf for fully masked rows, whose out is 0). See the module docstring."""
    if precision is not None:
        backend = backend_of_precision(precision, backend)
    if scale is not None and (type(scale) is not float or not math.isfinite(scale)):
        check_scale(scale)  # raises unless a finite number
        scale = float(scale)
    wants_grad = torch.is_grad_enabled() and (
        getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False)
        or getattr(v, "requires_grad", False) or getattr(attn_mask, "requires_grad", False))
    if wants_grad or torch.compiler.is_compiling():
        # Through the op: torch.compile traces it, autograd records its backward.
        check_attention_inputs(q, k, v, attn_mask)
        if return_lse:
            out, lse = torch.ops.triton_accel.attention_lse(q, k, v, attn_mask, scale, bool(is_causal), backend)
            return out, lse
        return torch.ops.triton_accel.attention(q, k, v, attn_mask, scale, bool(is_causal), backend)
    if return_lse:
        return _shared_dispatch_lse(q, k, v, attn_mask, scale, bool(is_causal), backend)
    # Eager calls without grad skip the dispatcher round trip of the custom op (tens of microseconds).
    return _shared_dispatch(q, k, v, attn_mask, scale, bool(is_causal), backend)


__all__ = ["attention", "attention_support", "call_facts", "clear_caches", "empty_output", "backend_of_precision",
           "fp8_route", "fp8_kernels_available", "fp8_kernel_refusals", "int8_implementation",
           "fp8_lse_route", "AttentionInputError", "BackendUnavailableError", "OP_QUALNAME", "OP_LSE_QUALNAME"]
