"""Fused norms: the elementwise work around attention and the MLP in one pass each, through
kernels/fused/layer_norm_modulate.py, kernels/fused/norm_rope.py, kernels/fused/gated_residual_norm.py (Wan's
attention blocks) and kernels/fused/qk_norm.py (the QKNorm of every model built from
comfy/ldm/flux/layers.py: Flux, Chroma, HunyuanVideo...: q and k normalised per head in one
launch, read through the permuted views ComfyUI hands it, instead of a copy and an RMSNorm
each).

What it replaces, per WanAttentionBlock call (comfy/ldm/wan/model.py), everything else staying
ComfyUI's own modules (Linear layers, attention, cross-attention, FFN, so our Linear and
attention patches still serve those calls):
- norm1(x) then addcmul(e[0], ., 1 + e[1]): one layer_norm_modulate pass;
- in the self-attention, norm_q(q(x)) then apply_rope1 (and the same for k): one
  rms_norm_rope pass each, instead of torch's RMSNorm plus comfy-kitchen's RoPE; the q, k and
  v Linears inside linear_fp8.quantize_once, so our FP8 Linear quantises their input once;
- addcmul(x, y, e[2]) then norm3 (the cross-attention's LayerNorm): one gated_residual_layer_norm
  pass, instead of torch's broadcasting addcmul (its non-vectorised kernel) and LayerNorm;
- x + cross_attn(...) then norm2 and addcmul(e[3], ., 1 + e[4]): one pass (the residual input
  of residual_layer_norm_modulate), and the block's last addcmul(x, y, e[5]) as gated_residual;
- on sm_89+, the norm1, norm3 and norm2 passes also write their output as the FP8 Linear's
  e4m3 rows (bit for bit its own quantisation), handed to the Linears that read it (q/k/v,
  the cross-attention's q, the FFN's first Linear) through quantize_once(x, rows): those skip
  their quantisation pass. A site whose Linear never reads them (not our FP8 Linear) stops
  getting them after FP8_ROWS_MISSES calls.
Measured at Wan 2.1 14B on an H100 (benchmarks/RESULTS.md, sessions 30-32): the fused passes
take 0.24 (LayerNorm + modulation) and 0.29 (RMSNorm + RoPE) ms against ComfyUI's 0.76 and 0.81
(benchmarks/fused_norms_bench.py); the Wan step without any of this is 1997 ms against 1892-1895
with it (session 32, same call), and the e4m3 rows with the residual + norm2 pass took the
activation quantisation from 50.4 to 30.6 ms a step and the residual add's 13.1 ms away.
Flux's QKNorms are fused too (10-11 ms less GPU time a Flux 1024² step, session 32);
TRITON_ACCEL_FUSED_NORMS=blocks keeps them ComfyUI's (docs/settings.md).

Flux's DoubleStreamBlock / SingleStreamBlock (comfy/ldm/flux/layers.py: Flux, HunyuanVideo),
with TRITON_ACCEL_FUSED_NORMS=all (the default; =qk keeps them ComfyUI's), per stream:
- norm1(x) then apply_mod's addcmul(shift, ., 1 + scale): one layer_norm_modulate pass, with
  the e4m3 rows of the qkv Linear (linear1 in the single block);
- `x += proj(attn) * gate1`, then norm2 and its modulation: one residual_layer_norm_modulate
  pass with a gate, the product rounded before the add as ComfyUI's two ops round it, with the
  rows of the MLP's first Linear;
- `x += mlp(.) * gate2` (the single block's `x += linear2(.) * gate`): one gated_residual pass.
The blocks return new tensors where ComfyUI's add into their inputs (their callers use the
returned ones); the checked first call runs ours before ComfyUI's forward for that reason. No
rows for a stream the Linear hands back for its token count (the 512-token text stream).
Measured on an H100 (session 33): 96.8 ms of kernels a Flux step against 104.5, 456 fewer
launches. Refused per call (ComfyUI's forward): per-token modulation (modulation_dims), attn1
patches, flipped_img_txt blocks.

How, and why this way:
- Each block's `forward` becomes an object patch on the patched clone (as the Linear patch
  does for each Linear), installed when ComfyUI loads that clone and removed when it unloads
  it. Only blocks whose class is ComfyUI's WanAttentionBlock with its own forward and a
  WanSelfAttention with RMSNorm q/k norms are patched; subclasses (VACE, S2V...) keep theirs.
- A call goes to the block's original forward when anything is unusual: torch.compile tracing
  (inductor fuses these ops itself), per-frame modulation (Wan 2.2 TI2V's timesteps), modulation in
  another dtype than x (ComfyUI would then promote the block's output), attn1/attn2 patches
  of other nodes, rope freqs of another layout, a device the kernels cannot run on. Counted
  per reason in call_stats (kind "norms").
- Quality guard: the first call of each block on each device runs the original forward too
  and compares; a rel. L2 above GUARD_MAX_REL_L2 or a NaN/Inf sends that block to ComfyUI's
  forward for good. The kernels round where ComfyUI's ops round, so the two agree to a bf16
  rounding (bit for bit under the interpreter at the tests' shapes).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import types

import torch

from ..kernels.core import env_settings
from ..kernels.linear.cat_fp8_rows import CatRowsInputError, cat_fp8_rows
from ..kernels.fused.gated_residual_norm import (GatedResidualInputError, gated_residual, gated_residual_layer_norm,
                                           gated_residual_layer_norm_rows)
from ..kernels.core.kernel_common import fp8_device_refusal
from ..kernels.fused.layer_norm_modulate import LayerNormModulateInputError, residual_layer_norm_modulate
from ..kernels.fused.layer_norm_modulate import refusal as layer_norm_modulate_refusal
from ..kernels.linear.fp8 import quantize_once
from ..kernels.fused.norm_rope import NormRopeInputError, freqs_table, rms_norm_rope
from ..kernels.fused.norm_rope import refusal as norm_rope_refusal
from ..kernels.fused.qk_norm import QKNormInputError, qk_rms_norm
from ..kernels.fused.qk_norm_rope import QKNormRopeInputError, qk_rms_norm_rope
from . import call_stats
from .patch_linear import LinearLayer, guard_failure, module_attr

log = logging.getLogger("triton_accel.nodes.patch_fused_norms")  # not __name__: the clone's folder name

KIND = "norms"
PATH = "fused_norms"
PATH_QK = "fused_qk_norm"
PATH_FLUX = "fused_flux_block"
FLUX_MODULE = "comfy.ldm.flux.layers"
FLUX_MATH_MODULE = "comfy.ldm.flux.math"
CALLBACK_KEY = "triton_accel_fused_norms"
# The fused passes reproduce ComfyUI's roundings; what is left is the order of fp32 sums and
# rsqrt's last bits (a bf16 ulp on a few values). A block differing by more is not the block
# this module was written for.
GUARD_MAX_REL_L2 = 0.01
WAN_MODULE = "comfy.ldm.wan.model"

# A site (the Linear after one of the block's norms) stops getting e4m3 rows from the norm
# kernel after this many calls in a row in which no GEMM read them: its Linear is not our FP8
# one (another mode, LoRA, dynamic VRAM...), and the rows would be 0.05 ms of writes a call
# for nothing. Our FP8 Linear reads them from its third call on (DirectCall), so this is more
# than the calls before that.
FP8_ROWS_MISSES = 4

REASON_PATCHES = "attn1/attn2 patches of another node"
REASON_FALLBACK = "block failed the first-call check"
# What a fused kernel raises for a call it cannot serve (checked before anything runs).
INPUT_ERRORS = (NormRopeInputError, LayerNormModulateInputError, QKNormInputError, GatedResidualInputError)


class Guard:
    """The first-call check's outcome per device, shared by every patch of one kind that one
    patch_fused_norms call put into one model: its blocks are one class running one forward,
    so the first block called on a device is compared with ComfyUI's forward for all of them
    (a whole-block reference costs a block's attention and MLP again: checking each of Wan
    14B's 40 blocks would add about a step to the first one)."""

    def __init__(self):
        self.guarded: set[str] = set()  # devices whose first call agreed with the original
        self.fallbacks: dict[str, str] = {}  # device -> why these run ComfyUI's forward for good


class _GuardedPatch:
    """An object patch of one module's forward whose first call on each device (first among
    the patches sharing its Guard) also runs the forward it replaces and compares; shared by
    clones, never copied. Subclasses give PATH and __call__, which hands back what it refuses
    and passes the rest to _serve."""

    PATH = ""

    def __init__(self, label: str, name: str, module: torch.nn.Module, previous, guard: Guard | None = None):
        self.label = label
        self.name = name
        self.module = module
        self.previous = previous  # the module's own forward (bound method)
        self.guard = guard if guard is not None else Guard()

    @property
    def guarded(self) -> set[str]:
        return self.guard.guarded

    @property
    def fallbacks(self) -> dict[str, str]:
        return self.guard.fallbacks

    def __deepcopy__(self, memo):
        return self

    def _original(self, args, kwargs, reason: str):
        call_stats.record(call_stats.OUTCOME_HANDED_BACK, reason, kind=KIND, model=self.label)
        return self.previous(*args, **kwargs)

    def _serve(self, args, kwargs, device: str, fused, compare, ours_first: bool = False):
        """fused(): our output; compare(ours, reference): why they disagree, or None. ours_first:
        on the checked call ours runs before the original forward, which writes into its inputs
        (Flux's blocks: `x += ...`)."""
        if device in self.fallbacks:
            return self._original(args, kwargs, REASON_FALLBACK)
        if device in self.guarded:
            try:
                out = fused()
            except INPUT_ERRORS as e:
                return self._original(args, kwargs, e.reason)
            call_stats.record(call_stats.OUTCOME_SERVED, path=self.PATH, kind=KIND, model=self.label)
            return out
        ours = failure = None
        if ours_first:
            try:
                ours = fused()
            except INPUT_ERRORS as e:  # this call only: the next one is guarded again
                return self._original(args, kwargs, e.reason)
            except Exception as e:  # a kernel that fails here fails for good on this device
                failure = f"kernel error: {type(e).__name__}: {e}"
        reference = self.previous(*args, **kwargs)
        try:
            if failure is None:
                failure = compare(ours if ours_first else fused(), reference)
        except INPUT_ERRORS as e:  # this call only: the next one is guarded again
            call_stats.record(call_stats.OUTCOME_HANDED_BACK, e.reason, kind=KIND, model=self.label)
            return reference
        except Exception as e:  # a kernel that fails here fails for good on this device
            failure = f"kernel error: {type(e).__name__}: {e}"
        if failure is not None:
            self.fallbacks[device] = failure
            log.warning("Triton Accel fused norms: %s's %s (checked at %s) go to ComfyUI's forward on %s: %s",
                        self.label, type(self.module).__name__, self.name, device, failure)
            call_stats.record(call_stats.OUTCOME_HANDED_BACK, REASON_FALLBACK, kind=KIND, model=self.label)
        else:
            self.guarded.add(device)
            call_stats.record(call_stats.OUTCOME_SERVED, path=self.PATH, kind=KIND, model=self.label)
        return reference


class _RowsSites(_GuardedPatch):
    """A block patch whose norm passes hand e4m3 rows to the Linear after them, per site (the
    Linear's name in the block), until FP8_ROWS_MISSES calls in a row found no GEMM reading them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # site -> calls in a row whose e4m3 rows no GEMM read (FP8_ROWS_MISSES)
        self.fp8_rows_misses: dict[str, int] = {}

    def _wants_rows(self, site: str, rows_ok: bool, linear=None, x: torch.Tensor | None = None) -> bool:
        """Whether the norm pass before `site` writes e4m3 rows; `linear`, the Linear that reads
        its output x, where known."""
        return (rows_ok and self.fp8_rows_misses.get(site, 0) < FP8_ROWS_MISSES
                and (linear is None or _may_read_rows(linear, x)))

    def _rows_read(self, site: str):
        """What a _rows_scope reports to: whether a GEMM read the site's rows this call."""
        def note(read: bool) -> None:
            misses = 0 if read else self.fp8_rows_misses.get(site, 0) + 1
            self.fp8_rows_misses[site] = misses
            if misses == FP8_ROWS_MISSES:
                log.debug("Triton Accel fused norms: %s's %s Linear does not read FP8 rows; not made any more",
                          self.name, site)
        return note


class FusedWanBlock(_RowsSites):
    """The object patch of one WanAttentionBlock's forward."""

    PATH = PATH

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.previous(*args, **kwargs)  # traced as ComfyUI's: not counted, like the Linear patch
        try:
            call = _bind(args, kwargs)
            reason = self._refusal(call)
        except (TypeError, *INPUT_ERRORS) as e:
            reason = getattr(e, "reason", None) or f"arguments: {e}"
        if reason is not None:
            return self._original(args, kwargs, reason)
        return self._serve(args, kwargs, str(call["x"].device), lambda: self._fused(**call), _guard_failure)

    def _refusal(self, call: dict) -> str | None:
        x, e, freqs = call["x"], call["e"], call["freqs"]
        block = self.module
        patches = call["transformer_options"].get("patches", {})
        if "attn1_patch" in patches or "attn2_patch" in patches:
            return REASON_PATCHES
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != block.dim:
            return f"x is not [B, L, {block.dim}]"
        if not isinstance(e, torch.Tensor) or not _one_modulation(e, x):
            return "modulation is not one [6, C] per batch element (per-frame timesteps stay ComfyUI's)"
        if e.dtype != x.dtype:
            return f"modulation in {e.dtype}, x in {x.dtype}"
        if torch.is_grad_enabled() and (x.requires_grad or e.requires_grad):
            return "autograd records this call"
        for why in (layer_norm_modulate_refusal(x.device), norm_rope_refusal(x.device)):
            if why is not None:
                return why
        if not isinstance(freqs, torch.Tensor):
            return "no rope freqs tensor"
        freqs_table(freqs, x.shape[0], x.shape[1], block.self_attn.head_dim)  # raises with the reason
        return None

    def _fused(self, x, e, freqs, context, context_img_len=257, transformer_options={}):
        block = self.module
        model_management = _wan_globals(block)["comfy"].model_management
        modulation = model_management.cast_to(block.modulation, dtype=x.dtype, device=x.device)
        # ComfyUI 0.3.x hands [B, 6, C]; 0.4+ [B, T, 6, C] with T = 1 here (_one_modulation).
        e = (modulation + e).chunk(6, dim=1) if e.dim() == 3 else (modulation.unsqueeze(0) + e).unbind(2)
        x = x.contiguous()
        rows_ok = _fp8_rows_refusal(x.device) is None
        _, h, rows = residual_layer_norm_modulate(x, e[0], e[1], block.norm1.eps,
                                                  fp8_rows=self._wants_rows("qkv", rows_ok))
        y = _self_attention(block.self_attn, h, freqs, transformer_options, rows, self._rows_read("qkv"))
        x, normed, rows = _gated_residual_norm3(block.norm3, x, y, e[2], self._wants_rows("cross_q", rows_ok))
        del y, h
        with _rows_scope(normed, rows, self._rows_read("cross_q")):
            y = block.cross_attn(normed, context, context_img_len=context_img_len,
                                 transformer_options=transformer_options)
        del normed
        # x + cross-attention, then norm2 and its modulation, in one pass.
        x, h, rows = residual_layer_norm_modulate(x, e[3], e[4], block.norm2.eps, residual=y,
                                                  fp8_rows=self._wants_rows("ffn", rows_ok))
        with _rows_scope(h, rows, self._rows_read("ffn")):
            y = block.ffn(h)
        return gated_residual(x, y, e[5])


def _may_read_rows(linear, x: torch.Tensor) -> bool:
    """False where `linear` carries our Linear patch (ComfyUI installs object patches as the
    module's own `forward`) and hands x back for its token count (Flux's 512-token text
    stream): its rows would go unread, and the rowless kernel variant FP8_ROWS_MISSES calls
    later would compile in the middle of sampling."""
    forward = getattr(linear, "__dict__", {}).get("forward")
    if not isinstance(forward, LinearLayer):
        return True
    return x.numel() // max(x.shape[-1], 1) >= forward.state.min_tokens


@functools.lru_cache(maxsize=16)
def _fp8_rows_refusal(device: torch.device) -> str | None:
    """Why the norm kernels cannot emit e4m3 rows on `device` (sm_89+, the FP8 Linear's rule)."""
    return fp8_device_refusal(device, "FP8 activation rows")


@contextlib.contextmanager
def _rows_scope(x: torch.Tensor, rows, note):
    """quantize_once(x, rows) where the norm kernel made rows (the Linear that reads x reads them
    instead of quantising x), then note(whether a GEMM did); nothing where it made none."""
    if rows is None:
        yield
        return
    with quantize_once(x, rows) as scope:
        yield
    note(scope.used > 0)


def _one_modulation(e: torch.Tensor, x: torch.Tensor) -> bool:
    """e is one set of 6 modulation vectors per batch element: [B, 6, C] (ComfyUI 0.3.x) or
    [B, 1, 6, C] (0.4+, whose per-frame timesteps make that 1 the frame count), B 1 or x's."""
    shape = tuple(e.shape)
    if len(shape) == 4 and shape[1] == 1:
        shape = (shape[0], shape[2], shape[3])
    return len(shape) == 3 and shape[1] == 6 and shape[2] == x.shape[-1] and shape[0] in (1, x.shape[0])


def _bind_names(names: tuple, required: int, args, kwargs) -> dict:
    """A forward's arguments by name, `names` its parameters in order, the first `required` of
    them without defaults (raises TypeError for any other call)."""
    if len(args) > len(names) or set(kwargs) - set(names):
        raise TypeError("not the block's forward arguments")
    call = dict(zip(names, args))
    for key, value in kwargs.items():
        if key in call:
            raise TypeError(f"{key} given twice")
        call[key] = value
    if any(n not in call for n in names[:required]):
        raise TypeError(f"{', '.join(names[:required])} are required")
    return call


def _bind(args, kwargs) -> dict:
    """WanAttentionBlock.forward's arguments by name (raises TypeError for any other call)."""
    call = _bind_names(("x", "e", "freqs", "context", "context_img_len", "transformer_options"), 4, args, kwargs)
    call.setdefault("context_img_len", 257)
    call.setdefault("transformer_options", {})
    return call


def _wan_globals(block) -> dict:
    """The namespace ComfyUI's Wan module code runs in: what it calls optimized_attention and
    comfy.model_management, so ours calls the very same functions."""
    return type(block).forward.__globals__


def _norm_params(norm, x: torch.Tensor):
    """(weight, bias, release), each in x's dtype on x's device (None where the norm has none),
    the way ComfyUI's norms get them: cast by comfy.ops (LoRA weight functions, offloading,
    dynamic VRAM) where the module casts, its own parameters otherwise."""
    weight = module_attr(norm, "weight")  # not getattr: nn.Module.__getattr__ costs microseconds
    if weight is None:
        return None, None, None
    bias = module_attr(norm, "bias")
    if not _casts_weights(norm) and all(t is None or (t.device == x.device and t.dtype == x.dtype)
                                        for t in (weight, bias)):
        return weight, bias, None
    ops = sys.modules.get("comfy.ops")
    cast = getattr(ops, "cast_bias_weight", None)
    if cast is None:
        return tuple(None if t is None else t.to(device=x.device, dtype=x.dtype) for t in (weight, bias)) + (None,)
    if _takes_offloadable(cast):  # ComfyUI 0.4+: hand the cast back after use
        w, b, stream = cast(norm, x, offloadable=True)
        return w, b, (lambda: ops.uncast_bias_weight(norm, w, b, stream))
    w, b = cast(norm, x)
    return w, b, None


def _casts_weights(module: torch.nn.Module) -> bool:
    """Whether comfy.ops casts this module's weight per call (manual cast, offloading, LoRA
    weight functions): ComfyUI sets these on the instance over class-level defaults."""
    d, cls = module.__dict__, type(module)
    return bool(d.get("comfy_cast_weights", getattr(cls, "comfy_cast_weights", False))
                or d.get("weight_function", getattr(cls, "weight_function", ()))
                or d.get("bias_function", getattr(cls, "bias_function", ())))


@functools.lru_cache(maxsize=4)
def _takes_offloadable(cast) -> bool:
    """Whether comfy.ops.cast_bias_weight has ComfyUI 0.4+'s offloadable argument (read once:
    every fused block call asks)."""
    return "offloadable" in inspect.signature(cast).parameters


def _norm_rope(norm, x: torch.Tensor, freqs: torch.Tensor, head_dim: int) -> torch.Tensor:
    weight, _, release = _norm_params(norm, x)
    try:
        return rms_norm_rope(x, weight, freqs, norm.eps, head_dim)
    finally:
        if release is not None:
            release()


def _gated_residual_norm3(norm, x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, fp8_rows: bool = False):
    """(x + y * gate, norm3 of it, the norm's e4m3 rows or None) in one pass where norm3 is
    ComfyUI's LayerNorm over the channels (Wan's cross_attn_norm) or an Identity; any other norm
    runs as it is on the fused residual. Rows only where asked and the norm is fused."""
    if isinstance(norm, torch.nn.LayerNorm) and tuple(norm.normalized_shape) == (x.shape[-1],):
        weight, bias, release = _norm_params(norm, x)
        try:
            if (weight is None) == (bias is None):
                if fp8_rows:
                    return gated_residual_layer_norm_rows(x, y, gate, norm.eps, weight, bias)
                return (*gated_residual_layer_norm(x, y, gate, norm.eps, weight, bias), None)
        finally:
            if release is not None:
                release()
    h = gated_residual(x, y, gate)
    return h, (h if isinstance(norm, torch.nn.Identity) else norm(h)), None


def _self_attention(attn, x: torch.Tensor, freqs: torch.Tensor, transformer_options: dict, rows=None,
                    note=None) -> torch.Tensor:
    """WanSelfAttention.forward with each of q and k normalised and rotated in one pass (calls
    with attn1 patches never get here). x is the fused LayerNorm's fresh output, read by the q,
    k and v Linears and written by nobody: our FP8 Linear quantises it once for the three, or
    reads `rows` (x's e4m3 rows from the norm kernel, then note(whether a GEMM did))."""
    b, s, n, d = *x.shape[:2], attn.num_heads, attn.head_dim
    with quantize_once(x, rows) as scope:
        q = _norm_rope(attn.norm_q, attn.q(x), freqs, d)
        k = _norm_rope(attn.norm_k, attn.k(x), freqs, d)
        v = attn.v(x)
    if rows is not None and note is not None:
        note(scope.used > 0)
    out = _wan_globals(attn)["optimized_attention"](q.view(b, s, n * d), k.view(b, s, n * d), v.view(b, s, n * d),
                                                     heads=n, transformer_options=transformer_options)
    return attn.o(out)


def _is_own_forward(module: torch.nn.Module, class_name: str, module_name: str = WAN_MODULE) -> bool:
    cls = type(module)
    return (cls.__name__ == class_name and cls.__module__ == module_name
            and getattr(cls.forward, "__qualname__", "") == f"{class_name}.forward")


# ---- Flux's QKNorm (comfy/ldm/flux/layers.py: Flux, Chroma, HunyuanVideo...) -------------------

class FusedQKNorm(_GuardedPatch):
    """The object patch of one QKNorm's forward(q, k, v): both per-head RMSNorms in one
    kernel (kernels/fused/qk_norm.py) reading the permuted q / k views as they are."""

    PATH = PATH_QK

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.previous(*args, **kwargs)
        q, k, v = args if len(args) == 3 and not kwargs else (None, None, None)
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            return self._original(args, kwargs, "arguments other than QKNorm's (q, k, v)")
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            return self._original(args, kwargs, "autograd records this call")
        # qk_rms_norm raises QKNormInputError with the reason for a device or layout it cannot
        # serve: no separate refusal check on this path, which Flux takes ~76 times a step.
        return self._serve(args, kwargs, str(q.device), lambda: self._fused(q, k, v),
                           lambda ours, ref: _guard_failure(ours[0], ref[0]) or _guard_failure(ours[1], ref[1]))

    def _fused(self, q, k, v):
        module = self.module
        (wq, eps_q, release_q), (wk, eps_k, release_k) = (_qk_weight(module_attr(module, "query_norm"), q),
                                                          _qk_weight(module_attr(module, "key_norm"), k))
        try:
            if eps_q != eps_k:
                raise QKNormInputError("q and k norms with different eps")
            qo, ko = qk_rms_norm(q, k, wq, wk, eps_q)
        finally:
            for release in (release_q, release_k):
                if release is not None:
                    release()
        return qo.to(v), ko.to(v)


def _qk_weight(norm, x: torch.Tensor):
    """(weight in x's dtype on x's device, eps, release) as the norm's own forward gets them:
    ComfyUI 0.4+ builds QKNorm from comfy.ops' RMSNorm (a torch RMSNorm: its eps, or fp32's
    machine epsilon when None, as torch's rms_norm does); 0.3.x from flux.layers'
    RMSNorm (a `scale` parameter, eps 1e-6, cast to x by model_management.cast_to)."""
    if isinstance(norm, torch.nn.RMSNorm):
        weight, _, release = _norm_params(norm, x)
        if weight is None:
            raise QKNormInputError("QKNorm without a weight")
        # torch's rms_norm takes eps None as the epsilon of its fp32 opmath type, for 16-bit
        # inputs too (checked against torch 2.13's CPU kernel: bf16's own would move 8 % of values)
        eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
        return weight, eps, release
    scale = getattr(norm, "scale", None)
    if type(norm).__name__ == "RMSNorm" and type(norm).__module__ == FLUX_MODULE and isinstance(scale, torch.Tensor):
        return scale.to(device=x.device, dtype=x.dtype), 1e-6, None
    raise QKNormInputError(f"unknown QKNorm norm {type(norm).__name__}")


# ---- Flux's blocks (comfy/ldm/flux/layers.py: Flux, HunyuanVideo...) --------------------------

# SingleStreamBlock.forward / DoubleStreamBlock.forward's parameters, in order.
_SINGLE_ARGS = ("x", "vec", "pe", "attn_mask", "modulation_dims", "transformer_options")
_DOUBLE_ARGS = ("img", "txt", "vec", "pe", "attn_mask", "modulation_dims_img", "modulation_dims_txt",
                "transformer_options")


class _FusedFluxBlock(_RowsSites):
    """What Flux's two block patches share: the call checks, and ours running first on the
    checked call (ComfyUI's forward adds into its inputs in place)."""

    PATH = PATH_FLUX
    ARGS: tuple = ()
    TENSORS: tuple = ()  # the activations, [B, L, hidden]
    MODULATION_DIMS: tuple = ()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # TRITON_ACCEL_FUSED_ROPE, read when the node patches (as TRITON_ACCEL_FUSED_NORMS is).
        self.fuse_rope = env_settings.fused_rope_enabled()

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.previous(*args, **kwargs)
        try:
            call = _bind_names(self.ARGS, len(self.TENSORS) + 2, args, kwargs)
            reason = self._refusal(call)
        except TypeError as e:
            reason = f"arguments: {e}"
        if reason is not None:
            return self._original(args, kwargs, reason)
        return self._serve(args, kwargs, str(call[self.TENSORS[0]].device), lambda: self._fused(**call),
                           self._compare, ours_first=True)

    def _refusal(self, call: dict) -> str | None:
        options = call.get("transformer_options")
        patches = options.get("patches", {}) if isinstance(options, dict) else {}
        if "attn1_patch" in patches or "attn1_output_patch" in patches:
            return REASON_PATCHES
        if any(call.get(name) is not None for name in self.MODULATION_DIMS):
            return "per-token modulation (modulation_dims) stays ComfyUI's"
        hidden = self.module.hidden_size
        for name in self.TENSORS:
            x = call[name]
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != hidden:
                return f"{name} is not [B, L, {hidden}]"
            if torch.is_grad_enabled() and x.requires_grad:
                return "autograd records this call"
        return layer_norm_modulate_refusal(call[self.TENSORS[0]].device)

    def _compare(self, ours, reference) -> str | None:
        if isinstance(reference, torch.Tensor):
            return _guard_failure(ours, reference)
        return next((f for f in map(_guard_failure, ours, reference) if f is not None), None)


class FusedFluxSingleBlock(_FusedFluxBlock):
    """The object patch of one SingleStreamBlock's forward: the pre-norm + modulation in one
    pass (with linear1's e4m3 rows on sm_89+) and the gated residual in one, ComfyUI's modules
    (Linears, QKNorm, attention, MLP activation) in between."""

    ARGS = _SINGLE_ARGS
    TENSORS = ("x",)
    MODULATION_DIMS = ("modulation_dims",)

    def _fused(self, x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options=None):
        block = self.module
        x = _unit_last_stride(x)
        shift, scale, gate = _mod_vectors(block.modulation(vec)[0] if block.modulation is not None else vec)
        rows_ok = _fp8_rows_refusal(x.device) is None
        _, h, rows = residual_layer_norm_modulate(x, shift, scale, block.pre_norm.eps,
                                                  fp8_rows=self._wants_rows("linear1", rows_ok, block.linear1, x))
        with _rows_scope(h, rows, self._rows_read("linear1")):
            y = block.linear1(h)
        del h
        first = getattr(block, "mlp_hidden_dim_first", block.mlp_hidden_dim)  # ComfyUI 0.3.x: mlp_hidden_dim
        qkv, mlp = torch.split(y, [3 * block.hidden_size, first], dim=-1)
        q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, block.num_heads, -1).permute(2, 0, 3, 1, 4)
        del qkv
        options = {} if transformer_options is None else transformer_options
        attn = None
        if _rope_refusal(block, (block.norm,), pe, self.fuse_rope) is None:
            try:
                attn = _rope_attention(block, [(block.norm, q, k)], v, pe, attn_mask, options)
            except QKNormRopeInputError:
                attn = None  # this call: the norm, then ComfyUI's attention with its RoPE
        if attn is None:
            q, k = block.norm(q, k, v)
            attn = _flux_attention(block)(q, k, v, pe=pe, mask=attn_mask, transformer_options=options)
        del q, k, v
        if getattr(block, "yak_mlp", False):
            mlp = block.mlp_act(mlp[..., first // 2:]) * mlp[..., :first // 2]
        else:
            mlp = block.mlp_act(mlp)
        h, rows = _cat_with_rows(attn, mlp, self._wants_rows("linear2", rows_ok, block.linear2, x))
        del attn, mlp
        with _rows_scope(h, rows, self._rows_read("linear2")):
            y = block.linear2(h)
        del h
        x = gated_residual(x, y, gate, round_product=True)
        return _fp16_finite(x)


class FusedFluxDoubleBlock(_FusedFluxBlock):
    """The object patch of one DoubleStreamBlock's forward: per stream (image, text), norm1 +
    modulation in one pass; after the attention, the projection's gated residual with norm2 +
    modulation in one (img += proj * gate1, then the MLP's input); the MLP's gated residual in
    one; on sm_89+ the two norm passes write the e4m3 rows of the Linear after them."""

    ARGS = _DOUBLE_ARGS
    TENSORS = ("img", "txt")
    MODULATION_DIMS = ("modulation_dims_img", "modulation_dims_txt")

    def _fused(self, img, txt, vec, pe, attn_mask=None, modulation_dims_img=None, modulation_dims_txt=None,
               transformer_options=None):
        block = self.module
        if getattr(block, "modulation", True):  # ComfyUI 0.3.x's blocks always modulate
            img_mod1, img_mod2 = block.img_mod(vec)
            txt_mod1, txt_mod2 = block.txt_mod(vec)
        else:
            (img_mod1, img_mod2), (txt_mod1, txt_mod2) = vec
        img, txt = _unit_last_stride(img), _unit_last_stride(txt)
        rows_ok = _fp8_rows_refusal(img.device) is None
        options = {} if transformer_options is None else transformer_options
        rope = _rope_refusal(block, (block.img_attn.norm, block.txt_attn.norm), pe, self.fuse_rope) is None
        img_q, img_k, img_v = self._qkv("img", block.img_norm1, block.img_attn, img, img_mod1, rows_ok, not rope)
        txt_q, txt_k, txt_v = self._qkv("txt", block.txt_norm1, block.txt_attn, txt, txt_mod1, rows_ok, not rope)
        attn = None
        if rope:
            try:
                # The text stream's rows, then the image stream's, into one q and one k.
                attn = _rope_attention(block, [(block.txt_attn.norm, txt_q, txt_k), (block.img_attn.norm, img_q, img_k)],
                                       torch.cat((txt_v, img_v), dim=2), pe, attn_mask, options)
            except QKNormRopeInputError:  # this call: the norms, then ComfyUI's attention with its RoPE
                txt_q, txt_k = block.txt_attn.norm(txt_q, txt_k, txt_v)
                img_q, img_k = block.img_attn.norm(img_q, img_k, img_v)
        if attn is None:
            q = torch.cat((txt_q, img_q), dim=2)
            k = torch.cat((txt_k, img_k), dim=2)
            v = torch.cat((txt_v, img_v), dim=2)
            attn = _flux_attention(block)(q, k, v, pe=pe, mask=attn_mask, transformer_options=options)
            del q, k, v
        del txt_q, img_q, txt_k, img_k, txt_v, img_v
        txt_attn, img_attn = attn[:, :txt.shape[1]], attn[:, txt.shape[1]:]
        img = self._mlp("img", block.img_attn.proj, block.img_norm2, block.img_mlp, img, img_attn, img_mod1, img_mod2,
                        rows_ok)
        del img_attn
        txt = self._mlp("txt", block.txt_attn.proj, block.txt_norm2, block.txt_mlp, txt, txt_attn, txt_mod1, txt_mod2,
                        rows_ok)
        return img, _fp16_finite(txt)

    def _qkv(self, stream: str, norm, attn, x, mod, rows_ok: bool, normalise: bool = True):
        """q, k, v of one stream ([B, H, L, D] views of its qkv Linear's output), q and k through
        the stream's QKNorm when `normalise` (else _rope_attention normalises them)."""
        shift, scale, _ = _mod_vectors(mod)
        site = stream + "_qkv"
        _, h, rows = residual_layer_norm_modulate(x, shift, scale, norm.eps,
                                                  fp8_rows=self._wants_rows(site, rows_ok, attn.qkv, x))
        with _rows_scope(h, rows, self._rows_read(site)):
            qkv = attn.qkv(h)
        del h
        q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, self.module.num_heads, -1).permute(2, 0, 3, 1, 4)
        del qkv
        if normalise:
            q, k = attn.norm(q, k, v)
        return q, k, v

    def _mlp(self, stream: str, proj, norm2, mlp, x, attn_out, mod1, mod2, rows_ok: bool):
        """x + proj(attn_out) * gate1, norm2 + modulation of that, and the MLP's gated residual."""
        gate1 = _mod_vectors(mod1)[2]
        shift2, scale2, gate2 = _mod_vectors(mod2)
        site = stream + "_mlp"
        first = mlp[0] if isinstance(mlp, torch.nn.Sequential) and len(mlp) else None
        x, h, rows = residual_layer_norm_modulate(x, shift2, scale2, norm2.eps, residual=proj(attn_out), gate=gate1,
                                                  round_product=True,
                                                  fp8_rows=self._wants_rows(site, rows_ok, first, x))
        with _rows_scope(h, rows, self._rows_read(site)):
            y = mlp(h)
        del h
        return gated_residual(x, y, gate2, round_product=True)


def _cat_with_rows(attn: torch.Tensor, mlp: torch.Tensor, want_rows: bool):
    """(torch.cat((attn, mlp), 2), its FP8 Linear e4m3 rows or None): both from one pass of
    kernels/linear/cat_fp8_rows.py where the rows are wanted and the kernel takes the call."""
    if want_rows:
        try:
            return cat_fp8_rows(attn, mlp)
        except CatRowsInputError:
            pass
    return torch.cat((attn, mlp), 2), None


def _mod_vectors(mod) -> tuple:
    """(shift, scale, gate) of one of Flux's ModulationOut."""
    try:
        return mod.shift, mod.scale, mod.gate
    except AttributeError:
        raise LayerNormModulateInputError(f"modulation {type(mod).__name__} has no shift/scale/gate") from None


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """x as the row kernels read it (HunyuanVideo hands its text stream over as a strided view)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _fp16_finite(x: torch.Tensor) -> torch.Tensor:
    """What Flux's blocks do to a float16 residual stream they return."""
    if x.dtype == torch.float16:
        return torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504)
    return x


def _flux_attention(block):
    """The attention function ComfyUI's flux layers call (comfy.ldm.flux.math.attention, as their
    module imported it): RoPE, then optimized_attention with the model's overrides."""
    return type(block).forward.__globals__["attention"]


def _rope_refusal(block, norms: tuple, pe, enabled: bool = True) -> str | None:
    """Why a Flux-layer block's q/k norm and RoPE cannot run as _rope_attention (None: they can):
    TRITON_ACCEL_FUSED_ROPE off when the block was patched (`enabled`), no rope, an attention
    function other than ComfyUI's (a node that replaced it keeps its own), or a QKNorm another
    node patched."""
    if not enabled:
        return "TRITON_ACCEL_FUSED_ROPE is off"
    if not isinstance(pe, torch.Tensor):
        return "no rope"
    attention = _flux_attention(block)
    if (getattr(attention, "__module__", None) != FLUX_MATH_MODULE or getattr(attention, "__name__", None) != "attention"
            or "optimized_attention" not in getattr(attention, "__globals__", {})):
        return "the block's attention function is not ComfyUI's flux attention"
    for norm in norms:
        forward = getattr(norm, "__dict__", {}).get("forward")
        if forward is not None and not isinstance(forward, FusedQKNorm):
            return "another node patches the QKNorm"
    return None


def _rope_attention(block, parts: list, v: torch.Tensor, pe: torch.Tensor, mask, transformer_options: dict):
    """What comfy.ldm.flux.math.attention computes for q = cat(q_i), k = cat(k_i) of `parts`
    [(QKNorm module, q_i, k_i)] (in sequence order, each not yet normalised) and v, with each
    part's QKNorm and the RoPE in one kernel (kernels/fused/qk_norm_rope.py) writing its rows into one
    q and one k of [B, L, H, D] memory: no concatenation, no RoPE pass, and an attention output
    whose [B, L, H * D] form is a view (torch's SDPA and our kernels allocate it in q's layout).
    Raises QKNormRopeInputError for a call the kernel cannot serve, before anything runs."""
    first = parts[0][1]
    bsz, heads, _, head_dim = first.shape
    if any(q.dtype != v.dtype for _, q, _ in parts):
        raise QKNormRopeInputError(f"q in {first.dtype}, v in {v.dtype}")
    length = sum(q.shape[2] for _, q, _ in parts)
    q_all = torch.empty((bsz, length, heads, head_dim), dtype=first.dtype, device=first.device).transpose(1, 2)
    k_all = torch.empty((bsz, length, heads, head_dim), dtype=first.dtype, device=first.device).transpose(1, 2)
    releases = []
    try:
        weights = []
        for norm, q, k in parts:  # every weight first: a refused call writes nothing
            wq, eps_q, release = _qk_weight(module_attr(norm, "query_norm"), q)
            releases.append(release)
            wk, eps_k, release = _qk_weight(module_attr(norm, "key_norm"), k)
            releases.append(release)
            if eps_q != eps_k:
                raise QKNormRopeInputError("q and k norms with different eps")
            weights.append((wq, wk, eps_q))
        offset = 0
        for (_, q, k), (wq, wk, eps) in zip(parts, weights):
            qk_rms_norm_rope(q, k, wq, wk, eps, pe, q_all, k_all, offset)
            offset += q.shape[2]
    except QKNormInputError as e:
        raise QKNormRopeInputError(e.reason) from None
    finally:
        for release in releases:
            if release is not None:
                release()
    optimized_attention = _flux_attention(block).__globals__["optimized_attention"]
    return optimized_attention(q_all, k_all, v, heads, skip_reshape=True, mask=mask,
                               transformer_options=transformer_options)


def fusable_flux_block(block: torch.nn.Module) -> str | None:
    """Why `block` is not a Flux-layer block this patch knows (None: it is)."""
    if _is_own_forward(block, "SingleStreamBlock", FLUX_MODULE):
        norms = ("pre_norm",)
        modules = ("linear1", "linear2", "norm", "mlp_act")
    elif _is_own_forward(block, "DoubleStreamBlock", FLUX_MODULE):
        if getattr(block, "flipped_img_txt", False):
            return "a block with flipped_img_txt"
        norms = ("img_norm1", "img_norm2", "txt_norm1", "txt_norm2")
        modules = ("img_attn", "txt_attn", "img_mlp", "txt_mlp")
    else:
        return f"{type(block).__name__} is not ComfyUI's flux SingleStreamBlock / DoubleStreamBlock"
    hidden, heads = getattr(block, "hidden_size", None), getattr(block, "num_heads", None)
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0 or hidden % heads:
        return "heads do not tile the hidden size"
    for name in modules:
        if not isinstance(getattr(block, name, None), torch.nn.Module):
            return f"no {name} module"
    for name in norms:
        norm = getattr(block, name, None)
        if not isinstance(norm, torch.nn.LayerNorm) or norm.weight is not None \
                or tuple(norm.normalized_shape) != (hidden,):
            return f"{name} is not a LayerNorm over {hidden} channels without affine"
    return None


def fusable_qk_norm(module: torch.nn.Module) -> str | None:
    """Why `module` is not a QKNorm this patch knows (None: it is)."""
    if not _is_own_forward(module, "QKNorm", FLUX_MODULE):
        return f"{type(module).__name__} is not ComfyUI's flux QKNorm"
    for name in ("query_norm", "key_norm"):
        norm = getattr(module, name, None)
        if isinstance(norm, torch.nn.RMSNorm):
            if getattr(norm, "weight", None) is None:
                return f"{name} has no weight"
        elif not (type(norm).__name__ == "RMSNorm" and type(norm).__module__ == FLUX_MODULE
                  and _is_own_forward(norm, "RMSNorm", FLUX_MODULE)):
            return f"{name} is not an RMSNorm"
    return None


def fusable_block(block: torch.nn.Module) -> str | None:
    """Why `block` is not a Wan attention block this patch knows (None: it is)."""
    if not _is_own_forward(block, "WanAttentionBlock"):
        return f"{type(block).__name__} is not ComfyUI's WanAttentionBlock"
    attn = getattr(block, "self_attn", None)
    if attn is None or not _is_own_forward(attn, "WanSelfAttention"):
        return "self-attention is not ComfyUI's WanSelfAttention"
    for name in ("norm_q", "norm_k"):
        norm = getattr(attn, name, None)
        if not isinstance(norm, torch.nn.RMSNorm) or getattr(norm, "eps", None) is None \
                or tuple(norm.normalized_shape) != (block.dim,):
            return f"{name} is not an RMSNorm over {block.dim} channels with eps"
    for name in ("norm1", "norm2"):
        norm = getattr(block, name, None)
        if not isinstance(norm, torch.nn.LayerNorm) or norm.weight is not None \
                or tuple(norm.normalized_shape) != (block.dim,):
            return f"{name} is not a LayerNorm over {block.dim} channels without affine"
    if attn.head_dim % 2 or block.dim != attn.num_heads * attn.head_dim:
        return "heads do not tile the channels in even head dims"
    return None


def enabled() -> bool:
    return env_settings.fused_norms() != "off"


def patch_fused_norms(patched, label: str) -> int:
    """Put the fused-norm object patches (Wan blocks, Flux-layer QKNorms and blocks, by
    TRITON_ACCEL_FUSED_NORMS) on every fusable module of `patched` (a ModelPatcher clone,
    changed in place); returns how many. Modules already patched are left as they are."""
    diffusion_model = getattr(getattr(patched, "model", None), "diffusion_model", None)
    if not isinstance(diffusion_model, torch.nn.Module):
        return 0
    mode = env_settings.fused_norms()
    # Flux's QKNorms unless TRITON_ACCEL_FUSED_NORMS=blocks: 10-11 ms less GPU time in a Flux
    # 1024² step (session 32's profiles on an H100: 105.0 / 106.6 against 116.2 / 116.5 ms).
    count = _patch_qk_norms(patched, diffusion_model, label) if mode in ("all", "qk") else 0
    if mode == "all":
        count += _patch_blocks(patched, diffusion_model, "double_blocks", FusedFluxDoubleBlock, fusable_flux_block,
                               label)
        count += _patch_blocks(patched, diffusion_model, "single_blocks", FusedFluxSingleBlock, fusable_flux_block,
                               label)
    count += _patch_blocks(patched, diffusion_model, "blocks", FusedWanBlock, fusable_block, label)
    if count:
        _add_multigpu_callbacks(patched)
        log.info("Triton Accel fused norms (%s): %d blocks / QKNorms patched", label, count)
    return count


def _patch_blocks(patched, diffusion_model: torch.nn.Module, attr: str, cls, fusable, label: str) -> int:
    """Object patches of class `cls` on the blocks of diffusion_model.<attr> that `fusable`
    accepts, one Guard for them all; how many were added."""
    count = 0
    blocks = getattr(diffusion_model, attr, None)
    guard = Guard()
    for i, block in enumerate(blocks if isinstance(blocks, torch.nn.ModuleList) else ()):
        if fusable(block) is not None:
            continue
        key = f"diffusion_model.{attr}.{i}.forward"
        previous = patched.get_model_object(key)
        if not (isinstance(previous, types.MethodType) and previous.__self__ is block):
            continue  # ours already, or another node's patch: left alone
        patched.add_object_patch(key, cls(label, f"{attr}.{i}", block, previous, guard))
        count += 1
    return count


def _patch_qk_norms(patched, diffusion_model: torch.nn.Module, label: str) -> int:
    count = 0
    guard = Guard()
    for name, module in diffusion_model.named_modules():
        if not name or fusable_qk_norm(module) is not None:
            continue
        key = f"diffusion_model.{name}.forward"
        previous = patched.get_model_object(key)
        if not (isinstance(previous, types.MethodType) and previous.__self__ is module):
            continue  # ours already, or another node's patch: left alone
        patched.add_object_patch(key, FusedQKNorm(label, name, module, previous, guard))
        count += 1
    return count


def _add_multigpu_callbacks(patched) -> None:
    add = getattr(patched, "add_callback_with_key", None)
    if add is None:
        return
    try:
        from comfy.patcher_extension import CallbacksMP

        names = (getattr(CallbacksMP, "ON_DEEPCLONE_MULTIGPU", "on_deepclone_multigpu"),
                 getattr(CallbacksMP, "ON_MATCH_MULTIGPU_CLONES", "on_match_multigpu_clones"))
    except ImportError:  # outside ComfyUI (tests): the names ComfyUI uses
        names = ("on_deepclone_multigpu", "on_match_multigpu_clones")
    for name in names:
        if CALLBACK_KEY not in getattr(patched, "callbacks", {}).get(name, {}):
            add(name, CALLBACK_KEY, on_multigpu_clone)


def on_multigpu_clone(source, clone) -> None:
    """ComfyUI's MultiGPU clone callbacks: the clone carries its own copy of the model on
    another GPU, but copies of `source`'s object patches, which wrap `source`'s blocks. Point
    each at the clone's own block (and its own forward), with a guard of its own."""
    diffusion_model = getattr(getattr(clone, "model", None), "diffusion_model", None)
    for key, value in list(clone.object_patches.items()):
        if not isinstance(value, (FusedWanBlock, FusedQKNorm, _FusedFluxBlock)):
            continue
        try:
            module = diffusion_model.get_submodule(value.name)
        except AttributeError:
            module = None
        if module is value.module:
            continue
        fusable = (fusable_block if isinstance(value, FusedWanBlock)
                   else fusable_flux_block if isinstance(value, _FusedFluxBlock) else fusable_qk_norm)
        if module is None or fusable(module) is not None:
            del clone.object_patches[key]
            continue
        clone.object_patches[key] = type(value)(value.label, value.name, module,
                                                types.MethodType(type(module).forward, module), value.guard)


def _guard_failure(ours: torch.Tensor, reference: torch.Tensor) -> str | None:
    return guard_failure(ours, reference, GUARD_MAX_REL_L2)
