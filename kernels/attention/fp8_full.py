"""Full-FP8 attention forward for NVIDIA sm_89+: Q.K^T and P.V both on e4m3 tensor cores.

Inputs come from attention_fp8_quant.quantize_qkv (K and V smoothed by their means over the
sequence, Q/K per-block scales, V per-channel scales and transposed, outlier channels with a
residual side operand). One program owns BLOCK_M query rows of one (batch, head) and streams
keys in BLOCK_N tiles with an online softmax. Choices that matter:
- scores: S = (dot(q8, k8) + dot(q_side, k_side)) * (sq * sk), already in log2 units (the
  softmax scale and log2(e) live in sq), so p = exp2(S - m); the de-quantising multiply is
  folded into the exp2's argument (one FFMA per score);
- P is quantised to e4m3 after max subtraction, scaled to [0, 448] by shifting the max by
  log2(448) inside the exp2 (no extra multiply); the row sums l use the same scaled p, so
  the 448 cancels in acc / l;
- two-level P.V accumulation (TWO_LEVEL): each tile's dot starts from zero and is added in
  fp32 to the running accumulator (acc * alpha + pv is one FMA, what the rescale costs
  anyway). FP8 MMAs keep a short accumulator (SageAttention 2: ~22 bits, on Ada's mma.sync
  and Hopper's wgmma), so chaining every tile into one MMA accumulator over 30k keys would
  lose the small contributions; within one tile the sum runs over BLOCK_N keys only;
- the epilogue applies V's per-channel scale and adds V's mean back in fp32;
- no mask and no causal: quantisation statistics (means, outlier channels) are over all
  keys, and the kernel has no -inf bookkeeping beyond the last partial key tile. Such calls
  are refused by the launcher (and would be by the registry, see registry_constraints()).
Any lengths: Q/K/V are padded to whole tiles by the quantiser (zeros), the last key tile is
masked to -inf, padded query rows are never stored.
"""
from __future__ import annotations

import logging
import math

import torch

from ..core.kernel_common import tl, triton  # None, None where Triton does not import

from ..core import device as _device
from .checks import half_precision_refusal
from .fp8_quant import FP8_MAX, LOG2E, N_OUTLIER, padded_head_dim, quantize_qkv
from .ref import attention_ref
from ..core.gpu_rules import min_capability_for
from ..core.kernel_common import LAUNCH_OPTIONS, LOG2_P_SCALE, fp8_device_refusal

if triton is not None:
    from ..core.kernel_common import store_smoothed_out
    from .fp8_quant import cast_e4m3

log = logging.getLogger("triton_accel.kernels.attention.fp8_full")  # not __name__: the clone's folder name

MAX_HEAD_DIM = 128  # 128x128 fp32 accumulators: two of them (two-level P.V) fill the registers

# Per arch: BLOCK_M, BLOCK_N (also the quantisation block sizes), num_warps, num_stages,
# TWO_LEVEL (P.V per tile into a fresh accumulator, added in fp32). sm90: the winner of
# benchmarks/fp8_attention_bench.py's sweep (numbers in benchmarks/RESULTS.md); one-level
# accumulation was as accurate there.
# sm89/sm120: untimed, sized for ~100 KB of shared memory (39 KB as compiled by Triton 3.9).
FP8_FULL_CONFIGS = {
    "sm90": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, TWO_LEVEL=True),
    "sm89": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, TWO_LEVEL=True),
    # The interpreter runs on numpy: 32x32 tiles keep CPU tests fast and still loop.
    "interpreter": dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1, TWO_LEVEL=True),
}


class FP8FullUnsupportedError(RuntimeError):
    """The call or the device cannot be served by the full-FP8 kernel; the message says why."""


if triton is not None:

    @triton.jit
    def _fp8_full_tile(
        acc, l_i, m_i, q8, qs, q_scale,
        K8, KS, VT8, SK, start_n, offs_n, offs_d, LK, LK_PAD,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, N_OUT: tl.constexpr,
        BOUNDARY: tl.constexpr, EXACT_CAST: tl.constexpr, TWO_LEVEL: tl.constexpr,
    ):
        cols = start_n + offs_n
        k8 = tl.load(K8 + cols[:, None] * BLOCK_D + offs_d[None, :])
        s = tl.dot(q8, tl.trans(k8))
        if N_OUT > 0:
            ks = tl.load(KS + cols[:, None] * (2 * N_OUT) + tl.arange(0, 2 * N_OUT)[None, :])
            s = tl.dot(qs, tl.trans(ks), s)
        # De-quantisation folded into the exp2's argument (one FFMA per score): c > 0, so
        # max(s) * c is the max of the scaled scores.
        c = q_scale * tl.load(SK + start_n // BLOCK_N)
        if BOUNDARY:
            s = tl.where(cols[None, :] < LK, s, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(s, 1) * c)
        p = tl.math.exp2(s * c - (m_ij - LOG2_P_SCALE)[:, None])  # in [0, 448]
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(VT8 + offs_d[:, None] * LK_PAD + cols[None, :])
        p8 = cast_e4m3(p, EXACT_CAST)
        if TWO_LEVEL:
            acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(vt))
        else:
            acc = tl.dot(p8, tl.trans(vt), acc * alpha[:, None])
        return acc, l_i, m_ij

    @triton.jit
    def _attn_fp8_full_fwd(
        Q8, SQ, QS, K8, SK, KS, VT8, SV, VMEAN, O, LSE,
        stride_ob, stride_oh, stride_om, stride_od,
        H, LQ, LK, LQ_PAD, LK_PAD, NQB, NKB,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        N_OUT: tl.constexpr, EXACT_CAST: tl.constexpr, TWO_LEVEL: tl.constexpr, RETURN_LSE: tl.constexpr,
    ):
        start_m = tl.program_id(0)
        bh = tl.program_id(1)
        off_b = bh // H
        off_h = bh % H
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        # int64 bases: heads * length * dim passes 2**31 on video models.
        bh64 = bh.to(tl.int64)
        q8 = tl.load(Q8 + (bh64 * LQ_PAD + offs_m[:, None]) * BLOCK_D + offs_d[None, :])
        q_scale = tl.load(SQ + bh64 * NQB + start_m)
        if N_OUT > 0:
            qs = tl.load(QS + (bh64 * LQ_PAD + offs_m[:, None]) * (2 * N_OUT) + tl.arange(0, 2 * N_OUT)[None, :])
        else:
            qs = q_scale  # unused
        K8 += bh64 * LK_PAD * BLOCK_D
        KS += bh64 * LK_PAD * (2 * N_OUT)
        VT8 += bh64 * BLOCK_D * LK_PAD
        SK += bh64 * NKB

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        lk_full = (LK // BLOCK_N) * BLOCK_N
        for start_n in range(0, lk_full, BLOCK_N):
            acc, l_i, m_i = _fp8_full_tile(
                acc, l_i, m_i, q8, qs, q_scale, K8, KS, VT8, SK, start_n, offs_n, offs_d, LK, LK_PAD,
                BLOCK_N, BLOCK_D, N_OUT, False, EXACT_CAST, TWO_LEVEL)
        if lk_full < LK:
            acc, l_i, m_i = _fp8_full_tile(
                acc, l_i, m_i, q8, qs, q_scale, K8, KS, VT8, SK, lk_full, offs_n, offs_d, LK, LK_PAD,
                BLOCK_N, BLOCK_D, N_OUT, True, EXACT_CAST, TWO_LEVEL)

        sv = tl.load(SV + bh64 * BLOCK_D + offs_d)
        v_mean = tl.load(VMEAN + bh64 * BLOCK_D + offs_d)
        store_smoothed_out(acc, l_i, m_i, sv, v_mean, O, LSE, off_b, off_h, bh64, offs_m, offs_d,
                           stride_ob, stride_oh, stride_om, stride_od, LQ, HEAD_DIM, BLOCK_D, RETURN_LSE, True)


# ---- checks -------------------------------------------------------------------------------

def call_refusal(q, k, v, attn_mask=None, is_causal=False) -> str | None:
    """Why the kernel cannot serve these tensors (shapes, dtypes, mask, causal), or None."""
    reason = half_precision_refusal(q, k, v)
    if reason:
        return reason
    B, H, _, D = q.shape
    if k.shape[:2] != (B, H) or v.shape[:2] != (B, H):
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: batch and heads must match (no GQA)"
    if k.shape[2] != v.shape[2] or k.shape[3] != D or v.shape[3] != D:
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} must share length and q's head dim"
    if not 1 <= D <= MAX_HEAD_DIM:
        return f"head dim {D} outside 1..{MAX_HEAD_DIM}"
    if attn_mask is not None:
        return "attention masks are not supported (quantisation statistics are over all keys)"
    if is_causal:
        return "is_causal is not supported"
    return None


def device_refusal(device: torch.device) -> str | None:
    """Why the kernel cannot run on this device, or None (CPU: only through the interpreter)."""
    return fp8_device_refusal(device, "FP8 attention")


def default_config(device: torch.device) -> dict:
    if device.type == "cpu":
        return dict(FP8_FULL_CONFIGS["interpreter"])
    major = _device.describe(device).capability[0]
    return dict(FP8_FULL_CONFIGS["sm90" if major in (9, 10, 11) else "sm89"])


# ---- launch -------------------------------------------------------------------------------

def attention_fp8_full(q, k, v, attn_mask=None, scale=None, is_causal=False, config=None,
                       n_outlier: int = N_OUTLIER, return_lse: bool = False):
    """softmax(q k^T * scale) v with Q.K^T and P.V in float8 e4m3, quantisation included;
    [B, H, L, D] fp16/bf16 tensors (any strides), output in q's dtype laid out like
    torch.empty_like(q); with return_lse, (out, lse): lse float32 [B, H, Lq], the natural-log
    logsumexp of each row's scaled scores (as the quantized kernel saw them). Raises
    FP8FullUnsupportedError for masks, causal, GQA, head dims over 128, other dtypes, and
    devices below sm_89."""
    reason = call_refusal(q, k, v, attn_mask, is_causal) or device_refusal(q.device)
    if reason:
        raise FP8FullUnsupportedError(f"attention_fp8_full: {reason}")
    config = config or default_config(q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    interpreter = q.device.type == "cpu"
    qkv = quantize_qkv(q, k, v, scale, config["BLOCK_M"], config["BLOCK_N"], n_outlier, exact_cast=interpreter)
    if not return_lse:
        return attention_fp8_full_quantized(qkv, q.shape, k.shape[2], q.dtype, q.device, config)
    out, lse = attention_fp8_full_quantized(qkv, q.shape, k.shape[2], q.dtype, q.device, config, return_lse=True)
    return out, lse.add_(key_mean_shift(q, k, scale))


def key_mean_shift(q, k, scale: float) -> torch.Tensor:
    """scale * q.mean_k per query row, float32 [B, H, Lq]: what the quantisers' K smoothing
    (K minus its mean over the sequence) took out of every score of the row. The softmax does
    not see it, but a logsumexp merged with other key sets' must have it back: each set has
    its own mean. GQA: query head h reads KV head h // (H // HK)."""
    k_mean = k.mean(dim=2, dtype=torch.float32)  # [B, HK, D]
    if k.shape[1] != q.shape[1]:
        k_mean = k_mean.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.matmul(q.float(), k_mean.unsqueeze(-1)).squeeze(-1) * scale


def attention_fp8_full_quantized(qkv, q_shape, lk: int, dtype, device, config, return_lse: bool = False):
    """The attention kernel alone, on quantize_qkv's output (benchmarks time it separately).
    With return_lse, (out, lse of the smoothed scores): key_mean_shift() makes it the real one."""
    B, H, Lq, D = q_shape
    out = torch.empty(B, H, Lq, D, dtype=dtype, device=device)
    lse = torch.empty(B, H, Lq, dtype=torch.float32, device=device) if return_lse else None
    if out.numel() == 0:
        return (out, lse) if return_lse else out
    bh, lq_pad, block_d = qkv.q8.shape
    grid = (qkv.sq.shape[1], bh)
    _attn_fp8_full_fwd[grid](
        qkv.q8, qkv.sq, qkv.qs, qkv.k8, qkv.sk, qkv.ks, qkv.vt8, qkv.sv, qkv.vmean, out, lse,
        *out.stride(), H, Lq, lk, lq_pad, qkv.k8.shape[1], qkv.sq.shape[1], qkv.sk.shape[1],
        HEAD_DIM=D, BLOCK_M=qkv.block_m, BLOCK_N=qkv.block_n, BLOCK_D=block_d, N_OUT=qkv.n_outlier,
        EXACT_CAST=device.type == "cpu", TWO_LEVEL=config.get("TWO_LEVEL", True), RETURN_LSE=return_lse,
        num_warps=config["num_warps"], num_stages=config["num_stages"], **LAUNCH_OPTIONS)
    return (out, lse) if return_lse else out


# ---- registration facts (kernels/attention/dispatch.py would register it; not wired yet) -----------

def registry_constraints():
    """What the kernel serves, as the registry's Constraints: NVIDIA sm_89+ (fp8=True: gpu_rules
    refuses older GPUs; CPU only through the interpreter), fp16/bf16, head dims 1..128, no
    mask, no causal, no GQA."""
    from ..core.registry import Constraints

    return Constraints(
        device_types=frozenset({"cuda", "cpu"}), vendors=frozenset({"nvidia", "amd", "cpu"}),
        cpu_needs_interpreter=True, min_capability=min_capability_for(_device.triton_version()), fp8=True,
        dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=(1, MAX_HEAD_DIM),
        masks=frozenset({"none"}), gqa=False, causal=False)


# ---- references ---------------------------------------------------------------------------

def attention_fp8_full_ref(q, k, v, attn_mask=None, scale=None, is_causal=False):
    """The exact float32 answer, what accuracy is measured against (same signature)."""
    return attention_ref(q, k, v, attn_mask, scale, is_causal)


def attention_fp8_per_tensor(q, k, v, attn_mask=None, scale=None, is_causal=False):
    """Naive FP8 attention in torch, the baseline ours must beat: one e4m3 scale per tensor
    for Q, K and V, no smoothing, P scaled by 448; fp32 everywhere else."""
    del attn_mask, is_causal  # the baseline serves what the kernel serves
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)

    def fake_quant(x):
        x = x.float()
        s = x.abs().amax().clamp_min(1e-30) / FP8_MAX
        return (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s

    qf, kf, vf = fake_quant(q), fake_quant(k), fake_quant(v)
    p = torch.softmax(qf @ kf.transpose(-1, -2) * scale, dim=-1)
    p = (p * FP8_MAX).to(torch.float8_e4m3fn).float() / FP8_MAX
    return p @ vf


def accuracy_inputs(kind: str, shape, dtype=torch.bfloat16, device="cpu", seed: int = 0):
    """(q, k, v) for accuracy checks (tests and benchmarks share the recipe). "gauss": N(0, 1).
    "outlier", the layout real DiT activations show, per (batch, head), channels drawn at
    random: K with a large per-channel offset (N(0, 10^2), shared by all tokens); 4 Q channels
    scaled 6-12x; 4 V channels scaled 6-12x with offsets of a few units. The offsets are what
    sink per-tensor FP8 (they set the scale), the Q channels what limits per-block FP8 Q.K."""
    B, H, L, D = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=gen, device=device) for _ in range(3))
    if kind == "outlier":
        chans = torch.rand(B, H, D, generator=gen, device=device).argsort(dim=-1)[..., :min(8, D)]

        def per_channel(fill, cols, values):  # [B, H, 1, D]: `fill` except `values` on `cols`
            vals = torch.tensor(values, device=device, dtype=torch.float32)[: cols.shape[-1]]
            base = torch.full((B, H, D), fill, device=device)
            return base.scatter(-1, cols, vals.expand(B, H, -1)).unsqueeze(2)

        k += 10.0 * torch.randn(B, H, 1, D, generator=gen, device=device)
        q *= per_channel(1.0, chans[..., :4], [8.0, 10.0, 12.0, 6.0])
        v *= per_channel(1.0, chans[..., 4:8], [10.0, 8.0, 12.0, 6.0])
        v += per_channel(0.0, chans[..., 4:8], [5.0, -4.0, 3.0, 6.0])
    elif kind != "gauss":
        raise ValueError(f"unknown input kind {kind!r} (gauss, outlier)")
    return q.to(dtype), k.to(dtype), v.to(dtype)


def compile_specs(dtype: str, head_dim: int, config: dict, n_outlier: int = N_OUTLIER):
    """[(name, kernel, signature, constexprs, attrs, num_warps)] for
    triton.compile(ASTSource(...)): quantize_qkv's kernels, then the attention kernel,
    specialised as launches on contiguous [B, H, L, D] tensors specialise them."""
    from .fp8_quant import compile_specs as quant_specs

    names = ["Q8", "SQ", "QS", "K8", "SK", "KS", "VT8", "SV", "VMEAN", "O", "LSE",
             "stride_ob", "stride_oh", "stride_om", "stride_od", "H", "LQ", "LK", "LQ_PAD", "LK_PAD", "NQB", "NKB"]
    types = dict(O=f"*{dtype}", **{n: "*fp8e4nv" for n in ("Q8", "QS", "K8", "KS", "VT8")},
                 **{n: "*fp32" for n in ("SQ", "SK", "SV", "VMEAN")})
    sig = {n: types.get(n, "i32") for n in names}
    const = dict(LSE=None, stride_od=1, HEAD_DIM=head_dim, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
                 BLOCK_D=padded_head_dim(head_dim), N_OUT=n_outlier, EXACT_CAST=False,
                 TWO_LEVEL=config.get("TWO_LEVEL", True), RETURN_LSE=False)
    for n in const:
        sig[n] = "constexpr"
    order = list(sig)
    aligned = ["Q8", "QS", "K8", "KS", "VT8", "SV", "VMEAN", "O", "stride_ob", "stride_oh", "stride_om",
               "LQ_PAD", "LK_PAD"]
    attrs = {(order.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return quant_specs(dtype, head_dim, config["BLOCK_M"], config["BLOCK_N"], n_outlier) + [
        ("_attn_fp8_full_fwd", _attn_fp8_full_fwd, sig, const, attrs, config["num_warps"])]


__all__ = ["attention_fp8_full", "accuracy_inputs", "key_mean_shift", "compile_specs", "attention_fp8_full_quantized",
           "attention_fp8_full_ref",
           "attention_fp8_per_tensor", "call_refusal", "device_refusal", "registry_constraints",
           "FP8FullUnsupportedError", "FP8_FULL_CONFIGS", "MAX_HEAD_DIM", "LOG2E", "padded_head_dim"]
