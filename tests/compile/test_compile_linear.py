"""Every Linear method's kernels (kernels/linear/fp8.py, linear_int8.py, linear_fp8_weight_only.py)
compile for their targets with the intended tensor-core instruction in the PTX, without a GPU:
triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32)) with the shipped configs.

- fp8_w8a8: e4m3 wgmma on sm_90, e4m3 mma.sync on sm_89 / sm_120;
- int8_w8a8: mma.sync s8 x s8 -> s32 on sm_80 / 86 / 89 / 120 (m16n8k32) and on sm_75
  (m8n8k16, Triton 3.2, the last release with Turing), wgmma s8 on sm_90; the activation
  quantisation's Hadamard rotation is an f16 / bf16 mma;
- fp8_weight_only: f16 / bf16 mma.sync with f32 accumulation on sm_80 / 86 and no e4m3
  conversion at all: no Triton from 3.2 to 3.9 accepts fp8e4nv below sm_89 ("type fp8e4nv not
  supported in this architecture", checked 2026-12-02 for every release in
  tests/versions/version_matrix.RELEASES), so the kernel decodes the bytes with integer shifts.

Under TRITON_INTERPRET=1 (tests/conftest.py) @triton.jit gives interpreter functions, so one
subprocess with the variable unset compiles every case (one worker per core) and reports
JSON. The Triton 3.2 cases run with .cache/triton-versions/triton-3.2 first on PYTHONPATH
(installed by tests/versions/) and skip with the reason when it is not there.
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
TRITON_32 = ROOT / ".cache" / "triton-versions" / "triton-3.2"

SMEM_LIMIT = {75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448, 120: 101376}
FP8_MMA = {90: r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3",
           89: r"mma\.sync\.aligned\.m16n8k32\.row\.col\.f32\.e4m3\.e4m3\.f32",
           120: r"mma\.sync\.aligned\.m16n8k32\.row\.col\.f32\.e4m3\.e4m3\.f32"}
INT8_MMA_SYNC = r"mma\.sync\.aligned\.m16n8k32\.row\.col(\.satfinite)?\.s32\.s8\.s8\.s32"
INT8_MMA = {75: r"mma\.sync\.aligned\.m8n8k16\.row\.col(\.satfinite)?\.s32\.s8\.s8\.s32",
            80: INT8_MMA_SYNC, 86: INT8_MMA_SYNC, 89: INT8_MMA_SYNC, 120: INT8_MMA_SYNC,
            90: r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.s32\.s8\.s8"}
PTX_DTYPE = {"fp16": "f16", "bf16": "bf16"}

# (module, compile_specs kwargs, cc, config family)
CURRENT = [
    ("linear.fp8", {"out_dtype": "bf16", "has_bias": True, "tma": True}, 90, "sm90"),
    ("linear.fp8", {"out_dtype": "bf16", "has_bias": True}, 89, "sm89"),
    ("linear.fp8", {"out_dtype": "fp16", "has_bias": False}, 120, "sm120"),
    ("linear.int8", {"in_dtype": "bf16", "out_dtype": "bf16"}, 80, "sm80"),
    ("linear.int8", {"in_dtype": "fp16", "out_dtype": "fp16", "has_bias": False}, 86, "sm86"),
    ("linear.int8", {"in_dtype": "bf16", "out_dtype": "bf16"}, 89, "sm89"),
    ("linear.int8", {"in_dtype": "bf16", "out_dtype": "bf16"}, 90, "sm90"),
    ("linear.int8", {"in_dtype": "fp16", "out_dtype": "bf16", "rotation": 0}, 120, "sm120"),
    ("linear.fp8_weight_only", {"in_dtype": "bf16", "out_dtype": "bf16"}, 80, "sm80"),
    ("linear.fp8_weight_only", {"in_dtype": "fp16", "out_dtype": "fp16"}, 86, "sm86"),
    ("linear.fp8_weight_only", {"in_dtype": "bf16", "out_dtype": "fp16", "has_bias": False}, 86, "sm86"),
    # The GELU epilogue (kernels.linear.dispatch's activation="gelu_tanh"), one case per GEMM: act 2,
    # the tanh.approx.f32 form NVIDIA launches with 16-bit outputs; act 1, the exp2 form (fp32
    # outputs).
    ("linear.fp8", {"out_dtype": "bf16", "has_bias": True, "tma": True, "act": 2}, 90, "sm90"),
    ("linear.fp8", {"out_dtype": "fp32", "has_bias": True, "tma": True, "act": 1}, 90, "sm90"),
    ("linear.fp8", {"out_dtype": "fp16", "has_bias": True, "act": 2}, 120, "sm120"),
    ("linear.int8", {"in_dtype": "fp16", "out_dtype": "fp16", "act": 2}, 86, "sm86"),
    ("linear.fp8_weight_only", {"in_dtype": "bf16", "out_dtype": "bf16", "act": 2}, 80, "sm80"),
]
TRITON32 = [
    ("linear.int8", {"in_dtype": "fp16", "out_dtype": "fp16"}, 75, "sm75"),
    ("linear.int8", {"in_dtype": "bf16", "out_dtype": "bf16"}, 80, "sm80"),
    ("linear.fp8_weight_only", {"in_dtype": "fp16", "out_dtype": "fp16"}, 80, "sm80"),
    ("linear.fp8_weight_only", {"in_dtype": "bf16", "out_dtype": "bf16"}, 86, "sm86"),
    ("linear.int8", {"in_dtype": "fp16", "out_dtype": "fp16", "act": 2}, 75, "sm75"),
]
# Other Triton releases users run (tests/versions/ installs them): one case per method and MMA
# kind. 3.3 (first with sm_120), 3.5 (torch 2.9's), 3.6 (the H200's), 3.8 (newest triton-windows);
# 3.4 and 3.7 passed the same cases by hand on 2026-12-02 and are left out for time (each
# release costs ~15 s of CPU). Triton 3.5-3.7 rejected the int8 GEMM until its tl.dot named
# out_dtype=int32.
OTHER_VERSIONS = ("3.3", "3.5", "3.6", "3.8")
PER_VERSION = [
    ("linear.fp8", {"out_dtype": "bf16", "has_bias": True}, 89, "sm89"),
    ("linear.int8", {"in_dtype": "bf16", "out_dtype": "bf16"}, 80, "sm80"),
    ("linear.int8", {"in_dtype": "fp16", "out_dtype": "fp16"}, 90, "sm90"),
    ("linear.fp8_weight_only", {"in_dtype": "bf16", "out_dtype": "bf16"}, 86, "sm86"),
    ("linear.fp8", {"out_dtype": "bf16", "has_bias": True, "act": 2}, 89, "sm89"),
    # activation_out's masked copy (the TMA copy needs host descriptors, 3.4+: the installed
    # Triton's compile in test_compile_linear_fp8.py, and the H200 run on 3.6).
    ("linear.fp8", {"out_dtype": "bf16", "has_bias": True, "act": 2, "split": True}, 89, "sm89"),
]
CONFIG_TABLE = {"linear.fp8": "LINEAR_FP8_CONFIGS", "linear.int8": "LINEAR_INT8_CONFIGS",
                "linear.fp8_weight_only": "LINEAR_FP8_WO_CONFIGS"}

WORKER = r"""
import importlib, importlib.util, json, os, sys, time
from concurrent.futures import ProcessPoolExecutor

root, tables, jobs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])

def load():
    name = "triton_accel_compile"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, "__init__.py"),
                                                      submodule_search_locations=[root])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    # Triton 3.2's ASTSource takes another signature: the version matrix's converter.
    cspec = importlib.util.spec_from_file_location("child_compile",
                                                   os.path.join(root, "tests", "versions", "child_compile.py"))
    child = importlib.util.module_from_spec(cspec)
    cspec.loader.exec_module(child)
    return name, child

def compile_job(job):
    module, kwargs, cc, family = job
    name, child = load()
    mod = importlib.import_module(f"{name}.kernels.{module}")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    legacy = tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 3)
    cfg = getattr(mod, tables[module])[mod.config_family(family)]
    out = []
    for fn, sig, const, attrs, opts in mod.compile_specs(cfg, **kwargs):
        kname = fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__
        try:
            k = triton.compile(child._source(ASTSource, fn, sig, const, attrs, legacy),
                               target=GPUTarget("cuda", cc, 32), options=opts)
            out.append(dict(kernel=kname, ok=True, cubin=len(k.asm.get("cubin", b"")), shared=k.metadata.shared,
                            ptx=k.asm.get("ptx", ""), triton=triton.__version__))
        except Exception as e:
            out.append(dict(kernel=kname, ok=False, error=child._error_line(e)))
    return out

if __name__ == "__main__":
    load()
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as ex:
        results = list(ex.map(compile_job, [tuple(j) for j in jobs]))
    print("RESULT " + json.dumps(results))
"""


def _compile(jobs, pythonpath=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton >= 3.9 warns when unset
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    p = subprocess.run([sys.executable, "-c", WORKER, str(ROOT), json.dumps(CONFIG_TABLE), json.dumps(jobs)],
                       capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"compile worker failed:\n{p.stderr[-3000:]}"
    return {_id(j): r for j, r in zip(jobs, json.loads(lines[-1][7:]), strict=True)}


def _id(job):
    module, kwargs, cc, _family = job
    return f"{module}-sm{cc}-" + "-".join(f"{k}={v}" for k, v in sorted(kwargs.items()))


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("triton")
    return _compile(CURRENT)


@pytest.fixture(scope="module")
def report_32():
    if not (TRITON_32 / "triton").is_dir():
        pytest.skip(f"Triton 3.2 not installed at {TRITON_32} (tests/versions/version_matrix.py 3.2 installs it)")
    return _compile(TRITON32, TRITON_32)


def _check(job, results):
    module, kwargs, cc, _family = job
    for r in results:
        assert r["ok"], f"{r['kernel']}: {r.get('error')}"
        assert r["cubin"] > 0, f"{r['kernel']}: no binary"
        assert r["shared"] <= SMEM_LIMIT[cc], f"{r['kernel']} needs {r['shared']} B of shared memory on sm_{cc}"
    gemm = results[-1]["ptx"]
    if module == "linear.fp8":
        assert re.search(FP8_MMA[cc], gemm), f"no e4m3 MMA ({FP8_MMA[cc]}) in the sm_{cc} PTX"
        # Triton <= 3.8 converts through f16x2 (a double rounding that only moves ties), 3.9 from f32.
        assert re.search(r"cvt\.rn\.satfinite\.e4m3x2\.(f32|f16x2)", results[0]["ptx"]), \
            "quantisation lost its e4m3 cvt"
    elif module == "linear.int8":
        quant, name = results[0], [r["kernel"] for r in results]
        assert name == ["_quant_rows_int8", "_int8_linear"]
        assert re.search(INT8_MMA[cc], gemm), f"no int8 MMA ({INT8_MMA[cc]}) in the sm_{cc} PTX"
        assert "f32.e4m3" not in gemm and ".f16.f16" not in gemm and ".bf16.bf16" not in gemm
        if kwargs.get("rotation", 128):
            t = PTX_DTYPE[kwargs["in_dtype"]]
            assert re.search(rf"mma\.sync\.aligned\.m16n8k(8|16)\.row\.col\.f32\.{t}\.{t}\.f32", quant["ptx"]), \
                "the Hadamard rotation is not a tensor-core dot"
        else:
            assert "mma" not in quant["ptx"]
    else:
        t = PTX_DTYPE[kwargs["in_dtype"]]
        assert re.search(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{t}\.{t}\.f32", gemm), \
            f"no {t} MMA with f32 accumulation in the sm_{cc} PTX"
        assert "e4m3" not in gemm, "weight-only must decode e4m3 bytes itself below sm_89"
        assert re.search(r"shl\.b(16|32)", gemm), "the e4m3 byte decode (shifts) is missing"
    if cc != 90:
        assert "wgmma" not in gemm
    # The GELU epilogue: one tanh.approx (act 2) or one exp2 (act 1) per element, only when asked for.
    act = kwargs.get("act", 0)
    assert bool(re.search(r"tanh\.approx\.f32", gemm)) == (act == 2), f"act {act}: tanh.approx"
    assert bool(re.search(r"ex2\.approx", gemm)) == (act == 1), f"act {act}: ex2.approx"


@pytest.mark.parametrize("job", CURRENT, ids=[_id(j) for j in CURRENT])
def test_compiles_with_intended_mma(report, job):
    _check(job, report[_id(job)])


@pytest.mark.parametrize("job", TRITON32, ids=[_id(j) for j in TRITON32])
def test_compiles_with_triton_3_2(report_32, job):
    results = report_32[_id(job)]
    assert all(r.get("triton", "3.2").startswith("3.2") for r in results if r["ok"])
    _check(job, results)


@pytest.mark.parametrize("version", OTHER_VERSIONS)
def test_compiles_with_other_triton_releases(version):
    folder = ROOT / ".cache" / "triton-versions" / f"triton-{version}"
    if not (folder / "triton").is_dir():
        pytest.skip(f"Triton {version} not installed at {folder} (tests/versions/version_matrix.py installs it)")
    report = _compile(PER_VERSION, folder)
    for job in PER_VERSION:
        results = report[_id(job)]
        assert all(r["triton"].startswith(version) for r in results if r["ok"])
        _check(job, results)
