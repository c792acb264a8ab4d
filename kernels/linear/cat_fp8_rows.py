"""torch.cat((a, b), -1) of two activations and the FP8 Linear's e4m3 rows of the result, in one
pass: Flux's single block feeds its second Linear with

    linear2(torch.cat((attn, mlp_act(mlp)), 2))

a [B, L, 3072 + 12288] tensor at Flux 1024² that ComfyUI writes (torch's cat: 141 MB read and
written) and the FP8 Linear then reads again to quantise it (141 MB read, 70 MB written): an H100
profile of a Flux step spent 4.4 ms of 96.8 in those concatenations (benchmarks/
RESULTS.md). Here one program per row reads both
pieces once, writes the concatenation (ComfyUI's Linear and our first-call check read it) and
its e4m3 rows with per-row scales in linear_fp8.quantize_activation's format and bits
(kernel_common.store_fp8_row_parts), which the FP8 Linear then takes instead of quantising
(linear_fp8.quantize_once).
"""
from __future__ import annotations

import torch

from ..core.kernel_common import tl, triton  # None, None where Triton does not import

from ..core import direct_launch
from ..core.kernel_common import fp8_row_outputs, next_pow2, row_kernel_refusal, row_warps, rows_2d
from ..core.kernel_common import RowKernelInputError, register_custom_ops

if triton is not None:
    from ..core.kernel_common import store_fp8_row_parts

OP_QUALNAME = "triton_accel::cat_fp8_rows"
MAX_PART = 16384  # channels of each piece held in registers (Flux's MLP half: 12288)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class CatRowsInputError(RowKernelInputError):
    """A call the kernel cannot serve; `.reason` says why (callers concatenate with torch)."""


if triton is not None:

    @triton.jit
    def _cat_fp8_rows(A, B, Y, Q, S, KA, KB, stride_am, stride_bm, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
                      EXACT_CAST: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        k = KA + KB
        offs_a = tl.arange(0, BLOCK_A)
        offs_b = tl.arange(0, BLOCK_B)
        mask_a = offs_a < KA
        mask_b = offs_b < KB
        xa = tl.load(A + row * stride_am + offs_a, mask=mask_a, other=0.0)
        xb = tl.load(B + row * stride_bm + offs_b, mask=mask_b, other=0.0)
        y_row = Y + row * k
        tl.store(y_row + offs_a, xa, mask=mask_a)
        tl.store(y_row + KA + offs_b, xb, mask=mask_b)
        # The Linear reads the concatenation in its dtype: quantise exactly those values.
        store_fp8_row_parts(Q + row * k, S + row, xa.to(tl.float32), offs_a, mask_a, xb.to(tl.float32), KA + offs_b,
                            mask_b, EXACT_CAST)


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype not in DTYPES or b.dtype != a.dtype:
        raise CatRowsInputError(f"a and b must share a float16/bfloat16/float32 dtype (got {a.dtype}, {b.dtype})")
    if a.dim() < 2 or a.shape[:-1] != b.shape[:-1]:
        raise CatRowsInputError(f"a {tuple(a.shape)} and b {tuple(b.shape)} differ before their last dim")
    if a.device != b.device:
        raise CatRowsInputError(f"a on {a.device}, b on {b.device}")
    for t, name in ((a, "a"), (b, "b")):
        if not 0 < t.shape[-1] <= MAX_PART:
            raise CatRowsInputError(f"{name} has {t.shape[-1]} channels: the kernel takes 1 to {MAX_PART}")
        if t.stride(-1) != 1:
            raise CatRowsInputError(f"{name}'s last dim must be contiguous")


def _launch(a: torch.Tensor, b: torch.Tensor):
    _check(a, b)
    ka, kb = a.shape[-1], b.shape[-1]
    a2, b2 = rows_2d(a, ka), rows_2d(b, kb)
    rows = a2.shape[0]
    out = torch.empty(a.shape[:-1] + (ka + kb,), dtype=a.dtype, device=a.device)
    q, s = fp8_row_outputs(rows, ka + kb, a.device)
    if rows == 0:
        return out, q, s
    block_a, block_b = next_pow2(ka, 1), next_pow2(kb, 1)
    args = (a2, b2, out.view(rows, ka + kb), q, s, ka, kb, a2.stride(0), b2.stride(0))
    consts = dict(BLOCK_A=block_a, BLOCK_B=block_b, EXACT_CAST=a.device.type == "cpu")
    direct_launch.jit_or_plan(_cat_fp8_rows, (rows,), args, consts, 2, "cat_fp8_rows",
                              num_warps=row_warps(block_a + block_b))
    return out, q, s


refusal = row_kernel_refusal  # why a device cannot run the kernel (None: it can)


def cat_fp8_rows_ref(a: torch.Tensor, b: torch.Tensor):
    """The reference: torch.cat, then linear_fp8.quantize_activation's format written in torch
    (e4m3 of x * 448 / amax per row, amax / 448)."""
    _check(a, b)
    out = torch.cat((a, b), -1)
    x = out.reshape(-1, out.shape[-1]).float()
    amax = x.abs().amax(dim=1).clamp_min(1e-12)
    q = (x * (448.0 / amax)[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return out, q, amax / 448.0


def _register_op() -> None:
    @torch.library.custom_op(OP_QUALNAME, mutates_args=())
    def cat_fp8_rows_op(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _launch(a, b)

    @cat_fp8_rows_op.register_fake
    def _(a, b):
        k = a.shape[-1] + b.shape[-1]
        rows = a.numel() // a.shape[-1]
        return (a.new_empty(a.shape[:-1] + (k,)), a.new_empty((rows, k), dtype=torch.float8_e4m3fn),
                a.new_empty((rows,), dtype=torch.float32))


_REGISTRATION_ERROR = register_custom_ops(_register_op)  # None: registered


def cat_fp8_rows(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(torch.cat((a, b), -1), (its e4m3 rows [M, Ka + Kb], per-row scales [M])) for a [..., Ka]
    and b [..., Kb] of one dtype with contiguous last dims: the rows in the FP8 Linear's activation
    format, bit for bit linear_fp8.quantize_activation of the concatenation. Raises
    CatRowsInputError for a call it cannot serve (checked before anything runs)."""
    reason = refusal(a.device)
    if reason is not None:
        raise CatRowsInputError(reason)
    if _REGISTRATION_ERROR is None and torch.compiler.is_compiling():
        _check(a, b)
        out, q, s = torch.ops.triton_accel.cat_fp8_rows(a, b)
    else:
        out, q, s = _launch(a, b)  # eager: no custom-op dispatch; _launch checks
    return out, (q, s)


def compile_specs(dtype: str = "bf16", ka: int = 3072, kb: int = 12288):
    """[(kernel, signature, constexprs, attrs, options)] for triton.compile(ASTSource(...)): Flux's
    single block (3072 attention channels, 12288 MLP channels), contiguous rows."""
    sig = {"A": f"*{dtype}", "B": f"*{dtype}", "Y": f"*{dtype}", "Q": "*fp8e4nv", "S": "*fp32", "KA": "i32",
           "KB": "i32", "stride_am": "i32", "stride_bm": "i32", "BLOCK_A": "constexpr", "BLOCK_B": "constexpr",
           "EXACT_CAST": "constexpr"}
    block_a, block_b = next_pow2(ka, 1), next_pow2(kb, 1)
    const = dict(BLOCK_A=block_a, BLOCK_B=block_b, EXACT_CAST=False)
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in ("A", "B", "Y", "Q", "S", "KA", "KB", "stride_am", "stride_bm")}
    return [(_cat_fp8_rows, sig, const, attrs, dict(num_warps=row_warps(block_a + block_b), num_stages=1))]


__all__ = ["cat_fp8_rows", "cat_fp8_rows_ref", "refusal", "CatRowsInputError", "OP_QUALNAME", "MAX_PART",
           "compile_specs"]
