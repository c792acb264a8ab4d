"""INT8 Q.K attention with FP16-accumulated P.V (the SageAttention recipe) for NVIDIA GPUs whose
tensor cores run INT8 at twice and FP16-accumulating MMAs at twice the FP32-accumulate rate:
Turing (with Triton <= 3.2), Ampere, Ada, consumer Blackwell (and, untuned, Hopper).

Inputs come from attention_int8_quant.quantize_qkv_int8 (K and V smoothed by their means, Q
and K channels balanced, Q per-row and K per-block INT8 scales, V per-channel scaled into
[-V_RANGE, V_RANGE]). One
program owns BLOCK_M query rows of one (batch, head) and streams keys in BLOCK_N tiles with
an online softmax in fp32. Choices that matter:
- scores: S = dot(q_i8, k_i8) in int32, exact (|S| <= 127 * 127 * BLOCK_D < 2**31), then
  de-quantised by sq[row] * sk[tile] inside the exp2's argument (one FFMA per score); the
  softmax scale and log2(e) live in sq;
- P.V in two levels: each key tile's `tl.dot(p, v, out_dtype=fp16)` starts from zero in an
  FP16 accumulator (the fast MMA on GeForce cards) and is added into the FP32 running
  accumulator, so the FP16 sum covers BLOCK_N keys only and long sequences lose nothing to
  its 11-bit mantissa. The tile bound |sum| <= P_MAX * V_RANGE * BLOCK_N <= 32768 keeps it
  below fp16's 65504 (v_range() picks V_RANGE);
- PV "fp16": P = exp2(S - m) in [0, 1] and V in fp16. bf16 inputs are safe here: V was
  smoothed and scaled per channel to |v| <= V_RANGE by the quantiser, so its fp16 copy cannot
  overflow and, 3 mantissa bits wider than bf16, it loses nothing but values under fp16's
  subnormal floor (2**-24, some 2**-32 of the channel's range); P in [0, 1] only drops
  probabilities under 2**-24, which a row whose largest term is 1 does not see;
- PV "fp8" (sm_89+, the SageAttention 2++ recipe): P scaled to [0, 448] by shifting the max by
  log2(448) inside the exp2, V in e4m3 transposed to [D, L] (keys contiguous), the MMA still
  accumulating in FP16 within a tile and FP32 across tiles; l uses the same scaled p, so the
  448 cancels in acc / l;
- the epilogue applies V's per-channel scale and adds V's mean back in fp32;
- no mask and no causal: quantisation statistics (means, scales) are over all keys and the
  kernel has no -inf bookkeeping beyond the last partial key tile; such calls are refused.
Any lengths: Q/K/V are padded to whole tiles by the quantiser (zeros), the last key tile is
masked to -inf, padded query rows are never stored. GQA: query head h reads KV head h // G.
"""
from __future__ import annotations

import math

import torch

from ..core.kernel_common import tl, triton  # None, None where Triton does not import

from ..core import device as _device
from .checks import half_precision_refusal
from .fp8_full import accuracy_inputs, key_mean_shift
from .fp8_quant import padded_head_dim
from .int8_quant import QuantizedInt8, quantize_qkv_int8
from .ref import attention_ref
from ..core.gpu_rules import (amd_arch_blocker, amd_int8_refusal, capability_refusal, min_capability_for,
                        nvidia_gpu_blocker, version_tuple)
from ..core.kernel_common import LAUNCH_OPTIONS, LOG2_P_SCALE, arch_family, family_in

if triton is not None:
    from ..core.kernel_common import store_smoothed_out
    from .fp8_quant import cast_e4m3

PV_MODES = ("fp16", "fp8")
MAX_HEAD_DIM = 128  # a 128x128 fp32 accumulator and a 128x128 int8 Q tile stay in registers
# e4m3's largest finite value; P is scaled to [0, 448] in the fp8 P.V (kernel_common.LOG2_P_SCALE).
P_MAX_FP8 = 448.0
FP16_TILE_BOUND = 32768.0  # half of fp16's 65504: room for the rounding of partial sums
# An e4m3 MMA with an FP16 accumulator (the fp8 P.V) first lowers correctly in Triton 3.5:
# compiled here, Triton 3.3 and 3.4 crash in ConvertTritonGPUToLLVM for sm_89 and, for sm_120,
# upcast P and V to fp16 (an f16 MMA: no FP8 rate, e4m3's rounding for nothing); 3.5-3.9 emit
# mma.sync...f16.e4m3.e4m3.f16 (tests/compile/test_compile_int8_attention.py pins both).
PV_FP8_MIN_TRITON = (3, 5)

# Per arch family: BLOCK_M, BLOCK_N (BLOCK_N is also K's quantisation block), num_warps for
# head dims <= 64 and above, num_stages. Untimed (no sm_75-sm_89 GPU here; the H200 numbers come
# from benchmarks/int8_attention_bench.py --sweep): SageAttention's Triton kernel uses 128x64
# with 4 warps / 3 stages (d64) and 8 warps / 4 stages (d128) on sm_80+.
# Stages are sized so each family's shared memory holds them (checked by
# tests/compile/test_compile_int8_attention.py): one stage holds a K tile (BLOCK_N x D int8)
# and a V tile (BLOCK_N x D fp16, or e4m3). sm_75 has 64 KB: smaller query tiles.
INT8_CONFIGS = {
    "sm90": dict(BLOCK_M=128, BLOCK_N=64, warps_small=4, warps_large=8, num_stages=4),
    "sm80": dict(BLOCK_M=128, BLOCK_N=64, warps_small=4, warps_large=8, num_stages=4),
    "sm86": dict(BLOCK_M=128, BLOCK_N=64, warps_small=4, warps_large=8, num_stages=3),
    "sm75": dict(BLOCK_M=64, BLOCK_N=64, warps_small=4, warps_large=4, num_stages=2),
    "default": dict(BLOCK_M=64, BLOCK_N=64, warps_small=4, warps_large=4, num_stages=2),
    # The interpreter runs on numpy: 32x32 tiles keep CPU tests fast and still loop.
    "interpreter": dict(BLOCK_M=32, BLOCK_N=32, warps_small=4, warps_large=4, num_stages=1),
}


class Int8AttentionUnsupportedError(RuntimeError):
    """The call or the device cannot be served by the INT8 kernel; the message says why."""


def v_range(pv: str, block_n: int) -> float:
    """The largest power of two V_RANGE with P_MAX * V_RANGE * BLOCK_N <= FP16_TILE_BOUND: what
    V is scaled to so one key tile's P.V cannot overflow the FP16 accumulator (fp16 P: 512 at
    BLOCK_N 64; fp8 P: 1.0 at BLOCK_N 64). For e4m3 the range only moves where its subnormals
    start: emulated in torch on our outlier inputs, V ranges from 1.125 to 448 gave the same
    rel. L2 (0.0233-0.0236)."""
    p_max = P_MAX_FP8 if pv == "fp8" else 1.0
    return 2.0 ** math.floor(math.log2(FP16_TILE_BOUND / (p_max * block_n)))


if triton is not None:

    @triton.jit
    def _int8_tile(
        acc, l_i, m_i, q8, c_q, K8, SK, V, start_n, offs_n, offs_d, LK, LK_PAD,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BOUNDARY: tl.constexpr, PV_FP8: tl.constexpr,
        EXACT_CAST: tl.constexpr,
    ):
        cols = start_n + offs_n
        k8 = tl.load(K8 + cols[:, None] * BLOCK_D + offs_d[None, :])
        s = tl.dot(q8, tl.trans(k8)).to(tl.float32)  # int32 accumulation: exact
        # De-quantisation folded into the exp2's argument: c > 0 per row, so max(s) * c is
        # the max of the scaled scores.
        c = c_q * tl.load(SK + start_n // BLOCK_N)
        if BOUNDARY:
            s = tl.where(cols[None, :] < LK, s, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(s, 1) * c)
        alpha = tl.math.exp2(m_i - m_ij)
        if PV_FP8:
            p = tl.math.exp2(s * c[:, None] - (m_ij - LOG2_P_SCALE)[:, None])  # in [0, 448]
            vt = tl.load(V + offs_d[:, None] * LK_PAD + cols[None, :])
            pv = tl.dot(cast_e4m3(p, EXACT_CAST), tl.trans(vt), out_dtype=tl.float16)
        else:
            p = tl.math.exp2(s * c[:, None] - m_ij[:, None])  # in [0, 1]
            v = tl.load(V + cols[:, None] * BLOCK_D + offs_d[None, :])
            pv = tl.dot(p.to(tl.float16), v, out_dtype=tl.float16)
        l_i = l_i * alpha + tl.sum(p, 1)
        # Two levels: this tile's FP16 sum joins the FP32 running accumulator (one FMA).
        acc = acc * alpha[:, None] + pv.to(tl.float32)
        return acc, l_i, m_ij

    @triton.jit
    def _attn_int8_fwd(
        Q8, SQ, K8, SK, V, SV, VMEAN, O, LSE,
        stride_ob, stride_oh, stride_om, stride_od,
        H, G, LQ, LK, LQ_PAD, LK_PAD, NKB, v_dequant,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        PV_FP8: tl.constexpr, EXACT_CAST: tl.constexpr, RETURN_LSE: tl.constexpr,
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
        bhk64 = (off_b * (H // G) + off_h // G).to(tl.int64)  # GQA: G query heads per KV head
        q8 = tl.load(Q8 + (bh64 * LQ_PAD + offs_m[:, None]) * BLOCK_D + offs_d[None, :])
        c_q = tl.load(SQ + bh64 * LQ_PAD + offs_m)
        K8 += bhk64 * LK_PAD * BLOCK_D
        V += bhk64 * LK_PAD * BLOCK_D  # [L, D] fp16 or [D, L] e4m3: the same size
        SK += bhk64 * NKB

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        lk_full = (LK // BLOCK_N) * BLOCK_N
        for start_n in range(0, lk_full, BLOCK_N):
            acc, l_i, m_i = _int8_tile(acc, l_i, m_i, q8, c_q, K8, SK, V, start_n, offs_n, offs_d, LK, LK_PAD,
                                       BLOCK_N, BLOCK_D, False, PV_FP8, EXACT_CAST)
        if lk_full < LK:
            acc, l_i, m_i = _int8_tile(acc, l_i, m_i, q8, c_q, K8, SK, V, lk_full, offs_n, offs_d, LK, LK_PAD,
                                       BLOCK_N, BLOCK_D, True, PV_FP8, EXACT_CAST)

        sv = tl.load(SV + bhk64 * BLOCK_D + offs_d) * v_dequant
        v_mean = tl.load(VMEAN + bhk64 * BLOCK_D + offs_d)
        store_smoothed_out(acc, l_i, m_i, sv, v_mean, O, LSE, off_b, off_h, bh64, offs_m, offs_d,
                           stride_ob, stride_oh, stride_om, stride_od, LQ, HEAD_DIM, BLOCK_D, RETURN_LSE, PV_FP8)


# ---- checks -------------------------------------------------------------------------------

def call_refusal(q, k, v, attn_mask=None, is_causal=False) -> str | None:
    """Why the kernel cannot serve these tensors (shapes, dtypes, mask, causal), or None."""
    reason = half_precision_refusal(q, k, v)
    if reason:
        return reason
    B, H, _, D = q.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[1] != v.shape[1]:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: batch and k/v heads must match"
    if k.shape[1] == 0 or H % k.shape[1]:
        return f"{H} query heads are not a multiple of {k.shape[1]} key/value heads"
    if k.shape[2] != v.shape[2] or k.shape[3] != D or v.shape[3] != D:
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} must share length and q's head dim"
    if not 1 <= D <= MAX_HEAD_DIM:
        return f"head dim {D} outside 1..{MAX_HEAD_DIM}"
    if k.shape[2] == 0:
        return "no keys: k and v have length 0 (the softmax is undefined)"
    if attn_mask is not None:
        return "attention masks are not supported (quantisation statistics are over all keys)"
    if is_causal:
        return "is_causal is not supported"
    return None


def device_refusal(device: torch.device, pv: str = "fp16") -> str | None:
    """Why the kernel cannot run on this device with this P.V precision, or None. INT8 and
    FP16 MMAs exist from sm_75 (Turing, which only Triton <= 3.2 compiles for: gpu_rules);
    the FP8 P.V needs e4m3 tensor cores (sm_89+) and Triton 3.5+ (PV_FP8_MIN_TRITON). CPU only
    through the interpreter (tests)."""
    if pv not in PV_MODES:
        return f"pv must be one of {PV_MODES} (got {pv!r})"
    what = "INT8 attention" + (" with FP8 P.V" if pv == "fp8" else "")
    if triton is None:
        return f"{what} needs Triton: {_device.triton_import_error()}"
    if device.type == "cpu":
        return None if _device.interpreter_enabled() else f"{what} on CPU tensors needs TRITON_INTERPRET=1 (tests only)"
    info = _device.describe(device)
    if info.vendor == "amd":
        # i8 MFMA (CDNA) / iu8 WMMA (RDNA3/4); AMD's FP8 dots accumulate in FP32 only, so the
        # FP16-accumulating FP8 P.V this variant exists for has no AMD form.
        rule = amd_arch_blocker(info.arch, info.name) or amd_int8_refusal(info.arch, info.name)
        if rule is None and pv == "fp8":
            return f"{what}: AMD matrix cores accumulate FP8 in FP32 only (no FP16-accumulating P.V)"
        return f"{what}: {rule.reason}" if rule is not None else None
    if info.vendor != "nvidia":
        return f"{what} supports NVIDIA and AMD GPUs only; {info.name} is {info.arch}"
    version = _device.triton_version()
    rule = (nvidia_gpu_blocker(info.name, info.capability, version)
            or capability_refusal(info.vendor, info.capability, info.name, fp8=pv == "fp8"))
    if rule is not None:
        return rule.reason
    if pv == "fp8" and version_tuple(version)[:2] < PV_FP8_MIN_TRITON:
        need = ".".join(map(str, PV_FP8_MIN_TRITON))
        return f"{what} needs Triton {need}+ for an FP8 MMA with an FP16 accumulator (installed: {version})"
    return None


def default_config(device: torch.device, head_dim: int = 128) -> dict:
    """The tile config the launcher uses on this device (num_warps by head dim)."""
    if device.type == "cpu":
        base = INT8_CONFIGS["interpreter"]
    else:
        base = INT8_CONFIGS[family_in(INT8_CONFIGS, arch_family(_device.describe(device).arch))]
    return config_for(base, head_dim)


def config_for(base: dict, head_dim: int) -> dict:
    warps = base["warps_small"] if padded_head_dim(head_dim) <= 64 else base["warps_large"]
    return dict(BLOCK_M=base["BLOCK_M"], BLOCK_N=base["BLOCK_N"], num_warps=warps, num_stages=base["num_stages"])


# ---- launch -------------------------------------------------------------------------------

def attention_int8(q, k, v, attn_mask=None, scale=None, is_causal=False, pv: str = "fp16", config=None,
                   balance: bool = True, return_lse: bool = False):
    """softmax(q k^T * scale) v with Q.K^T in INT8 and P.V in fp16 (pv="fp16") or e4m3
    (pv="fp8", sm_89+), both accumulated in FP16 per key tile and FP32 across tiles;
    quantisation included. q [B, H, Lq, D], k/v [B, HK, Lk, D] with HK dividing H (GQA),
    fp16/bf16, any strides; output in q's dtype laid out like torch.empty_like(q). Raises
    Int8AttentionUnsupportedError for masks, causal, head dims over 128, other dtypes and
    devices that cannot run it (device_refusal). balance=False skips the Q/K channel
    balancing (attention_int8_quant; for tests and benchmarks). return_lse: (out, lse), lse float32
    [B, H, Lq] the natural-log logsumexp of each row's scaled scores (as the kernel saw them)."""
    reason = call_refusal(q, k, v, attn_mask, is_causal) or device_refusal(q.device, pv)
    if reason:
        raise Int8AttentionUnsupportedError(f"attention_int8: {reason}")
    if q.numel() == 0:  # nothing to quantise or launch
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return (out, torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)) if return_lse else out
    config = config or default_config(q.device, q.shape[-1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    qkv = quantize_qkv_int8(q, k, v, scale, config["BLOCK_M"], config["BLOCK_N"], pv,
                            v_range(pv, config["BLOCK_N"]), balance=balance, exact_cast=q.device.type == "cpu")
    if not return_lse:
        return attention_int8_quantized(qkv, q.shape, k.shape[1], k.shape[2], q.dtype, q.device, config)
    out, lse = attention_int8_quantized(qkv, q.shape, k.shape[1], k.shape[2], q.dtype, q.device, config,
                                        return_lse=True)
    return out, lse.add_(key_mean_shift(q, k, scale))


def attention_int8_quantized(qkv: QuantizedInt8, q_shape, kv_heads: int, lk: int, dtype, device, config,
                             return_lse: bool = False):
    """The attention kernel alone, on quantize_qkv_int8's output (benchmarks time it separately).
    With return_lse, (out, lse of the smoothed scores): key_mean_shift() makes it the real one."""
    B, H, Lq, D = q_shape
    out = torch.empty(B, H, Lq, D, dtype=dtype, device=device)
    lse = torch.empty(B, H, Lq, dtype=torch.float32, device=device) if return_lse else None
    if out.numel() == 0:
        return (out, lse) if return_lse else out
    bh, lq_pad, block_d = qkv.q8.shape
    lk_pad = qkv.k8.shape[1]
    grid = (lq_pad // qkv.block_m, bh)
    _attn_int8_fwd[grid](
        qkv.q8, qkv.sq, qkv.k8, qkv.sk, qkv.v, qkv.sv448, qkv.vmean, out, lse,
        *out.stride(), H, H // kv_heads, Lq, lk, lq_pad, lk_pad, qkv.sk.shape[1], 448.0 / qkv.v_range,
        HEAD_DIM=D, BLOCK_M=qkv.block_m, BLOCK_N=qkv.block_n, BLOCK_D=block_d, PV_FP8=qkv.pv == "fp8",
        EXACT_CAST=device.type == "cpu", RETURN_LSE=return_lse,
        num_warps=config["num_warps"], num_stages=config["num_stages"], **LAUNCH_OPTIONS)
    return (out, lse) if return_lse else out


# ---- registration facts (kernels/attention/dispatch.py registers it as "triton_int8") --------------

def registry_constraints(pv: str = "fp16"):
    """What the kernel serves, as the registry's Constraints: NVIDIA from the oldest capability
    the installed Triton compiles for (sm_75 with Triton <= 3.2, else sm_80; CPU only through
    the interpreter), FP8 tensor cores (sm_89+) for pv="fp8", fp16/bf16 (gpu_rules refuses
    bf16 below sm_80), head dims 1..128, GQA, no mask, no causal."""
    from ..core.registry import Constraints

    return Constraints(
        device_types=frozenset({"cuda", "cpu"}), vendors=frozenset({"nvidia", "amd", "cpu"}),
        cpu_needs_interpreter=True, min_capability=min_capability_for(_device.triton_version()), fp8=pv == "fp8",
        dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=(1, MAX_HEAD_DIM),
        masks=frozenset({"none"}), gqa=True, causal=False)


# ---- references ---------------------------------------------------------------------------

def attention_int8_ref(q, k, v, attn_mask=None, scale=None, is_causal=False):
    """The exact float32 answer, what accuracy is measured against (same signature)."""
    if k.shape[1] != q.shape[1]:  # GQA: the reference wants one K/V head per query head
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return attention_ref(q, k, v, attn_mask, scale, is_causal)


def attention_int8_per_tensor(q, k, v, attn_mask=None, scale=None, is_causal=False):
    """Naive INT8 attention in torch, the baseline ours must beat: one INT8 scale per tensor
    for Q and K, no smoothing; P and V rounded to fp16; fp32 everywhere else."""
    del attn_mask, is_causal  # the baseline serves what the kernel serves
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)

    def fake_quant(x):
        x = x.float()
        s = x.abs().amax().clamp_min(1e-30) / 127.0
        return torch.round(x / s).clamp(-127, 127) * s

    p = torch.softmax(fake_quant(q) @ fake_quant(k).transpose(-1, -2) * scale, dim=-1)
    return p.half().float() @ v.half().float()


def compile_specs(dtype: str, head_dim: int, config: dict, pv: str = "fp16"):
    """[(name, kernel, signature, constexprs, attrs, num_warps)] for
    triton.compile(ASTSource(...)): the quantiser's kernels, then the attention kernel,
    specialised as launches on contiguous [B, H, L, D] tensors specialise them."""
    from .int8_quant import compile_specs as quant_specs

    names = ["Q8", "SQ", "K8", "SK", "V", "SV", "VMEAN", "O", "LSE", "stride_ob", "stride_oh", "stride_om", "stride_od",
             "H", "G", "LQ", "LK", "LQ_PAD", "LK_PAD", "NKB", "v_dequant"]
    types = dict(O=f"*{dtype}", Q8="*i8", K8="*i8", V="*fp8e4nv" if pv == "fp8" else "*fp16", v_dequant="fp32",
                 **{n: "*fp32" for n in ("SQ", "SK", "SV", "VMEAN")})
    sig = {n: types.get(n, "i32") for n in names}
    const = dict(LSE=None, stride_od=1, HEAD_DIM=head_dim, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
                 BLOCK_D=padded_head_dim(head_dim), PV_FP8=pv == "fp8", EXACT_CAST=False, RETURN_LSE=False)
    for n in const:
        sig[n] = "constexpr"
    order = list(sig)
    aligned = ["Q8", "SQ", "K8", "V", "SV", "VMEAN", "O", "stride_ob", "stride_oh", "stride_om", "LQ_PAD", "LK_PAD"]
    attrs = {(order.index(n),): [["tt.divisibility", 16]] for n in aligned}
    block_n = config["BLOCK_N"]
    return quant_specs(dtype, head_dim, config["BLOCK_M"], block_n, pv, v_range(pv, block_n)) + [
        ("_attn_int8_fwd", _attn_int8_fwd, sig, const, attrs, config["num_warps"])]


__all__ = ["attention_int8", "attention_int8_quantized", "attention_int8_ref", "attention_int8_per_tensor",
           "accuracy_inputs", "call_refusal", "device_refusal", "default_config", "config_for", "registry_constraints",
           "compile_specs", "v_range", "Int8AttentionUnsupportedError", "INT8_CONFIGS", "MAX_HEAD_DIM", "PV_MODES",
           "PV_FP8_MIN_TRITON"]
