"""kernels/fused/norm_rope.py, layer_norm_modulate.py, qk_norm.py and gated_residual_norm.py under the
Triton interpreter against ComfyUI's own ops (the references compute in float32 and round where
ComfyUI rounds).

Tolerances (rel. L2 against the reference, per dtype):
- fp16 / bf16: 1e-3, and at least 99.9 % of values bit-identical (at most one value differing
  in tensors under 2000 values). The kernels round where ComfyUI's ops round (the normalised
  row, `1 + scale`, the residual stream, the output), so what is left is the
  order of the fp32 row sums and rsqrt's last bits: a one-ulp flip on a value sitting on a
  rounding boundary;
- fp32: 1e-6 (fp32 sums in another order).
Inputs carry outlier channels (x30 on a few channels, as DiT activations have) and a row
offset, so the mean subtraction and the full-row RMS are exercised, not only unit noise.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from triton_accel.kernels.fused import layer_norm_modulate as lnm
from triton_accel.kernels.fused import norm_rope as nr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from norm_checks import DTYPES, check  # noqa: E402  (the fused-norm tests' shared checks)

# (name, batch, tokens, heads, head_dim): Wan 2.1 1.3B (12 x 128) and 14B (40 x 128) channel
# counts with a few tokens, a small odd-sized case, and 7 heads of 32 (224 channels: the
# rope kernel's second block is 96 channels padded to 128, masked).
SHAPES = [("wan_1.3b", 1, 9, 12, 128), ("wan_14b", 1, 5, 40, 128), ("small_odd", 2, 13, 3, 64),
          ("padded_second_block", 1, 6, 7, 32)]


def comfy_rope(tokens: int, head_dim: int, batch: int = 1, offset: float = 0.0) -> torch.Tensor:
    """comfy.ldm.flux.math.rope's freqs for positions offset..offset+tokens, in Wan's layout
    after movedim: [batch, tokens, 1, head_dim/2, 2, 2] float32."""
    pos = torch.arange(tokens, dtype=torch.float32)[None, :].repeat(batch, 1) + offset
    pos = pos + torch.arange(batch, dtype=torch.float32)[:, None] * 7.0  # distinct per batch element
    scale = torch.linspace(0, (head_dim - 2) / head_dim, steps=head_dim // 2, dtype=torch.float64)
    omega = 1.0 / (10000 ** scale)
    out = torch.einsum("...n,d->...nd", pos.double(), omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    return out.reshape(batch, tokens, 1, head_dim // 2, 2, 2).float()


def activations(batch, tokens, channels, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, channels, generator=g) * 2.0 + 0.5
    x[..., 3] *= 30.0
    x[..., channels // 2 + 1] *= -30.0
    return x.to(dtype)


def comfy_rms_norm_rope(x, weight, freqs, eps, head_dim):
    """What ComfyUI's Wan self-attention does to q: torch's rms_norm in x's dtype, then
    _apply_rope1 (float32 freqs) on the [b, s, n, d] view."""
    b, s, c = x.shape
    y = torch.nn.functional.rms_norm(x.float(), (c,), None if weight is None else weight.float(), eps).to(x.dtype)
    y_ = y.view(b, s, c // head_dim, head_dim).to(freqs.dtype).reshape(b, s, c // head_dim, -1, 1, 2)
    out = freqs[..., 0] * y_[..., 0]
    out.addcmul_(freqs[..., 1], y_[..., 1])
    return out.reshape(b, s, c).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,batch,tokens,heads,head_dim", SHAPES, ids=[s[0] for s in SHAPES])
def test_rms_norm_rope_matches_comfyui(dtype, name, batch, tokens, heads, head_dim):
    channels = heads * head_dim
    x = activations(batch, tokens, channels, dtype)
    weight = (torch.rand(channels, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    freqs = comfy_rope(tokens, head_dim, offset=11.0)
    out = nr.rms_norm_rope(x, weight, freqs, 1e-6, head_dim)
    check(out, nr.rms_norm_rope_ref(x, weight, freqs, 1e-6, head_dim), dtype)
    check(out, comfy_rms_norm_rope(x, weight, freqs, 1e-6, head_dim), dtype)


@pytest.mark.parametrize("channels,blocks", [(5120, (4096, 1024)), (1536, (1024, 512)), (4096, (4096, 0)),
                                             (224, (128, 128)), (2, (2, 0))])
def test_rms_norm_rope_row_blocks(channels, blocks):
    # Wan's rows split into two power-of-two blocks with no padded lane; one padded block is
    # what the kernel did before (37.5 % idle lanes at 5120) and is still reachable for timing.
    assert nr.row_blocks(channels) == blocks
    assert nr.row_blocks(channels, split=False) == (nr.next_pow2(channels, 2), 0)


@pytest.mark.parametrize("split", [True, False], ids=["two_blocks", "one_padded_block"])
def test_rms_norm_rope_both_block_layouts(split):
    dtype, heads, head_dim = torch.bfloat16, 40, 128
    x = activations(1, 3, heads * head_dim, dtype, seed=5)
    weight = (torch.rand(heads * head_dim) + 0.5).to(dtype)
    freqs = comfy_rope(3, head_dim, offset=3.0)
    out = nr._launch(x, weight, freqs, 1e-6, head_dim, split=split)
    check(out, comfy_rms_norm_rope(x, weight, freqs, 1e-6, head_dim), dtype)


@pytest.mark.parametrize("case", ["per_batch_freqs", "no_weight", "strided_rows", "zero_row", "two_dims"])
def test_rms_norm_rope_edge_cases(case):
    dtype, batch, tokens, heads, head_dim = torch.bfloat16, 2, 7, 4, 32
    channels = heads * head_dim
    x = activations(batch, tokens, channels, dtype, seed=3)
    weight = (torch.rand(channels) + 0.5).to(dtype)
    freqs = comfy_rope(tokens, head_dim)
    if case == "per_batch_freqs":
        freqs = comfy_rope(tokens, head_dim, batch=batch)
    elif case == "no_weight":
        weight = None
    elif case == "strided_rows":  # a column slice of a wider activation (a fused QKV's q part)
        x = torch.cat([x, activations(batch, tokens, 64, dtype, seed=4)], dim=-1)[..., :channels]
        assert not x.is_contiguous()
    elif case == "zero_row":  # rms 0: eps keeps it finite, the row stays 0
        x[1, 2] = 0
    out = nr.rms_norm_rope(x[0] if case == "two_dims" else x, weight, freqs, 1e-6, head_dim)
    ref = comfy_rms_norm_rope(x, weight, freqs if case != "two_dims" else freqs, 1e-6, head_dim)
    check(out, ref[0] if case == "two_dims" else ref, dtype)
    if case == "zero_row":
        assert (out[1, 2] == 0).all()


@pytest.mark.parametrize("bad,reason", [
    ("freqs_fp16", "float32"), ("freqs_tokens", "do not match"), ("odd_head_dim", "whole heads"),
    ("weight_shape", "norm weight"), ("int_dtype", "dtype"), ("too_wide", "exceed")])
def test_rms_norm_rope_refuses_with_reason(bad, reason):
    x = torch.randn(1, 4, 64, dtype=torch.float16)
    weight, freqs, head_dim = torch.ones(64, dtype=torch.float16), comfy_rope(4, 32), 32
    if bad == "freqs_fp16":
        freqs = freqs.half()
    elif bad == "freqs_tokens":
        freqs = comfy_rope(5, 32)
    elif bad == "odd_head_dim":
        head_dim = 21
    elif bad == "weight_shape":
        weight = torch.ones(32, dtype=torch.float16)
    elif bad == "int_dtype":
        x = x.to(torch.int32)
    elif bad == "too_wide":
        x = torch.randn(1, 4, nr.MAX_CHANNELS * 2, dtype=torch.float16)
        weight = None
    with pytest.raises(nr.NormRopeInputError, match=reason):
        nr.rms_norm_rope(x, weight, freqs, 1e-6, head_dim)


def comfy_layer_norm_modulate(x, shift, scale, eps, weight=None, bias=None):
    """Wan's block: addcmul(e[0], norm(x), 1 + e[1]), each op in x's dtype with fp32 math."""
    c = x.shape[-1]
    norm = torch.nn.functional.layer_norm(x.float(), (c,), None if weight is None else weight.float(),
                                          None if bias is None else bias.float(), eps).to(x.dtype)
    one_plus = 1 + scale  # a separate op in the modulation's dtype (CPU bf16 adds in fp32, rounds once)
    return torch.addcmul(shift.float(), norm.float(), one_plus.float()).to(x.dtype)


# (name, batch, tokens, channels): Wan 1.3B / 14B, Flux / HunyuanVideo 3072, and odd sizes.
LN_SHAPES = [("wan_1.3b", 1, 9, 1536), ("wan_14b", 1, 5, 5120), ("flux", 1, 6, 3072), ("odd", 2, 13, 200)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,batch,tokens,channels", LN_SHAPES, ids=[s[0] for s in LN_SHAPES])
def test_layer_norm_modulate_matches_comfyui(dtype, name, batch, tokens, channels):
    x = activations(batch, tokens, channels, dtype)
    e = (torch.randn(batch, 6, channels, generator=torch.Generator().manual_seed(2)) * 0.4).to(dtype).chunk(6, dim=1)
    out = lnm.layer_norm_modulate(x, e[0], e[1], 1e-6)
    check(out, lnm.layer_norm_modulate_ref(x, e[0], e[1], 1e-6), dtype)
    check(out, comfy_layer_norm_modulate(x, e[0], e[1], 1e-6), dtype)


@pytest.mark.parametrize("case", ["affine", "broadcast_batch", "two_dim_modulation", "strided_rows", "constant_row",
                                  "two_dims"])
def test_layer_norm_modulate_edge_cases(case):
    dtype, batch, tokens, channels = torch.bfloat16, 2, 7, 96
    x = activations(batch, tokens, channels, dtype, seed=5)
    e = (torch.randn(batch, 6, channels) * 0.4).to(dtype).chunk(6, dim=1)
    shift, scale, weight, bias = e[0], e[1], None, None
    if case == "affine":
        weight, bias = (torch.rand(channels) + 0.5).to(dtype), torch.randn(channels).to(dtype)
    elif case == "broadcast_batch":  # one modulation for both batch elements
        shift, scale = shift[:1], scale[:1]
    elif case == "two_dim_modulation":
        shift, scale = shift[:, 0], scale[:, 0]
    elif case == "strided_rows":
        x = torch.cat([x, x], dim=-1)[..., :channels]
    elif case == "constant_row":  # variance 0: the normalised row is 0, the output is the shift
        x[0, 1] = 3.0
    if case == "two_dims":
        out = lnm.layer_norm_modulate(x[0], shift[:1], scale[:1], 1e-6)
        ref = comfy_layer_norm_modulate(x[0], shift[0], scale[0], 1e-6)
    else:
        out = lnm.layer_norm_modulate(x, shift, scale, 1e-6, weight, bias)
        s3 = shift if shift.dim() == 3 else shift[:, None]
        c3 = scale if scale.dim() == 3 else scale[:, None]
        ref = comfy_layer_norm_modulate(x, s3, c3, 1e-6, weight, bias)
    check(out, ref, dtype)
    if case == "constant_row":
        assert torch.equal(out[0, 1], shift[0, 0])


@pytest.mark.parametrize("bad,reason", [
    ("per_token", "one vector per batch"), ("dtype_mix", "must be"), ("half_affine", "both weight and bias"),
    ("wrong_channels", "one vector per batch")])
def test_layer_norm_modulate_refuses_with_reason(bad, reason):
    x = torch.randn(2, 4, 32, dtype=torch.bfloat16)
    shift = scale = torch.zeros(2, 1, 32, dtype=torch.bfloat16)
    weight = bias = None
    if bad == "per_token":  # Wan 2.2's per-frame modulation: not this kernel's layout
        shift = torch.zeros(2, 4, 32, dtype=torch.bfloat16)
    elif bad == "dtype_mix":
        scale = torch.zeros(2, 1, 32)
    elif bad == "half_affine":
        weight = torch.ones(32, dtype=torch.bfloat16)
    elif bad == "wrong_channels":
        shift = torch.zeros(2, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(lnm.LayerNormModulateInputError, match=reason):
        lnm.layer_norm_modulate(x, shift, scale, 1e-6, weight, bias)


def test_ops_trace_with_fake_tensors():
    # torch.compile and ComfyUI's TorchCompileModel see the custom ops through their fakes.
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert nr._REGISTRATION_ERROR is None and lnm._REGISTRATION_ERROR is None
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(1, 4, 64, dtype=torch.bfloat16))
        w = mode.from_tensor(torch.ones(64, dtype=torch.bfloat16))
        f = mode.from_tensor(comfy_rope(4, 32))
        s = mode.from_tensor(torch.zeros(1, 1, 64, dtype=torch.bfloat16))
        out = torch.ops.triton_accel.rms_norm_rope(x, w, f, 1e-6, 32)
        out2 = torch.ops.triton_accel.layer_norm_modulate(x, s, s, 1e-6, None, None)
    assert out.shape == out2.shape == (1, 4, 64) and out.dtype == out2.dtype == torch.bfloat16


def test_ops_run_under_torch_compile():
    x = activations(1, 5, 64, torch.float16)
    freqs = comfy_rope(5, 32)
    e = (torch.randn(1, 6, 64) * 0.3).half().chunk(6, dim=1)

    def block(x):
        return nr.rms_norm_rope(lnm.layer_norm_modulate(x, e[0], e[1], 1e-6), None, freqs, 1e-6, 32)

    compiled = torch.compile(block, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), block(x))


# ---- kernels/fused/qk_norm.py: Flux's QKNorm on the permuted views of one qkv tensor ----------------

from triton_accel.kernels.fused import qk_norm as qkn  # noqa: E402

# (name, batch, tokens, heads, head_dim): Flux (24 x 128), HunyuanVideo's 24 x 128 at another
# length, an odd small case and head dim 64 (Chroma Radiance's NeRF blocks: 64-wide heads).
QK_SHAPES = [("flux", 1, 40, 24, 128), ("odd", 2, 13, 3, 80), ("d64", 1, 9, 4, 64)]


def qkv_views(batch, tokens, heads, head_dim, dtype, seed=0):
    """q, k, v as Flux's blocks make them: view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)."""
    qkv = activations(batch, tokens, 3 * heads * head_dim, dtype, seed)
    return qkv.view(batch, tokens, 3, heads, head_dim).permute(2, 0, 3, 1, 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,batch,tokens,heads,head_dim", QK_SHAPES, ids=[s[0] for s in QK_SHAPES])
def test_qk_rms_norm_matches_torch_on_permuted_views(dtype, name, batch, tokens, heads, head_dim):
    q, k, _v = qkv_views(batch, tokens, heads, head_dim, dtype)
    assert not q.is_contiguous()
    g = torch.Generator().manual_seed(4)
    wq, wk = ((torch.rand(head_dim, generator=g) + 0.5).to(dtype) for _ in range(2))
    eps = torch.finfo(torch.float32).eps  # ComfyUI 0.4+'s QKNorm: torch's rms_norm with eps None
    qo, ko = qkn.qk_rms_norm(q, k, wq, wk, eps)
    rq, rk = qkn.qk_rms_norm_ref(q, k, wq, wk, eps)
    assert qo.is_contiguous() and ko.is_contiguous()
    check(qo, rq, dtype)
    check(ko, rk, dtype)


def test_qk_rms_norm_edge_cases():
    dtype = torch.bfloat16
    q, k, _v = qkv_views(1, 7, 2, 32, dtype, seed=6)
    w = torch.ones(32, dtype=dtype)
    q = q.clone()
    q[0, 1, 3] = 0  # a zero head row: stays 0
    qo, ko = qkn.qk_rms_norm(q, k.contiguous(), w, w, 1e-6)  # contiguous k beside a strided q
    rq, rk = qkn.qk_rms_norm_ref(q, k, w, w, 1e-6)
    check(qo, rq, dtype)
    check(ko, rk, dtype)
    assert (qo[0, 1, 3] == 0).all()
    with pytest.raises(qkn.QKNormInputError, match="weight"):
        qkn.qk_rms_norm(q, k, w.float(), w, 1e-6)
    with pytest.raises(qkn.QKNormInputError, match="one shape"):
        qkn.qk_rms_norm(q, k[:, :1], w, w, 1e-6)


# ---- kernels/fused/gated_residual_norm.py: Wan's gated residual and the LayerNorm after it -----------

from triton_accel.kernels.fused import gated_residual_norm as grn  # noqa: E402


def comfy_gated_residual_norm(x, y, gate, eps, weight=None, bias=None):
    """Wan's block: x = addcmul(x, y, e[2]) in x's dtype, then norm3(x) (affine LayerNorm)."""
    h = torch.addcmul(x, y, gate) if gate is not None else x + y
    n = torch.nn.functional.layer_norm(h.float(), (x.shape[-1],), None if weight is None else weight.float(),
                                       None if bias is None else bias.float(), eps).to(x.dtype)
    return h, n


def gated_residual_inputs(batch, tokens, channels, dtype):
    """(x, y, gate, weight, bias) of Wan's residual after the self-attention and norm3."""
    x = activations(batch, tokens, channels, dtype)
    y = activations(batch, tokens, channels, dtype, seed=7) * 0.5
    g = torch.Generator().manual_seed(8)
    gate = (torch.randn(batch, 1, channels, generator=g) * 0.4).to(dtype)
    weight, bias = (torch.rand(channels, generator=g) + 0.5).to(dtype), torch.randn(channels, generator=g).to(dtype)
    return x, y, gate, weight, bias


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,batch,tokens,channels", LN_SHAPES, ids=[s[0] for s in LN_SHAPES])
def test_gated_residual_layer_norm_matches_comfyui(dtype, name, batch, tokens, channels):
    x, y, gate, weight, bias = gated_residual_inputs(batch, tokens, channels, dtype)
    h, n = grn.gated_residual_layer_norm(x, y, gate, 1e-6, weight, bias)
    rh, rn = grn.gated_residual_norm_ref(x, y, gate, 1e-6, weight, bias)
    ch, cn = comfy_gated_residual_norm(x, y, gate, 1e-6, weight, bias)
    for out, ref, comfy in ((h, rh, ch), (n, rn, cn)):
        check(out, ref, dtype)
        check(out, comfy, dtype)
    check(grn.gated_residual(x, y, gate), ch, dtype)


@pytest.mark.parametrize("case", ["no_gate", "no_affine", "broadcast_batch", "two_dim_gate", "strided_rows",
                                  "constant_row", "two_dims"])
def test_gated_residual_layer_norm_edge_cases(case):
    dtype, batch, tokens, channels = torch.bfloat16, 2, 7, 96
    x = activations(batch, tokens, channels, dtype, seed=9)
    y = activations(batch, tokens, channels, dtype, seed=10)
    g = torch.Generator().manual_seed(11)
    gate = (torch.randn(batch, 1, channels, generator=g) * 0.4).to(dtype)
    weight = (torch.rand(channels, generator=g) + 0.5).to(dtype)
    bias = torch.randn(channels, generator=g).to(dtype)
    ref_gate = gate
    if case == "no_gate":  # the cross-attention's plain residual add
        gate = ref_gate = None
    elif case == "no_affine":
        weight = bias = None
    elif case == "broadcast_batch":  # one gate for both batch elements
        gate = ref_gate = gate[:1]
    elif case == "two_dim_gate":
        gate = gate[:, 0]
    elif case == "strided_rows":  # column slices of wider tensors: rows keep their stride
        x = torch.cat([x, x], dim=-1)[..., :channels]
        y = torch.cat([y, x], dim=-1)[..., :channels]
        assert not x.is_contiguous() and not y.is_contiguous()
    elif case == "constant_row":  # x + y * gate constant along the row: variance 0, norm = bias
        x[0, 1], y[0, 1] = 3.0, 0.0
    if case == "two_dims":
        h, n = grn.gated_residual_layer_norm(x[0], y[0], gate[0], 1e-6, weight, bias)
        rh, rn = comfy_gated_residual_norm(x[0], y[0], gate[0], 1e-6, weight, bias)
    else:
        h, n = grn.gated_residual_layer_norm(x, y, gate, 1e-6, weight, bias)
        rh, rn = comfy_gated_residual_norm(x, y, ref_gate, 1e-6, weight, bias)
    check(h, rh, dtype)
    check(n, rn, dtype)
    if case == "constant_row":
        assert torch.equal(n[0, 1], bias)


@pytest.mark.parametrize("bad,reason", [
    ("per_token_gate", "one vector per batch"), ("gate_dtype", "must be"), ("y_shape", "must match"),
    ("y_dtype", "must match"), ("half_affine", "both weight and bias"), ("int_dtype", "dtype")])
def test_gated_residual_refuses_with_reason(bad, reason):
    x = torch.randn(2, 4, 32, dtype=torch.bfloat16)
    y, gate = torch.randn_like(x), torch.zeros(2, 1, 32, dtype=torch.bfloat16)
    weight = bias = None
    if bad == "per_token_gate":  # Wan 2.2's per-frame modulation
        gate = torch.zeros(2, 4, 32, dtype=torch.bfloat16)
    elif bad == "gate_dtype":
        gate = gate.float()
    elif bad == "y_shape":
        y = y[:, :3]
    elif bad == "y_dtype":
        y = y.half()
    elif bad == "half_affine":
        weight = torch.ones(32, dtype=torch.bfloat16)
    elif bad == "int_dtype":
        x, y, gate = x.to(torch.int32), y.to(torch.int32), gate.to(torch.int32)
    with pytest.raises(grn.GatedResidualInputError, match=reason):
        grn.gated_residual_layer_norm(x, y, gate, 1e-6, weight, bias)


def test_gated_residual_op_traces_and_compiles():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert grn._REGISTRATION_ERROR is None
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(1, 4, 64, dtype=torch.bfloat16))
        g = mode.from_tensor(torch.zeros(1, 1, 64, dtype=torch.bfloat16))
        both = torch.ops.triton_accel.gated_residual_norm(x, x, g, 1e-6, None, None, True)
        one = torch.ops.triton_accel.gated_residual_norm(x, x, None, 1e-6, None, None, False)
    assert len(both) == 2 and len(one) == 1 and both[1].shape == (1, 4, 64)
    x, y = activations(1, 5, 64, torch.float16), activations(1, 5, 64, torch.float16, seed=2)
    gate = (torch.randn(1, 1, 64) * 0.3).half()

    def block(x):
        h, n = grn.gated_residual_layer_norm(x, y, gate, 1e-6)
        return grn.gated_residual(h, n, None)

    compiled = torch.compile(block, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), block(x))


# ---- direct launches: what jit_or_plan remembers for each fused-norm kernel -----------------

def test_direct_launch_records_every_constexpr_and_the_output(monkeypatch):
    """The third call of a signature skips Triton's JIT and launches the remembered kernel with
    the runtime args and these constexpr values: one per constexpr of the kernel, in its order
    (a missing one would raise here), and out_index naming the tensor the verification
    compares, the op's output. Recorded on the CPU with the bookkeeping forced on (the
    interpreter compiles nothing, so no plan is kept)."""
    from triton_accel.kernels.core import direct_launch as dl

    seen = []
    monkeypatch.setattr(dl, "usable", lambda t: True)
    monkeypatch.setattr(dl, "record", lambda key, kernel, grid, consts, args, out_index=None, **kw:
                        seen.append((key, consts, args, out_index)))
    x = activations(1, 5, 64, torch.bfloat16)
    e = (torch.randn(1, 6, 64) * 0.3).bfloat16().chunk(6, dim=1)
    q, k, _ = qkv_views(1, 7, 2, 32, torch.bfloat16)
    outs = [lnm.layer_norm_modulate(x, e[0], e[1], 1e-6), nr.rms_norm_rope(x, None, comfy_rope(5, 32), 1e-6, 32),
            qkn.qk_rms_norm(q, k, torch.ones(32, dtype=torch.bfloat16), torch.ones(32, dtype=torch.bfloat16), 1e-6)[0],
            grn.gated_residual_layer_norm(x, x, e[2], 1e-6)[1], grn.gated_residual(x, x, e[2])]
    kernels = [lnm._layer_norm_modulate, nr._rms_norm_rope, qkn._qk_rms_norm, grn._gated_residual_norm,
               grn._gated_residual_norm]
    assert len(seen) == 5
    for (key, consts, args, out_index), out, kernel in zip(seen, outs, kernels):
        device, grid, values, options, name = key[:5]  # then signature_key(args) past the name
        assert len(consts) == len(dl.constexpr_order(kernel)) and values == consts, (name, consts)
        assert args[out_index].data_ptr() == out.data_ptr(), name
        assert device == x.device.index and name in ("layer_norm_modulate", "rms_norm_rope", "qk_rms_norm",
                                                     "gated_residual_norm")
    # What the JIT specialises on is in the key: a 2-byte-aligned view is another signature; so
    # are what the launcher derives from outside the args: the grid (a second batch element,
    # same tokens and strides) and a constexpr (a norm with its weight, where the call above had
    # a placeholder pointer of the same dtype).
    rope_without_weight = seen[1][0]
    seen.clear()
    base = torch.randn(1, 5 * 64 + 1).bfloat16()
    lnm.layer_norm_modulate(base[:, 1:].view(1, 5, 64), e[0], e[1], 1e-6)
    lnm.layer_norm_modulate(base[:, :-1].view(1, 5, 64), e[0], e[1], 1e-6)
    lnm.layer_norm_modulate(activations(2, 5, 64, torch.bfloat16), e[0], e[1], 1e-6)
    nr.rms_norm_rope(x, torch.ones(64, dtype=torch.bfloat16), comfy_rope(5, 32), 1e-6, 32)
    misaligned, aligned, batch2, rope_with_weight = (key for key, *_ in seen)
    assert misaligned != aligned
    assert batch2 != aligned
    assert rope_with_weight != rope_without_weight


# ---- the norm kernels' residual input and e4m3 rows (Wan's norm2 after the cross-attention) --
# The rows are the FP8 Linear's activation format: they must equal linear_fp8.quantize_activation
# of the norm's 16-bit output bit for bit (the GEMM then computes what it would have), on
# inputs with outlier channels (the row amax sits on them).

def _fp8_rows_equal(rows, out):
    from triton_accel.kernels.linear import fp8 as linear_fp8

    q, scales = linear_fp8.quantize_activation(out.reshape(-1, out.shape[-1]))
    assert rows[0].dtype == torch.float8_e4m3fn and rows[0].shape == q.shape and rows[0].is_contiguous()
    assert torch.equal(rows[0].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(rows[1], scales)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,batch,tokens,channels", LN_SHAPES, ids=[s[0] for s in LN_SHAPES])
@pytest.mark.parametrize("residual", [False, True], ids=["no_residual", "residual"])
def test_residual_layer_norm_modulate_matches_comfyui_and_its_rows_the_linear_quantisation(
        dtype, name, batch, tokens, channels, residual):
    """h = x + r (ComfyUI's `x = x + cross_attn(...)`, in x's dtype), then norm2 + modulation of
    h, and the result's e4m3 rows; without a residual, h is x itself."""
    x = activations(batch, tokens, channels, dtype)
    r = activations(batch, tokens, channels, dtype, seed=5) * 0.3 if residual else None
    e = (torch.randn(batch, 6, channels, generator=torch.Generator().manual_seed(2)) * 0.4).to(dtype).chunk(6, dim=1)
    h, out, rows = lnm.residual_layer_norm_modulate(x, e[3], e[4], 1e-6, residual=r, fp8_rows=True)
    ref_h = x if r is None else (x + r)  # one rounding of the fp32 sum (CPU 16-bit adds compute in fp32)
    if r is None:
        assert h is x
    else:
        check(h, ref_h, dtype)
    check(out, comfy_layer_norm_modulate(ref_h, e[3], e[4], 1e-6), dtype)
    _fp8_rows_equal(rows, out)
    h2, out2, none = lnm.residual_layer_norm_modulate(x, e[3], e[4], 1e-6, residual=r)
    assert none is None and torch.equal(out2, out) and torch.equal(h2, h)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,batch,tokens,channels", LN_SHAPES, ids=[s[0] for s in LN_SHAPES])
def test_gated_residual_layer_norm_rows_are_the_linear_quantisation(dtype, name, batch, tokens, channels):
    x, y, gate, weight, bias = gated_residual_inputs(batch, tokens, channels, dtype)
    h, n, rows = grn.gated_residual_layer_norm_rows(x, y, gate, 1e-6, weight, bias)
    rh, rn = grn.gated_residual_layer_norm(x, y, gate, 1e-6, weight, bias)
    assert torch.equal(h, rh) and torch.equal(n, rn)
    _fp8_rows_equal(rows, n)


@pytest.mark.parametrize("case", ["zero_row", "strided_residual", "broadcast_batch"])
def test_residual_layer_norm_modulate_edge_cases(case):
    """An output row of zeros (its amax floors at 1e-12: finite scale, e4m3 zeros), a residual read
    through a row-strided view, one modulation for two batch elements."""
    dtype = torch.bfloat16
    x = activations(2, 7, 96, dtype)
    r = activations(2, 7, 96, dtype, seed=3)
    shift, scale = (torch.randn(2, 1, 96, generator=torch.Generator().manual_seed(4)) * 0.3).to(dtype).unbind(0)
    shift, scale = shift[None], scale[None]
    if case == "zero_row":  # the normalised row is 0, and with no shift so is the output row
        x[1, 2] = 0
        r[1, 2] = 0
        shift = torch.zeros_like(shift)
    elif case == "strided_residual":
        r = activations(2, 7, 192, dtype, seed=3)[..., :96]
    h, out, rows = lnm.residual_layer_norm_modulate(x, shift, scale, 1e-6, residual=r, fp8_rows=True)
    ref_h = x + r
    check(h, ref_h, dtype)
    check(out, comfy_layer_norm_modulate(ref_h, shift, scale, 1e-6), dtype)
    _fp8_rows_equal(rows, out)
    if case == "zero_row":
        assert rows[1][9].item() == pytest.approx(1e-12 / 448.0) and not rows[0][9].float().any()


def test_residual_layer_norm_modulate_refuses_with_reason():
    x = activations(1, 4, 64, torch.bfloat16)
    s = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(lnm.LayerNormModulateInputError, match="residual"):
        lnm.residual_layer_norm_modulate(x, s, s, 1e-6, residual=x[..., :32])
    with pytest.raises(lnm.LayerNormModulateInputError, match="residual"):
        lnm.residual_layer_norm_modulate(x, s, s, 1e-6, residual=x.half())


def test_rows_ops_trace_with_fake_tensors_and_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(2, 4, 64, dtype=torch.bfloat16))
        s = mode.from_tensor(torch.zeros(1, 1, 64, dtype=torch.bfloat16))
        outs = torch.ops.triton_accel.residual_layer_norm_modulate(x, x, s, s, 1e-6, True)
        plain = torch.ops.triton_accel.residual_layer_norm_modulate(x, None, s, s, 1e-6, False)
        grn_outs = torch.ops.triton_accel.gated_residual_norm(x, x, s, 1e-6, None, None, True, True)
    assert [tuple(t.shape) for t in outs] == [(2, 4, 64), (2, 4, 64), (8, 64), (8,)]
    assert outs[2].dtype == torch.float8_e4m3fn and outs[3].dtype == torch.float32 and len(plain) == 1
    assert [t.dtype for t in grn_outs] == [torch.bfloat16, torch.bfloat16, torch.float8_e4m3fn, torch.float32]
    x, r = activations(1, 5, 64, torch.float16), activations(1, 5, 64, torch.float16, seed=2)
    e = (torch.randn(1, 6, 64) * 0.3).half().chunk(6, dim=1)

    def block(x):
        h, out, rows = lnm.residual_layer_norm_modulate(x, e[0], e[1], 1e-6, residual=r, fp8_rows=True)
        return h, out, rows[0].view(torch.uint8), rows[1]

    compiled = torch.compile(block, backend="eager", fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(compiled(x), block(x)))


# ---- Flux's blocks (comfy/ldm/flux/layers.py): `x += apply_mod(y, gate)`, a product tensor then
# an in-place add (two roundings, where Wan's addcmul rounds once), then norm2 + modulation -----

def comfy_flux_gated_residual(x, y, gate):
    """Flux's `x += apply_mod(y, gate)`: y * gate in x's dtype, then the in-place add."""
    out = x.clone()
    out += y * gate
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,batch,tokens,channels", LN_SHAPES, ids=[s[0] for s in LN_SHAPES])
def test_flux_gated_residual_rounds_the_product_first(dtype, name, batch, tokens, channels):
    x, y, gate, _, _ = gated_residual_inputs(batch, tokens, channels, dtype)
    comfy = comfy_flux_gated_residual(x, y, gate)
    out = grn.gated_residual(x, y, gate, round_product=True)
    check(out, comfy, dtype)
    check(out, grn.gated_residual_norm_ref(x, y, gate, 0.0, norm=False, round_product=True)[0], dtype)
    if dtype == torch.bfloat16:
        # The rounding is what the flag changes: Wan's single rounding moves values here.
        assert not torch.equal(grn.gated_residual(x, y, gate), comfy)
        assert torch.equal(out, comfy)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,batch,tokens,channels", LN_SHAPES, ids=[s[0] for s in LN_SHAPES])
@pytest.mark.parametrize("fp8_rows", [False, True], ids=["no_rows", "rows"])
def test_gated_residual_layer_norm_modulate_matches_flux(dtype, name, batch, tokens, channels, fp8_rows):
    """Flux's double block after its attention: img += proj(attn) * gate1, then
    addcmul(shift2, norm2(img), 1 + scale2), and the result's e4m3 rows, in one pass. The
    modulation vectors are chunks of one [B, 1, 6C] tensor, as Flux's Modulation returns them."""
    x, y, _, _, _ = gated_residual_inputs(batch, tokens, channels, dtype)
    mod = (torch.randn(batch, 1, 6 * channels, generator=torch.Generator().manual_seed(3)) * 0.4).to(dtype)
    shift1, scale1, gate1, shift2, scale2, gate2 = mod.chunk(6, dim=-1)
    h, out, rows = lnm.residual_layer_norm_modulate(x, shift2, scale2, 1e-6, residual=y, gate=gate1,
                                                    round_product=True, fp8_rows=fp8_rows)
    ref_h = comfy_flux_gated_residual(x, y, gate1)
    check(h, ref_h, dtype)
    check(out, comfy_layer_norm_modulate(ref_h, shift2, scale2, 1e-6), dtype)
    if fp8_rows:
        _fp8_rows_equal(rows, out)
    else:
        assert rows is None
    if dtype == torch.bfloat16:
        assert torch.equal(h, ref_h)


def test_gated_residual_layer_norm_modulate_refuses_a_gate_without_residual():
    x = activations(1, 4, 64, torch.bfloat16)
    s = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(lnm.LayerNormModulateInputError, match="gate needs a residual"):
        lnm.residual_layer_norm_modulate(x, s, s, 1e-6, gate=s)
    with pytest.raises(lnm.LayerNormModulateInputError, match="gate"):
        lnm.residual_layer_norm_modulate(x, s, s, 1e-6, residual=x, gate=torch.zeros(3, 1, 64, dtype=torch.bfloat16))


def test_flux_residual_ops_trace_and_compile():
    x, r = activations(1, 5, 64, torch.float16), activations(1, 5, 64, torch.float16, seed=2)
    e = (torch.randn(1, 1, 6 * 64) * 0.3).half().chunk(6, dim=-1)

    def block(x):
        h, out, _ = lnm.residual_layer_norm_modulate(x, e[3], e[4], 1e-6, residual=r, gate=e[2], round_product=True)
        return grn.gated_residual(h, out, e[5], round_product=True)

    compiled = torch.compile(block, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), block(x))


# ---- direct_launch.SiteMemo: a repeated call layout skips the checks and the signature key ----

@pytest.fixture
def memo_harness(monkeypatch):
    """Direct launches on as on a GPU (the CPU tensors read as CUDA ones, every signature's
    plan verified), launches recorded instead of run; the memos emptied before and after."""
    from triton_accel.kernels.core import cache_registry
    from triton_accel.kernels.core import direct_launch as dl

    launches = []
    plan = dl.Plan("kernel", (1,), (), True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(dl, "usable", lambda t: True)
    monkeypatch.setattr(dl, "lookup", lambda key: plan)
    monkeypatch.setattr(dl, "launch", lambda p, index, args: launches.append((p, args)))
    cache_registry.clear_all()
    yield launches
    cache_registry.clear_all()


def _same_launch(first, second, inputs):
    """The remembered launch passes what the checked one passed: the inputs by data pointer,
    fresh outputs of the same dtype and size, equal scalars."""
    (p1, a1), (p2, a2) = first, second
    assert p1 is p2 and len(a1) == len(a2)
    ptrs = {t.data_ptr() for t in inputs}
    for u, v in zip(a1, a2):
        if isinstance(u, torch.Tensor):
            assert isinstance(v, torch.Tensor) and u.dtype == v.dtype
            if u.data_ptr() in ptrs:
                assert v.data_ptr() == u.data_ptr()
            else:
                assert v.data_ptr() not in ptrs and v.numel() == u.numel()
        else:
            assert type(u) is type(v) and u == v


@pytest.mark.parametrize("kernel", ["layer_norm_modulate_rows", "flux_gated_layer_norm_modulate", "gated_residual",
                                    "qk_rms_norm"])
def test_site_memo_repeats_the_checked_launch(memo_harness, kernel):
    x, y = activations(2, 5, 64, torch.bfloat16), activations(2, 5, 64, torch.bfloat16, seed=3)
    mod = (torch.randn(2, 1, 6 * 64) * 0.3).bfloat16().chunk(6, dim=-1)
    q, k, _ = qkv_views(1, 7, 2, 32, torch.bfloat16)
    w = torch.ones(32, dtype=torch.bfloat16)
    calls = {"layer_norm_modulate_rows": (lambda: lnm.residual_layer_norm_modulate(x, mod[0], mod[1], 1e-6,
                                                                                     fp8_rows=True), (x, *mod)),
             "flux_gated_layer_norm_modulate": (lambda: lnm.residual_layer_norm_modulate(
                 x, mod[3], mod[4], 1e-6, residual=y, gate=mod[2], round_product=True), (x, y, *mod)),
             "gated_residual": (lambda: grn.gated_residual(x, y, mod[5], round_product=True), (x, y, *mod)),
             "qk_rms_norm": (lambda: qkn.qk_rms_norm(q, k, w, w, 1e-6), (q, k, w))}
    call, inputs = calls[kernel]
    call()
    call()
    assert len(memo_harness) == 2
    _same_launch(*memo_harness, inputs)


def test_site_memo_misses_on_another_layout(memo_harness, monkeypatch):
    """Another alignment, stride or flag is another fingerprint: the checks run again (and
    refuse what they refuse)."""
    checked = []
    real = lnm._check
    monkeypatch.setattr(lnm, "_check", lambda *a: checked.append(1) or real(*a))
    x = activations(1, 5, 64, torch.bfloat16)
    mod = (torch.randn(1, 1, 6 * 64) * 0.3).bfloat16().chunk(6, dim=-1)
    lnm.residual_layer_norm_modulate(x, mod[0], mod[1], 1e-6)
    lnm.residual_layer_norm_modulate(x, mod[0], mod[1], 1e-6)
    assert len(checked) == 1
    lnm.residual_layer_norm_modulate(x, mod[0], mod[1], 1e-6, fp8_rows=True)
    base = torch.randn(1, 5 * 64 + 1).bfloat16()
    lnm.residual_layer_norm_modulate(base[:, 1:].view(1, 5, 64), mod[0], mod[1], 1e-6)
    assert len(checked) == 3
    with pytest.raises(lnm.LayerNormModulateInputError):
        lnm.residual_layer_norm_modulate(x, mod[0], mod[1][..., :32], 1e-6)
