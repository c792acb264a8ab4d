"""INT8 W8A8 Linear (y = x @ W.T + b) in Triton: block-Hadamard rotation along K, per-token
activation quantisation, the persistent int8 GEMM, its configs per arch and the launcher.

Numerics:
- weights: int8 with one scale per output channel (amax / 127), quantised once per layer;
- activations: int8 with one scale per token (row), computed by a small kernel;
- outlier channels: diffusion activations have a few channels 10-100x the others in every
  token. With plain per-token scales they set the row's step, and the small channels (most of
  the signal) get a few levels: rel. L2 0.05-0.06 against fp32 with 30x outliers in 3 of 256
  channels (tests/kernels/test_linear.py measures it), above the 0.03 bar. So both operands are
  rotated by the same orthogonal block-diagonal Hadamard matrix along K (x H and W H, H H^T =
  block * I, so (x H)(W H)^T = block * x W^T): an outlier's energy spreads over its block of
  `block` channels, the rows become near-Gaussian and int8 holds them (rel. L2 ~0.01). W is
  rotated once at prepare time (in fp32 torch); x inside the quantisation kernel as a tl.dot
  with a +-1 Hadamard tile built in registers (exact in fp16/bf16), so the rotation costs no
  extra pass over memory. The 1/block is folded into the weight scales.
- The GEMM multiplies int8 x int8 into int32 (exact: |sum| <= 127^2 * K < 2^31 for K < 133k)
  and applies row scale x channel scale, the bias and the output cast in fp32 in its epilogue.

Layout: x [M, K] and the weight [N, K] both K-major (nn.Linear's layout); the kernel multiplies
by the transposed view of each weight tile. Pointer loads (no TMA) so it compiles with every
Triton down to 3.2 (sm_75); rows / columns past the edge are clamped into range and dropped by
the masked store. K and N are multiples of 16 (16-byte int8 rows, whole MMA depths).
"""
from __future__ import annotations

import logging
from functools import lru_cache

import torch

from ..core.kernel_common import tl, triton  # None, None where Triton does not import

from ..core import cache_registry
from ..core import device as _device
from ..core.kernel_common import LAUNCH_OPTIONS, arch_family, cdiv, family_in, sm_count
from .fp8 import epilogue_act

if triton is not None:
    from .gemm_common import activation, load_k_tile, scale_bias, store_tile, tile_operands

log = logging.getLogger("triton_accel.kernels.linear.int8")  # not __name__: the clone's folder name

INT8_MAX = 127.0  # symmetric: -128 is never used, so negation stays in range
AMAX_FLOOR = 1e-12  # a row or channel of zeros: finite scale, zeros stay zeros
# Hadamard block along K: the largest of these dividing K. 128 spreads an outlier over 128
# channels (its share of the row's amax falls ~11x) and is one 128x128 dot tile.
HADAMARD_BLOCKS = (128, 64, 32, 16)

# GEMM tiles per arch family (kernel_common.arch_family). Untimed on real cards: chosen to fit
# each family's shared memory (A + B tiles x stages): sm_75 64 KB, sm_86/89/120 ~100 KB,
# sm_80 164 KB, sm_90 228 KB. int8 MMAs are k32 deep, so BLOCK_K 64-128.
LINEAR_INT8_CONFIGS = {
    "sm90": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=16, num_warps=8, num_stages=3),
    "sm80": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4),
    "sm86": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    "sm75": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=2),
    "default": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=2),
    # The interpreter runs on numpy: small tiles keep CPU tests fast and still walk several
    # tiles per program, partial tiles and several K steps.
    "interpreter": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1),
}
QUANT_BLOCK_M = 32  # rows per program of the activation quantisation (16 in the interpreter)
QUANT_PLAIN_BLOCK_K = 128  # K step of the quantisation without rotation
INTERPRETER_PROGRAMS = 3  # programs of the persistent grid under the interpreter


def hadamard_block_for(k: int) -> int:
    for b in HADAMARD_BLOCKS:
        if k % b == 0:
            return b
    raise ValueError(f"in_features {k} is not a multiple of {HADAMARD_BLOCKS[-1]}")


@lru_cache(maxsize=None)
def _hadamard_cpu(block: int) -> torch.Tensor:
    # Sylvester's construction: H[i, j] = (-1)^popcount(i & j), entries +-1 (not normalised).
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


cache_registry.register("kernels.linear.int8.hadamard", _hadamard_cpu.cache_clear)


def hadamard_blocks(t: torch.Tensor, block: int) -> torch.Tensor:
    """t [..., K] times the block-diagonal +-1 Hadamard matrix along K, in fp32."""
    h = _hadamard_cpu(block).to(t.device)
    k = t.shape[-1]
    return (t.float().reshape(*t.shape[:-1], k // block, block) @ h).reshape(t.shape)


def quantize_weight(weight: torch.Tensor, rotate: bool = True) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(int8 [N, K], fp32 scale [N] incl. 1/block, block or 0) of a float weight [N, K]."""
    k = weight.shape[1]
    block = hadamard_block_for(k) if rotate else 0
    w = hadamard_blocks(weight, block) if block else weight.float()
    amax = w.abs().amax(dim=1).clamp_min(AMAX_FLOOR)
    s = amax / INT8_MAX
    # Division by the same fp32 scale the epilogue multiplies by; round half away from zero,
    # as the activation kernel does.
    v = w / s[:, None]
    q = torch.trunc(v + torch.where(v >= 0, 0.5, -0.5)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), (s / block if block else s).contiguous(), block


def prepare(weight: torch.Tensor, weight_scale=None, rotate: bool = True) -> tuple[torch.Tensor, torch.Tensor, int]:
    """kernels.linear.dispatch's entry. FP8 checkpoint weights are dequantised (x scale_weight) first."""
    w = weight.float()
    if weight.dtype == torch.float8_e4m3fn and weight_scale is not None:
        s = torch.as_tensor(weight_scale, dtype=torch.float32, device=weight.device).reshape(-1)
        w = w * (s[:, None] if s.numel() > 1 else s)
    return quantize_weight(w, rotate)


def config_family(arch: str) -> str:
    return family_in(LINEAR_INT8_CONFIGS, arch_family(arch))


if triton is not None:

    @triton.jit
    def _rotated_tile(X, rows, cols, M, K, stride_xm, H, ROTATE: tl.constexpr, DOT_FP32: tl.constexpr):
        x = tl.load(X + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :],
                    mask=(rows[:, None] < M) & (cols[None, :] < K), other=0.0)
        if ROTATE:
            # H is already in the dot's dtype: x's (fp32 in the interpreter, whose bf16 dots
            # are wrong). +-1 entries are exact in every dtype, the products too, summed in fp32.
            return tl.dot(x.to(H.dtype), H)
        return x.to(tl.float32)

    @triton.jit
    def _quant_rows_int8(X, Y, S, M, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         ROTATE: tl.constexpr, LOG2_BLOCK: tl.constexpr, DOT_FP32: tl.constexpr):
        # BLOCK_M rows per program. With ROTATE, BLOCK_K is the Hadamard block: each K step is
        # one [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_K] dot. Two passes (row amax, then quantise)
        # recompute the rotation rather than keep whole rows (up to 13824 values) on chip.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs = tl.arange(0, BLOCK_K)
        H = tl.zeros((BLOCK_K, BLOCK_K), dtype=tl.float32)
        if ROTATE:
            # Sylvester's Hadamard matrix: H[i, j] = (-1)^popcount(i & j).
            both = offs[:, None] & offs[None, :]
            parity = tl.zeros((BLOCK_K, BLOCK_K), dtype=tl.int32)
            for b in tl.static_range(LOG2_BLOCK):
                parity = parity ^ ((both >> b) & 1)
            H = 1.0 - 2.0 * parity.to(tl.float32)
        if not DOT_FP32:
            H = H.to(X.dtype.element_ty)  # converted once, not per K step
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            v = _rotated_tile(X, rows, k0 + offs, M, K, stride_xm, H, ROTATE, DOT_FP32)
            amax = tl.maximum(amax, tl.max(tl.abs(v), 1))
        amax = tl.maximum(amax, 1e-12)
        inv = tl.math.div_rn(tl.full((BLOCK_M,), 127.0, tl.float32), amax)  # correctly rounded
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs
            v = _rotated_tile(X, rows, cols, M, K, stride_xm, H, ROTATE, DOT_FP32) * inv[:, None]
            # Round half away from zero (the cast truncates); the clamp keeps a rounding of
            # |v| just above 127 in range.
            q = tl.clamp(v + tl.where(v >= 0, 0.5, -0.5), -127.0, 127.0).to(tl.int8)
            tl.store(Y + rows.to(tl.int64)[:, None] * K + cols[None, :], q,
                     mask=(rows[:, None] < M) & (cols[None, :] < K))
        tl.store(S + rows, amax / 127.0, mask=rows < M)

    @triton.jit
    def _int8_linear(
        A, B, C, SA, SB, BIAS, M, N, K, stride_am, stride_bn, stride_cm, ACT_FROM,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, EVEN_K: tl.constexpr, ACT: tl.constexpr,
    ):
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS):
            rm, rn, a_ptrs, b_ptrs = tile_operands(tile, A, B, M, N, stride_am, stride_bn, num_pid_m, num_pid_n,
                                                    GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            for ki in range(k_tiles):
                a, b = load_k_tile(a_ptrs, b_ptrs, ki, K, BLOCK_K, EVEN_K, 0, 0)
                # int8 x int8 -> int32, exact. out_dtype spelled out: Triton 3.5-3.7 otherwise
                # assume an fp32 accumulator and reject the int32 one.
                acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
            out = scale_bias(acc.to(tl.float32), SA, SB, BIAS, rm, rn, M, N, HAS_BIAS)
            store_tile(C, activation(out, rn, ACT, ACT_FROM), rm, rn, M, N, stride_cm)


def _interpreter(device: torch.device) -> bool:
    if triton is None:
        raise RuntimeError(f"INT8 Linear needs Triton: {_device.triton_import_error()}")
    return device.type == "cpu"


def default_config(device: torch.device, interpreter: bool) -> dict:
    if interpreter:
        return dict(LINEAR_INT8_CONFIGS["interpreter"])
    return dict(LINEAR_INT8_CONFIGS[config_family(_device.describe(device).arch)])


def quantize_activation(x2d: torch.Tensor, rotation: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8 of a [M, K] activation (unit last stride), rotated by the block-Hadamard
    matrix of `rotation` (0: none): (x_int8 [M, K], scale [M] fp32)."""
    interpreter = _interpreter(x2d.device)
    m, k = x2d.shape
    y = torch.empty((m, k), dtype=torch.int8, device=x2d.device)
    s = torch.empty((m,), dtype=torch.float32, device=x2d.device)
    if m == 0:
        return y, s
    if rotation and k % rotation:
        raise ValueError(f"in_features {k} is not a multiple of the rotation block {rotation}")
    bm = 16 if interpreter else QUANT_BLOCK_M
    block_k = rotation or QUANT_PLAIN_BLOCK_K
    _quant_rows_int8[(cdiv(m, bm),)](
        x2d, y, s, m, k, x2d.stride(0), BLOCK_M=bm, BLOCK_K=block_k, ROTATE=bool(rotation),
        LOG2_BLOCK=max(rotation, 1).bit_length() - 1, DOT_FP32=interpreter, num_warps=4, **LAUNCH_OPTIONS)
    return y, s


def int8_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype, config: dict | None = None,
              act: int = 0, act_from: int = 0) -> torch.Tensor:
    """(x_q * x_scale) @ (weight * w_scale).T + bias, cast to out_dtype: the GEMM alone; `act`
    (linear_fp8.ACTIVATIONS' code, 0 none) applied to output columns >= act_from."""
    m, k = x_q.shape
    n = weight.shape[0]
    interpreter = _interpreter(x_q.device)
    cfg = config or default_config(x_q.device, interpreter)
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0:
        return out
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tiles = cdiv(m, bm) * cdiv(n, bn)
    programs = min(tiles, INTERPRETER_PROGRAMS if interpreter else sm_count(x_q.device.index or 0))
    bias_arg = bias if bias is not None else x_scale  # placeholder pointer, never read
    _int8_linear[(programs,)](
        x_q, weight, out, x_scale, w_scale, bias_arg, m, n, k, x_q.stride(0), weight.stride(0), out.stride(0),
        int(act_from), HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
        NUM_PROGRAMS=programs, EVEN_K=k % bk == 0, ACT=epilogue_act(int(act), x_q.device, out_dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **LAUNCH_OPTIONS)
    return out


def run_linear(x2d: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               rotation: int, out_dtype: torch.dtype, act: int = 0, act_from: int = 0) -> torch.Tensor:
    """kernels.linear.dispatch's entry: a checked [M, K] call (unit last stride) on a prepared weight."""
    x_q, x_scale = quantize_activation(x2d, rotation)
    return int8_gemm(x_q, x_scale, weight, scale, bias, out_dtype, act=act, act_from=act_from)


def compile_specs(config: dict, in_dtype: str = "fp16", out_dtype: str = "fp16", has_bias: bool = True,
                  rotation: int = 128, act: int = 0):
    """[(kernel, signature, constexprs, attrs, options)] for triton.compile(ASTSource(...)): the
    activation quantisation and the GEMM as a launch on contiguous tensors specialises them."""
    quant_sig = {"X": f"*{in_dtype}", "Y": "*i8", "S": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i32",
                 "BLOCK_M": "constexpr", "BLOCK_K": "constexpr", "ROTATE": "constexpr", "LOG2_BLOCK": "constexpr",
                 "DOT_FP32": "constexpr"}
    quant_const = dict(BLOCK_M=QUANT_BLOCK_M, BLOCK_K=rotation or QUANT_PLAIN_BLOCK_K, ROTATE=bool(rotation),
                       LOG2_BLOCK=max(rotation, 1).bit_length() - 1, DOT_FP32=False)
    quant_attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 4, 5)}
    specs = [(_quant_rows_int8, quant_sig, quant_const, quant_attrs, dict(num_warps=4, num_stages=1))]
    const = dict(HAS_BIAS=has_bias, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
                 GROUP_M=config["GROUP_M"], NUM_PROGRAMS=132, EVEN_K=True, ACT=int(act))
    sig = {"A": "*i8", "B": "*i8", "C": f"*{out_dtype}", "SA": "*fp32", "SB": "*fp32", "BIAS": f"*{out_dtype}",
           "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_bn": "i32", "stride_cm": "i32",
           "ACT_FROM": "i32"}
    for name in const:
        sig[name] = "constexpr"
    names = list(sig)
    aligned = ["A", "B", "C", "SA", "SB", "BIAS", "N", "K", "stride_am", "stride_bn", "stride_cm"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    specs.append((_int8_linear, sig, const, attrs, dict(num_warps=config["num_warps"], num_stages=config["num_stages"])))
    return specs


__all__ = ["LINEAR_INT8_CONFIGS", "HADAMARD_BLOCKS", "hadamard_block_for", "hadamard_blocks", "quantize_weight",
           "prepare", "quantize_activation", "int8_gemm", "run_linear", "config_family", "compile_specs"]
