"""The INT8 attention kernels (kernels/attention/int8.py and its quantiser) compile for every
NVIDIA target the registry serves, with the intended tensor-core instructions in the PTX, and
the FP8 P.V variant is refused below sm_89; without a GPU:
triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32)).

What the attention kernel's PTX must show (every matrix instruction is one of these two):
- Q.K^T in INT8 with int32 accumulation: `mma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32`
  on sm_80/86/89/120 (Triton emits the .satfinite form; the sums cannot reach it,
  |S| <= 127 * 127 * 128 < 2**31), `wgmma.mma_async ... k32.s32.s8.s8` on sm_90, and Turing's
  `mma.sync.aligned.m8n8k16.row.col.satfinite.s32.s8.s8.s32` on sm_75 (Triton 3.2);
- P.V accumulating in FP16: `mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16` (fp16 P.V;
  m16n8k8 on sm_75) or `mma.sync.aligned.m16n8k32.row.col.f16.e4m3.e4m3.f16` (fp8 P.V on
  sm_89/120); on sm_90 `wgmma ... k16.f16.f16.f16` / `wgmma ... k32.f16.e4m3.e4m3` (an f16
  accumulator). An f32-accumulating P.V would show as `.f32.f16.f16.f32` / `.f32.e4m3`.
sm_75 needs Triton <= 3.2 (gpu_rules), so it is compiled with the Triton 3.2 that the version
matrix (tests/versions/) keeps in .cache/triton-versions/triton-3.2; the FP8 P.V's Triton 3.5
floor (attention_int8.PV_FP8_MIN_TRITON) is shown with its Triton 3.4. Those tests skip, with
that reason, when the release is not there. Under TRITON_INTERPRET=1 (tests/conftest.py) @triton.jit gives
interpreter functions that cannot be compiled, so subprocesses with the variable unset compile
every case (one worker per core) and report JSON; the tests assert on that report.
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
TRITON_34 = ROOT / ".cache" / "triton-versions" / "triton-3.4"
SMEM_LIMIT = {75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448, 120: 101376}
FAMILY = {75: "sm75", 80: "sm80", 86: "sm86", 89: "sm89", 90: "sm90", 120: "sm120"}

# (cc, pv, dtype, head_dim, which kernels): all four kernels where a config or the quantiser's
# V layout differs, the attention kernel alone elsewhere; head dims 64, 80 and 96 (padded to
# 128) and 128.
GOOD = [(80, "fp16", "bf16", 128, "all"), (86, "fp16", "fp16", 64, "attn"), (86, "fp16", "bf16", 80, "attn"),
        (89, "fp16", "bf16", 128, "attn"), (89, "fp8", "fp16", 128, "all"), (90, "fp16", "bf16", 128, "all"),
        (90, "fp8", "bf16", 128, "attn"), (120, "fp8", "bf16", 128, "attn"), (120, "fp16", "fp16", 96, "attn")]
BAD = [(80, "fp8", "bf16", 128, "attn"), (86, "fp8", "fp16", 64, "attn")]
GOOD_32 = [(75, "fp16", "fp16", 64, "all"), (75, "fp16", "fp16", 128, "attn")]
BAD_32 = [(75, "fp8", "fp16", 64, "attn")]
# Why attention_int8.PV_FP8_MIN_TRITON is 3.5: Triton 3.4 cannot lower the fp8 P.V on sm_89 and
# upcasts it to an f16 MMA on sm_120.
FP8_PV_34 = [(89, "fp8", "fp16", 128, "attn"), (120, "fp8", "fp16", 128, "attn")]

QK = {"mma": r"mma\.sync\.aligned\.m16n8k32\.row\.col\.satfinite\.s32\.s8\.s8\.s32",
      "wgmma": r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.s32\.s8\.s8",
      "turing": r"mma\.sync\.aligned\.m8n8k16\.row\.col\.satfinite\.s32\.s8\.s8\.s32"}
PV = {("mma", "fp16"): r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f16\.f16\.f16\.f16",
      ("mma", "fp8"): r"mma\.sync\.aligned\.m16n8k32\.row\.col\.f16\.e4m3\.e4m3\.f16",
      ("wgmma", "fp16"): r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f16\.f16\.f16",
      ("wgmma", "fp8"): r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f16\.e4m3\.e4m3",
      ("turing", "fp16"): r"mma\.sync\.aligned\.m16n8k8\.row\.col\.f16\.f16\.f16\.f16"}

WORKER = r"""
import importlib, importlib.util, json, os, re, sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

root, jobs, families = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])

def load():
    name = "triton_accel_compile"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, "__init__.py"),
                                                      submodule_search_locations=[root])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return importlib.import_module(name + ".kernels.attention.int8")

def source(fn, sig, const, attrs):
    import triton
    from triton.compiler import ASTSource
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 3):
        return ASTSource(fn, sig, const, attrs)
    # Triton 3.2: runtime arguments only in the signature, 1-valued ints and divisibility as hints.
    from triton.backends.compiler import AttrsDescriptor
    names, signature, hints = list(sig), {}, {}
    for p in fn.params:
        if p.is_constexpr:
            continue
        value = const.get(p.name, "runtime")
        signature[p.name] = sig[p.name] if sig[p.name] != "constexpr" else "i32"
        if value == 1 and not isinstance(value, bool):
            hints[p.num] = 1
    for (idx,), _ in attrs.items():
        hints[fn.arg_names.index(names[idx])] = 16
    return ASTSource(fn, signature, dict(const), AttrsDescriptor.from_hints(hints))

def compile_job(job):
    cc, pv, dtype, d, which = job
    int8 = load()
    import triton
    from triton.backends.compiler import GPUTarget
    base = int8.INT8_CONFIGS[int8.family_in(int8.INT8_CONFIGS, families[str(cc)])]
    cfg = int8.config_for(base, d)
    out = []
    for name, fn, sig, const, attrs, warps in int8.compile_specs(dtype, d, cfg, pv):
        if which == "attn" and name != "_attn_int8_fwd":
            continue
        try:
            k = triton.compile(source(fn, sig, const, attrs), target=GPUTarget("cuda", cc, 32),
                               options=dict(num_warps=warps, num_stages=cfg["num_stages"]))
            ptx = k.asm["ptx"]
            mma = Counter(re.findall(r"\b(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", ptx))
            out.append(dict(kernel=name, ok=True, cubin=len(k.asm.get("cubin", b"")), shared=k.metadata.shared,
                            mma=dict(mma), local="ld.local" in ptx or "st.local" in ptx))
        except Exception as e:
            out.append(dict(kernel=name, ok=False, error=f"{type(e).__name__}: {e}"[-600:]))
    return out

if __name__ == "__main__":
    load()
    import triton
    with ProcessPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as ex:
        results = list(ex.map(compile_job, [tuple(j) for j in jobs]))
    print("RESULT " + json.dumps(dict(triton=triton.__version__, results=results)))
"""


def _compile(jobs, pythonpath=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton >= 3.9 warns when unset
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    p = subprocess.run([sys.executable, "-c", WORKER, str(ROOT), json.dumps(jobs), json.dumps(FAMILY)],
                       capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"compile worker failed:\n{p.stderr[-3000:]}"
    report = json.loads(lines[-1][7:])
    return report["triton"], dict(zip(map(tuple, jobs), report["results"]))


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("triton")
    return _compile(GOOD + BAD)[1]


@pytest.fixture(scope="module")
def report_32():
    if not (TRITON_32 / "triton").is_dir():
        pytest.skip(f"Triton 3.2 (the last with sm_75) is not in {TRITON_32}: "
                    "tests/versions/test_triton_versions.py installs it there")
    version, results = _compile(GOOD_32 + BAD_32, TRITON_32)
    assert version.startswith("3.2."), f"the subprocess imported Triton {version}, not 3.2"
    return results


@pytest.fixture(scope="module")
def report_34():
    if not (TRITON_34 / "triton").is_dir():
        pytest.skip(f"Triton 3.4 is not in {TRITON_34}: tests/versions/test_triton_versions.py installs it there")
    version, results = _compile(FP8_PV_34, TRITON_34)
    assert version.startswith("3.4."), f"the subprocess imported Triton {version}, not 3.4"
    return results


def _ids(jobs):
    return [f"sm{j[0]}-pv_{j[1]}-{j[2]}-d{j[3]}" for j in jobs]


def _check_compiled(results, job):
    # The FP8 P.V's V-mean correction is a launch of its own (attention_fp8_quant._v_mean_fix_kernel).
    fix = ["_v_mean_fix_kernel"] if job[1] == "fp8" else []
    expected = ["_attn_int8_fwd"] if job[4] == "attn" else [
        "fp8_stats_kernel", "_int8_finalize_kernel", "_int8_quant_kernel", *fix, "_attn_int8_fwd"]
    assert [r["kernel"] for r in results] == expected
    for r in results:
        assert r["ok"], r.get("error")
        assert r["cubin"] > 0, f"{r['kernel']}: no binary"
        assert r["shared"] <= SMEM_LIMIT[job[0]], f"{r['kernel']} needs {r['shared']} B of shared memory"
        assert not r["local"], f"{r['kernel']} spills to local memory"


def _check_instructions(results, job, kind):
    mma = next(r for r in results if r["kernel"] == "_attn_int8_fwd")["mma"]
    qk = [i for i in mma if re.fullmatch(QK[kind], i)]
    pv = [i for i in mma if re.fullmatch(PV[(kind, job[1])], i)]
    assert qk, f"no INT8 Q.K instruction ({QK[kind]}) in {mma}"
    assert pv, f"no FP16-accumulating P.V instruction ({PV[(kind, job[1])]}) in {mma}"
    assert set(qk) | set(pv) == set(mma), f"other matrix instructions: {mma}"


@pytest.mark.parametrize("job", GOOD, ids=_ids(GOOD))
def test_compiles_within_shared_memory(report, job):
    _check_compiled(report[job], job)


@pytest.mark.parametrize("job", GOOD, ids=_ids(GOOD))
def test_int8_qk_and_fp16_accumulating_pv_in_the_ptx(report, job):
    _check_instructions(report[job], job, "wgmma" if job[0] == 90 else "mma")


def test_instruction_counts_per_key_tile_sm86(report):
    """sm_86, d64, 4 warps, 128x64 tiles: per key tile Q.K^T is 8 x 8 m16n8 tiles x 2 k-steps
    of 32 and P.V 8 x 8 tiles x 4 k-steps of 16, over 4 warps; the hot loop and the partial
    last tile each have a copy."""
    mma = next(r for r in report[(86, "fp16", "fp16", 64, "attn")] if r["kernel"] == "_attn_int8_fwd")["mma"]
    assert sum(v for i, v in mma.items() if re.fullmatch(QK["mma"], i)) == 2 * 8 * 8 * 2 // 4
    assert sum(v for i, v in mma.items() if re.fullmatch(PV[("mma", "fp16")], i)) == 2 * 8 * 8 * 4 // 4


@pytest.mark.parametrize("job", BAD, ids=_ids(BAD))
def test_fp8_pv_refused_below_sm89(report, job):
    for r in report[job]:
        assert not r["ok"], f"{r['kernel']} compiled for sm_{job[0]}"
        assert "fp8e4nv" in r["error"], r["error"]


@pytest.mark.parametrize("job", GOOD_32, ids=_ids(GOOD_32))
def test_turing_with_triton_32(report_32, job):
    _check_compiled(report_32[job], job)
    _check_instructions(report_32[job], job, "turing")


@pytest.mark.parametrize("job", BAD_32, ids=_ids(BAD_32))
def test_fp8_pv_refused_on_turing_with_triton_32(report_32, job):
    for r in report_32[job]:
        assert not r["ok"], f"{r['kernel']} compiled for sm_{job[0]}"
        assert "fp8e4nv" in r["error"], r["error"]


def test_fp8_pv_needs_triton_35(report_34):
    """The compile facts behind attention_int8.PV_FP8_MIN_TRITON: if a Triton 3.4 ever builds
    the e4m3 P.V with an FP16 accumulator, the rule can go."""
    sm89 = report_34[FP8_PV_34[0]][0]
    assert not sm89["ok"], "Triton 3.4 compiled the fp8 P.V for sm_89"
    sm120 = report_34[FP8_PV_34[1]][0]
    assert sm120["ok"], sm120.get("error")
    assert not any("e4m3" in i for i in sm120["mma"]), sm120["mma"]
    assert any(re.fullmatch(PV[("mma", "fp16")], i) for i in sm120["mma"]), sm120["mma"]
