"""The FP8 Gluon kernel's relabelling of P's columns, checked on the CPU.

The kernels run only on sm_90; their SASS (no register copies at the back edge, no layout
shuffles for P, no spills in the loop) is pinned by tests/compile/test_compile_gluon_hopper*.py.
Here, what decides whether the relabelling computes the same attention:
- the kernel relabels P's columns (reshape / permute / reshape, P_RELABEL_ORDER) and
  quantize_qkv(v_key_perm=True) stores V's keys in v_key_order(): the two must be one map,
  so that P.V pairs every probability with its own key;
- the map must send the columns a thread holds in wgmma's accumulator layout to the k
  positions the same thread holds in the 8-bit A-operand layout (else the conversion moves
  data between threads, which is what it exists to avoid);
- a float64 emulation of the kernel's arithmetic on the quantised operands gives the same
  output with and without the relabelling (interpreter-run quantisation, outlier inputs).
"""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch

glu = importlib.import_module("triton_accel.kernels.attention.gluon_hopper")
glb = importlib.import_module("triton_accel.kernels.attention.gluon_hopper_bf16")
quant = importlib.import_module("triton_accel.kernels.attention.fp8_quant")
full = importlib.import_module("triton_accel.kernels.attention.fp8_full")

LOG2_P_SCALE = 8.8073


def test_v_key_order_permutes_each_group_of_32():
    for group in range(3):
        keys = range(32 * group, 32 * group + 32)
        assert sorted(quant.v_key_order(n) for n in keys) == list(keys)
    assert quant.v_key_order(2) == 4 and quant.v_key_order(8) == 2  # not the identity


def test_p_relabel_moves_column_n_to_v_key_order():
    n = 128
    p = torch.arange(n, dtype=torch.float64).repeat(3, 1)
    out = glu.p_relabel(p)
    for col in range(n):
        assert out[1, quant.v_key_order(col)] == col


def test_the_kernel_relabels_with_p_relabel_order():
    if glu.gluon is None:
        pytest.skip(f"Gluon does not import with this Triton: {glu.gluon_api_refusal()}")
    src = inspect.getsource(glu._p_operand.fn if hasattr(glu._p_operand, "fn") else glu._p_operand)
    assert f"gl.permute(p8, {list(glu.P_RELABEL_ORDER)})" in src
    assert "gl.reshape(p8, [rows, n // 32, 2, 2, 2, 2, 2])" in src


def test_relabel_keeps_every_value_in_its_thread():
    """wgmma m64nNk32 with an fp32 accumulator: in each 32-column k-step, lane t (mod 4) of a
    quad holds columns 8c + 2t + e (c < 4, e < 2); the 8-bit A operand: k = 16h + 4t + f
    (h < 2, f < 4). Relabelled, lane t's columns are exactly its A positions: registers only."""
    for t in range(4):
        held = {8 * c + 2 * t + e for c in range(4) for e in range(2)}
        wanted = {16 * h + 4 * t + f for h in range(2) for f in range(4)}
        assert {quant.v_key_order(col) for col in held} == wanted


def _inputs(shape, seed=0):
    q, k, v = full.accuracy_inputs("outlier", shape, torch.float16, seed=seed)
    return q, k, v


def test_quantize_stores_v_keys_in_v_key_order():
    q, k, v = _inputs((1, 2, 300, 128), seed=1)
    plain = quant.quantize_qkv(q, k, v, 0.088, 128, 128, exact_cast=True)
    perm = quant.quantize_qkv(q, k, v, 0.088, 128, 128, exact_cast=True, v_key_perm=True)
    assert not plain.v_key_perm and perm.v_key_perm
    lk_pad = plain.vt8.shape[-1]
    order = torch.tensor([quant.v_key_order(n) for n in range(lk_pad)])
    assert torch.equal(perm.vt8.float()[:, :, order], plain.vt8.float())
    for name in ("q8", "sq", "qs", "k8", "sk", "ks", "sv"):
        assert torch.equal(getattr(perm, name).float(), getattr(plain, name).float()), name
    # vmean carries V's mean rounding error, summed in fp32 over VT8 in its stored key order:
    # the same value to fp32 rounding.
    assert torch.allclose(perm.vmean, plain.vmean, rtol=1e-6, atol=1e-7)


def test_quantize_for_config_matches_what_its_kernel_reads():
    q, k, v = _inputs((1, 1, 130, 128))
    config = glu.default_config()
    qkv = glu.quantize_for_config(q, k, v, 0.088, config)
    assert (qkv.block_m, qkv.block_n) == (glu.BLOCK_M, config["BLOCK_N"])
    assert qkv.v_key_perm


def test_v_key_perm_needs_whole_groups_of_32_keys():
    q, k, v = _inputs((1, 1, 40, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_qkv(q, k, v, 0.1, 32, 16, v_key_perm=True)


def _emulate(qkv, lq, lk, relabel):
    """The Gluon kernel's arithmetic in float64 on quantize_qkv's operands, one softmax over
    all keys (the kernel's online rescaling cancels in O / l): S from the e4m3 operands and
    the side dot, P = e4m3(exp2(S * c - max + LOG2_P_SCALE)), O = P.V * sv / l + vmean, with
    l the row sum of the unrounded exponentials (fp32 in the kernel)."""
    bh, lq_pad, _ = qkv.q8.shape
    lk_pad = qkv.k8.shape[1]
    out = []
    for i in range(bh):
        s = qkv.q8[i].double() @ qkv.k8[i].double().T + qkv.qs[i].double() @ qkv.ks[i].double().T
        c = qkv.sq[i].double().repeat_interleave(qkv.block_m)[:lq_pad, None] \
            * qkv.sk[i].double().repeat_interleave(qkv.block_n)[None, :lk_pad]
        t = (s * c)[:lq]
        t[:, lk:] = float("-inf")
        arg = t - t.amax(1, keepdim=True) + LOG2_P_SCALE
        exact = torch.exp2(arg)
        p = exact.to(torch.float8_e4m3fn).double()
        l = exact.sum(1, keepdim=True)
        if relabel:
            p = glu.p_relabel(p)
        o = p @ qkv.vt8[i].double().T
        out.append(o * qkv.sv[i].double() / l + qkv.vmean[i].double())
    return torch.stack(out)


@pytest.mark.parametrize("shape", [(1, 2, 300, 128), (1, 1, 77, 64)], ids=["d128_300", "d64_77"])
def test_relabelled_p_with_permuted_v_is_the_same_attention(shape):
    q, k, v = _inputs(shape, seed=2)
    scale = shape[-1] ** -0.5
    plain = quant.quantize_qkv(q, k, v, scale, 128, 128, exact_cast=True)
    perm = quant.quantize_qkv(q, k, v, scale, 128, 128, exact_cast=True, v_key_perm=True)
    # V's mean correction is summed over VT8 in its stored key order (fp32 rounding apart, the same; the
    # test above): one vmean for both, so the comparison sees only the relabelling.
    assert torch.allclose(perm.vmean, plain.vmean, rtol=1e-6, atol=1e-7)
    perm = perm._replace(vmean=plain.vmean)
    L, D = shape[2], shape[3]
    o_plain = _emulate(plain, L, L, relabel=False)
    o_perm = _emulate(perm, L, L, relabel=True)
    assert torch.allclose(o_perm, o_plain, rtol=1e-12, atol=1e-12)
    # Without the relabelling the permuted V pairs probabilities with other keys' values.
    wrong = _emulate(perm, L, L, relabel=False)
    assert (wrong - o_plain).abs().max() > 1e-2
    # And the emulation is the attention (the outlier accuracy bar: rel. L2 <= 0.03).
    ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale, -1) @ v.double()
    got = o_perm[..., :D].reshape(ref.shape)
    assert ((got - ref).norm() / ref.norm()).item() < 0.03


def test_launcher_refuses_operands_quantised_for_the_other_order():
    q, k, v = _inputs((1, 1, 130, 128))
    plain = quant.quantize_qkv(q, k, v, 0.088, 128, 128, exact_cast=True)
    perm = quant.quantize_qkv(q, k, v, 0.088, 128, 128, exact_cast=True, v_key_perm=True)
    assert perm.v_key_perm
    with pytest.raises(ValueError, match="v_key_perm=True"):
        glu.attention_gluon_fp8_quantized(plain, q.shape, 130, q.dtype, q.device, glu.default_config())


def test_default_configs_are_the_shipped_loops():
    assert list(glu.GLUON_CONFIGS) == ["sm90_lean"]
    assert glu.default_config() == glu.GLUON_CONFIGS["sm90_lean"]
    assert glu.default_config() is not glu.GLUON_CONFIGS["sm90_lean"]  # a copy the caller may change
    for head_dim, name in ((40, "sm90_d64"), (64, "sm90_d64"), (72, "sm90_d128"), (128, "sm90_d128"),
                           (256, "sm90_d256")):
        assert glb.default_config(head_dim) == glb.GLUON_BF16_CONFIGS[name], head_dim
