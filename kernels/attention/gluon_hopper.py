"""Full-FP8 attention forward for Hopper (sm_90) written in Gluon, warp-specialised.

Same numerics and inputs as attention_fp8_full (quantize_qkv's Q8/K8/VT8 with per-block
scales, K and V smoothing, the outlier side operands, the 448 shift inside exp2, V's
per-channel scale and mean in the epilogue); what changes is who does what inside a CTA:
- one producer warp issues TMA loads of the key tiles (K8 + its side columns) and of the
  transposed value tiles (VT8) into STAGES-deep rings, each slot guarded by a "full"
  mbarrier (TMA bytes landed) and an "empty" one (both consumers done with it: count 2);
- two consumer warpgroups own 64 query rows each (BLOCK_M = 128 per CTA, sharing every
  K/V tile and the query block scale) and run the online softmax on async wgmma. The
  scheduler interleaves them, so one warpgroup's exp2 runs while the other's MMAs do;
  inside each, the Q.K^T of tile j+1 is issued before the softmax of tile j (it runs on
  the tensor cores meanwhile), as in FlashAttention-3.
- P.V: P is cast to e4m3 in registers and fed as wgmma's register A operand, VT8's tile
  (keys contiguous) as its K-major B operand, chained into one accumulator at BLOCK_N = 128
  (a fresh fp32 accumulator per tile needs BLOCK_N = 64 to fit and measured slower, with the
  same error up to 33k keys: FP8 wgmma keeps a ~22-bit accumulator, see attention_fp8_full).
Serves what attention_fp8_full serves (fp16/bf16, head dims 1..128, any lengths, no mask,
no causal, no GQA); the launcher raises GluonUnsupportedError otherwise.
The Gluon API moves between Triton minors (warp_specialize's signature changed in 3.6);
gluon_refusal() checks the installed Triton for every name used here, so older or newer
ones are refused with a reason and attention_fp8_full stays the fallback.
"""
from __future__ import annotations

import inspect
import logging
import math
from functools import lru_cache

import torch

from ..core import cache_registry
from ..core import device as _device
from .fp8_quant import N_OUTLIER, padded_head_dim, quantize_qkv
from ..core.kernel_common import LAUNCH_OPTIONS, LOG2_P_SCALE
from ..core.gpu_rules import GLUON_CAPABILITY, feature_refusal, gluon_release_refusal

log = logging.getLogger("triton_accel.kernels.attention.gluon_hopper")  # not __name__: the clone's folder name

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # TMA global -> shared copy: `async_copy_global_to_shared` up to 3.8, `async_load` from
    # 3.8 on (3.9 removed the old name).
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _IMPORT_ERROR = None
except Exception as e:  # no Triton, or a Triton whose Gluon lacks these names: refused with this
    triton = gluon = gl = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

ROWS_PER_WARPGROUP = 64  # one wgmma M-extent per warpgroup; two warpgroups per CTA
BLOCK_M = 2 * ROWS_PER_WARPGROUP
MAX_HEAD_DIM = 128

# BLOCK_N (also quantize_qkv's key block), ring depth, registers per thread of the second
# consumer warpgroup and of the producer warp (setmaxnreg; the default partition, consumer 0,
# gets what is left of the 64K: 256). The kernel runs one loop: two key tiles a trip, P in
# wgmma's operand order (V's keys stored to match), the output rescaled before P's exp2;
# benchmarks/RESULTS.md lists the loop shapes measured against it.
GLUON_CONFIGS = {
    "sm90_lean": dict(BLOCK_N=128, STAGES=2, CONSUMER_REGS=232, PRODUCER_REGS=24),
}

# Every Gluon name this file uses, checked by gluon_refusal() before any launch.
_REQUIRED = {
    "gl": ("warp_specialize", "allocate_shared_memory", "NVMMADistributedLayout", "NVMMASharedLayout",
           "DotOperandLayout", "SliceLayout", "static_range", "convert_layout", "float8e4nv", "exp2"),
    "hopper": ("warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared", "mbarrier", "tma"),
    "mbarrier": ("MBarrierLayout", "init", "invalidate", "expect", "wait", "arrive"),
}


# The relabelling of a [rows, n] P tile's columns (_p_operand) viewed as [rows, n // 32, 2, 2, 2, 2, 2]:
# the kernel's gl.permute spells it out (Triton 3.6's permute takes no constexpr tuple; a test
# reads the kernel's source against this), p_relabel() is its torch twin for tests, and
# quantize_qkv's v_key_order() is the same map on key indices.
P_RELABEL_ORDER = (0, 1, 2, 4, 5, 3, 6)


def p_relabel(p: torch.Tensor) -> torch.Tensor:
    """What the kernel's relabelling does to a [rows, n] P tile's columns (n a multiple of 32), on a torch
    tensor: column n of p lands at column v_key_order(n)."""
    rows, n = p.shape
    return p.reshape(rows, n // 32, 2, 2, 2, 2, 2).permute(P_RELABEL_ORDER).reshape(rows, n)


class GluonUnsupportedError(RuntimeError):
    """The call, the device or the installed Triton cannot run the Gluon kernel; says why."""


def gluon_api_refusal(triton_version: str | None = None) -> str | None:
    """Why the installed Triton's Gluon lacks what this kernel uses, or None."""
    version = triton_version if triton_version is not None else _device.triton_version()
    return _api_refusal_for(version)


# Remembered per version string: the check inspects warp_specialize's signature (~50 us),
# which every launch would otherwise pay (a Flux-sized call's kernel runs ~400 us).
@lru_cache(maxsize=None)
def _api_refusal_for(version: str) -> str | None:
    rule = feature_refusal("gluon", version)
    if rule is not None:
        return rule.reason
    if _IMPORT_ERROR is not None:
        return f"Triton {version}: Gluon's Hopper API does not import ({_IMPORT_ERROR})"
    from triton.experimental.gluon.language.nvidia import hopper

    return api_gaps(version, gl, hopper)


def api_gaps(version: str | None, gl_module, hopper_module) -> str | None:
    """What `gl_module` (triton.experimental.gluon.language) and `hopper_module` (its
    nvidia.hopper) lack of what the kernel calls, as a reason, or None. Separate from the
    import so tests can hand it the API of another Triton minor."""
    spaces = {"gl": gl_module, "hopper": hopper_module, "mbarrier": getattr(hopper_module, "mbarrier", None),
              "tma": getattr(hopper_module, "tma", None)}
    missing = [f"{space}.{name}" for space, names in _REQUIRED.items() for name in names
               if not hasattr(spaces[space], name)]
    tma_module = spaces["tma"]
    if not any(hasattr(tma_module, n) for n in ("async_load", "async_copy_global_to_shared")):
        missing.append("tma.async_load (or tma.async_copy_global_to_shared)")
    if missing:
        return f"Triton {version}: Gluon lacks {', '.join(missing)}"
    # 3.4 / 3.5 took (default_args, default_partition, worker_args, ...); 3.6+ one list of
    # (function, args) pairs, which is what the kernel below passes.
    params = list(inspect.signature(gl_module.warp_specialize).parameters)
    if not params or params[0] != "functions_and_args":
        return (f"Triton {version}: gl.warp_specialize takes ({', '.join(params[:3])}, ...), "
                "not the (functions_and_args, worker_num_warps, worker_num_regs) form of Triton 3.6+")
    return None


cache_registry.register("kernels.attention.gluon_hopper.api_refusal", _api_refusal_for.cache_clear)


def gluon_refusal(device, kernel: str = "fp8") -> str | None:
    """Why the Gluon `kernel` ("fp8" here, "bf16" attention_gluon_hopper_bf16's) cannot run on
    `device`, or None: only NVIDIA sm_90 (wgmma and setmaxnreg are sm_90a instructions) with a
    Triton whose Gluon has all used here, on which that kernel ran right on a GPU (_release_refusal)."""
    reason = gluon_api_refusal()
    if reason:
        return reason
    device = torch.device(device)
    if device.type != "cuda":
        return f"the Gluon Hopper kernel needs an NVIDIA sm_90 GPU (got a {device.type} device; no interpreter path)"
    info = _device.describe(device)
    if info.vendor != "nvidia":
        return f"the Gluon Hopper kernel supports NVIDIA GPUs only; {info.name} is {info.arch}"
    if info.capability != GLUON_CAPABILITY:
        major, minor = info.capability or (0, 0)
        return f"the Gluon Hopper kernel uses sm_90a's wgmma and setmaxnreg; {info.name} is sm_{major}{minor}"
    return _release_refusal(kernel)


def call_refusal(q, k, v, attn_mask=None, is_causal=False) -> str | None:
    """Why these tensors cannot be served (same contract as attention_fp8_full), or None."""
    from .fp8_full import call_refusal as fp8_full_call_refusal

    return fp8_full_call_refusal(q, k, v, attn_mask, is_causal)


if gluon is not None:

    @gluon.jit
    def ring_barriers(STAGES: gl.constexpr):
        # The K and V rings' mbarriers, one per slot, initialised: "full" (the TMA bytes
        # landed) and "empty" (both consumer warpgroups read the slot: it is free once both
        # have arrived).
        k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)
        return k_full, k_empty, v_full, v_empty

    @gluon.jit
    def _ring_slot(r, STAGES: gl.constexpr):
        # Ring position r >= 0 (tiles count up from 0): a power-of-two ring's slot is a mask,
        # not a signed remainder with its sign fix-ups.
        if (STAGES & (STAGES - 1)) == 0:
            return r & (STAGES - 1)
        else:
            return r % STAGES

    @gluon.jit
    def _ring_phase(r, STAGES: gl.constexpr):
        # The parity of r's lap round the ring: the mbarrier phase its slot is on.
        if STAGES == 2:
            return (r >> 1) & 1
        elif STAGES == 4:
            return (r >> 2) & 1
        else:
            return (r // STAGES) & 1

    @gluon.jit
    def _load_tile(q_desc, qs_desc, k_desc, ks_desc, v_desc, q_smem, qs_smem, k_ring, ks_ring, v_ring, q_bar,
                   k_full, k_empty, v_full, v_empty, q_row0, k_row0, v_row0, n_kb, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, N_OUT: gl.constexpr):
        # The CTA's loads: its Q (both warpgroups' rows), then its key tiles K0, V0, K1, V1...:
        # a consumer asks for K[j+1] before V[j], which the ring allows whenever STAGES >= 2
        # (slot (j+1) % STAGES was freed at j+1-STAGES).
        q_bytes: gl.constexpr = q_desc.block_type.nbytes + qs_desc.block_type.nbytes * (N_OUT > 0)
        mbarrier.expect(q_bar, 2 * q_bytes)
        for wg in gl.static_range(2):
            tma_load(q_desc, [q_row0 + wg * 64, 0], q_bar, q_smem.index(wg))
            if N_OUT > 0:
                tma_load(qs_desc, [q_row0 + wg * 64, 0], q_bar, qs_smem.index(wg))
        k_bytes: gl.constexpr = k_desc.block_type.nbytes + ks_desc.block_type.nbytes * (N_OUT > 0)
        for j in range(n_kb):
            slot = _ring_slot(j, STAGES)
            phase = _ring_phase(j, STAGES)
            # Parity phase ^ 1 on a fresh barrier passes at once: the first lap needs no wait.
            mbarrier.wait(k_empty.index(slot), phase ^ 1)
            mbarrier.expect(k_full.index(slot), k_bytes)
            tma_load(k_desc, [k_row0 + j * BLOCK_N, 0], k_full.index(slot), k_ring.index(slot))
            if N_OUT > 0:
                tma_load(ks_desc, [k_row0 + j * BLOCK_N, 0], k_full.index(slot), ks_ring.index(slot))
            mbarrier.wait(v_empty.index(slot), phase ^ 1)
            mbarrier.expect(v_full.index(slot), v_desc.block_type.nbytes)
            tma_load(v_desc, [v_row0, j * BLOCK_N], v_full.index(slot), v_ring.index(slot))

    @gluon.jit
    def _load_partition(q_desc, qs_desc, k_desc, ks_desc, v_desc, q_smem, qs_smem, k_ring, ks_ring, v_ring,
                        q_full, k_full, k_empty, v_full, v_empty, LQ_PAD, LK_PAD, n_kb, BLOCK_N: gl.constexpr,
                        BLOCK_D: gl.constexpr, STAGES: gl.constexpr, N_OUT: gl.constexpr):
        # One warp. The CTA's tile is (query block start_m, batch*head bh): Q rows bh * LQ_PAD +
        # 128 start_m, K rows from bh * LK_PAD, VT rows from bh * BLOCK_D.
        bh = gl.program_id(1)
        _load_tile(q_desc, qs_desc, k_desc, ks_desc, v_desc, q_smem, qs_smem, k_ring, ks_ring, v_ring,
                   q_full.index(0), k_full, k_empty, v_full, v_empty, bh * LQ_PAD + gl.program_id(0) * 128,
                   bh * LK_PAD, bh * BLOCK_D, n_kb, BLOCK_N, STAGES, N_OUT)

    @gluon.jit
    def _issue_qk(q, qs, k_ring, ks_ring, k_full, s_zero, j, STAGES: gl.constexpr, N_OUT: gl.constexpr):
        slot = _ring_slot(j, STAGES)
        mbarrier.wait(k_full.index(slot), _ring_phase(j, STAGES))
        s = warpgroup_mma(q, k_ring.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if N_OUT > 0:
            # The outlier channels' residual products: one more k-step on the same accumulator.
            s = warpgroup_mma(qs, ks_ring.index(slot).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _softmax_tile(s, m_i, l_i, c, cols, LK, acc, p_layout: gl.constexpr, o_layout: gl.constexpr,
                      BOUNDARY: gl.constexpr):
        # c = sq * sk > 0 de-quantises and holds sm_scale * log2(e): max(s) * c is the max of
        # the scaled scores and the de-quantising multiply folds into the exp2's argument.
        if BOUNDARY:
            s = gl.where(gl.expand_dims(cols < LK, 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * c)
        alpha = gl.exp2(m_i - m_new)
        a = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        # acc is free here (the last P.V was waited for): rescaled before P's exp2 in program
        # order, its 64 multiplies a thread can issue while the MUFU pipe works on the
        # exponentials instead of delaying the next P.V.
        acc = acc * a
        p = gl.exp2(s * c - gl.expand_dims(m_new - LOG2_P_SCALE, 1))  # in [0, 448]
        l_i = l_i * alpha + gl.sum(p, 1)
        p = _p_operand(p, p_layout)
        return p, m_new, l_i, acc

    @gluon.jit
    def _p_operand(p, p_layout: gl.constexpr):
        # P (fp32, in [0, 448]) as P.V's e4m3 register A operand. The accumulator layout gives a
        # thread columns 8c + 2t + e of each 32-column k-step (t its lane mod 4, e one register
        # bit); wgmma's 8-bit A operand wants columns 16h + 4t + f. Relabelling the columns by
        # the bit permutation below puts every element where the A layout wants it already
        # (register renaming, no shuffles); V's keys were stored in the same order
        # (quantize_qkv(v_key_perm=True)), so P.V sums the same products.
        p8 = p.to(gl.float8e4nv)
        rows: gl.constexpr = p8.shape[0]
        n: gl.constexpr = p8.shape[1]
        p8 = gl.reshape(p8, [rows, n // 32, 2, 2, 2, 2, 2])  # (k-step, c1, c0, t1, t0, e)
        p8 = gl.permute(p8, [0, 1, 2, 4, 5, 3, 6])  # P_RELABEL_ORDER: (k-step, c1, t1, t0, c0, e)
        p8 = gl.reshape(p8, [rows, n])
        return gl.convert_layout(p8, p_layout)

    @gluon.jit
    def _pv_issue(acc, p8, v_ring, v_full, j, STAGES: gl.constexpr):
        # P.V of key tile j onto the (already rescaled) accumulator.
        slot = _ring_slot(j, STAGES)
        mbarrier.wait(v_full.index(slot), _ring_phase(j, STAGES))
        return warpgroup_mma(p8, v_ring.index(slot).permute((1, 0)), acc, is_async=True)

    @gluon.jit
    def _kv_step(s, acc, m_i, l_i, j, q, qs, k_ring, ks_ring, v_ring, k_full, k_empty, v_full, v_empty, s_zero,
                 offs_n, q_scale, SK, LK, p_layout: gl.constexpr, o_layout: gl.constexpr, STAGES: gl.constexpr,
                 N_OUT: gl.constexpr):
        # One key tile j that is not the last: tile j+1's scores go to the tensor cores
        # first and run under tile j's softmax.
        s_next = _issue_qk(q, qs, k_ring, ks_ring, k_full, s_zero, j + 1, STAGES, N_OUT)
        c = q_scale * gl.load(SK + j)
        p8, m_i, l_i, acc = _softmax_tile(s, m_i, l_i, c, offs_n, LK, acc, p_layout, o_layout, False)
        pv = _pv_issue(acc, p8, v_ring, v_full, j, STAGES)
        s, acc = warpgroup_mma_wait(0, deps=(s_next, pv))
        mbarrier.arrive(k_empty.index(_ring_slot(j + 1, STAGES)), count=1)
        mbarrier.arrive(v_empty.index(_ring_slot(j, STAGES)), count=1)
        return s, acc, m_i, l_i

    @gluon.jit
    def _last_tile(s, acc, m_i, l_i, q_scale, SK, LK, NKB, offs_n, v_ring, v_full, v_empty,
                   p_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        # The last key tile: the only one that can hold padded keys, masked to -inf here.
        last = NKB - 1
        c = q_scale * gl.load(SK + last)
        p8, m_i, l_i, acc = _softmax_tile(s, m_i, l_i, c, last * BLOCK_N + offs_n, LK, acc, p_layout, o_layout, True)
        pv = _pv_issue(acc, p8, v_ring, v_full, last, STAGES)
        acc = warpgroup_mma_wait(0, deps=(pv,))
        mbarrier.arrive(v_empty.index(_ring_slot(last, STAGES)), count=1)
        return acc, l_i

    @gluon.jit
    def _mainloop(q, qs, k_ring, ks_ring, v_ring, k_full, k_empty, v_full, v_empty, s_zero, acc, m_i, l_i, offs_n,
                  q_scale, SK, LK, NKB, p_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, N_OUT: gl.constexpr):
        # Each warpgroup on its own: Q.K^T of tile j+1 is issued before tile j's softmax; the
        # two warpgroups interleave as the warp schedulers see fit. Two key tiles a trip: in a
        # one-tile loop tile j+1's scores land in fresh registers while tile j's are still
        # being read, and ptxas copies them back at the back edge (64 MOVs a tile, on the
        # critical path); two tiles a trip let the two score tiles swap roles instead.
        s = _issue_qk(q, qs, k_ring, ks_ring, k_full, s_zero, 0, STAGES, N_OUT)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(_ring_slot(0, STAGES)), count=1)
        for jj in range(0, (NKB - 1) // 2):
            j = 2 * jj
            s, acc, m_i, l_i = _kv_step(s, acc, m_i, l_i, j, q, qs, k_ring, ks_ring, v_ring, k_full, k_empty, v_full,
                                        v_empty, s_zero, offs_n, q_scale, SK, LK, p_layout, o_layout, STAGES, N_OUT)
            s, acc, m_i, l_i = _kv_step(s, acc, m_i, l_i, j + 1, q, qs, k_ring, ks_ring, v_ring, k_full, k_empty,
                                        v_full, v_empty, s_zero, offs_n, q_scale, SK, LK, p_layout, o_layout, STAGES,
                                        N_OUT)
        # An odd count of inner tiles ends with one more inner step and the last tile in
        # their own branch: a branch that merged the score tile back (one step peeled
        # before or after the loop) made ptxas spill 1.5 KB and serialise the wgmmas.
        if (NKB - 1) % 2 == 1:
            s, acc, m_i, l_i = _kv_step(s, acc, m_i, l_i, NKB - 2, q, qs, k_ring, ks_ring, v_ring, k_full, k_empty,
                                        v_full, v_empty, s_zero, offs_n, q_scale, SK, LK, p_layout, o_layout, STAGES,
                                        N_OUT)
            acc, l_i = _last_tile(s, acc, m_i, l_i, q_scale, SK, LK, NKB, offs_n, v_ring, v_full, v_empty, p_layout,
                                  o_layout, BLOCK_N, STAGES)
        else:
            acc, l_i = _last_tile(s, acc, m_i, l_i, q_scale, SK, LK, NKB, offs_n, v_ring, v_full, v_empty, p_layout,
                                  o_layout, BLOCK_N, STAGES)
        return acc, l_i

    @gluon.jit
    def _consumer_tile(q, qs, q_bar, k_ring, ks_ring, v_ring, k_full, k_empty, v_full, v_empty, SQ, SK, SV, VMEAN,
                       O, stride_ob, stride_oh, stride_om, stride_od, H, bh, start_m, LQ, LK, NQB, NKB,
                       WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
                       STAGES: gl.constexpr, N_OUT: gl.constexpr):
        # This warpgroup's 64 query rows of CTA tile (start_m, bh), Q in `q` / `qs` once q_bar
        # completes its first phase.
        ROWS: gl.constexpr = 64
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_D, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

        bh64 = bh.to(gl.int64)
        q_scale = gl.load(SQ + bh64 * NQB + start_m)
        SK = SK + bh64 * NKB
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        acc = gl.zeros([ROWS, BLOCK_D], gl.float32, o_layout)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([ROWS], gl.float32, row_layout)
        offs_n = gl.arange(0, BLOCK_N, layout=col_layout)

        mbarrier.wait(q_bar, 0)
        acc, l_i = _mainloop(q, qs, k_ring, ks_ring, v_ring, k_full, k_empty, v_full, v_empty, s_zero, acc, m_i, l_i,
                             offs_n, q_scale, SK, LK, NKB, p_layout, o_layout, BLOCK_N, STAGES, N_OUT)

        # Epilogue in fp32: V's per-channel scale, 1 / l (the 448 of P cancels) and V's mean.
        o_row0 = (bh // H).to(gl.int64) * stride_ob + (bh % H).to(gl.int64) * stride_oh
        offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
        rows = start_m * 128 + WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
        sv = gl.load(SV + bh64 * BLOCK_D + offs_d)
        v_mean = gl.load(VMEAN + bh64 * BLOCK_D + offs_d)
        inv_l = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout))
        out = acc * gl.expand_dims(inv_l, 1) * gl.expand_dims(sv, 0) + gl.expand_dims(v_mean, 0)
        ptrs = O + o_row0 + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(offs_d * stride_od, 0)
        mask = gl.expand_dims(rows < LQ, 1) & gl.expand_dims(offs_d < HEAD_DIM, 0)
        gl.store(ptrs, out.to(O.dtype.element_ty), mask=mask)

    @gluon.jit
    def _consumer_partition(q_smem, qs_smem, k_ring, ks_ring, v_ring, q_full, k_full, k_empty, v_full, v_empty, SQ,
                            SK, SV, VMEAN, O, stride_ob, stride_oh, stride_om, stride_od, H, LQ, LK, NQB, NKB,
                            WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
                            STAGES: gl.constexpr, N_OUT: gl.constexpr):
        _consumer_tile(q_smem.index(WG), qs_smem.index(WG), q_full.index(0), k_ring, ks_ring, v_ring, k_full,
                       k_empty, v_full, v_empty, SQ, SK, SV, VMEAN, O, stride_ob, stride_oh, stride_om, stride_od, H,
                       gl.program_id(1), gl.program_id(0), LQ, LK, NQB, NKB, WG, HEAD_DIM, BLOCK_N, BLOCK_D, STAGES,
                       N_OUT)

    @gluon.jit
    def _attn_fp8_gluon_fwd(
        q_desc, qs_desc, k_desc, ks_desc, v_desc, ones_desc, SQ, SK, SV, VMEAN, O,
        stride_ob, stride_oh, stride_om, stride_od,
        H, LQ, LK, LQ_PAD, LK_PAD, NQB, NKB, N_TILES,
        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr,
        N_OUT: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        # Grid (NQB, B*H), one CTA tile each.
        # Shared memory is allocated before the partitions fork: Q for both warpgroups
        # (16 KB at d128), the K ring (K8 + side columns) and the VT ring.
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        qs_smem = gl.allocate_shared_memory(qs_desc.dtype, [2] + qs_desc.block_type.shape, qs_desc.layout)
        k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        ks_ring = gl.allocate_shared_memory(ks_desc.dtype, [STAGES] + ks_desc.block_type.shape, ks_desc.layout)
        v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        _ones_smem = gl.allocate_shared_memory(ones_desc.dtype, ones_desc.block_type.shape, ones_desc.layout)
        q_full = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_full.index(0), count=1)
        mbarrier.init(q_empty.index(0), count=2)
        k_full, k_empty, v_full, v_empty = ring_barriers(STAGES)
        fence_async_shared()

        gl.warp_specialize([
            (_consumer_partition, (q_smem, qs_smem, k_ring, ks_ring, v_ring, q_full, k_full, k_empty, v_full,
                                   v_empty, SQ, SK, SV, VMEAN, O, stride_ob, stride_oh, stride_om, stride_od, H, LQ,
                                   LK, NQB, NKB, 0, HEAD_DIM, BLOCK_N, BLOCK_D, STAGES, N_OUT)),
            (_consumer_partition, (q_smem, qs_smem, k_ring, ks_ring, v_ring, q_full, k_full, k_empty, v_full,
                                   v_empty, SQ, SK, SV, VMEAN, O, stride_ob, stride_oh, stride_om, stride_od, H, LQ,
                                   LK, NQB, NKB, 1, HEAD_DIM, BLOCK_N, BLOCK_D, STAGES, N_OUT)),
            (_load_partition, (q_desc, qs_desc, k_desc, ks_desc, v_desc, q_smem, qs_smem, k_ring, ks_ring, v_ring,
                               q_full, k_full, k_empty, v_full, v_empty, LQ_PAD, LK_PAD, NKB, BLOCK_N, BLOCK_D,
                               STAGES, N_OUT)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---- host side ----------------------------------------------------------------------------

def _fp8_layout(block_shape):
    return shared_layout(tuple(block_shape), "fp8e4nv")


# get_default_for costs ~20 us a call and a launch needs up to five: remembered per
# (block shape, element type), the only inputs of the answer.
@lru_cache(maxsize=None)
def shared_layout(block_shape: tuple, dtype_name: str):
    """The NVMMA shared layout of a TMA box of `block_shape` with elements `dtype_name`
    (fp8e4nv, bf16, fp16): 128-byte swizzle where the box's rows allow it."""
    dtype = {"fp8e4nv": gl.float8e4nv, "bf16": gl.bfloat16, "fp16": gl.float16}[dtype_name]
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), dtype)


cache_registry.register("kernels.attention.gluon_hopper.shared_layout", shared_layout.cache_clear)


def _block_shapes(block_n: int, block_d: int, side: int):
    """TMA box of each operand: Q / Q-side per warpgroup (64 rows), K / K-side per key tile,
    VT as [head dim, keys] (keys contiguous: the K-major B operand of P.V)."""
    return dict(q=[ROWS_PER_WARPGROUP, block_d], qs=[ROWS_PER_WARPGROUP, side], k=[block_n, block_d],
                ks=[block_n, side], v=[block_d, block_n], ones=[8, block_n])


# The kernel's ones_desc operand: 8 rows of e4m3 ones, one per device and key tile width, with
# its TMA descriptor, kept for the process (1 KB). The kernel allocates its tile and never reads it.
@lru_cache(maxsize=None)
def _ones_descriptor(device: torch.device, block_n: int):
    ones = torch.ones(8, block_n, device=device).to(torch.float8_e4m3fn)
    return TensorDescriptor.from_tensor(ones, [8, block_n], _fp8_layout([8, block_n]))


cache_registry.register("kernels.attention.gluon_hopper.ones_descriptor", _ones_descriptor.cache_clear)


def default_config(device=None) -> dict:
    """GLUON_CONFIGS["sm90_lean"], the one config of the kernel (sm_90 only)."""
    del device  # one target: sm_90
    return dict(GLUON_CONFIGS["sm90_lean"])


def attention_gluon_fp8(q, k, v, scale=None, config=None, n_outlier: int = N_OUTLIER):
    """softmax(q k^T * scale) v with Q.K^T and P.V in e4m3 on sm_90, quantisation included;
    q, k, v [B, H, L, D] fp16/bf16 (any strides, D <= 128, no mask, no causal, no GQA, any
    lengths >= 1); output in q's dtype, [B, H, Lq, D] in q's memory layout (torch.empty_like):
    for ComfyUI's q, a view of [B, Lq, H, D] memory, the [B, Lq, H * D] it hands back is then a
    view, not a transposing copy (0.3-0.4 ms a call at Wan 2.1 14B; torch's flash SDPA allocates
    its output the same way). Raises GluonUnsupportedError with the reason when the device,
    Triton or the call is refused."""
    reason = call_refusal(q, k, v) or gluon_refusal(q.device)
    if reason:
        raise GluonUnsupportedError(f"attention_gluon_fp8: {reason}")
    config = config or default_config(q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if q.shape[2] == 0 or q.shape[0] * q.shape[1] == 0:
        return torch.empty_like(q)
    if k.shape[2] == 0:
        raise GluonUnsupportedError("attention_gluon_fp8: zero keys (softmax over nothing)")
    qkv = quantize_for_config(q, k, v, scale, config, n_outlier)
    return attention_gluon_fp8_quantized(qkv, q.shape, k.shape[2], q.dtype, q.device, config,
                                         out=torch.empty_like(q))


def quantize_for_config(q, k, v, scale: float, config: dict, n_outlier: int = N_OUTLIER):
    """quantize_qkv's operands as this config's kernel reads them: its tiles (BLOCK_M, the
    config's BLOCK_N) and V's keys in v_key_order() (the kernel's order of P's columns)."""
    return quantize_qkv(q, k, v, scale, BLOCK_M, config["BLOCK_N"], n_outlier, v_key_perm=True)


def attention_gluon_fp8_quantized(qkv, q_shape, lk: int, dtype, device, config, out=None):
    """The Gluon kernel alone on quantize_qkv(..., block_m=128, block_n=config's BLOCK_N), into
    `out` ([B, H, Lq, D] of `dtype`, any strides) or a new contiguous tensor."""
    B, H, Lq, D = q_shape
    if out is None:
        out = torch.empty(B, H, Lq, D, dtype=dtype, device=device)
    elif out.shape != (B, H, Lq, D) or out.dtype != dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not [{B}, {H}, {Lq}, {D}] {dtype}")
    bh, lq_pad, block_d = qkv.q8.shape
    lk_pad = qkv.k8.shape[1]
    if qkv.block_m != BLOCK_M or qkv.block_n != config["BLOCK_N"]:
        raise ValueError(f"quantize_qkv blocks ({qkv.block_m}, {qkv.block_n}) != kernel's ({BLOCK_M}, {config['BLOCK_N']})")
    if not qkv.v_key_perm:
        # A mismatch would not fail: it would pair P's columns with the wrong keys.
        raise ValueError("the Gluon kernel needs quantize_qkv(v_key_perm=True), got v_key_perm=False")
    side = max(2 * qkv.n_outlier, 16)  # the side operands' width (16 bytes, unused, when n_outlier = 0)
    shapes = _block_shapes(config["BLOCK_N"], block_d, side)
    flat = dict(q=qkv.q8.view(bh * lq_pad, block_d), qs=qkv.qs.view(bh * lq_pad, side),
                k=qkv.k8.view(bh * lk_pad, block_d), ks=qkv.ks.view(bh * lk_pad, side),
                v=qkv.vt8.view(bh * block_d, lk_pad))
    desc = {n: TensorDescriptor.from_tensor(t, shapes[n], _fp8_layout(shapes[n])) for n, t in flat.items()}
    desc["ones"] = _ones_descriptor(torch.device(device), config["BLOCK_N"])
    n_tiles = qkv.sq.shape[1] * bh
    grid = (qkv.sq.shape[1], bh)
    _attn_fp8_gluon_fwd[grid](
        desc["q"], desc["qs"], desc["k"], desc["ks"], desc["v"], desc["ones"], qkv.sq, qkv.sk, qkv.sv, qkv.vmean,
        out,
        *out.stride(), H, Lq, lk, lq_pad, lk_pad, qkv.sq.shape[1], qkv.sk.shape[1], n_tiles,
        HEAD_DIM=D, BLOCK_N=config["BLOCK_N"], BLOCK_D=block_d, STAGES=config["STAGES"], N_OUT=qkv.n_outlier,
        CONSUMER_REGS=config["CONSUMER_REGS"], PRODUCER_REGS=config["PRODUCER_REGS"], num_warps=4,
        **LAUNCH_OPTIONS)
    return out


def compile_specs(dtype: str, head_dim: int, config: dict, n_outlier: int = N_OUTLIER):
    """[(name, kernel, signature, constexprs, attrs, num_warps)] for
    triton.compile(GluonASTSource(...)) of the attention kernel, specialised as a launch on
    contiguous [B, H, L, D] tensors specialises it (tensor descriptors by their block shape
    and shared layout)."""
    block_d = padded_head_dim(head_dim)
    side = max(2 * n_outlier, 16)
    shapes = _block_shapes(config["BLOCK_N"], block_d, side)
    descs = {f"{n}_desc": f"tensordesc<fp8e4nv[{', '.join(map(str, s))}],{_fp8_layout(s)!r}>" for n, s in shapes.items()}
    names = ["q_desc", "qs_desc", "k_desc", "ks_desc", "v_desc", "ones_desc", "SQ", "SK", "SV", "VMEAN", "O",
             "stride_ob", "stride_oh", "stride_om", "stride_od", "H", "LQ", "LK", "LQ_PAD", "LK_PAD", "NQB", "NKB", "N_TILES"]
    types = dict(descs, O=f"*{dtype}", **{n: "*fp32" for n in ("SQ", "SK", "SV", "VMEAN")})
    sig = {n: types.get(n, "i32") for n in names}
    const = dict(stride_od=1, HEAD_DIM=head_dim, BLOCK_N=config["BLOCK_N"], BLOCK_D=block_d, STAGES=config["STAGES"],
                 N_OUT=n_outlier, CONSUMER_REGS=config["CONSUMER_REGS"], PRODUCER_REGS=config["PRODUCER_REGS"])
    for n in const:
        sig[n] = "constexpr"
    order = list(sig)
    aligned = ["SV", "VMEAN", "O", "stride_ob", "stride_oh", "stride_om", "LQ_PAD", "LK_PAD"]
    attrs = {(order.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return [("_attn_fp8_gluon_fwd", _attn_fp8_gluon_fwd, sig, const, attrs, 4)]


__all__ = ["attention_gluon_fp8", "attention_gluon_fp8_quantized", "gluon_refusal", "gluon_api_refusal",
           "api_gaps", "call_refusal", "compile_specs", "default_config", "GluonUnsupportedError", "GLUON_CONFIGS",
           "MAX_HEAD_DIM", "BLOCK_M", "p_relabel", "P_RELABEL_ORDER", "quantize_for_config"]


# At the end of the file: a line added above the @gluon.jit kernels would move their line
# numbers, which are part of their cache keys (every user would recompile them).
def _release_refusal(kernel: str) -> str | None:
    """gpu_rules.gluon_release_refusal's reason for the installed Triton: the Gluon kernels run
    only on the minors where they were checked on a GPU (GLUON_GPU_VERIFIED)."""
    rule = gluon_release_refusal(kernel, _device.triton_version())
    return rule.reason if rule is not None else None
