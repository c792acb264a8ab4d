"""What every attention kernel file shares: constants, jit helpers, padding, the arch family,
the mask layout handed to a kernel, the out-of-resources test, shape classes and the
interpreter's bf16 upcast.

Each kernel file keeps its own config tables (per arch family) and kernel; the facts here
are the ones that must agree between them: the same GPU maps to the same family, a mask is
read through the same strides, a config that does not fit is recognised the same way.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from . import cache_registry

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources
except Exception:  # the registry reports why; importing the pack must still work
    triton = None
    tl = None
    OutOfResources = None

LOG2E = 1.4426950408889634  # scores are scaled by scale*log2(e) so the kernels use exp2
# log2(448) rounded down: the FP8 P.V kernels form P = exp2(S - max + LOG2_P_SCALE) <= 448,
# e4m3's largest finite value, so P spans e4m3's whole range. A constexpr: jit code reads it.
LOG2_P_SCALE = tl.constexpr(8.8073) if tl is not None else 8.8073

# Mask kinds, a constexpr of every kernel that reads masks.
MASK_NONE, MASK_BOOL, MASK_ADDITIVE = 0, 1, 2
MASK_NAMES = {MASK_NONE: "none", MASK_BOOL: "bool", MASK_ADDITIVE: "add"}


# ---- sizes and layouts ----------------------------------------------------------------------

def next_pow2(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= n and >= minimum: tile extents (16 is the smallest MMA dim)."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints. Host code uses this, not triton.cdiv: since Triton 3.6 that is a
    constexpr_function whose Python call costs microseconds, on every kernel launch."""
    return -(-a // b)


def row_alignment(*tensors) -> int:
    """Largest power of two (<= 16 elements) dividing every row/head/batch stride, or 1 when a
    last dim is strided: the divisibility the kernels may promise Triton for row offsets."""
    if any(t.stride(-1) != 1 for t in tensors):
        return 1
    g = 0
    for t in tensors:
        for st in t.stride()[:-1]:
            g = _gcd(g, st)
    align = min(16, g & -g) if g else 16
    return align if align >= 2 else 1


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def dot_input_precision(fp32: bool, hip: bool) -> str:
    # fp32 inputs keep fp32 accuracy ("ieee"), as SDPA gives; 16-bit inputs ignore the
    # setting on NVIDIA, but AMD's Triton rejects "tf32" outright.
    return "ieee" if fp32 or hip else "tf32"


def mask_layout(attn_mask, B: int, H: int, Lq: int, Lk: int, placeholder: torch.Tensor):
    """(kind, tensor, strides, row_broadcast) of a mask as the kernels read it.

    The mask is expanded to [B, H, Lq, Lk] as a stride-0 view (never materialised); bool
    masks are reinterpreted as uint8. Without a mask the placeholder stands in for the pointer.
    A row-broadcast mask ([B, 1, 1, Lk], the usual padding mask) has a zero query stride, so
    the kernels read it as one vector per key tile.
    """
    if attn_mask is None:
        return MASK_NONE, placeholder, (0, 0, 0, 0), False
    mk = attn_mask.expand(B, H, Lq, Lk)
    if mk.dtype == torch.bool:
        kind, mk = MASK_BOOL, mk.view(torch.uint8)
    else:
        kind = MASK_ADDITIVE
    strides = mk.stride()
    return kind, mk, strides, strides[2] == 0


# ---- GPUs -----------------------------------------------------------------------------------

FAMILIES = frozenset({"sm75", "sm80", "sm86", "sm89", "sm90", "sm120", "hip", "default"})


def arch_family(arch: str) -> str:
    """The config family of a device arch ("sm90", "gfx942"...): one of sm75, sm80, sm86, sm89,
    sm90, sm120, hip, default. Datacenter Blackwell (sm_100/sm_110) runs Hopper-sized tiles;
    consumer Blackwell (sm_12x) has Ada's ~100 KB of shared memory. Eligibility (which GPU may
    run a kernel at all) is gpu_rules.py's, never decided here."""
    if arch in FAMILIES:  # already a family name (the compile tests pass those)
        return arch
    if arch.startswith("gfx"):
        return "hip"
    if not arch.startswith("sm"):
        return "default"
    try:
        major, minor = int(arch[2:-1] or 0), int(arch[-1])
    except ValueError:
        return "default"
    if major >= 12:
        return "sm120"
    if major >= 9:
        return "sm90"
    if major == 8:
        return {0: "sm80", 9: "sm89"}.get(minor, "sm86")
    return "sm75" if arch == "sm75" else "default"


# A family a table has no entry for takes the next one here (smaller shared memory first).
FAMILY_FALLBACK = {"sm120": "sm89", "sm89": "sm86", "sm86": "default", "sm80": "default", "sm90": "default",
                   "sm75": "default", "hip": "default"}


def family_in(table: dict, family: str) -> str:
    """The key of `table` that serves `family`: itself, else its fallbacks, else "default"."""
    while family not in table and family in FAMILY_FALLBACK:
        family = FAMILY_FALLBACK[family]
    return family


@lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


cache_registry.register("kernels.core.kernel_common.sm_count", sm_count.cache_clear)


def is_out_of_resources(exc: BaseException) -> bool:
    """A launch that needs more shared memory (or threads, tensor memory) than the GPU has.

    Every supported Triton (3.2-3.9) raises triton.runtime.errors.OutOfResources for it when
    the kernel is loaded, so the type decides; no message text is matched.
    """
    return OutOfResources is not None and isinstance(exc, OutOfResources)


def is_hip() -> bool:
    return bool(getattr(torch.version, "hip", None))


# ---- calls ----------------------------------------------------------------------------------

def shape_class(dtype: torch.dtype, head_dim: int, kv_len: int, mask_kind: str, is_causal: bool,
                gqa: bool | None = None) -> tuple:
    """The tuning cache's key for a call: (dtype, head dim, [gqa,] mask, causal, key-length
    bucket). Key lengths are bucketed to powers of two (capped at 65536) so one tuned config
    serves a resolution's neighbours."""
    lk_class = min(1 << max(0, (kv_len - 1).bit_length()), 1 << 16)
    head = (str(dtype).replace("torch.", ""), head_dim)
    return head + ((bool(gqa),) if gqa is not None else ()) + (mask_kind, bool(is_causal), lk_class)


def interpreter_upcast(q, k, v, attn_mask):
    """fp32 copies of bf16 inputs for the Triton interpreter, or None when not needed.

    The interpreter's bf16 dots are wrong (numpy has no bf16), so bf16 calls run in fp32
    there and the caller casts the result back. Only the CPU interpreter pays this copy;
    GPUs run bf16 natively.
    """
    if q.dtype != torch.bfloat16:
        return None
    m = attn_mask.float() if attn_mask is not None and attn_mask.dtype == torch.bfloat16 else attn_mask
    return q.float(), k.float(), v.float(), m


# ---- jit helpers ----------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def load_2d(ptrs, rows, row_limit, cols, col_limit, ROW_CHECK: tl.constexpr, COL_CHECK: tl.constexpr):
        # Bounds checks only where a tile can cross an edge; zeros fill what is outside.
        if ROW_CHECK and COL_CHECK:
            x = tl.load(ptrs, mask=(rows[:, None] < row_limit) & (cols[None, :] < col_limit), other=0.0)
        elif ROW_CHECK:
            x = tl.load(ptrs, mask=rows[:, None] < row_limit, other=0.0)
        elif COL_CHECK:
            x = tl.load(ptrs, mask=cols[None, :] < col_limit, other=0.0)
        else:
            x = tl.load(ptrs)
        return x

    @triton.jit
    def row_offsets(idx, stride, ALIGN: tl.constexpr):
        # Triton learns only divisibility by 16 from a launch; head dim 40 gives row strides
        # of 40 elements, still 16-byte aligned. Saying so restores 16-byte vector loads and
        # cp.async pipelining (a hint on the scalar stride argument is not propagated).
        off = idx * stride
        if ALIGN > 1:
            off = tl.multiple_of(off, ALIGN)
        return off

    @triton.jit
    def layer_norm_row(x, mask, C, eps, W, B, offs, HAS_AFFINE: tl.constexpr):
        # LayerNorm of one fp32 row held in registers: mean and variance in two passes (as exact
        # as torch's Welford); padded lanes (mask off, loaded as 0) must not add (0 - mean)^2 to
        # the variance. Times weight plus bias in fp32 when affine; the caller rounds.
        mean = tl.sum(x, 0) / C
        centred = tl.where(mask, x - mean, 0.0)
        rstd = tl.math.rsqrt(tl.sum(centred * centred, 0) / C + eps)
        y = centred * rstd
        if HAS_AFFINE:
            y = y * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32) \
                + tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
        return y

    @triton.jit
    def round_bits(y, DROPPED: tl.constexpr):
        # fp32 y rounded to nearest even on its bits, the low DROPPED mantissa bits cleared
        # (16: bf16's precision, 13: fp16's), still fp32. Finite values only.
        bits = y.to(tl.uint32, bitcast=True)
        half = (1 << (DROPPED - 1)) - 1
        bits = (bits + half + ((bits >> DROPPED) & 1)) & (0xFFFFFFFF ^ ((1 << DROPPED) - 1))
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def to_output_dtype(y, DTYPE: tl.constexpr, EXACT_BF16: tl.constexpr):
        # fp32 -> DTYPE, rounding to nearest even. GPUs' cvt.rn does; the Triton interpreter
        # truncates fp32 -> bf16 (half of all values land one ulp low), so under it
        # (EXACT_BF16) the value is rounded on its bits first and the cast becomes exact.
        # Finite values only: what the normalisation kernels produce from finite inputs.
        if EXACT_BF16:
            y = round_bits(y, 16)
        return y.to(DTYPE)

    @triton.jit
    def round_unfused(y, DTYPE: tl.constexpr):
        # y rounded to DTYPE's precision, kept in fp32, for a product ComfyUI stores as a
        # tensor before adding it (Flux's `x += y * gate`: two roundings). A plain
        # y.to(DTYPE).to(fp32) before the add is folded by the compiler into one bf16/fp16 FMA
        # (fma.rn.bf16x2, one rounding); rounding on the bits first leaves it no multiply to
        # contract. The cast after is exact for bf16 and fp16's normal range, and rounds
        # fp16's subnormals and overflow as a cast does.
        if DTYPE == tl.bfloat16:
            y = round_bits(y, 16)
        elif DTYPE == tl.float16:
            y = round_bits(y, 13)
        return y.to(DTYPE).to(tl.float32)

    @triton.jit
    def to_e4m3(y, EXACT_CAST: tl.constexpr):
        # y is already within +-448. The Triton interpreter's fp32 -> e4m3 conversion drops the
        # carry when rounding crosses a power of two (31.7 becomes 16) and flushes subnormals:
        # there, round to e4m3's grid first (3 mantissa bits, subnormal step 2**-9) so the
        # cast is exact. GPUs convert correctly (cvt.rn.satfinite) and skip this.
        if EXACT_CAST:
            e = tl.floor(tl.log2(tl.maximum(tl.abs(y), 0.015625)))
            step = tl.exp2(e - 3.0)
            # Round half to even by floor and remainder: y / step is exact (step is a power of
            # two), where adding 1.5 * 2**23 would round a second time (5.2500005 -> 5.0).
            r = y / step
            f = tl.floor(r)
            d = r - f
            odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
            y = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f) * step
        return y.to(tl.float8e4nv)

    @triton.jit
    def store_fp8_row(q_row, scale_ptr, x, offs, mask, EXACT_CAST: tl.constexpr):
        # The FP8 Linear's per-token activation format (linear_fp8.quantize_activation): e4m3 of
        # x * 448 / amax(|x|) at q_row + offs, amax / 448 at scale_ptr. x: the row as the Linear
        # would read it (fp32 of the rounded 16-bit values), 0 on masked lanes. One definition,
        # so a norm kernel that emits these rows gives the GEMM the very bits the separate
        # quantisation would.
        amax = tl.maximum(tl.max(tl.abs(x), 0), 1e-12)
        inv = tl.math.div_rn(448.0, amax)  # correctly rounded: Triton's '/' is approximate
        store_e4m3_part(q_row, x, inv, offs, mask, EXACT_CAST)
        tl.store(scale_ptr, amax / 448.0)

    @triton.jit
    def store_fp8_row_parts(q_row, scale_ptr, xa, offs_a, mask_a, xb, offs_b, mask_b, EXACT_CAST: tl.constexpr):
        # store_fp8_row of one row held as two pieces (xa at offs_a, xb at offs_b): the amax of
        # both, the same bits as store_fp8_row of the whole row.
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(xa), 0), tl.max(tl.abs(xb), 0)), 1e-12)
        inv = tl.math.div_rn(448.0, amax)
        store_e4m3_part(q_row, xa, inv, offs_a, mask_a, EXACT_CAST)
        store_e4m3_part(q_row, xb, inv, offs_b, mask_b, EXACT_CAST)
        tl.store(scale_ptr, amax / 448.0)

    @triton.jit
    def store_e4m3_part(q_row, x, inv, offs, mask, EXACT_CAST: tl.constexpr):
        # The clamp keeps a rounding of x * inv just above 448 from overflowing e4m3.
        y = tl.clamp(x * inv, -448.0, 448.0)
        tl.store(q_row + offs, to_e4m3(y, EXACT_CAST), mask=mask)

    # ---- attention pieces (flash.py, fp8.py) ----

    @triton.jit
    def masked_softmax_tile(s, m_i, cols, offs_m, Mk, mask_rows, stride_mn, LK,
                            MASK_KIND: tl.constexpr, MASK_ROW_BCAST: tl.constexpr, IS_CAUSAL: tl.constexpr,
                            BOUNDARY: tl.constexpr):
        # One online-softmax step over a score tile s (already scaled by scale*log2(e)) that
        # may hold -inf: the mask (bool: -inf where false; additive: + mask*log2(e)), the keys
        # past LK on a BOUNDARY tile and the causal triangle. Returns (p, alpha, m_ij): the
        # tile's exp2 weights, the factor that rescales the running sum and accumulator, and
        # the new running max.
        if MASK_KIND != 0:
            if BOUNDARY:
                mcols = tl.minimum(cols, LK - 1)  # clamped reads stay in bounds; masked below
            else:
                mcols = cols
            if MASK_ROW_BCAST:
                mval = tl.load(Mk + mcols * stride_mn)[None, :]
            else:
                mval = tl.load(Mk + mask_rows[:, None] + mcols[None, :] * stride_mn)
            if MASK_KIND == 1:
                s = tl.where(mval != 0, s, float("-inf"))
            else:
                s = s + mval.to(tl.float32) * 1.4426950408889634
        if BOUNDARY:
            s = tl.where(cols[None, :] < LK, s, float("-inf"))
        if IS_CAUSAL:
            s = tl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing allowed yet keeps m = -inf; subtract 0 instead so p = 0, not NaN.
        m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        return p, alpha, m_ij

    @triton.jit
    def store_smoothed_out(acc, l_i, m_i, sv, v_mean, O, LSE, off_b, off_h, bh64, offs_m, offs_d,
                           stride_ob, stride_oh, stride_om, stride_od, LQ,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, RETURN_LSE: tl.constexpr,
                           P_SCALED: tl.constexpr):
        # The epilogue of the attention kernels with a quantised, mean-smoothed V (fp8_full.py,
        # int8.py): out = acc / l * sv + v_mean (V's per-channel scale and the mean its
        # quantiser took out), stored in O's dtype; with RETURN_LSE the natural-log logsumexp
        # of the rows' scores from the log2-unit m and l. P_SCALED: P was formed times
        # 2**LOG2_P_SCALE (an fp8 P.V), so log2(l) carries that shift. The scores are those of
        # K minus its mean: the launcher adds scale * q.mean_k back.
        out = acc * (sv[None, :] / l_i[:, None]) + v_mean[None, :]
        O += off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
        o_ptrs = O + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od
        if BLOCK_D > HEAD_DIM:
            tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(offs_m[:, None] < LQ) & (offs_d[None, :] < HEAD_DIM))
        else:
            tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=offs_m[:, None] < LQ)
        if RETURN_LSE:
            lse2 = m_i + tl.math.log2(l_i)
            if P_SCALED:
                lse2 = lse2 - LOG2_P_SCALE
            tl.store(LSE + bh64 * LQ + offs_m, lse2 * 0.6931471805599453, mask=offs_m < LQ)

    # ---- quantiser pieces (attention/fp8_quant.py, attention/int8_quant.py) ----

    @triton.jit
    def reduce_stat_partials(P, plane, cols, NCH, BLOCK_D: tl.constexpr, CH: tl.constexpr, WITH_Q: tl.constexpr):
        # fp8_quant.fp8_stats_kernel's per-chunk partials of one (batch*head), NCH chunks at P
        # (planes `plane` apart: max|q|, sum k, min k, max k, sum v, min v, max v), reduced
        # over the chunks per channel. q_amax stays 0 unless WITH_Q.
        q_amax = tl.zeros([BLOCK_D], dtype=tl.float32)
        k_sum = tl.zeros([BLOCK_D], dtype=tl.float32)
        v_sum = tl.zeros([BLOCK_D], dtype=tl.float32)
        k_min = tl.full([BLOCK_D], float("inf"), dtype=tl.float32)
        k_max = tl.full([BLOCK_D], float("-inf"), dtype=tl.float32)
        v_min = tl.full([BLOCK_D], float("inf"), dtype=tl.float32)
        v_max = tl.full([BLOCK_D], float("-inf"), dtype=tl.float32)
        # CH chunks per step: a Wan head has 64 chunks, one load chain each would be 64 deep.
        for c0 in range(0, NCH, CH):
            ch = c0 + tl.arange(0, CH)
            ok = (ch < NCH)[:, None]
            p = P + ch[:, None] * BLOCK_D + cols[None, :]
            if WITH_Q:
                q_amax = tl.maximum(q_amax, tl.max(tl.load(p, mask=ok, other=0.0), 0))
            k_sum += tl.sum(tl.load(p + plane, mask=ok, other=0.0), 0)
            k_min = tl.minimum(k_min, tl.min(tl.load(p + 2 * plane, mask=ok, other=float("inf")), 0))
            k_max = tl.maximum(k_max, tl.max(tl.load(p + 3 * plane, mask=ok, other=float("-inf")), 0))
            v_sum += tl.sum(tl.load(p + 4 * plane, mask=ok, other=0.0), 0)
            v_min = tl.minimum(v_min, tl.min(tl.load(p + 5 * plane, mask=ok, other=float("inf")), 0))
            v_max = tl.maximum(v_max, tl.max(tl.load(p + 6 * plane, mask=ok, other=float("-inf")), 0))
        return q_amax, k_sum, k_min, k_max, v_sum, v_min, v_max


def exact_bf16(x: torch.Tensor) -> bool:
    """The EXACT_BF16 constexpr of to_output_dtype(): a bf16 output under the interpreter."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu"


# Warps per program of the row-LayerNorm kernels (one row a program, held in registers), by
# padded row width: 8 warps give a 8192-wide block 32 values a thread (2769 GB/s on an H100).
ROW_KERNEL_WARPS = ((2048, 4), (8192, 8), (16384, 16))


def row_warps(block_c: int) -> int:
    """num_warps of a row kernel whose row is padded to block_c lanes (ROW_KERNEL_WARPS)."""
    for width, warps in ROW_KERNEL_WARPS:
        if block_c <= width:
            return warps
    return ROW_KERNEL_WARPS[-1][1]


def rows_2d(t: torch.Tensor, channels: int) -> torch.Tensor:
    """t as [M, channels] rows with a unit last stride (a view where it already has one)."""
    t2d = t.reshape(-1, channels)
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


def fp8_row_outputs(rows: int, channels: int, device) -> list[torch.Tensor]:
    """[e4m3 rows, fp32 scales]: what a row kernel's store_fp8_row writes, in the FP8 Linear's
    activation format (linear_fp8.quantize_activation)."""
    return [torch.empty((rows, channels), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((rows,), dtype=torch.float32, device=device)]


def layer_norm_inputs(x: torch.Tensor, weight, bias, error, max_channels: int) -> tuple[int, int, int]:
    """(batch, tokens, channels) of a row-wise LayerNorm kernel's input: x [B, L, C] or [L, C]
    in fp16/bf16/fp32 with unit last stride and 1..max_channels channels, and an optional
    affine pair of [C] tensors on x's device; raises `error(reason)` for anything else."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise error(f"dtype {x.dtype} is not float16/bfloat16/float32")
    if x.dim() not in (2, 3):
        raise error(f"x must be [B, L, C] or [L, C] (got {x.dim()} dims)")
    channels = x.shape[-1]
    if channels > max_channels or channels == 0:
        raise error(f"rows of {channels} channels: the kernel takes 1 to {max_channels}")
    if x.stride(-1) != 1:
        raise error("x's last dim must be contiguous")
    if (weight is None) != (bias is None):
        raise error("an affine LayerNorm needs both weight and bias")
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is not None and (t.shape != (channels,) or t.device != x.device):
            raise error(f"LayerNorm {name} must be [{channels}] on {x.device}")
    batch, tokens = (x.shape[0], x.shape[1]) if x.dim() == 3 else (1, x.shape[0])
    return batch, tokens, channels


def batch_vector(m: torch.Tensor, name: str, x: torch.Tensor, batch: int, channels: int, error) -> torch.Tensor:
    """A modulation or gate vector of the fused norm kernels, [B or 1, 1, C] or [B or 1, C] in
    x's dtype on x's device (one vector per batch element, broadcast over its tokens), as
    [Bm, C] with unit last stride; raises `error(reason)` for anything else."""
    if m.dtype != x.dtype or m.device != x.device:
        raise error(f"{name} must be {x.dtype} on {x.device} (got {m.dtype} on {m.device})")
    shape = tuple(m.shape)
    if len(shape) == 3 and shape[1] == 1:
        shape = (shape[0], shape[2])
    if len(shape) != 2 or shape[1] != channels or shape[0] not in (1, batch):
        raise error(f"{name} of shape {tuple(m.shape)} is not one vector per batch element "
                    f"([{batch} or 1, 1, {channels}])")
    m2 = m.reshape(shape)
    return m2 if m2.stride(-1) == 1 else m2.contiguous()


# ---- what every fused row kernel file (kernels/fused/*.py, linear/cat_fp8_rows.py) shares ----

class RowKernelInputError(ValueError):
    """A call a fused row kernel cannot serve; `.reason` says why (callers fall back). Each
    kernel file subclasses it with its own name."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


def raise_if_refused(device: torch.device, error) -> None:
    """Raise error(reason) where row_kernel_refusal refuses `device`."""
    reason = row_kernel_refusal(device)
    if reason is not None:
        raise error(reason)


def register_custom_ops(register) -> str | None:
    """Run a kernel file's torch.library registration: None, or why it failed (an older torch
    without torch.library.custom_op; eager calls still work)."""
    try:
        register()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def row_kernel_refusal(device: torch.device) -> str | None:
    """Why a plain Triton row kernel (no dots, no arch-specific code: the fused norms) cannot
    run on `device`, or None."""
    if triton is not None and device.type == "cuda":  # first: every fused-norm call asks
        return None
    from . import device as _device

    if triton is None:
        return f"Triton is not importable: {_device.triton_import_error()}"
    if device.type == "cpu":
        return None if _device.interpreter_enabled() else "CPU tensors need TRITON_INTERPRET=1"
    if device.type not in ("cuda", "xpu"):
        return f"device type {device.type!r} has no Triton backend"
    return None


# ---- where the FP8 kernels may run ------------------------------------------------------------

def fp8_device_refusal(device: torch.device, what: str) -> str | None:
    """Why an FP8 kernel (`what`: "FP8 attention", "FP8 Linear") cannot run on this device, or
    None. CPU tensors only through the interpreter (tests). The capability rules are gpu_rules':
    on AMD only gfx families whose matrix cores take OCP e4m3 (gfx950, gfx12); gfx942's FP8 is
    the fnuz flavour our kernels do not emit, gfx11 has no FP8 dot."""
    from . import device as _device
    from .gpu_rules import amd_arch_blocker, amd_fp8_refusal, capability_refusal

    if triton is None:
        return f"{what} needs Triton: {_device.triton_import_error()}"
    if device.type == "cpu":
        return None if _device.interpreter_enabled() else f"{what} on CPU tensors needs TRITON_INTERPRET=1 (tests only)"
    info = _device.describe(device)
    if info.vendor == "amd":
        rule = amd_arch_blocker(info.arch, info.name) or amd_fp8_refusal(info.arch, info.name,
                                                                         _device.triton_version())
        return f"{what}: {rule.reason}" if rule is not None else None
    if info.vendor != "nvidia":
        return f"{what} supports NVIDIA and AMD GPUs only; {info.name} is {info.arch}"
    rule = capability_refusal(info.vendor, info.capability, info.name, fp8=True)
    return rule.reason if rule is not None else None


# ---- launch options (at the end: a line added above the @triton.jit helpers would move their
# line numbers, which are part of every dependent kernel's cache key) ----

# Compile options every launch of a pack kernel passes (`kernel[grid](..., **LAUNCH_OPTIONS)`).
# FP fusion (a*b+c as one FMA, one rounding; ptxas without --fmad=false) is what every kernel
# was tuned and checked with. Left unset it follows TRITON_DEFAULT_FP_FUSION: Triton 3.9 warns
# on the first launch of each process that its default turns OFF in 3.10, and any release
# compiles the softmax's scale-and-subtract, the online rescale and the epilogues' dequantise
# as separate multiplies and adds where that variable is 0 (more instructions in
# latency-bound loops, different rounding from what the tests bound).
LAUNCH_OPTIONS = {"enable_fp_fusion": True}
