"""Attention over few keys (cross-attention to text tokens): configs, the kernel, its launcher.

SD1.5 and SDXL attend 4,096 (or 1,024) image tokens to 77 text tokens in every block, half of
their attention calls. All keys fit one tile there, so the flash kernel's key loop runs once
and each program is a serial chain of load Q, load K/V, two small dots and a store: latency
bound at a fraction of memory bandwidth (17 us for 2x10x4096x77x64 on an H200, where moving
Q and O takes about 5 us). Here a program loads K and V once, keeps them on chip, and walks
several query tiles with a software-pipelined loop, so the next Q tile is in flight while the
current one is computed. One key tile means an exact softmax: no running max, no rescale.
Measured there (CUDA graph, bf16): 12.9 us, against 20.1 for FlashAttention-2 and 15.2 for
cuDNN (benchmarks/RESULTS.md, run 4).

Serves calls with no mask and no causal flag whose padded K and V fit the arch's on-chip
budget (SHORT_KV_BYTES); everything else goes to the flash kernel (attention_triton.py).
The softmax max is taken after scaling, so negative scales are exact here. Shared helpers
(jit loads, padding, arch family) come from kernel_common.py.
"""
from __future__ import annotations

import math

import torch

from ..core import direct_launch
from ..core.kernel_common import (LAUNCH_OPTIONS, LOG2E, arch_family, dot_input_precision, family_in, is_hip, next_pow2,
                            row_alignment, sm_count, tl, triton)

if triton is not None:
    from ..core.kernel_common import load_2d, row_offsets

# Per arch family: query rows per tile, warps, pipeline depth of the Q-tile loop, and how many
# programs to start per multiprocessor (each then walks its share of the query tiles).
SHORT_KV_CONFIGS = {
    # The winner of benchmarks/run.py --sweep: 128-row tiles and 8 warps were no faster.
    "sm90": dict(BLOCK_M=64, num_warps=4, num_stages=4, PROGRAMS_PER_SM=2),
    # Not measured: sm90's winning shape, one stage fewer for A100's smaller shared memory.
    "sm80": dict(BLOCK_M=64, num_warps=4, num_stages=3, PROGRAMS_PER_SM=2),
    "sm86": dict(BLOCK_M=64, num_warps=4, num_stages=2, PROGRAMS_PER_SM=2),
    "default": dict(BLOCK_M=64, num_warps=4, num_stages=2, PROGRAMS_PER_SM=2),
    "hip": dict(BLOCK_M=64, num_warps=4, num_stages=1, PROGRAMS_PER_SM=2),
    # Small tiles and two programs per head make the CPU tests walk the tile loop.
    "interpreter": dict(BLOCK_M=16, num_warps=4, num_stages=1, PROGRAMS=2),
}
# Largest padded K+V (bytes) kept on chip per program, leaving room for the pipelined Q
# tiles: H100/H200 have 227 KB of shared memory per SM, A100 163 KB, RTX 30/40/50 ~100 KB.
# Turing and unknown GPUs get 0 (not used): Triton's sm_75 build of this kernel takes 96 KB
# of shared memory even at the smallest tiles, over Turing's 64 KB.
SHORT_KV_BYTES = {"sm90": 96 << 10, "sm80": 64 << 10, "sm86": 32 << 10, "default": 0,
                  "hip": 32 << 10, "interpreter": 1 << 30}
SHORT_KV_MAX_KEYS = 256


def config_family(info, interpreter: bool) -> str:
    """The key of SHORT_KV_CONFIGS and SHORT_KV_BYTES for this device."""
    if interpreter:
        return "interpreter"
    return family_in(SHORT_KV_CONFIGS, arch_family(info.arch))


def short_kv_refusal(q, k, v, attn_mask, is_causal, info, interpreter: bool) -> str | None:
    """Why this kernel cannot serve the call, or None when it can."""
    if triton is None:
        return "Triton is not installed"
    if attn_mask is not None or is_causal:
        return "masked or causal call"
    Lk, D = k.shape[2], q.shape[3]
    if Lk == 0 or Lk > SHORT_KV_MAX_KEYS:
        return f"{Lk} keys (serves 1..{SHORT_KV_MAX_KEYS})"
    kv_bytes = 2 * next_pow2(Lk) * next_pow2(D) * k.element_size()
    budget = SHORT_KV_BYTES[config_family(info, interpreter)]
    if budget == 0:
        return f"not enabled on {info.arch}"
    if kv_bytes > budget:
        return f"padded K+V take {kv_bytes >> 10} KB, over the {budget >> 10} KB kept on chip on this GPU"
    return None


if triton is not None:

    @triton.jit
    def _short_kv_tile(
        Q, O, kt, v, tile, offs_n, offs_d, qk_scale, stride_qm, stride_qd, stride_om, stride_od, LQ, LK,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, M_CHECK: tl.constexpr, N_CHECK: tl.constexpr,
        D_CHECK: tl.constexpr, ALIGN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        q = load_2d(Q + row_offsets(offs_m, stride_qm, ALIGN)[:, None] + offs_d[None, :] * stride_qd,
                     offs_m, LQ, offs_d, HEAD_DIM, M_CHECK, D_CHECK)
        # Scores scaled by scale*log2(e) so exp2 gives e**(s - max); the scale may be negative,
        # so it is applied before the max.
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
        if N_CHECK:
            s = tl.where(offs_n[None, :] < LK, s, float("-inf"))
        m = tl.max(s, 1)
        p = tl.math.exp2(s - m[:, None])
        inv_l = 1.0 / tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        out = (acc * inv_l[:, None]).to(O.dtype.element_ty)
        optrs = O + row_offsets(offs_m, stride_om, ALIGN)[:, None] + offs_d[None, :] * stride_od
        if M_CHECK and D_CHECK:
            tl.store(optrs, out, mask=(offs_m[:, None] < LQ) & (offs_d[None, :] < HEAD_DIM))
        elif M_CHECK:
            tl.store(optrs, out, mask=offs_m[:, None] < LQ)
        elif D_CHECK:
            tl.store(optrs, out, mask=offs_d[None, :] < HEAD_DIM)
        else:
            tl.store(optrs, out)

    @triton.jit
    def _attn_short_kv_fwd(
        Q, K, V, O, qk_scale,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        H, LQ, LK, N_TILES,
        HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        M_CHECK: tl.constexpr, N_CHECK: tl.constexpr, D_CHECK: tl.constexpr,
        ALIGN: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
        WHILE_LOOP: tl.constexpr,
    ):
        off_bh = tl.program_id(1)
        off_b = off_bh // H
        off_h = off_bh % H
        off_hkv = off_h // GROUP
        # int64 bases: batch*heads*length*dim passes 2**31 on video models.
        Q += off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        K += off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
        V += off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
        O += off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh

        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        # Padded key rows load as zeros; their scores are set to -inf below, so they get no weight.
        k = load_2d(K + row_offsets(offs_n, stride_kn, ALIGN)[:, None] + offs_d[None, :] * stride_kd,
                     offs_n, LK, offs_d, HEAD_DIM, N_CHECK, D_CHECK)
        v = load_2d(V + row_offsets(offs_n, stride_vn, ALIGN)[:, None] + offs_d[None, :] * stride_vd,
                     offs_n, LK, offs_d, HEAD_DIM, N_CHECK, D_CHECK)
        kt = tl.trans(k)

        if WHILE_LOOP:
            # Triton <= 3.6's interpreter turns tensor loop bounds into ints through 1-element
            # arrays, an error on NumPy >= 2.4; a while test goes through bool(). Interpreter
            # only: compiled code keeps tl.range, which Triton software-pipelines.
            tile = tl.program_id(0)
            while tile < N_TILES:
                _short_kv_tile(Q, O, kt, v, tile, offs_n, offs_d, qk_scale, stride_qm, stride_qd, stride_om,
                               stride_od, LQ, LK, HEAD_DIM, BLOCK_M, M_CHECK, N_CHECK, D_CHECK, ALIGN, DOT_PRECISION)
                tile += tl.num_programs(0)
        else:
            for tile in tl.range(tl.program_id(0), N_TILES, tl.num_programs(0), num_stages=NUM_STAGES):
                _short_kv_tile(Q, O, kt, v, tile, offs_n, offs_d, qk_scale, stride_qm, stride_qd, stride_om,
                               stride_od, LQ, LK, HEAD_DIM, BLOCK_M, M_CHECK, N_CHECK, D_CHECK, ALIGN, DOT_PRECISION)


def _runtime_args(q, k, v, out, scale, H, Lq, Lk, n_tiles):
    return (q, k, v, out, scale * LOG2E, *q.stride(), *k.stride(), *v.stride(), *out.stride(), H, Lq, Lk, n_tiles)


def attention_short_kv(q, k, v, scale=None, info=None, interpreter=False, config=None):
    """softmax(q k^T * scale) v for [B, H, L, D] inputs with at most SHORT_KV_MAX_KEYS keys
    (any strides; k/v may have fewer heads). The caller checks short_kv_refusal() first."""
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    if Lq == 0 or B == 0 or H == 0:
        return out
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)

    plan_key = None
    if direct_launch.usable(q):
        plan_key = ("short_kv", q.device, q.dtype, q.shape, q.stride(), k.shape, k.stride(), v.stride(),
                    out.stride(), None if config is None else tuple(config.items()),
                    q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, out.data_ptr() % 16)
        plan = direct_launch.lookup(plan_key)
        if plan is not None:
            n_tiles = -(-Lq // plan.consts[2])  # consts: HEAD_DIM, GROUP, BLOCK_M, ...
            direct_launch.launch(plan, q.device.index, _runtime_args(q, k, v, out, scale, H, Lq, Lk, n_tiles))
            return out

    cfg = dict(config or SHORT_KV_CONFIGS[config_family(info, interpreter)])
    if q.dtype == torch.float32 and not interpreter:
        # fp32 tiles take twice the shared memory of the tuned 16-bit ones.
        cfg["BLOCK_M"], cfg["num_stages"] = min(cfg["BLOCK_M"], 64), min(cfg["num_stages"], 2)
    block_m = cfg["BLOCK_M"]
    n_tiles = -(-Lq // block_m)
    if "PROGRAMS" in cfg:
        per_head = cfg["PROGRAMS"]
    else:
        per_head = -(-sm_count(q.device.index or 0) * cfg["PROGRAMS_PER_SM"] // (B * H))
    grid = (max(1, min(n_tiles, per_head)), B * H)
    block_d = next_pow2(D)
    consts = dict(
        HEAD_DIM=D, GROUP=H // Hkv, BLOCK_M=block_m, BLOCK_N=next_pow2(Lk), BLOCK_D=block_d,
        M_CHECK=Lq % block_m != 0, N_CHECK=next_pow2(Lk) != Lk, D_CHECK=block_d != D,
        ALIGN=row_alignment(q, k, v, out),
        DOT_PRECISION=dot_input_precision(q.dtype == torch.float32, is_hip()),
        NUM_STAGES=cfg["num_stages"],
        WHILE_LOOP=interpreter,
    )
    args = _runtime_args(q, k, v, out, scale, H, Lq, Lk, n_tiles)
    kernel = _attn_short_kv_fwd[grid](*args, **consts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                      **LAUNCH_OPTIONS)
    if plan_key is not None and not interpreter:
        direct_launch.record(plan_key, kernel, grid, (*consts.values(),), args, out_index=3)
    return out


def compile_spec(dtype: str, head_dim: int, kv_len: int, config: dict, hip: bool = False):
    """(kernel, signature, constexprs, attrs) for triton.compile(ASTSource(...)), as a JIT launch on
    contiguous-last-dim inputs would specialise it: the compile tests build it for every target."""
    ptr = f"*{dtype}"
    sig = {"Q": ptr, "K": ptr, "V": ptr, "O": ptr, "qk_scale": "fp32"}
    names = [f"stride_{t}{d}" for t in "qkvo" for d in ("b", "h", "m" if t in "qo" else "n", "d")]
    for n in names + ["H", "LQ", "LK", "N_TILES"]:
        sig[n] = "i32"
    block_d, block_n = next_pow2(head_dim), next_pow2(kv_len)
    constexprs = dict(
        HEAD_DIM=head_dim, GROUP=1, BLOCK_M=config["BLOCK_M"], BLOCK_N=block_n, BLOCK_D=block_d,
        M_CHECK=True, N_CHECK=block_n != kv_len, D_CHECK=block_d != head_dim,
        ALIGN=8 if dtype != "fp32" else 4, DOT_PRECISION=dot_input_precision(dtype == "fp32", hip),
        NUM_STAGES=config["num_stages"],
        WHILE_LOOP=False,
        stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1,
    )
    for k_ in constexprs:
        sig[k_] = "constexpr"
    arg_names = list(sig)
    aligned = ["Q", "K", "V", "O"] + [n for n in names if not n.endswith("d")]
    attrs = {(arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return _attn_short_kv_fwd, sig, constexprs, attrs
