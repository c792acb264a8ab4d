"""BF16/FP16 attention forward for Hopper (sm_90) written in Gluon, warp-specialised.

The pipeline of attention_gluon_hopper (the FP8 kernel) without quantisation:
- one producer warp issues TMA loads straight from the caller's [B, H, L, D] tensors (4-D
  tensor descriptors, so any layout whose head-dim stride is 1 and whose other strides are
  16-byte multiples is read in place: ComfyUI's [B, L, H, D]-permuted views too). A query
  block, a key tile or a value tile is the box [1, 1, rows, BLOCK_D]; TMA zero-fills rows
  past the sequence and channels past the head dim, so no padding copies exist.
- K and V tiles go into STAGES-deep rings, each slot guarded by a "full" mbarrier (TMA bytes
  landed) and an "empty" one (both consumer warpgroups done with it: count 2).
- two consumer warpgroups own 64 query rows each (BLOCK_M = 128 per CTA) and run the online
  softmax on async wgmma: the Q.K^T of tile j+1 is issued before the softmax of tile j, as
  in FlashAttention-3, and the warp schedulers interleave the two warpgroups.
Numerics: Q.K^T and P.V accumulate in fp32 on the tensor cores; the softmax runs in fp32 with
exp2 (sm_scale * log2(e) folded into one multiply of the scores); P is rounded to the input
dtype for P.V (as every flash kernel does). V is wgmma's B operand as stored ([keys, D],
D contiguous): 16-bit wgmma takes either major order, so there is no transpose.
GQA: query head h reads key/value head h // (H / H_kv) through the descriptor coordinate.
No mask, no causal (refused with the reason; kernels.attention.dispatch's other paths serve them).
"""
from __future__ import annotations

import math

import torch

from .checks import half_precision_refusal
from ..core.kernel_common import LAUNCH_OPTIONS, LOG2E
from .gluon_hopper import (
    BLOCK_M,
    ROWS_PER_WARPGROUP,
    GluonUnsupportedError,
    gl,
    gluon,
    gluon_refusal,
    shared_layout,
)

if gluon is not None:  # the names below exist only where Gluon's Hopper API imported
    from .gluon_hopper import (
        TensorDescriptor,
        fence_async_shared,
        mbarrier,
        ring_barriers,
        tma_load,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

MAX_HEAD_DIM = 256
# The wgmma tile's depth is 16 bf16 elements; BLOCK_D (the TMA box's width, zero-filled past
# the head dim) is the head dim rounded up to a power of two >= 64 (128-byte swizzle rows).
MIN_BLOCK_D = 64
MAX_GRID_Y = 65535  # CUDA's limit on the grid's second dimension, which runs over batch x heads

# BLOCK_N, ring depth, registers per thread of the second consumer warpgroup and of the
# producer warp (setmaxnreg; consumer 0 gets what is left of the 64K: 256). Per consumer
# thread at BLOCK_D 128 / BLOCK_N 128: O 64 + S 64 + next S 64 + P 32 fp32 registers; at
# BLOCK_D 256 the O accumulator alone is 128, so the key tile halves (S and next S 32 each).
# Shared memory: Q 2x64xBLOCK_D, K and V rings STAGES x BLOCK_N x BLOCK_D (bf16): 160 KB at
# d128, 192 KB at d256 (sm_90 allows 227 KB). d64 and d256 compile without spills; the d128
# and d256 configs are the timed ones (benchmarks/RESULTS.md).
GLUON_BF16_CONFIGS = {
    "sm90_d64": dict(BLOCK_N=128, STAGES=3, CONSUMER_REGS=232, PRODUCER_REGS=24),
    "sm90_d128": dict(BLOCK_N=128, STAGES=2, CONSUMER_REGS=232, PRODUCER_REGS=24),
    "sm90_d256": dict(BLOCK_N=64, STAGES=2, CONSUMER_REGS=232, PRODUCER_REGS=24),
}


def block_head_dim(head_dim: int) -> int:
    return max(MIN_BLOCK_D, 1 << (int(head_dim) - 1).bit_length())


def default_config(head_dim: int) -> dict:
    """The config of this head dim's block."""
    return dict(GLUON_BF16_CONFIGS[f"sm90_d{block_head_dim(head_dim)}"])


def gluon_bf16_refusal(device) -> str | None:
    """Why the BF16 Gluon kernel cannot run on `device`, or None: NVIDIA sm_90 with a Triton
    whose Gluon has every name used and on which this kernel ran right on a GPU (the FP8 kernel's rule)."""
    return gluon_refusal(device, "bf16")


def _stride_refusal(name: str, t: torch.Tensor) -> str | None:
    # TMA reads a tensor in place only if its innermost stride is 1 and every other stride
    # and the base address are multiples of 16 bytes (cuTensorMapEncodeTiled's rules).
    if t.stride(3) != 1 and t.shape[3] > 1:
        return f"{name}'s head dim is not contiguous (stride {t.stride(3)}); TMA needs stride 1"
    size = t.element_size()
    if any(s == 0 for s, n in zip(t.stride(), t.shape) if n > 1):
        return f"{name} is an expanded view (a zero stride in {tuple(t.stride())}); TMA boxes need distinct rows"
    bad = [s for s, n in zip(t.stride()[:3], t.shape[:3]) if n > 1 and (s * size) % 16]
    if bad:
        return f"{name}'s strides {tuple(t.stride())} are not 16-byte multiples; TMA cannot read it in place"
    if t.data_ptr() % 16:
        return f"{name}'s data pointer is not 16-byte aligned; TMA cannot read it"
    return None


def call_refusal(q, k, v, attn_mask=None, is_causal=False) -> str | None:
    """Why these tensors cannot be served by the BF16 Gluon kernel, or None."""
    reason = half_precision_refusal(q, k, v)
    if reason:
        return reason
    B, H, _, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        return (f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must match, "
                "with q's batch and head dim")
    if k.shape[1] < 1 or H % k.shape[1]:
        return f"{H} query heads are not a multiple of {k.shape[1]} key/value heads (GQA needs H % H_kv == 0)"
    if not 1 <= D <= MAX_HEAD_DIM:
        return f"head dim {D} outside 1..{MAX_HEAD_DIM}"
    if B * H > MAX_GRID_Y:
        return f"batch x heads = {B * H} exceeds the launch grid's {MAX_GRID_Y} (one program column per head)"
    if attn_mask is not None:
        return "attention masks are not supported by the Gluon BF16 kernel"
    if is_causal:
        return "is_causal is not supported by the Gluon BF16 kernel"
    for name, t in (("q", q), ("k", k), ("v", v)):
        reason = _stride_refusal(name, t)
        if reason:
            return reason
    return None


if gluon is not None:

    @gluon.jit
    def _bf16_load_partition(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, k_full, k_empty, v_full,
                             v_empty, off_b, off_h, off_hk, q_row0, NKB, BLOCK_N: gl.constexpr,
                             STAGES: gl.constexpr):
        # One warp. Order K0, V0, K1, V1...: a consumer asks for K[j+1] before V[j], which
        # the ring allows whenever STAGES >= 2 (slot (j+1) % STAGES was freed at j+1-STAGES).
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        for wg in gl.static_range(2):
            tma_load(q_desc, [off_b, off_h, q_row0 + wg * 64, 0], q_bar, q_smem.index(wg))
        for j in range(NKB):
            slot = j % STAGES
            phase = (j // STAGES) & 1
            # Parity phase ^ 1 on a fresh barrier passes at once: the first lap needs no wait.
            mbarrier.wait(k_empty.index(slot), phase ^ 1)
            mbarrier.expect(k_full.index(slot), k_desc.block_type.nbytes)
            tma_load(k_desc, [off_b, off_hk, j * BLOCK_N, 0], k_full.index(slot), k_ring.index(slot))
            mbarrier.wait(v_empty.index(slot), phase ^ 1)
            mbarrier.expect(v_full.index(slot), v_desc.block_type.nbytes)
            tma_load(v_desc, [off_b, off_hk, j * BLOCK_N, 0], v_full.index(slot), v_ring.index(slot))

    @gluon.jit
    def _bf16_issue_qk(q, k_ring, k_full, s_zero, j, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
                       STAGES: gl.constexpr):
        slot = j % STAGES
        mbarrier.wait(k_full.index(slot), (j // STAGES) & 1)
        k = k_ring.index(slot).reshape([BLOCK_N, BLOCK_D])
        return warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)

    @gluon.jit
    def _bf16_softmax_tile(s, m_i, l_i, qk_scale, cols, LK, p_layout: gl.constexpr, P_DTYPE: gl.constexpr,
                           BOUNDARY: gl.constexpr):
        # m_i is the running max of the scaled scores (base-2 units): the scale multiplies
        # into the exp2's argument, one FMA per score.
        if BOUNDARY:
            s = gl.where(gl.expand_dims(cols < LK, 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        p16 = gl.convert_layout(p.to(P_DTYPE), p_layout)
        return p16, alpha, m_new, l_i

    @gluon.jit
    def _bf16_pv(acc, p, alpha, v_ring, v_full, j, o_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_D: gl.constexpr, STAGES: gl.constexpr):
        slot = j % STAGES
        mbarrier.wait(v_full.index(slot), (j // STAGES) & 1)
        a = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        v = v_ring.index(slot).reshape([BLOCK_N, BLOCK_D])
        return warpgroup_mma(p, v, acc * a, is_async=True)

    @gluon.jit
    def _bf16_step(s, acc, m_i, l_i, j, q, k_ring, v_ring, k_full, k_empty, v_full, v_empty, s_zero, offs_n,
                   qk_scale, LK, p_layout: gl.constexpr, o_layout: gl.constexpr, P_DTYPE: gl.constexpr,
                   BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr):
        # Key tile j, not the last: tile j+1's scores go to the tensor cores first and run
        # under tile j's softmax.
        s_next = _bf16_issue_qk(q, k_ring, k_full, s_zero, j + 1, BLOCK_N, BLOCK_D, STAGES)
        p, alpha, m_i, l_i = _bf16_softmax_tile(s, m_i, l_i, qk_scale, offs_n, LK, p_layout, P_DTYPE, False)
        pv = _bf16_pv(acc, p, alpha, v_ring, v_full, j, o_layout, BLOCK_N, BLOCK_D, STAGES)
        s, acc = warpgroup_mma_wait(0, deps=(s_next, pv))
        mbarrier.arrive(k_empty.index((j + 1) % STAGES), count=1)
        mbarrier.arrive(v_empty.index(j % STAGES), count=1)
        return s, acc, m_i, l_i

    @gluon.jit
    def _bf16_last(s, acc, m_i, l_i, qk_scale, LK, NKB, offs_n, v_ring, v_full, v_empty, p_layout: gl.constexpr,
                   o_layout: gl.constexpr, P_DTYPE: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
                   STAGES: gl.constexpr):
        # Last key tile: the only one that can hold keys past LK (TMA zero-filled), masked here.
        last = NKB - 1
        p, alpha, m_i, l_i = _bf16_softmax_tile(s, m_i, l_i, qk_scale, last * BLOCK_N + offs_n, LK, p_layout, P_DTYPE,
                                                 True)
        pv = _bf16_pv(acc, p, alpha, v_ring, v_full, last, o_layout, BLOCK_N, BLOCK_D, STAGES)
        acc = warpgroup_mma_wait(0, deps=(pv,))
        mbarrier.arrive(v_empty.index(last % STAGES), count=1)
        return acc, l_i

    @gluon.jit
    def _bf16_mainloop(q, k_ring, v_ring, k_full, k_empty, v_full, v_empty, s_zero, acc, m_i, l_i, offs_n,
                       qk_scale, LK, NKB, p_layout: gl.constexpr, o_layout: gl.constexpr, P_DTYPE: gl.constexpr,
                       BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr):
        s = _bf16_issue_qk(q, k_ring, k_full, s_zero, 0, BLOCK_N, BLOCK_D, STAGES)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(0), count=1)
        for j in range(0, NKB - 1):
            s, acc, m_i, l_i = _bf16_step(s, acc, m_i, l_i, j, q, k_ring, v_ring, k_full, k_empty, v_full,
                                          v_empty, s_zero, offs_n, qk_scale, LK, p_layout, o_layout, P_DTYPE,
                                          BLOCK_N, BLOCK_D, STAGES)
        acc, l_i = _bf16_last(s, acc, m_i, l_i, qk_scale, LK, NKB, offs_n, v_ring, v_full, v_empty, p_layout,
                              o_layout, P_DTYPE, BLOCK_N, BLOCK_D, STAGES)
        return acc, l_i

    @gluon.jit
    def _bf16_consumer(q_smem, k_ring, v_ring, q_bar, k_full, k_empty, v_full, v_empty, O, stride_om, stride_od,
                       o_base, start_m, qk_scale, LQ, LK, NKB, WG: gl.constexpr, HEAD_DIM: gl.constexpr,
                       BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr):
        ROWS: gl.constexpr = 64
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        q = q_smem.index(WG).reshape([ROWS, BLOCK_D])
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        acc = gl.zeros([ROWS, BLOCK_D], gl.float32, o_layout)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([ROWS], gl.float32, row_layout)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

        mbarrier.wait(q_bar, 0)
        acc, l_i = _bf16_mainloop(q, k_ring, v_ring, k_full, k_empty, v_full, v_empty, s_zero, acc, m_i, l_i,
                                  offs_n, qk_scale, LK, NKB, p_layout, o_layout, q_smem.dtype, BLOCK_N, BLOCK_D,
                                  STAGES)

        offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
        rows = start_m * 128 + WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
        inv_l = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout))
        out = acc * gl.expand_dims(inv_l, 1)
        ptrs = O + o_base + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(offs_d * stride_od, 0)
        mask = gl.expand_dims(rows < LQ, 1) & gl.expand_dims(offs_d < HEAD_DIM, 0)
        gl.store(ptrs, out.to(O.dtype.element_ty), mask=mask)

    @gluon.jit
    def _attn_bf16_gluon_fwd(
        q_desc, k_desc, v_desc, O,
        stride_ob, stride_oh, stride_om, stride_od,
        H, GROUP, LQ, LK, NKB, qk_scale,
        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        start_m = gl.program_id(0)
        bh = gl.program_id(1)
        off_b = bh // H
        off_h = bh % H
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        k_full, k_empty, v_full, v_empty = ring_barriers(STAGES)
        fence_async_shared()

        o_base = off_b.to(gl.int64) * stride_ob + off_h.to(gl.int64) * stride_oh
        gl.warp_specialize([
            (_bf16_consumer, (q_smem, k_ring, v_ring, q_bar, k_full, k_empty, v_full, v_empty, O, stride_om,
                              stride_od, o_base, start_m, qk_scale, LQ, LK, NKB, 0, HEAD_DIM, BLOCK_N, BLOCK_D,
                              STAGES)),
            (_bf16_consumer, (q_smem, k_ring, v_ring, q_bar, k_full, k_empty, v_full, v_empty, O, stride_om,
                              stride_od, o_base, start_m, qk_scale, LQ, LK, NKB, 1, HEAD_DIM, BLOCK_N, BLOCK_D,
                              STAGES)),
            (_bf16_load_partition, (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, k_full, k_empty, v_full,
                                    v_empty, off_b, off_h, off_h // GROUP, start_m * 128, NKB, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---- host side ----------------------------------------------------------------------------

def _layout(block_shape, torch_dtype):
    return shared_layout(tuple(block_shape), "bf16" if torch_dtype == torch.bfloat16 else "fp16")


def _block_shapes(block_n: int, block_d: int):
    """TMA box of each operand: Q per warpgroup (64 rows), K and V per key tile."""
    return dict(q=[1, 1, ROWS_PER_WARPGROUP, block_d], k=[1, 1, block_n, block_d], v=[1, 1, block_n, block_d])


def _descriptor(t: torch.Tensor, block_shape):
    # A size-1 dim's stride is never stepped over, but TMA still checks it is a 16-byte
    # multiple (a [B, H, 1, D] slice or an expanded batch can carry any value there).
    strides = list(t.stride())
    step = 16 // t.element_size()
    for i in (2, 1, 0):
        if t.shape[i] == 1:
            strides[i] = -(-max(strides[i + 1] * t.shape[i + 1], step) // step) * step
    strides[3] = 1
    return TensorDescriptor(t, list(t.shape), strides, list(block_shape), _layout(block_shape, t.dtype))


def attention_gluon_bf16(q, k, v, scale=None, config=None):
    """softmax(q k^T * scale) v on sm_90 with bf16/fp16 wgmma and fp32 accumulation;
    q [B, H, Lq, D], k and v [B, H_kv, Lk, D] with H % H_kv == 0 (GQA), fp16 or bf16, D <= 256,
    read in place (head-dim stride 1, other strides 16-byte multiples), any lengths >= 1, no
    mask, no causal. Output in q's dtype and layout. Raises GluonUnsupportedError with the
    reason when the device, the installed Triton or the call is refused."""
    reason = call_refusal(q, k, v) or gluon_bf16_refusal(q.device)
    if reason:
        raise GluonUnsupportedError(f"attention_gluon_bf16: {reason}")
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    if Lq == 0 or B * H == 0:
        return out
    if Lk == 0:
        raise GluonUnsupportedError("attention_gluon_bf16: zero keys (softmax over nothing)")
    config = config or default_config(D)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    block_d = block_head_dim(D)
    shapes = _block_shapes(config["BLOCK_N"], block_d)
    nkb = -(-Lk // config["BLOCK_N"])
    grid = (-(-Lq // BLOCK_M), B * H)
    _attn_bf16_gluon_fwd[grid](
        _descriptor(q, shapes["q"]), _descriptor(k, shapes["k"]), _descriptor(v, shapes["v"]), out,
        *out.stride(), H, H // Hk, Lq, Lk, nkb, scale * LOG2E,
        HEAD_DIM=D, BLOCK_N=config["BLOCK_N"], BLOCK_D=block_d, STAGES=config["STAGES"],
        CONSUMER_REGS=config["CONSUMER_REGS"], PRODUCER_REGS=config["PRODUCER_REGS"], num_warps=4,
        **LAUNCH_OPTIONS)
    return out


def compile_specs(dtype: str, head_dim: int, config: dict | None = None):
    """[(name, kernel, signature, constexprs, attrs, num_warps)] for
    triton.compile(GluonASTSource(...)), specialised as a launch on [B, H, L, D] tensors
    specialises it (tensor descriptors by block shape and shared layout)."""
    config = config or default_config(head_dim)
    block_d = block_head_dim(head_dim)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    shapes = _block_shapes(config["BLOCK_N"], block_d)
    descs = {f"{n}_desc": f"tensordesc<{dtype}[{', '.join(map(str, s))}],{_layout(s, torch_dtype)!r}>"
             for n, s in shapes.items()}
    names = ["q_desc", "k_desc", "v_desc", "O", "stride_ob", "stride_oh", "stride_om", "stride_od",
             "H", "GROUP", "LQ", "LK", "NKB", "qk_scale"]
    types = dict(descs, O=f"*{dtype}", qk_scale="fp32")
    sig = {n: types.get(n, "i32") for n in names}
    const = dict(stride_od=1, HEAD_DIM=head_dim, BLOCK_N=config["BLOCK_N"], BLOCK_D=block_d,
                 STAGES=config["STAGES"], CONSUMER_REGS=config["CONSUMER_REGS"],
                 PRODUCER_REGS=config["PRODUCER_REGS"])
    for n in const:
        sig[n] = "constexpr"
    order = list(sig)
    attrs = {(order.index(n),): [["tt.divisibility", 16]] for n in ("O", "stride_ob", "stride_oh", "stride_om")}
    return [("_attn_bf16_gluon_fwd", _attn_bf16_gluon_fwd, sig, const, attrs, 4)]


__all__ = ["attention_gluon_bf16", "gluon_bf16_refusal", "call_refusal", "compile_specs", "default_config",
           "block_head_dim", "GLUON_BF16_CONFIGS", "MAX_HEAD_DIM", "GluonUnsupportedError"]
