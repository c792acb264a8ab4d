"""FP8 weight-only Linear (y = x @ W.T + b) in Triton: e4m3 weights dequantised inside the GEMM,
FP16/BF16 products, fp32 accumulation; for GPUs without FP8 tensor cores (sm_80/86).

Why: many users load diffusion models with FP8 weights (`weight_dtype fp8_e4m3fn`, "scaled
FP8" checkpoints) and ComfyUI upcasts every weight on every call. This GEMM reads the e4m3
bytes instead: half the weight memory traffic of BF16, no upcast pass, x untouched.

Numerics: the weight keeps one fp32 scale per output channel (its own amax / 448, or
ComfyUI's per-tensor `scale_weight` broadcast). In the kernel each e4m3 byte becomes the fp16
number with the same sign, exponent and mantissa bits shifted into place,
    fp16 bits = (byte & 0x80) << 8 | (byte & 0x7F) << 7,
which is the e4m3 value times 2^-8 exactly, subnormals included (e4m3 bias 7, fp16 bias 15,
and e4m3's 3 mantissa bits fit fp16's 10; the smallest e4m3 subnormal 2^-9 becomes 2^-17, an
fp16 subnormal). The 2^8 goes into the epilogue's channel scale. So the dequantisation is an
integer shift and a bitcast: no e4m3 conversion instruction (cvt ... e4m3x2 exists from sm_89
only), and every Triton from 3.2 compiles it for every target. e4m3's NaN (0x7F/0xFF) would
become 480: FP8 checkpoints hold none, and prepare_weight refuses non-finite float weights.
bf16 activations multiply in bf16 (the fp16 tile converted, exactly: |v| <= 448 * 2^-8 and
>= 2^-17 are in range); fp16 ones in fp16; fp32 ones in bf16 (range over mantissa).

Layout and tiles: x [M, K] and the weight [N, K] both K-major (nn.Linear's layout); the
weight tile is multiplied through its transposed view. Persistent grid with grouped tile
order, pointer loads (rows past the edge clamped into range and dropped by the masked store).
"""
from __future__ import annotations

import logging

import torch

from ..core.kernel_common import tl, triton  # None, None where Triton does not import

from ..core import device as _device
from ..core.kernel_common import LAUNCH_OPTIONS, arch_family, cdiv, family_in, sm_count
from .fp8 import epilogue_act, quantize_weight

if triton is not None:
    from .gemm_common import activation, load_k_tile, store_tile, tile_operands

log = logging.getLogger("triton_accel.kernels.linear.fp8_weight_only")  # not __name__: the clone's folder name

E4M3_TO_FP16_SCALE = 256.0  # the bit-shifted fp16 is the e4m3 value times 2^-8

# Tiles per arch family (kernel_common.arch_family). Untimed on real cards: chosen to fit each
# family's shared memory with a 16-bit x tile and an 8-bit weight tile per stage: sm_80
# 164 KB, sm_86/89/120 ~100 KB, sm_90 228 KB.
LINEAR_FP8_WO_CONFIGS = {
    "sm90": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=16, num_warps=8, num_stages=4),
    "sm80": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    "sm86": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
    "default": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2),
    # The interpreter runs on numpy: small tiles, several tiles per program, K tails.
    "interpreter": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1),
}
INTERPRETER_PROGRAMS = 3  # programs of the persistent grid under the interpreter


def prepare(weight: torch.Tensor, weight_scale=None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """kernels.linear.dispatch's entry: (e4m3 [N, K], fp32 scale [N], 0); FP8 weights are kept as they are."""
    w = quantize_weight(weight, weight_scale)
    return w.weight, w.scale, 0


def config_family(arch: str) -> str:
    return family_in(LINEAR_FP8_WO_CONFIGS, arch_family(arch))


if triton is not None:

    @triton.jit
    def _e4m3_bits_to_fp16(w):
        # uint8 e4m3 bytes -> fp16 holding value * 2^-8 (see the module docstring).
        b = w.to(tl.uint16)
        return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)

    @triton.jit
    def _fp8_weight_only_linear(
        A, B, C, SB, BIAS, M, N, K, stride_am, stride_bn, stride_cm, ACT_FROM,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, EVEN_K: tl.constexpr, COMPUTE: tl.constexpr,
        ACT: tl.constexpr,
    ):
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS):
            rm, rn, a_ptrs, b_ptrs = tile_operands(tile, A, B, M, N, stride_am, stride_bn, num_pid_m, num_pid_n,
                                                    GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                a, b = load_k_tile(a_ptrs, b_ptrs, ki, K, BLOCK_K, EVEN_K, 0.0, 0)
                w = _e4m3_bits_to_fp16(b).to(COMPUTE)
                acc = tl.dot(a.to(COMPUTE), tl.trans(w), acc)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
            # Channel scale x 2^8 (the decode's offset), the bias and the output cast, in fp32.
            sb = tl.load(SB + rn, mask=rn < N, other=0.0) * 256.0
            out = acc * sb[None, :]
            if HAS_BIAS:
                out = out + tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            store_tile(C, activation(out, rn, ACT, ACT_FROM), rm, rn, M, N, stride_cm)


def _compute_dtype(x_dtype: torch.dtype, interpreter: bool):
    if interpreter:  # the interpreter's bf16 dots are wrong (numpy has no bf16): fp32 there
        return tl.float32
    return tl.float16 if x_dtype == torch.float16 else tl.bfloat16


def run_linear(x2d: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               rotation: int, out_dtype: torch.dtype, act: int = 0, act_from: int = 0,
               config: dict | None = None) -> torch.Tensor:
    """kernels.linear.dispatch's entry: a checked [M, K] call (unit last stride) on a prepared e4m3 weight;
    `act` (linear_fp8.ACTIVATIONS' code, 0 none) applied to output columns >= act_from."""
    if triton is None:
        raise RuntimeError(f"FP8 weight-only Linear needs Triton: {_device.triton_import_error()}")
    interpreter = x2d.device.type == "cpu"
    m, k = x2d.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x2d.device)
    if m == 0:
        return out
    cfg = config or dict(LINEAR_FP8_WO_CONFIGS["interpreter" if interpreter else
                                              config_family(_device.describe(x2d.device).arch)])
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tiles = cdiv(m, bm) * cdiv(n, bn)
    programs = min(tiles, INTERPRETER_PROGRAMS if interpreter else sm_count(x2d.device.index or 0))
    w_bytes = weight.view(torch.uint8)  # the kernel decodes the bits itself
    _fp8_weight_only_linear[(programs,)](
        x2d, w_bytes, out, scale, bias if bias is not None else scale, m, n, k,
        x2d.stride(0), w_bytes.stride(0), out.stride(0), int(act_from),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
        NUM_PROGRAMS=programs, EVEN_K=k % bk == 0, COMPUTE=_compute_dtype(x2d.dtype, interpreter),
        ACT=epilogue_act(int(act), x2d.device, out_dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **LAUNCH_OPTIONS)
    return out


def compile_specs(config: dict, in_dtype: str = "bf16", out_dtype: str = "bf16", has_bias: bool = True,
                  act: int = 0):
    """[(kernel, signature, constexprs, attrs, options)] for triton.compile(ASTSource(...))."""
    const = dict(HAS_BIAS=has_bias, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
                 GROUP_M=config["GROUP_M"], NUM_PROGRAMS=132, EVEN_K=True,
                 COMPUTE=tl.float16 if in_dtype == "fp16" else tl.bfloat16, ACT=int(act))
    sig = {"A": f"*{in_dtype}", "B": "*u8", "C": f"*{out_dtype}", "SB": "*fp32", "BIAS": f"*{out_dtype}",
           "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_bn": "i32", "stride_cm": "i32",
           "ACT_FROM": "i32"}
    for name in const:
        sig[name] = "constexpr"
    names = list(sig)
    aligned = ["A", "B", "C", "SB", "BIAS", "N", "K", "stride_am", "stride_bn", "stride_cm"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return [(_fp8_weight_only_linear, sig, const, attrs,
             dict(num_warps=config["num_warps"], num_stages=config["num_stages"]))]


__all__ = ["LINEAR_FP8_WO_CONFIGS", "prepare", "run_linear", "config_family", "compile_specs",
           "E4M3_TO_FP16_SCALE"]
