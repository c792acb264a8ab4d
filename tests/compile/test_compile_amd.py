"""Every kernel gpu_rules lets run on AMD compiles for its gfx targets with the intended matrix
instruction in the AMDGCN assembly, without a GPU: triton.compile(ASTSource(...),
target=GPUTarget("hip", arch, warp size)), with the configs the launchers pick on AMD.

Targets, one per family gpu_rules.amd_family knows (gpu_rules.AMD_COMPILE_TARGETS):
gfx942 (CDNA3, MI300, wave64), gfx950 (CDNA4, MI350, wave64), gfx1100 (RDNA3, wave32),
gfx1201 (RDNA4, wave32). What the assembly must show (Triton 3.9, checked 2026-12-03):
- FP16/BF16 dots: `v_mfma_f32_32x32x8_{f16,bf16}` (gfx942; gfx950 also its 32x32x16 forms),
  `v_wmma_f32_16x16x16_{f16,bf16}` (gfx11 and gfx12);
- INT8 dots: `v_mfma_i32_32x32x16_i8` (gfx942), `v_mfma_i32_32x32x32_i8` (gfx950),
  `v_wmma_i32_16x16x16_iu8` (gfx11/12);
- OCP FP8 (float8_e4m3fn) dots: `v_mfma_f32_32x32x64_f8f6f4` / `v_mfma_f32_32x32x16_fp8_fp8`
  (gfx950, which reads OCP e4m3 in the latter), `v_wmma_f32_16x16x16_fp8_fp8` (gfx1201).
What is refused, and the compile facts behind it (gpu_rules.amd_fp8_refusal):
- gfx942's FP8 MFMA takes only the fnuz formats: our e4m3fn kernels compile there, but Triton
  upcasts the dots to f16 MFMAs (no FP8 instruction at all); the same kernel with fnuz inputs
  (fp8e4b8) gets `v_mfma_f32_32x32x16_fp8_fp8`, which is what an fnuz variant would buy;
- gfx1100 (RDNA3) has no FP8 dot (Triton upcasts the same way; not compiled here: 20-60 s a
  kernel for a fact the ISA manual states);
- the INT8 attention's FP8 P.V variant on AMD (FP16 accumulation: no AMD form).

Under TRITON_INTERPRET=1 (tests/conftest.py) @triton.jit gives interpreter functions, so one
subprocess with the variable unset compiles every case (one worker per core) and reports JSON;
the module-scoped fixture keeps the report for the session (Triton's own cache makes reruns
fast).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import importlib

import pytest

ROOT = Path(__file__).resolve().parents[2]
gpu_rules = importlib.import_module("triton_accel.kernels.core.gpu_rules")

WAVE = {"gfx942": 64, "gfx950": 64, "gfx1100": 32, "gfx1201": 32}
LDS_LIMIT = {"gfx942": 65536, "gfx950": 163840, "gfx1100": 65536, "gfx1201": 65536}  # bytes per workgroup

HALF = {"gfx942": r"v_mfma_f32_32x32x8_{t}", "gfx950": r"v_mfma_f32_32x32x(8|16)_{t}",
        "gfx1100": r"v_wmma_f32_16x16x16_{t}", "gfx1201": r"v_wmma_f32_16x16x16_{t}"}
INT8 = {"gfx942": r"v_mfma_i32_32x32x16_i8", "gfx950": r"v_mfma_i32_32x32x32_i8",
        "gfx1100": r"v_wmma_i32_16x16x16_iu8", "gfx1201": r"v_wmma_i32_16x16x16_iu8"}
# gfx950 keeps CDNA3's fp8_fp8 MFMA opcode, reading OCP e4m3 there; Triton uses it for the
# full-FP8 kernel's P.V next to the new f8f6f4 form.
FP8_OCP = {"gfx950": r"v_mfma_f32_32x32x(64_f8f6f4|16_fp8_fp8)", "gfx1201": r"v_wmma_f32_16x16x16_fp8_fp8"}
FP8_FNUZ_GFX942 = r"v_mfma_f32_32x32x16_fp8_fp8"
ISA_DTYPE = {"fp16": "f16", "bf16": "bf16"}

# (target, kind, args). Flash kernel: every tile class of the "hip" table (d64, d128 with an
# additive row-broadcast mask, d256, short <= 128 keys) and the short-key kernel, on the
# three required targets; gfx950 the d64 class. FP8 where the target has OCP FP8; INT8
# everywhere; the Linear kernels each target runs (fp8 W8A8 only on OCP-FP8 targets). The
# quantisers (no matrix instructions but the FP8 casts) once per ISA kind ("all"), the
# attention kernel alone elsewhere ("attn"): one cold run costs ~110 s of CPU.
FLASH = [("fp16", 64, 4096, 0), ("bf16", 128, 4096, 2), ("fp16", 256, 4096, 0), ("bf16", 64, 77, 0)]
JOBS = []
for _t in ("gfx942", "gfx1100", "gfx1201"):
    JOBS += [(_t, "flash", list(c)) for c in FLASH] + [(_t, "short_kv", ["fp16", 64, 77])]
    JOBS += [(_t, "int8_attention", ["bf16", 128, "fp16", "all" if _t == "gfx942" else "attn"]),
             (_t, "linear.int8", ["bf16"]), (_t, "linear.fp8_weight_only", ["bf16"])]
JOBS += [("gfx950", "flash", ["bf16", 64, 4096, 0]), ("gfx950", "short_kv", ["fp16", 64, 77]),
         ("gfx950", "int8_attention", ["fp16", 128, "fp16", "attn"]), ("gfx950", "linear.int8", ["fp16"]),
         ("gfx950", "linear.fp8_weight_only", ["fp16"])]
for _t in FP8_OCP:
    JOBS += [(_t, "fp8_qk", ["fp16", 128]), (_t, "fp8_full", ["bf16", 128, "all" if _t == "gfx1201" else "attn"]),
             (_t, "linear.fp8", ["bf16"])]
# The compile facts behind the gfx942 refusal: the FP8 GEMM on OCP e4m3 and on fnuz inputs.
JOBS += [("gfx942", "fp8_gemm", ["fp8e4nv"]), ("gfx942", "fp8_gemm", ["fp8e4b8"])]
# attention_fp8_full.default_config picks by the capability major ROCm reports (gfx950: 9 ->
# the sm90 tile, gfx1201: 12 -> the sm89 tile).
FP8_FULL_FAMILY = {"gfx950": "sm90", "gfx1201": "sm89"}

WORKER = r"""
import importlib, importlib.util, json, os, re, sys, time, types
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

root = sys.argv[1]
jobs, waves, fp8_full_family = (json.loads(a) for a in sys.argv[2:5])

def mod(name):
    pack = "triton_accel_compile_amd"
    if pack not in sys.modules:
        spec = importlib.util.spec_from_file_location(pack, os.path.join(root, "__init__.py"),
                                                      submodule_search_locations=[root])
        m = importlib.util.module_from_spec(spec)
        sys.modules[pack] = m
        spec.loader.exec_module(m)
    return importlib.import_module(f"{pack}.kernels.{name}")

def name_of(fn):
    return fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__

def specs(target, kind, args):
    # [(kernel name, fn, signature, constexprs, attrs, options)] as the AMD launchers build them.
    if kind == "flash":
        at = mod("attention.flash")
        dtype, d, lk, mk = args
        cfg = at.lookup_config(mod("core.kernel_common").arch_family(target), at.head_dim_class(d, lk))
        fn, sig, c, a = at.compile_spec(dtype, d, cfg, mask_kind=mk, hip=True, mask_row_bcast=mk == 2)
        return [(name_of(fn), fn, sig, c, a, dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))]
    if kind == "short_kv":
        sk = mod("attention.short_kv")
        dtype, d, lk = args
        fam = sk.config_family(types.SimpleNamespace(arch=target), False)
        cfg = sk.SHORT_KV_CONFIGS[fam]
        assert 2 * sk.next_pow2(d) * sk.next_pow2(lk) * 2 <= sk.SHORT_KV_BYTES[fam], "launcher would not use it"
        fn, sig, c, a = sk.compile_spec(dtype, d, lk, cfg, hip=True)
        return [(name_of(fn), fn, sig, c, a, dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))]
    if kind == "int8_attention":
        m = mod("attention.int8")
        dtype, d, pv, which = args
        cfg = m.config_for(m.INT8_CONFIGS[m.family_in(m.INT8_CONFIGS, m.arch_family(target))], d)
        return [(n, fn, sig, c, a, dict(num_warps=w, num_stages=cfg["num_stages"]))
                for n, fn, sig, c, a, w in m.compile_specs(dtype, d, cfg, pv)
                if which == "all" or n == "_attn_int8_fwd"]
    if kind == "fp8_qk":
        m = mod("attention.fp8")
        dtype, d = args
        cfg = m.FP8_ATTENTION_CONFIGS[m.config_family(target)][m.head_dim_class(d)]
        return [(name_of(fn), fn, sig, c, a, dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
                for fn, sig, c, a in m.compile_specs(dtype, d, cfg)]
    if kind == "fp8_full":
        m = mod("attention.fp8_full")
        dtype, d, which = args
        cfg = m.FP8_FULL_CONFIGS[fp8_full_family[target]]
        return [(n, fn, sig, c, a, dict(num_warps=w, num_stages=cfg["num_stages"]))
                for n, fn, sig, c, a, w in m.compile_specs(dtype, d, cfg)
                if which == "all" or n == "_attn_fp8_full_fwd"]
    if kind == "fp8_gemm":  # the FP8 Linear's GEMM alone, its e4m3 inputs retyped (fnuz: fp8e4b8)
        m = mod("linear.fp8")
        fn, sig, c, a, o = m.compile_specs(m.LINEAR_FP8_CONFIGS[m.config_family(target)], tma=False)[-1]
        sig = {k: (v.replace("fp8e4nv", args[0]) if isinstance(v, str) else v) for k, v in sig.items()}
        return [(name_of(fn), fn, sig, c, a, o)]
    m = mod(kind)
    table = {"linear.fp8": "LINEAR_FP8_CONFIGS", "linear.int8": "LINEAR_INT8_CONFIGS",
             "linear.fp8_weight_only": "LINEAR_FP8_WO_CONFIGS"}[kind]
    cfg = getattr(m, table)[m.config_family(target)]
    kwargs = dict(out_dtype=args[0], has_bias=True) if kind == "linear.fp8" else \
        dict(in_dtype=args[0], out_dtype=args[0])
    return [(name_of(fn), fn, sig, c, a, o) for fn, sig, c, a, o in m.compile_specs(cfg, **kwargs)]

def compile_job(job):
    target, kind, args = job
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    out = []
    for name, fn, sig, c, a, opts in specs(target, kind, args):
        start = time.time()
        try:
            k = triton.compile(ASTSource(fn, sig, c, a), target=GPUTarget("hip", target, waves[target]), options=opts)
            asm = k.asm["amdgcn"]
            ins = Counter(re.findall(r"\b(v_(?:mfma|wmma|smfmac)_\w+)", asm))
            out.append(dict(kernel=name, ok=True, hsaco=len(k.asm.get("hsaco", b"")), lds=k.metadata.shared,
                            ins=dict(ins), arch=re.findall(r"\.amdgcn_target\s+\"([^\"]+)\"", asm)[:1],
                            seconds=round(time.time() - start, 1)))
        except Exception as e:
            out.append(dict(kernel=name, ok=False, error=f"{type(e).__name__}: {e}"[-600:]))
    return out

if __name__ == "__main__":
    import triton
    with ProcessPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as ex:
        results = list(ex.map(compile_job, [tuple(j) for j in jobs]))
    print("RESULT " + json.dumps(dict(triton=triton.__version__, results=results)))
"""


def _id(job):
    target, kind, args = job
    return f"{target}-{kind}-" + "-".join(map(str, args))


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton >= 3.9 warns when unset
    p = subprocess.run([sys.executable, "-c", WORKER, str(ROOT), json.dumps(JOBS), json.dumps(WAVE),
                        json.dumps(FP8_FULL_FAMILY)], capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"compile worker failed:\n{p.stderr[-3000:]}"
    out = json.loads(lines[-1][7:])
    return {_id(j): r for j, r in zip(JOBS, out["results"], strict=True)}


def _matching(ins: dict, pattern: str) -> dict:
    return {i: n for i, n in ins.items() if re.fullmatch(pattern, i)}


def _compiled(report, job) -> list:
    results = report[_id(job)]
    target = job[0]
    for r in results:
        assert r["ok"], f"{r['kernel']}: {r.get('error')}"
        assert r["hsaco"] > 0, f"{r['kernel']}: no code object"
        assert r["lds"] <= LDS_LIMIT[target], f"{r['kernel']} needs {r['lds']} B of LDS on {target}"
        assert r["arch"] and r["arch"][0].endswith(f"-{target}"), r["arch"]  # e.g. amdgpu9.42-amd-amdhsa-unknown-gfx942
    return results


def _jobs(kind, *targets):
    return [j for j in JOBS if j[1] == kind and (not targets or j[0] in targets)]


@pytest.mark.parametrize("job", _jobs("flash") + _jobs("short_kv"), ids=_id)
def test_fp16_bf16_attention_uses_half_matrix_cores(report, job):
    target, _kind, args = job
    (r,) = _compiled(report, job)
    want = HALF[target].format(t=ISA_DTYPE[args[0]])
    assert _matching(r["ins"], want), f"no {want} in {r['ins']}"
    assert set(_matching(r["ins"], want)) == set(r["ins"]), f"other matrix instructions: {r['ins']}"


@pytest.mark.parametrize("job", _jobs("int8_attention"), ids=_id)
def test_int8_attention_qk_is_an_int8_dot(report, job):
    target, _kind, args = job
    results = _compiled(report, job)
    assert [r["kernel"] for r in results] == (["fp8_stats_kernel", "_int8_finalize_kernel", "_int8_quant_kernel",
                                               "_attn_int8_fwd"] if args[-1] == "all" else ["_attn_int8_fwd"])
    ins = results[-1]["ins"]
    qk, pv = _matching(ins, INT8[target]), _matching(ins, HALF[target].format(t="f16"))
    assert qk, f"no INT8 Q.K ({INT8[target]}) in {ins}"
    assert pv, f"no f16 P.V in {ins}"
    assert set(qk) | set(pv) == set(ins), f"other matrix instructions: {ins}"


@pytest.mark.parametrize("job", _jobs("fp8_qk") + _jobs("fp8_full"), ids=_id)
def test_fp8_attention_uses_ocp_fp8_dots(report, job):
    target, kind, _args = job
    results = _compiled(report, job)
    attn = results[-1]
    assert attn["kernel"] in ("_attn_fp8_fwd", "_attn_fp8_full_fwd"), attn["kernel"]
    fp8 = _matching(attn["ins"], FP8_OCP[target])
    assert fp8, f"no OCP FP8 dot ({FP8_OCP[target]}) in {attn['ins']}"
    if kind == "fp8_full":  # Q.K, the outlier side dot and P.V all in FP8
        assert set(fp8) == set(attn["ins"]), attn["ins"]
    else:  # FP8 Q.K, the 16-bit P.V and outlier dot
        assert set(fp8) | set(_matching(attn["ins"], HALF[target].format(t="f16"))) == set(attn["ins"]), attn["ins"]


@pytest.mark.parametrize("job", _jobs("linear.int8") + _jobs("linear.fp8") + _jobs("linear.fp8_weight_only"), ids=_id)
def test_linear_gemm_uses_the_methods_dot(report, job):
    target, kind, args = job
    gemm = _compiled(report, job)[-1]["ins"]
    want = {"linear.int8": INT8[target], "linear.fp8": FP8_OCP.get(target),
            "linear.fp8_weight_only": HALF[target].format(t=ISA_DTYPE[args[0]])}[kind]
    assert _matching(gemm, want) and set(_matching(gemm, want)) == set(gemm), f"want only {want}: {gemm}"


def test_gfx942_ocp_fp8_gets_no_fp8_instruction_and_fnuz_does(report):
    """The compile facts behind gpu_rules.amd_fp8_refusal on CDNA3: our FP8 GEMM on OCP e4m3
    (fp8e4nv) inputs gets no FP8 instruction on gfx942 (Triton upcasts the dot to f16 MFMAs), the
    same GEMM on fnuz inputs (fp8e4b8) gets the FP8 MFMA. If Triton ever lowers e4m3fn to
    gfx942's FP8 MFMA, the rule can go; an fnuz variant of our quantisers is the other way."""
    ocp = _compiled(report, ("gfx942", "fp8_gemm", ["fp8e4nv"]))[-1]["ins"]
    assert ocp and not any("fp8" in i or "f8" in i for i in ocp), ocp
    assert set(_matching(ocp, HALF["gfx942"].format(t="f16"))) == set(ocp), ocp
    fnuz = _compiled(report, ("gfx942", "fp8_gemm", ["fp8e4b8"]))[-1]["ins"]
    assert _matching(fnuz, FP8_FNUZ_GFX942) and set(_matching(fnuz, FP8_FNUZ_GFX942)) == set(fnuz), fnuz
    rule = gpu_rules.amd_fp8_refusal("gfx942", "AMD Instinct MI300X")
    assert rule.code == gpu_rules.AMD_FP8_FNUZ and "fnuz" in rule.reason


def test_every_amd_target_and_family_is_compiled():
    """The rules name these targets as compile-tested: each has a job here, and each family
    gpu_rules lets run a kernel kind has that kind compiled for it."""
    targets = {j[0] for j in JOBS}
    assert targets == set(gpu_rules.AMD_COMPILE_TARGETS) == set(WAVE)
    for target in gpu_rules.AMD_COMPILE_TARGETS:
        kinds = {j[1] for j in JOBS if j[0] == target}
        assert {"flash", "short_kv", "int8_attention", "linear.int8", "linear.fp8_weight_only"} <= kinds, target
        if gpu_rules.amd_fp8_refusal(target) is None:
            assert {"fp8_qk", "fp8_full", "linear.fp8"} <= kinds, target


FP8_OPTIONS = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.amd.compiler import HIPBackend
print("RESULT " + json.dumps(dict(triton=triton.__version__, fp8={
    arch: sorted(HIPBackend(GPUTarget("hip", arch, wave)).parse_options({}).supported_fp8_dtypes)
    for arch, wave in (("gfx950", 64), ("gfx1201", 32))})))
"""


@pytest.mark.parametrize("version", ["3.2", "3.3", "3.4", "3.5"])
def test_amd_fp8_triton_floor_is_where_the_hip_backend_accepts_e4m3(version):
    """gpu_rules.AMD_FP8_MIN_TRITON against each release's HIP backend (tests/versions/ installs
    them in .cache/triton-versions/): fp8e4nv (OCP e4m3, what our quantisers write) is among the
    target's supported FP8 dtypes exactly from the floor on (3.2: no AMD target; 3.3: gfx950; 3.4:
    gfx12), and the rule refuses FP8 below it."""
    folder = ROOT / ".cache" / "triton-versions" / f"triton-{version}"
    if not (folder / "triton").is_dir():
        pytest.skip(f"Triton {version} not installed at {folder} (tests/versions/version_matrix.py installs it)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(folder)
    p = subprocess.run([sys.executable, "-c", FP8_OPTIONS], capture_output=True, text=True, env=env, timeout=120)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-2000:]
    report = json.loads(lines[-1][7:])
    assert report["triton"].startswith(version + "."), report["triton"]
    for arch, accepted in report["fp8"].items():
        floor = gpu_rules.AMD_FP8_MIN_TRITON[gpu_rules.amd_family(arch)]
        at_floor = tuple(int(x) for x in version.split(".")) >= floor
        assert ("fp8e4nv" in accepted) == at_floor, (arch, accepted, floor)
        assert (gpu_rules.amd_fp8_refusal(arch, triton_version=report["triton"]) is None) == at_floor
