"""The fused-norm kernels (kernels/fused/norm_rope.py, layer_norm_modulate.py, qk_norm.py,
qk_norm_rope.py, gated_residual_norm.py, cat_fp8_rows.py) compile for every GPU target with the code their speed depends on, without
a GPU: triton.compile(ASTSource(...)) of each file's compile_specs() at Wan 14B's row width (5120
channels) and Flux's head dim (128).

Pinned in the PTX of every NVIDIA target:
- the row is read and written in 16-byte vectors (ld/st.global.v4): these kernels are one
  pass over memory, and scalar 2-byte accesses would make them LSU-bound;
- no local memory (a 5120-wide row held in registers must not spill);
- no scalar load in the RMSNorm + RoPE kernels (their rope tables load as vectors too);
- rsqrt.approx for the normalisation (what torch's kernels use), and for bf16 outputs on
  sm_80+ the round-to-nearest conversion (cvt.rn.bf16) the numerics rely on.
AMD targets (gfx942, gfx1100) must build an hsaco. Other Triton releases: tests/versions.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NVIDIA = {"sm75": 75, "sm80": 80, "sm86": 86, "sm89": 89, "sm90": 90, "sm120": 120}
AMD = {"gfx942": ("gfx942", 64), "gfx1100": ("gfx1100", 32)}
# (module, compile_specs kwargs): Turing runs fp16 (no bf16 there), the rest bf16; the affine
# LayerNorm once.
CASES = [("fused.norm_rope", {"dtype": "bf16"}), ("fused.layer_norm_modulate", {"dtype": "bf16"}),
         ("fused.qk_norm", {"dtype": "bf16"}), ("fused.gated_residual_norm", {"dtype": "bf16"}), ("fused.qk_norm_rope", {"dtype": "bf16"}),
         ("fused.layer_norm_modulate", {"dtype": "bf16", "affine": True}), ("fused.gated_residual_norm", {"dtype": "bf16", "norm": False}),
         # Flux's blocks: the product rounded before the residual add, with and without norm2
         ("fused.gated_residual_norm", {"dtype": "bf16", "norm": False, "round_product": True}),
         ("fused.layer_norm_modulate", {"dtype": "bf16", "channels": 3072, "residual": True, "gate": True,
                                  "round_product": True})]
# The norm kernels' e4m3 rows for the FP8 Linear (sm_89+, where that Linear runs): Wan's norm2
# after the cross-attention's residual, and norm3 after the gated residual.
FP8_ROWS_CASES = [("fused.layer_norm_modulate", {"dtype": "bf16", "residual": True, "fp8_rows": True}),
                  ("fused.gated_residual_norm", {"dtype": "bf16", "fp8_rows": True}),
                  ("fused.layer_norm_modulate", {"dtype": "bf16", "channels": 3072, "residual": True, "gate": True,
                                           "round_product": True, "fp8_rows": True}),
                  # Flux's single block: the concatenation before linear2 with its e4m3 rows (a copy: no norm)
                  ("linear.cat_fp8_rows", {"dtype": "bf16"})]
TURING_CASES = [("fused.norm_rope", {"dtype": "fp16"}), ("fused.layer_norm_modulate", {"dtype": "fp16"}),
                ("fused.qk_norm", {"dtype": "fp16"}), ("fused.gated_residual_norm", {"dtype": "fp16"}),
                ("fused.qk_norm_rope", {"dtype": "fp16"})]

WORKER = r"""
import importlib, importlib.util, json, os, sys
from concurrent.futures import ProcessPoolExecutor

root, jobs = sys.argv[1], json.loads(sys.argv[2])

def load():
    name = "triton_accel_compile"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, "__init__.py"),
                                                      submodule_search_locations=[root])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return name

def compile_job(job):
    target, backend, arch, warp, module, kwargs = job
    name = load()
    mod = importlib.import_module(f"{name}.kernels.{module}")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    out = []
    for fn, sig, const, attrs, opts in mod.compile_specs(**kwargs):
        try:
            k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget(backend, arch, warp), options=opts)
            binary = k.asm.get("cubin") if backend == "cuda" else k.asm.get("hsaco")
            out.append(dict(kernel=fn.__name__, ok=True, elf=bool(binary) and binary[:4] == b"\x7fELF",
                            ptx=k.asm.get("ptx", "")))
        except Exception as e:
            out.append(dict(kernel=getattr(fn, "__name__", "?"), ok=False, error=f"{type(e).__name__}: {e}"[:500]))
    return out

if __name__ == "__main__":
    load()
    with ProcessPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as ex:
        results = list(ex.map(compile_job, [tuple(j) for j in jobs]))
    print("RESULT " + json.dumps(results))
"""


def _jobs():
    jobs = []
    for target, cc in NVIDIA.items():
        for module, kwargs in (TURING_CASES if cc == 75 else CASES + (FP8_ROWS_CASES if cc >= 89 else [])):
            jobs.append((target, "cuda", cc, 32, module, kwargs))
    for target, (arch, warp) in AMD.items():
        for module, kwargs in CASES[:5]:
            jobs.append((target, "hip", arch, warp, module, kwargs))
    return jobs


def _id(job):
    target, _b, _a, _w, module, kwargs = job
    return f"{target}-{module}-" + "-".join(f"{k}={v}" for k, v in sorted(kwargs.items()))


JOBS = _jobs()


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton >= 3.9 warns when unset
    p = subprocess.run([sys.executable, "-c", WORKER, str(ROOT), json.dumps(JOBS)], capture_output=True, text=True,
                       env=env, timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"compile worker failed:\n{p.stderr[-3000:]}"
    return {_id(j): r for j, r in zip(JOBS, json.loads(lines[-1][7:]), strict=True)}


@pytest.mark.parametrize("job", JOBS, ids=[_id(j) for j in JOBS])
def test_fused_norm_kernels_compile(report, job):
    target, backend, _arch, _warp, module, kwargs = job
    copy_only = module == "linear.cat_fp8_rows"  # no norm, no 16-bit conversion: the rows are the point
    for r in report[_id(job)]:
        assert r["ok"], f"{r['kernel']} on {target}: {r.get('error')}"
        assert r["elf"], f"{r['kernel']} on {target}: no ELF binary"
        if backend != "cuda":
            continue
        ptx = r["ptx"]
        assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx), "the row is not loaded in 16-byte vectors"
        assert re.search(r"st\.global(\.\w+)*\.v4\.b32", ptx), "the row is not stored in 16-byte vectors"
        assert ".local" not in ptx, "the row spills to local memory"
        if kwargs.get("norm", True) and not copy_only:
            assert "rsqrt.approx" in ptx
        if kwargs["dtype"] == "bf16" and NVIDIA[target] >= 80 and not copy_only:
            assert "cvt.rn.bf16" in ptx, "bf16 outputs must round to nearest"
        if kwargs.get("round_product"):
            # Flux's y * gate is rounded to bf16 on its bits (kernel_common.round_unfused): a
            # plain round trip through bf16 would be contracted with the residual add into one
            # bf16 FMA, one rounding where ComfyUI's two ops round twice.
            assert re.search(r"and\.b32\s+%r\d+, %r\d+, -65536;", ptx), "the product is not rounded on its bits"
        if kwargs.get("fp8_rows") or copy_only:
            # e4m3 by the hardware's saturating round-to-nearest conversion, the scale by an
            # IEEE division (quantize_activation's bits).
            assert re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx), "no e4m3 conversion"
            assert re.search(r"div\.rn\.f32", ptx), "the scale's division is not correctly rounded"
        if r["kernel"] in ("_rms_norm_rope", "_qk_rms_norm_rope"):
            # Every load is a vector: the rope table too (as gathers of 4-byte coefficients it
            # was 64 scalar loads per thread and the kernel ran at half the LayerNorm's GB/s).
            # The QK kernel's [D] norm weights (256 bytes each, from L1) may load as 2-byte scalars.
            scalar = [ld for ld in re.findall(r"ld\.global[.\w]*", ptx) if ".v2." not in ld and ".v4." not in ld
                      and not (r["kernel"] == "_qk_rms_norm_rope" and ld.endswith(".b16"))]
            assert not scalar, f"{len(scalar)} scalar loads"
