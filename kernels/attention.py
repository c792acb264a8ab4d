"""kernels.attention: a drop-in for torch SDPA on [B, H, L, D] tensors, dispatched through
the registry, exposed as the custom op torch.ops.triton_accel.attention.

Semantics follow torch.nn.functional.scaled_dot_product_attention, plus: k/v may have fewer
heads than q (GQA, whenever q's head count is a multiple of theirs); fully masked query rows
give zeros (what SDPA gives on current PyTorch). backend=None picks the best implementation
that accepts the call; backend="triton" runs our kernel or raises BackendUnavailableError
with the reason; backend="torch" runs PyTorch SDPA.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from . import device as _device
from . import attention_short_kv as _short_kv
from . import attention_triton as _at
from . import stats, tuning
from .attention_ref import attention_ref
from .registry import BackendUnavailableError, Call, Constraints, Implementation, registry

log = logging.getLogger(__name__)

OP = "attention"
OP_QUALNAME = "triton_accel::attention"
BACKEND_ALIASES = {"triton": "triton_attention", "fp8": "triton_fp8", "torch": "torch_sdpa", "sdpa": "torch_sdpa",
                   "reference": "reference_fp32"}


# ---- call facts and checks ----------------------------------------------------------------

def _shape_error(q, k, v, attn_mask) -> str | None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if t.dim() != 4:
            return f"{name} must be [B, H, L, D], got {tuple(t.shape)}"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    if not (q.device == k.device == v.device):
        return "q, k, v are on different devices"
    B, H, Lq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        return "batch sizes differ"
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree on heads or length"
    if k.shape[3] != D:
        return f"k head dim {k.shape[3]} != q head dim {D}"
    if k.shape[1] == 0 or H % k.shape[1]:
        return f"q heads {H} are not a multiple of k/v heads {k.shape[1]}"
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            return f"attn_mask must be bool or floating point, got {attn_mask.dtype}"
        target = (B, H, Lq, k.shape[2])
        try:
            if torch.broadcast_shapes(attn_mask.shape, target) != target:
                raise RuntimeError
        except RuntimeError:
            return f"attn_mask {tuple(attn_mask.shape)} does not broadcast to {target}"
        if attn_mask.device != q.device:
            return "attn_mask is on another device"
    return None


def call_facts(q, k, v, attn_mask=None, is_causal=False) -> Call:
    mask = "none" if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "additive")
    return Call(
        device=_device.describe(q.device), dtype=q.dtype, head_dim=q.shape[-1], head_dim_v=v.shape[-1],
        q_heads=q.shape[1], kv_heads=k.shape[1], mask=mask,
        mask_dtype=None if attn_mask is None else attn_mask.dtype, is_causal=bool(is_causal),
        batch=q.shape[0], q_len=q.shape[2], kv_len=k.shape[2],
    )


def attention_support(q, k, v, attn_mask=None, is_causal=False, backend: str = "triton") -> tuple[bool, str]:
    """Can `backend` (default: our Triton kernel) serve this call? (ok, reason)."""
    err = _shape_error(q, k, v, attn_mask)
    if err:
        return False, err
    impl = registry.get(OP, BACKEND_ALIASES.get(backend, backend))
    if impl is None:
        return False, f"unknown backend {backend!r}"
    reason = impl.refusal(call_facts(q, k, v, attn_mask, is_causal))
    return (reason is None), (reason or "ok")


# ---- implementations ----------------------------------------------------------------------

def _torch_sdpa(q, k, v, attn_mask=None, scale=None, is_causal=False):
    kw = {}
    if k.shape[1] != q.shape[1]:
        kw["enable_gqa"] = True
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, **kw)


def _reference(q, k, v, attn_mask=None, scale=None, is_causal=False):
    return attention_ref(q, k, v, attn_mask, scale, is_causal).to(q.dtype)


def _triton(q, k, v, attn_mask=None, scale=None, is_causal=False):
    # The interpreter only ever runs CPU tensors; CUDA calls skip the environment lookup.
    interpreter = not q.is_cuda and _device.interpreter_enabled()
    if interpreter and q.dtype == torch.bfloat16:
        # The interpreter's bf16 dots are wrong (numpy has no bf16): compute in fp32 there.
        # Only the CPU interpreter pays this copy; GPUs run bf16 natively.
        m = attn_mask.float() if attn_mask is not None and attn_mask.dtype == torch.bfloat16 else attn_mask
        return _triton(q.float(), k.float(), v.float(), m, scale, is_causal).to(q.dtype)
    # Which kernel and config serve a call depends only on these facts; remembering the answer
    # keeps the per-call host cost (it decides how fast small eager calls are) to a dict lookup.
    rkey = (q.device, q.dtype, q.shape[-1], k.shape[2], k.shape[1] != q.shape[1],
            None if attn_mask is None else attn_mask.dtype, bool(is_causal), interpreter)
    route = _routes.get(rkey)
    if route is None:
        route = _route(rkey, q, k, v, attn_mask, scale, is_causal, interpreter)
        _routes[rkey] = route
    kind, info_or_config = route
    if kind == "short_kv":
        try:
            out = _short_kv.attention_short_kv(q, k, v, scale, info_or_config, interpreter)
            stats.increment("triton_attention.short_kv")
            return out
        except Exception as e:
            # A GPU with less shared memory than its arch's budget assumes: the flash kernel
            # steps its tiles down instead. Anything else is a real error.
            if "OutOfResources" not in type(e).__name__ and "out of resource" not in str(e):
                raise
            _short_kv_refusals[rkey] = f"does not fit: {str(e).splitlines()[0]}"
            route = _route(rkey, q, k, v, attn_mask, scale, is_causal, interpreter)
            _routes[rkey] = route
            info_or_config = route[1]
    return _at.attention_triton(q, k, v, attn_mask, scale, is_causal, config=info_or_config)


def _route(rkey, q, k, v, attn_mask, scale, is_causal, interpreter):
    """("short_kv", device info) or ("flash", config) for the call signature rkey."""
    info = _device.describe(q.device)
    D, Lk = q.shape[-1], k.shape[2]
    refusal = _short_kv_refusals.get(rkey)
    if refusal is None:
        refusal = _short_kv.short_kv_refusal(q, k, v, attn_mask, is_causal, info, interpreter)
    if refusal is None:
        return "short_kv", info
    _short_kv_refusals[rkey] = refusal
    mask = "none" if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "add")
    lk_class = 1 << max(0, (Lk - 1).bit_length())  # power-of-two bucket
    shape_class = (str(q.dtype).replace("torch.", ""), D, k.shape[1] != q.shape[1], mask,
                   bool(is_causal), min(lk_class, 1 << 16))
    config = _at.default_config(info, D, Lk, interpreter)
    if not interpreter:
        def run(cfg):
            return _at.attention_triton(q, k, v, attn_mask, scale, is_causal, config=cfg)

        config = tuning.choose("attention", info, shape_class, config,
                               candidates=lambda: list(_at.AUTOTUNE_SPACE), run=run)
    return "flash", config


_routes: dict = {}
_short_kv_refusals: dict = {}  # route key -> why the short-key kernel does not serve it


def clear_caches() -> None:
    """Forget remembered decisions and configs (after changing env vars or the registry)."""
    _decisions.clear()
    _routes.clear()
    _short_kv_refusals.clear()


def _register_implementations() -> None:
    if registry.get(OP, "torch_sdpa") is not None:
        return
    triton_error = _device.triton_import_error()
    min_cap = (7, 5)
    if triton_error is None:
        tv = _device.triton_version() or "0"
        try:
            major, minor = (int(x) for x in tv.split(".")[:2])
            if (major, minor) >= (3, 3):
                min_cap = (8, 0)  # Triton 3.3 dropped Turing (triton-lang/triton#5066)
        except ValueError:
            pass
    registry.register(Implementation(
        name="triton_attention", op=OP, fn=_triton, priority=100,
        constraints=Constraints(
            device_types=frozenset({"cuda", "cpu"}), cpu_needs_interpreter=True,
            min_capability=min_cap, dtype_min_capability={torch.bfloat16: (8, 0)},
            head_dims=(1, 256)),
        unavailable=triton_error,
    ))
    # Lossy (e4m3 Q.K), so it is never picked by priority: only by name ("fp8"), which the
    # nodes do after timing it against ComfyUI's attention and checking the outputs agree.
    from . import attention_fp8 as _fp8

    registry.register(Implementation(
        name="triton_fp8", op=OP, fn=_fp8.registry_fn, priority=-50,
        constraints=_fp8.registry_constraints(), unavailable=triton_error,
    ))
    registry.register(Implementation(
        name="torch_sdpa", op=OP, fn=_torch_sdpa, priority=0,
        constraints=Constraints(device_types=frozenset({"cuda", "cpu", "mps", "xpu"}),
                                dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
                                head_dims=(1, 1 << 20), same_head_dim_v=False),
    ))
    registry.register(Implementation(
        name="reference_fp32", op=OP, fn=_reference, priority=-100,
        constraints=Constraints(device_types=frozenset({"cuda", "cpu", "mps", "xpu"}),
                                dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
                                head_dims=(1, 1 << 20), same_head_dim_v=False),
    ))


_register_implementations()


# ---- dispatch and the custom op -----------------------------------------------------------

# Diffusion models repeat the same few attention calls thousands of times; remembering the
# decision per call signature keeps validation and selection off the hot path (they cost
# tens of microseconds, as much as a small cross-attention kernel).
_decisions: dict = {}
_MAX_DECISIONS = 4096


def _signature(q, k, v, attn_mask, is_causal, backend):
    m = None if attn_mask is None else (attn_mask.dtype, attn_mask.shape, attn_mask.stride(), attn_mask.device)
    return (q.device, q.dtype, q.shape, k.dtype, k.shape, v.dtype, v.shape, k.device, v.device, m,
            is_causal, backend, False if q.is_cuda else _device.interpreter_enabled())


def _dispatch(q, k, v, attn_mask, scale, is_causal, backend):
    key = _signature(q, k, v, attn_mask, is_causal, backend)
    impl = _decisions.get(key)
    if impl is None:
        err = _shape_error(q, k, v, attn_mask)
        if err:
            raise ValueError(f"attention: {err}")
        name = None if backend in (None, "auto") else BACKEND_ALIASES.get(backend, backend)
        impl = registry.select(OP, call_facts(q, k, v, attn_mask, is_causal), name=name)
        if len(_decisions) > _MAX_DECISIONS:
            _decisions.clear()
        _decisions[key] = impl
    stats.increment(impl.name)
    if q.is_cuda and q.device.index != torch.cuda.current_device():
        # Triton launches on the current device; on a rig with two GPUs the model on the
        # second one would otherwise hand device-1 pointers to a device-0 launch.
        with torch.cuda.device(q.device):
            out = impl.fn(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal)
    else:
        out = impl.fn(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal)
    # The fake promises empty_like(q)'s layout; keep that promise on every path (the
    # Triton launcher allocates with empty_like itself).
    if impl.fn is not _triton and out.stride() != _expected_strides(q):
        fixed = torch.empty_like(q)
        fixed.copy_(out)
        out = fixed
    return out


def _expected_strides(q):
    return torch.empty_like(q, device="meta").stride()


def _shared_dispatch(q, k, v, attn_mask, scale, is_causal, backend):
    return stats.shared().dispatch(q, k, v, attn_mask, scale, is_causal, backend)


def _op_registered() -> bool:
    try:
        getattr(torch.ops.triton_accel, "attention")
    except (AttributeError, RuntimeError):
        return False
    return True


def _register_op() -> None:
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
        return torch.empty_like(q)


_register_op()


def attention(q, k, v, attn_mask=None, scale=None, is_causal=False, backend=None):
    """softmax(q k^T * scale + mask) v for [B, H, L, D] tensors; see the module docstring."""
    if torch.compiler.is_compiling():
        return torch.ops.triton_accel.attention(q, k, v, attn_mask, scale, bool(is_causal), backend)
    # Eager calls skip the dispatcher round trip of the custom op (tens of microseconds).
    return _shared_dispatch(q, k, v, attn_mask, scale, bool(is_causal), backend)


__all__ = ["attention", "attention_support", "call_facts", "BackendUnavailableError", "OP_QUALNAME"]
