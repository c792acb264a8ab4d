"""kernels/fused/qk_norm_rope.py under the Triton interpreter against ComfyUI's own ops: Flux's QKNorm
(torch's rms_norm over each head in the input dtype), the concatenation of a double block's text
and image streams, and comfy.ldm.flux.math's RoPE (float32 pe, `freqs[..., 0] * x0` then
`addcmul_(freqs[..., 1], x1)`), written independently of the kernel file's reference.

Tolerances (rel. L2 against ComfyUI's result, per dtype):
- fp16 / bf16: 1e-3, and at least 99.9 % of values bit-identical (at most one value differing in
  tensors under 2000 values): the kernel rounds where ComfyUI's ops round (the normalised value,
  the rotated one), so what is left is the order of the fp32 sum of squares and rsqrt's last
  bits;
- fp32: 1e-6.
Inputs carry outlier channels (x30 on two channels, as DiT activations have) and an offset.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from triton_accel.kernels.fused import qk_norm_rope as qnr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from norm_checks import DTYPES, check  # noqa: E402  (the fused-norm tests' shared checks)

# (name, batch, text tokens, image tokens, heads, head_dim): Flux's 24 heads of 128 with a few
# tokens per stream, HunyuanVideo-like 64-wide heads, an odd case whose rows are not a multiple
# of the kernel's 32-row programs, and a single block (no text stream).
SHAPES = [("flux_double", 1, 5, 11, 24, 128), ("d64_batch2", 2, 3, 7, 4, 64), ("odd_rows", 1, 1, 10, 3, 128),
          ("single_block", 1, 0, 13, 6, 128)]


def flux_pe(batch: int, tokens: int, head_dim: int, per_batch: bool = False) -> torch.Tensor:
    """comfy.ldm.flux.math.rope's output as EmbedND hands it to the blocks: [B or 1, 1, L, D/2, 2, 2]."""
    pos = torch.arange(tokens, dtype=torch.float64)[None, :].repeat(batch if per_batch else 1, 1)
    if per_batch:
        pos = pos + torch.arange(batch, dtype=torch.float64)[:, None] * 5.0
    scale = torch.linspace(0, (head_dim - 2) / head_dim, steps=head_dim // 2, dtype=torch.float64)
    out = torch.einsum("...n,d->...nd", pos, 1.0 / (10000 ** scale))
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    return out.reshape(out.shape[0], tokens, head_dim // 2, 2, 2).float().unsqueeze(1)


def stream_qkv(batch, tokens, heads, head_dim, dtype, seed):
    """q, k, v of one stream as Flux's blocks make them: view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, 3 * heads * head_dim, generator=g) * 2.0 + 0.5
    x[..., 3] *= 30.0
    x[..., head_dim + 1] *= -30.0
    return x.to(dtype).view(batch, tokens, 3, heads, head_dim).permute(2, 0, 3, 1, 4)


def comfy_qk(q, k, wq, wk, eps, pe):
    """ComfyUI: QKNorm per stream, torch.cat of the streams, then _apply_rope1 on the whole."""
    d = q.shape[-1]
    outs = []
    for x, w in ((q, wq), (k, wk)):
        y = torch.nn.functional.rms_norm(x.float(), (d,), w.float(), eps).to(x.dtype)
        y_ = y.to(pe.dtype).reshape(*y.shape[:-1], -1, 1, 2)
        out = pe[..., 0] * y_[..., 0]
        out.addcmul_(pe[..., 1], y_[..., 1])
        outs.append(out.reshape(*y.shape).type_as(y))
    return outs


def bhld_as_blhd(batch, heads, tokens, head_dim, dtype):
    """An output as the Flux blocks allocate it: [B, L, H, D] memory viewed as [B, H, L, D]."""
    return torch.empty(batch, tokens, heads, head_dim, dtype=dtype).transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,batch,txt,img,heads,head_dim", SHAPES, ids=[s[0] for s in SHAPES])
def test_streams_land_in_one_q_and_k_as_comfyui_computes_them(dtype, name, batch, txt, img, heads, head_dim):
    g = torch.Generator().manual_seed(2)
    length = txt + img
    pe = flux_pe(batch, length, head_dim, per_batch=batch > 1)
    q_all, k_all = bhld_as_blhd(batch, heads, length, head_dim, dtype), bhld_as_blhd(batch, heads, length, head_dim, dtype)
    streams, offset = [], 0
    for tokens, seed in ((txt, 1), (img, 2)):
        if tokens == 0:
            continue
        q, k, _v = stream_qkv(batch, tokens, heads, head_dim, dtype, seed)
        wq, wk = ((torch.rand(head_dim, generator=g) + 0.5).to(dtype) for _ in range(2))
        qnr.qk_rms_norm_rope(q, k, wq, wk, 1e-6, pe, q_all, k_all, offset)
        streams.append((q, k, wq, wk, offset))
        offset += tokens
    # ComfyUI: each stream's QKNorm with its own weights, then cat, then RoPE over the sequence.
    normed = [comfy_qk(q, k, wq, wk, 1e-6, pe[:, :, o:o + q.shape[2]]) for q, k, wq, wk, o in streams]
    ref_q = torch.cat([n[0] for n in normed], dim=2)
    ref_k = torch.cat([n[1] for n in normed], dim=2)
    check(q_all, ref_q, dtype)
    check(k_all, ref_k, dtype)
    # The kernel file's own reference agrees with ComfyUI's ops too (what other tests lean on).
    q, k, wq, wk, o = streams[-1]
    rq, rk = qnr.qk_rms_norm_rope_ref(q, k, wq, wk, 1e-6, pe, o)
    check(rq, ref_q[:, :, o:], dtype)
    check(rk, ref_k[:, :, o:], dtype)


def test_any_output_layout_and_untouched_rows():
    """A contiguous [B, H, L, D] output works as well, and rows outside offset..offset+L keep
    what they held (a double block writes its two streams in two calls)."""
    dtype = torch.float16
    q, k, _v = stream_qkv(1, 6, 2, 64, dtype, seed=3)
    w = torch.ones(64, dtype=dtype)
    pe = flux_pe(1, 10, 64)
    q_out = torch.full((1, 2, 10, 64), 7.0, dtype=dtype)
    k_out = torch.full((1, 2, 10, 64), 7.0, dtype=dtype)
    qnr.qk_rms_norm_rope(q, k, w, w, 1e-6, pe, q_out, k_out, 3)
    rq, rk = comfy_qk(q, k, w, w, 1e-6, pe[:, :, 3:9])
    check(q_out[:, :, 3:9], rq, dtype)
    check(k_out[:, :, 3:9], rk, dtype)
    assert (q_out[:, :, :3] == 7).all() and (q_out[:, :, 9:] == 7).all() and (k_out[:, :, 9:] == 7).all()


def test_zero_row_stays_zero():
    dtype = torch.bfloat16
    q, k, _v = stream_qkv(1, 4, 2, 128, dtype, seed=4)
    q = q.clone()
    q[0, 1, 2] = 0
    w = torch.ones(128, dtype=dtype)
    out_q, out_k = bhld_as_blhd(1, 2, 4, 128, dtype), bhld_as_blhd(1, 2, 4, 128, dtype)
    qnr.qk_rms_norm_rope(q, k, w, w, 1e-6, flux_pe(1, 4, 128), out_q, out_k, 0)
    assert (out_q[0, 1, 2] == 0).all()


@pytest.mark.parametrize("bad,reason", [
    ("head_dim_80", "head dim 80"), ("weight_dtype", "weight"), ("too_short", "do not fit"),
    ("pe_length", "do not match"), ("out_layouts_differ", "one layout"), ("pe_fp16", "float32"),
    ("out_dtype", "q_out must be")])
def test_refuses_with_reason_before_writing(bad, reason):
    dtype = torch.bfloat16
    d = 80 if bad == "head_dim_80" else 64
    q, k, _v = stream_qkv(1, 5, 2, d, dtype, seed=5)
    w = torch.ones(d, dtype=torch.float32 if bad == "weight_dtype" else dtype)
    length = 4 if bad == "too_short" else 5
    pe = flux_pe(1, 6 if bad == "pe_length" else length, d)
    if bad == "pe_fp16":
        pe = pe.half()
    out_dtype = torch.float16 if bad == "out_dtype" else dtype
    q_out = torch.zeros(1, length, 2, d, dtype=out_dtype).transpose(1, 2)
    k_out = torch.zeros(1, 2, length, d, dtype=out_dtype) if bad == "out_layouts_differ" else \
        torch.zeros(1, length, 2, d, dtype=out_dtype).transpose(1, 2)
    with pytest.raises(qnr.QKNormRopeInputError, match=reason):
        qnr.qk_rms_norm_rope(q, k, w, w, 1e-6, pe, q_out, k_out, 0)
    assert (q_out == 0).all() and (k_out == 0).all()


def test_op_traces_with_fake_tensors_and_runs_under_torch_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert qnr._REGISTRATION_ERROR is None
    with FakeTensorMode() as mode:
        q = mode.from_tensor(torch.randn(1, 2, 4, 32, dtype=torch.bfloat16))
        w = mode.from_tensor(torch.ones(32, dtype=torch.bfloat16))
        pe = mode.from_tensor(flux_pe(1, 4, 32))
        out = mode.from_tensor(torch.empty(1, 2, 4, 32, dtype=torch.bfloat16))
        torch.ops.triton_accel.qk_rms_norm_rope(q, q, w, w, 1e-6, pe, out, out, 0)
    dtype = torch.float16
    q, k, _v = stream_qkv(1, 5, 2, 32, dtype, seed=6)
    w = torch.ones(32, dtype=dtype)
    pe = flux_pe(1, 5, 32)

    def block(q, k):
        q_out, k_out = torch.empty(1, 2, 5, 32, dtype=dtype), torch.empty(1, 2, 5, 32, dtype=dtype)
        qnr.qk_rms_norm_rope(q, k, w, w, 1e-6, pe, q_out, k_out, 0)
        return q_out, k_out

    compiled = torch.compile(block, backend="eager", fullgraph=True)
    for a, b in zip(compiled(q, k), block(q, k)):
        assert torch.equal(a, b)


def test_one_pe_for_every_batch_element():
    """ComfyUI builds pe once for a batch whose elements share positions ([1, 1, L, D/2, 2, 2])."""
    dtype = torch.float16
    q, k, _v = stream_qkv(3, 6, 2, 64, dtype, seed=7)
    w = torch.ones(64, dtype=dtype)
    pe = flux_pe(1, 6, 64)
    q_out, k_out = bhld_as_blhd(3, 2, 6, 64, dtype), bhld_as_blhd(3, 2, 6, 64, dtype)
    qnr.qk_rms_norm_rope(q, k, w, w, 1e-6, pe, q_out, k_out, 0)
    rq, rk = comfy_qk(q, k, w, w, 1e-6, pe)
    check(q_out, rq, dtype)
    check(k_out, rk, dtype)


def test_direct_launch_verification_compares_the_rows_the_kernel_writes(monkeypatch):
    """The kernel fills rows offset..offset + L of a buffer (the other stream fills the rest), so
    its direct launch is verified on those rows only: a probe launched into a fresh tensor leaves
    the other rows unwritten, and comparing them disabled direct launches for the whole process
    (the first H100 run of this kernel, session 35). A launch that writes other values in those
    rows still disagrees. `launch` is faked (no GPU here); the bookkeeping is direct_launch's."""
    from triton_accel.kernels.core import direct_launch as dl

    monkeypatch.setattr(dl, "ENABLED", True)
    monkeypatch.setattr(dl, "_plans", {})
    rows = (1, 3)

    def run(value, written):
        out = torch.full((4, 3), 7.0)
        out[rows[0]:rows[1]] = 1.0  # what the JIT launch wrote
        monkeypatch.setattr(dl, "launch", lambda plan, index, args: args[0][rows[0]:rows[1]].fill_(value))
        for _ in range(2):  # remembered, then verified against the JIT launch's output
            dl.record(("key", value, written is None), object(), (1,), (), (out,), out_index=0, written=written)
        return dl.ENABLED

    assert run(1.0, lambda t: t[rows[0]:rows[1]]) and dl._plans[("key", 1.0, False)].verified
    assert not run(2.0, lambda t: t[rows[0]:rows[1]])  # wrong values in the written rows
