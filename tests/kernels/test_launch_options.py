"""Every launch of a pack kernel passes kernel_common.LAUNCH_OPTIONS (FP fusion pinned on).

Left unset, FP fusion follows TRITON_DEFAULT_FP_FUSION: Triton 3.9 warns on the first launch
of a process that the default turns off in 3.10, and any release compiles without FMAs (and
with ptxas --fmad=false) where the variable is 0. tests/versions checks, per release, that the
options keep the FMAs under that default; this file checks that each launch passes them:
statically, every `kernel[grid](...)` in kernels/, and at run time, the launches of every
kernel family under the interpreter (which drops compile options, so the recorder below reads
them off the call).
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

kc = importlib.import_module("triton_accel.kernels.core.kernel_common")
kernels = importlib.import_module("triton_accel.kernels")

KERNELS_DIR = Path(kc.__file__).resolve().parents[1]
# Subscript calls in kernels/ that are not kernel launches (a dict of functions).
NOT_LAUNCHES = {"_CALL_REFUSALS"}


def _passes_options(call: ast.Call) -> bool:
    return any(kw.arg is None and isinstance(kw.value, ast.Name) and kw.value.id == "LAUNCH_OPTIONS"
               for kw in call.keywords)


def _launch_sites():
    """(file:line, launched name, passes the options) of every `name[grid](...)` in kernels/."""
    sites = []
    for path in sorted(KERNELS_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id not in NOT_LAUNCHES):
                sites.append((f"{path.name}:{node.lineno}", node.func.value.id, _passes_options(node)))
    return sites


def test_launch_options_pin_fp_fusion():
    assert kc.LAUNCH_OPTIONS == {"enable_fp_fusion": True}


def test_every_launch_site_passes_the_options():
    sites = _launch_sites()
    # 24 when written: the attention, quantisation, Linear and row kernels, direct_launch's two
    # JIT launches (every row kernel goes through them) and the self-check kernel.
    assert len(sites) >= 24, sites
    missing = [f"{where} {name}" for where, name, ok in sites if not ok]
    assert not missing, "kernel launches without **LAUNCH_OPTIONS:\n" + "\n".join(missing)


@pytest.fixture
def launches(monkeypatch):
    """{kernel name: [enable_fp_fusion of each launch]} recorded off the interpreter's launches."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    if not kernels.interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    seen: dict[str, list] = {}
    original = interpreter.InterpretedFunction.run

    def run(self, *args, **kwargs):
        seen.setdefault(self.fn.__name__, []).append(kwargs.get("enable_fp_fusion"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run)
    return seen


def _qkv(h, lq, lk, d, dtype, gen):
    return [torch.randn(1, h, n, d, generator=gen).to(dtype) for n in (lq, lk, lk)]


def test_attention_launches_carry_the_options(launches):
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(2, 100, 700, 64, torch.float16, gen)  # past the short-key kernel's reach
    kernels.attention(q, k, v, backend="triton")
    q77, k77, v77 = _qkv(2, 100, 77, 64, torch.float16, gen)  # cross-attention to 77 text tokens
    kernels.attention(q77, k77, v77, backend="triton")
    kernels.attention(q, k, v, precision="fp8")
    kernels.attention(q, k, v, precision="int8")
    wanted = {"_attn_fwd", "_attn_short_kv_fwd", "fp8_stats_kernel", "_fp8_finalize_kernel", "_fp8_quant_kernel",
              "_v_mean_fix_kernel", "_attn_fp8_full_fwd", "_int8_finalize_kernel", "_int8_quant_kernel", "_attn_int8_fwd"}
    assert wanted <= set(launches), f"a path fell back or moved: launched {sorted(launches)}"
    unpinned = {name: flags for name, flags in launches.items() if not all(f is True for f in flags)}
    assert not unpinned, unpinned


@pytest.mark.parametrize("method", kernels.LINEAR_METHODS)
def test_linear_launches_carry_the_options(launches, method):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 96, generator=gen).to(torch.bfloat16)
    prepared = kernels.prepare_weight((torch.randn(80, 96, generator=gen) * 0.1).to(torch.bfloat16), method)
    kernels.linear(x, prepared, torch.randn(80, generator=gen).to(torch.bfloat16))
    assert launches, f"{method}: no Triton kernel ran"
    unpinned = {name: flags for name, flags in launches.items() if not all(f is True for f in flags)}
    assert not unpinned, unpinned


def test_row_kernel_launches_carry_the_options(launches):
    from triton_accel.kernels.linear import cat_fp8_rows
    from triton_accel.kernels.fused import gated_residual_norm, layer_norm_modulate, qk_norm

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 24, 256, generator=gen).to(torch.bfloat16)
    shift, scale = (torch.randn(2, 1, 256, generator=gen).to(torch.bfloat16) for _ in range(2))
    layer_norm_modulate.layer_norm_modulate(x, shift, scale, 1e-6)
    gated_residual_norm.gated_residual_layer_norm(x, x.clone(), scale, 1e-6)
    q, k = (torch.randn(1, 4, 24, 128, generator=gen).to(torch.bfloat16) for _ in range(2))
    w = torch.ones(128, dtype=torch.bfloat16)
    qk_norm.qk_rms_norm(q, k, w, w, 1e-6)
    cat_fp8_rows.cat_fp8_rows(x[0], x[1])
    wanted = {"_layer_norm_modulate", "_gated_residual_norm", "_qk_rms_norm", "_cat_fp8_rows"}
    assert wanted <= set(launches), f"launched {sorted(launches)}"
    unpinned = {name: flags for name, flags in launches.items() if not all(f is True for f in flags)}
    assert not unpinned, unpinned


def test_self_check_launch_carries_the_options(launches):
    from triton_accel.kernels.core import selfcheck

    ok, why = selfcheck._run(torch.device("cpu"))
    assert ok, why
    assert launches.get("_axpb_kernel") == [True], launches
