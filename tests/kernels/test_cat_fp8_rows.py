"""kernels/linear/cat_fp8_rows.py under the Triton interpreter: the concatenation equals torch.cat bit for
bit (a copy), and the e4m3 rows and scales equal linear_fp8.quantize_activation of that
concatenation bit for bit (the FP8 Linear reads them instead of quantising: any difference would
change the GEMM's input). Tolerance: none, per dtype (fp16, bf16, fp32), at Flux's single-block
split (3072 + 12288 channels scaled down to 96 + 384, and the real widths at one row) and edge
cases: an outlier channel that sets the row's scale from the second piece, rows of zeros
(scale floor), strided rows, pieces that are not powers of two.
"""
from __future__ import annotations

import pytest
import torch

from triton_accel.kernels.linear import cat_fp8_rows as cfr
from triton_accel.kernels.linear import fp8 as linear_fp8

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (name, leading shape, channels of the attention part, channels of the MLP part)
SHAPES = [("flux_single_scaled", (1, 9), 96, 384), ("flux_single_full_width", (1, 2), 3072, 12288),
          ("batch2_odd", (2, 5), 40, 200)]


def pieces(lead, ka, kb, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*lead, ka, generator=g) * 3
    b = torch.randn(*lead, kb, generator=g)
    b[..., 5] *= 60  # an outlier channel in the second piece: it sets every row's scale
    return a.to(dtype), b.to(dtype)


def check(a, b):
    out, (q, s) = cfr.cat_fp8_rows(a, b)
    ref = torch.cat((a, b), -1)
    assert torch.equal(out, ref)
    rq, rs = linear_fp8.quantize_activation(ref.reshape(-1, ref.shape[-1]))
    assert q.shape == rq.shape and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs)
    return out, q, s


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,lead,ka,kb", SHAPES, ids=[s[0] for s in SHAPES])
def test_concatenation_and_rows_equal_torch_cat_and_the_linears_quantisation(dtype, name, lead, ka, kb):
    a, b = pieces(lead, ka, kb, dtype)
    out, q, s = check(a, b)
    # and the torch-written reference of the format agrees to e4m3's rounding
    _, tq, ts = cfr.cat_fp8_rows_ref(a, b)
    assert torch.equal(ts, s)
    assert (tq.float() - q.float()).abs().max() <= 2 ** -6 + (q.float().abs() * 2 ** -3).max()


def test_edge_rows():
    a, b = pieces((1, 4), 48, 80, torch.bfloat16, seed=1)
    a, b = a.clone(), b.clone()
    a[0, 1] = 0
    b[0, 1] = 0  # an all-zero row: scale floor 1e-12 / 448, zeros
    _, q, s = check(a, b)
    assert (q[1].float() == 0).all() and s[1] == torch.tensor(1e-12 / 448.0)
    # strided rows: the pieces as views of wider tensors (ComfyUI's split of linear1's output)
    wide = torch.randn(1, 4, 48 + 80 + 16).to(torch.bfloat16)
    check(wide[..., :48], wide[..., 64:])


@pytest.mark.parametrize("bad,reason", [("dtypes", "share"), ("rows", "differ before"), ("wide", "channels"),
                                        ("strided", "contiguous")])
def test_refuses_with_reason(bad, reason):
    a, b = pieces((1, 3), 32, 64, torch.float16)
    if bad == "dtypes":
        b = b.float()
    elif bad == "rows":
        b = b[:, :2]
    elif bad == "wide":
        b = torch.zeros(1, 3, cfr.MAX_PART + 1, dtype=a.dtype)
    else:
        a = torch.randn(1, 32, 3).to(a.dtype).transpose(1, 2)
    with pytest.raises(cfr.CatRowsInputError, match=reason):
        cfr.cat_fp8_rows(a, b)


def test_op_traces_with_fake_tensors_and_under_torch_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert cfr._REGISTRATION_ERROR is None
    with FakeTensorMode() as mode:
        a = mode.from_tensor(torch.randn(1, 4, 32, dtype=torch.bfloat16))
        b = mode.from_tensor(torch.randn(1, 4, 64, dtype=torch.bfloat16))
        out, q, s = torch.ops.triton_accel.cat_fp8_rows(a, b)
    assert out.shape == (1, 4, 96) and q.shape == (4, 96) and q.dtype == torch.float8_e4m3fn and s.shape == (4,)
    a, b = pieces((1, 3), 32, 64, torch.float16, seed=2)
    compiled = torch.compile(lambda a, b: cfr.cat_fp8_rows(a, b), backend="eager", fullgraph=True)
    (out, (q, s)), (rout, (rq, rs)) = compiled(a, b), cfr.cat_fp8_rows(a, b)
    assert torch.equal(out, rout) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
