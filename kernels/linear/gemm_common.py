"""The jit pieces the Linear GEMMs share (FP8 in linear/fp8.py, INT8 in linear/int8.py, FP8
weight-only in linear/fp8_weight_only.py): the grouped tile order and a pointer tile's
operands, a K tile's loads, the dequantising epilogue (row x channel scales, bias), the GELU
epilogue and the masked store.
"""
from __future__ import annotations

from ..core.kernel_common import tl, triton

if triton is not None:

    @triton.jit
    def tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        # Grouped order: GROUP_M row tiles walk the N tiles together, so consecutive programs
        # share weight tiles (and activation tiles) while they sit in L2.
        per_group = GROUP_M * num_pid_n
        first_m = (tile // per_group) * GROUP_M
        group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_rows
        pid_n = (tile % per_group) // group_rows
        return pid_m, pid_n

    @triton.jit
    def tile_operands(tile, A, B, M, N, stride_am, stride_bn, num_pid_m, num_pid_n, GROUP_M: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # The pointer GEMMs' prologue (FP8, INT8 and FP8 weight-only): one output
        # tile's rows, columns and first K-tile pointers. Rows / columns past the edge read row
        # 0 instead: valid memory, unmasked (vector) loads; the masked store drops what they give.
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm_ld = tl.max_contiguous(tl.multiple_of(tl.where(rm < M, rm, 0), BLOCK_M), BLOCK_M)
        rn_ld = tl.max_contiguous(tl.multiple_of(tl.where(rn < N, rn, 0), BLOCK_N), BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = A + rm_ld.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        b_ptrs = B + rn_ld.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
        return rm, rn, a_ptrs, b_ptrs

    @triton.jit
    def load_k_tile(a_ptrs, b_ptrs, ki, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     A_ZERO: tl.constexpr, B_ZERO: tl.constexpr):
        # The last K tile of an odd K reads zeros past the end: they add nothing to the dot.
        # A_ZERO / B_ZERO: zero of the operand's kind (0.0 for fp8/fp16 tiles, 0 for int8 and
        # raw e4m3 bytes): the interpreter will not cast an int fill into an fp8 tile.
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = tl.arange(0, BLOCK_K)[None, :] < K - ki * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok, other=A_ZERO)
            b = tl.load(b_ptrs, mask=k_ok, other=B_ZERO)
        return a, b

    @triton.jit
    def store_tile(C, out, rm, rn, M, N, stride_cm):
        c_ptrs = C + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c_ptrs, out.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def scale_bias(acc, SA, SB, BIAS, rm, rn, M, N, HAS_BIAS: tl.constexpr):
        # Dequantise: row (token) scale x column (channel) scale, then the bias, in fp32.
        sa = tl.load(SA + rm, mask=rm < M, other=0.0)
        sb = tl.load(SB + rn, mask=rn < N, other=0.0)
        out = acc * sa[:, None] * sb[None, :]
        if HAS_BIAS:
            out = out + tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        return out

    @triton.jit
    def activation(out, rn, ACT: tl.constexpr, ACT_FROM):
        # GELU with the tanh approximation (nn.GELU(approximate="tanh")) on columns >= ACT_FROM,
        # in fp32 before the output cast: the separate GELU pass over the [M, N] output (a read
        # and a write of it, strided where the columns are a slice of a fused projection)
        # disappears. The epilogue does not overlap the MMAs, so its instruction count is time:
        # ACT 2 (NVIDIA, 16-bit outputs) takes tanh.approx.f32, one MUFU op (max. rel. error
        # ~2^-11, below bf16/fp16 output rounding); ACT 1 (fp32 outputs, AMD, the interpreter)
        # uses 0.5 * (1 + tanh(u)) = sigmoid(2u), i.e. x / (1 + exp(-2u)), with the exponent
        # clamped at 2^126 (no inf: x / 2^126 is GELU's -0.0 for very negative x, as torch's).
        if ACT != 0:
            u = 0.7978845608028654 * (out + 0.044715 * out * out * out)
            if ACT == 2:
                t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32,
                                              is_pure=True, pack=1)
                gelu = 0.5 * out * (1.0 + t)
            else:
                gelu = out / (1.0 + tl.exp2(tl.minimum(-2.0 * 1.4426950408889634 * u, 126.0)))
            out = tl.where(rn[None, :] >= ACT_FROM, gelu, out)
        return out
