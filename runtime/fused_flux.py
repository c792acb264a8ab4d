"""Flux-layer models (comfy/ldm/flux/layers.py: Flux, Chroma, HunyuanVideo...) in fused norm
passes: QKNorm, and the double / single stream blocks' norm, modulation and residual passes
(fused_norms.py says what and why)."""
from __future__ import annotations

import logging

import torch

from ..kernels.core import env_settings
from ..kernels.linear.cat_fp8_rows import CatRowsInputError, cat_fp8_rows
from ..kernels.fused.gated_residual_norm import (gated_residual)
from ..kernels.fused.layer_norm_modulate import LayerNormModulateInputError, residual_layer_norm_modulate
from ..kernels.fused.layer_norm_modulate import refusal as layer_norm_modulate_refusal
from ..kernels.fused.qk_norm import QKNormInputError, qk_rms_norm
from ..kernels.fused.qk_norm_rope import QKNormRopeInputError, qk_rms_norm_rope
from .linear_common import module_attr
from .fused_block_patch import (FLUX_MATH_MODULE, FLUX_MODULE, GuardedPatch, PATH_FLUX, PATH_QK, REASON_PATCHES,
                                RowsSites, bind_names, block_guard_failure, fp8_rows_refusal, is_own_forward,
                                norm_params, rows_scope)

log = logging.getLogger("triton_accel.nodes.patch_fused_norms")  # not __name__: the clone's folder name


# ---- Flux's QKNorm (comfy/ldm/flux/layers.py: Flux, Chroma, HunyuanVideo...) -------------------

class FusedQKNorm(GuardedPatch):
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
                           lambda ours, ref: block_guard_failure(ours[0], ref[0]) or block_guard_failure(ours[1], ref[1]))

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
        weight, _, release = norm_params(norm, x)
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


class FusedFluxBlock(RowsSites):
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
            call = bind_names(self.ARGS, len(self.TENSORS) + 2, args, kwargs)
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
            return block_guard_failure(ours, reference)
        return next((f for f in map(block_guard_failure, ours, reference) if f is not None), None)


class FusedFluxSingleBlock(FusedFluxBlock):
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
        rows_ok = fp8_rows_refusal(x.device) is None
        _, h, rows = residual_layer_norm_modulate(x, shift, scale, block.pre_norm.eps,
                                                  fp8_rows=self._wants_rows("linear1", rows_ok, block.linear1, x))
        with rows_scope(h, rows, self._rows_read("linear1")):
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
        with rows_scope(h, rows, self._rows_read("linear2")):
            y = block.linear2(h)
        del h
        x = gated_residual(x, y, gate, round_product=True)
        return _fp16_finite(x)


class FusedFluxDoubleBlock(FusedFluxBlock):
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
        rows_ok = fp8_rows_refusal(img.device) is None
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
        with rows_scope(h, rows, self._rows_read(site)):
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
        with rows_scope(h, rows, self._rows_read(site)):
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
    if is_own_forward(block, "SingleStreamBlock", FLUX_MODULE):
        norms = ("pre_norm",)
        modules = ("linear1", "linear2", "norm", "mlp_act")
    elif is_own_forward(block, "DoubleStreamBlock", FLUX_MODULE):
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
    if not is_own_forward(module, "QKNorm", FLUX_MODULE):
        return f"{type(module).__name__} is not ComfyUI's flux QKNorm"
    for name in ("query_norm", "key_norm"):
        norm = getattr(module, name, None)
        if isinstance(norm, torch.nn.RMSNorm):
            if getattr(norm, "weight", None) is None:
                return f"{name} has no weight"
        elif not (type(norm).__name__ == "RMSNorm" and type(norm).__module__ == FLUX_MODULE
                  and is_own_forward(norm, "RMSNorm", FLUX_MODULE)):
            return f"{name} is not an RMSNorm"
    return None
