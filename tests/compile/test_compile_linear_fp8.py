"""The FP8 Linear kernels (kernels/linear/fp8.py) compile for sm_89 / sm_90 / sm_120 with the
FP8 MMA in their PTX, and are refused below sm_89, without a GPU:
triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32)).

Under TRITON_INTERPRET=1 (set by tests/conftest.py) @triton.jit gives interpreter functions
that cannot be compiled, so one subprocess with the variable unset compiles every case (one
worker per core) and reports JSON; the tests assert on that report.
"""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
lf = importlib.import_module("triton_accel.kernels.linear.fp8")
device_mod = importlib.import_module("triton_accel.kernels.core.device")

SMEM_LIMIT = {89: 101376, 90: 232448, 120: 101376}  # bytes one block may use, per target
# The e4m3 x e4m3 -> fp32 tensor-core instruction each target must use: Hopper's
# asynchronous warpgroup MMA, Ada's / consumer Blackwell's warp-level mma.sync.
FP8_MMA = {90: r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3",
           89: r"mma\.sync\.aligned\.m16n8k32\.row\.col\.f32\.e4m3\.e4m3\.f32",
           120: r"mma\.sync\.aligned\.m16n8k32\.row\.col\.f32\.e4m3\.e4m3\.f32"}

# (cc, family whose config is built, tma, out dtype, bias): the shipped config of every target,
# sm_90's pointer variant too (its fallback where a tensor is not TMA-aligned), fp16 output.
GOOD = [(90, "sm90", True, "bf16", True), (90, "sm90", False, "fp16", False),
        (89, "sm89", False, "bf16", True), (120, "sm120", False, "fp16", True),
        # linear_bench.py's sweep options: the flattened persistent loop with a split epilogue.
        (90, "sm90", True, "bf16", True, {"FLATTEN": True, "EPILOGUE_SUBTILE": True, "num_stages": 4})]
# The GELU epilogue with its contiguous copy of the activated columns (SPLIT_ACT: Flux's
# single blocks), every target's shipped config: a second TMA store per activated half-tile
# must still fit sm_90's shared memory.
SPLIT = [(90, "sm90", True, "bf16", True, {"SPLIT": True}), (90, "sm90", False, "bf16", True, {"SPLIT": True}),
         (89, "sm89", False, "bf16", True, {"SPLIT": True}), (120, "sm120", False, "fp16", True, {"SPLIT": True})]
GOOD += SPLIT
# The split tail (tail_split): sm_90's shipped tile with 3 slices (Flux's 4608 x 3072 outputs)
# and 8 (the most), with the GELU epilogue; sm_89's pointer kernel with 2.
TAIL = [(90, "sm90", True, "bf16", True, {"SPLIT_K": 3}), (90, "sm90", True, "bf16", True, {"SPLIT_K": 8}),
        (90, "sm90", True, "bf16", True, {"SPLIT_K": 3, "ACT": 2}), (89, "sm89", False, "bf16", True, {"SPLIT_K": 2})]
GOOD += TAIL
BAD = [(80, "sm89", False, "bf16", True), (86, "sm89", False, "bf16", False)]

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
    return importlib.import_module(name + ".kernels.linear.fp8")

def compile_job(job):
    cc, family, tma, out_dtype, bias = job[:5]
    lf = load()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    cfg = dict(lf.LINEAR_FP8_CONFIGS[lf.config_family(family)], **(job[5] if len(job) > 5 else {}))
    split = cfg.pop("SPLIT", False)
    split_k = cfg.pop("SPLIT_K", 1)
    act = cfg.pop("ACT", 1 if split else 0)
    sys.path.insert(0, os.path.join(root, "tests", "compile"))
    from compile_report import disassemble, spills
    out = []
    for fn, sig, const, attrs, opts in lf.compile_specs(cfg, out_dtype, bias, tma, act=act, split=split,
                                                        split_k=split_k):
        name = fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__
        try:
            k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", cc, 32), options=opts)
            sass = disassemble(k.asm["cubin"], triton) if split_k > 1 else None
            out.append(dict(kernel=name, ok=True, cubin=len(k.asm.get("cubin", b"")), shared=k.metadata.shared,
                            ptx=k.asm.get("ptx", ""), spills=None if sass is None else spills(sass)))
        except Exception as e:
            out.append(dict(kernel=name, ok=False, error=f"{type(e).__name__}: {e}"[-600:]))
    return out

if __name__ == "__main__":
    load()
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as ex:
        results = list(ex.map(compile_job, [tuple(j) for j in jobs]))
    print("RESULT " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton >= 3.9 warns when unset
    jobs = GOOD + BAD
    p = subprocess.run([sys.executable, "-c", WORKER, str(ROOT), json.dumps(jobs)], capture_output=True,
                       text=True, env=env, timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"compile worker failed:\n{p.stderr[-3000:]}"
    return dict(zip(map(_key, jobs), json.loads(lines[-1][7:])))


def _key(job):
    return tuple(json.dumps(x, sort_keys=True) if isinstance(x, dict) else x for x in job)


def _ids(jobs):
    def extra(j):
        if len(j) <= 5:
            return ""
        if j[5].get("SPLIT_K"):
            return f"-tail{j[5]['SPLIT_K']}" + ("-gelu" if j[5].get("ACT") else "")
        return "-split-act" if j[5].get("SPLIT") else "-flat-sub"
    return [f"sm{j[0]}-{'tma' if j[2] else 'ptr'}-{j[3]}{'-bias' if j[4] else ''}{extra(j)}" for j in jobs]


@pytest.mark.parametrize("job", GOOD, ids=_ids(GOOD))
def test_compiles_with_fp8_mma(report, job):
    cc = job[0]
    results = report[_key(job)]
    assert [r["kernel"] for r in results] == ["quant_rows_fp8", "_fp8_linear_tma" if job[2] else "_fp8_linear_ptr"]
    for r in results:
        assert r["ok"], r.get("error")
        assert r["cubin"] > 0, f"{r['kernel']}: no binary"
        assert r["shared"] <= SMEM_LIMIT[cc], f"{r['kernel']} needs {r['shared']} B of shared memory"
    quant, gemm = results
    assert re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", quant["ptx"]), "quantisation lost its e4m3 conversion"
    assert re.search(FP8_MMA[cc], gemm["ptx"]), f"no e4m3 MMA ({FP8_MMA[cc]}) in the sm_{cc} PTX"
    if cc != 90:
        assert "wgmma" not in gemm["ptx"]
    if job[2]:
        assert "cp.async.bulk.tensor" in gemm["ptx"], "TMA variant without TMA loads"
    if len(job) > 5 and job[5].get("SPLIT"):
        # The activated copy's own stores: TMA (two half-tiles beside the output's two) or masked ones.
        if job[2]:
            stores = re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", gemm["ptx"])
            assert len(stores) >= 4, f"{len(stores)} TMA stores: the activated copy is not stored"
        else:
            assert len(re.findall(r"st\.global", gemm["ptx"])) > 0


@pytest.mark.parametrize("job", TAIL, ids=_ids(TAIL))
def test_split_tail_compiles_without_spills(report, job):
    """The split tail adds one arrival counter (an acquire-release atomic behind a CTA barrier),
    the partial's stores and the last slice's L1-bypassing loads, and no shared memory: sm_90's
    tile keeps the unsplit launch's 3-stage ring, and no register spills (the partials are
    summed 32 or 16 rows at a time, tail_rows)."""
    results = report[_key(job)]
    gemm = results[-1]
    assert gemm["ok"], gemm.get("error")
    whole = report[_key(GOOD[0] if job[0] == 90 else GOOD[2])][-1]
    assert gemm["shared"] == whole["shared"], (gemm["shared"], whole["shared"])
    ptx = gemm["ptx"]
    assert re.search(r"atom\.global\.(gpu\.acq_rel|acq_rel\.gpu)\.add\.u32", ptx), "no acquire-release arrival counter"
    assert "bar.sync" in ptx or "barrier.sync" in ptx
    assert len(re.findall(r"ld\.global\.cg", ptx)) >= job[5]["SPLIT_K"], "partials read through L1"
    assert re.search(r"atom\.global\.[a-z_.]*exch\.b32", ptx), "the counter is not zeroed for the next launch"
    if gemm["spills"] is None:
        pytest.skip("no cuobjdump beside this Triton")
    assert gemm["spills"] == 0, gemm["spills"]


@pytest.mark.parametrize("job", BAD, ids=_ids(BAD))
def test_triton_refuses_fp8_below_sm89(report, job):
    gemm = report[_key(job)][-1]
    assert not gemm["ok"], f"FP8 GEMM compiled for sm_{job[0]}"
    assert "fp8e4nv" in gemm["error"], gemm["error"]


@pytest.mark.parametrize("cc", [75, 80, 86])
def test_launcher_refuses_below_sm89(monkeypatch, cc):
    major, minor = divmod(cc, 10)
    name = {75: "Tesla T4", 80: "NVIDIA A100-SXM4-80GB", 86: "NVIDIA GeForce RTX 3090"}[cc]
    info = device_mod.DeviceInfo("cuda", "nvidia", name, (major, minor), f"sm{cc}")
    monkeypatch.setattr(lf._device, "describe", lambda device=None: info)
    with pytest.raises(lf.Fp8LinearUnsupportedError) as e:
        lf._check_device(torch.device("cuda", 0))
    assert e.value.reason == f"FP8 tensor cores need sm_89+ ({name} is sm_{cc})"


@pytest.mark.parametrize("cc", [89, 90, 120])
def test_launcher_accepts_sm89_and_newer(monkeypatch, cc):
    major, minor = divmod(cc, 10)
    info = device_mod.DeviceInfo("cuda", "nvidia", f"gpu sm{cc}", (major, minor), f"sm{cc}")
    monkeypatch.setattr(lf._device, "describe", lambda device=None: info)
    assert lf._check_device(torch.device("cuda", 0)) is False  # False: not the interpreter
    assert lf.config_family(f"sm{cc}") == ("sm90" if cc == 90 else "sm89")


def test_launcher_refuses_amd(monkeypatch):
    info = device_mod.DeviceInfo("cuda", "amd", "AMD Instinct MI300X", (9, 4), "gfx942")
    monkeypatch.setattr(lf._device, "describe", lambda device=None: info)
    with pytest.raises(lf.Fp8LinearUnsupportedError, match="fnuz"):
        lf._check_device(torch.device("cuda", 0))
