"""Our kernels on every Triton release users run (3.2 ... 3.9), not only the newest.

version_matrix.py installs each release from the package registry into
.cache/triton-versions/triton-X.Y (kept between runs) and, in subprocesses with that folder
first on PYTHONPATH, compiles every shipped kernel for every GPU target and runs the kernels
under the interpreter. These tests read its reports. Skipped, with the reason, only when the
registry cannot be reached and the release is not cached yet.

What is asserted, per release:
- the wheel installs and the subprocesses import that release, not the venv's Triton;
- every target the registry serves on that release (gpu_rules.nvidia_gpu_blocker) builds the
  flash, short-key and FP8 kernels to ELF binaries (cubin / hsaco); a target it refuses
  (Turing after 3.2, Blackwell before 3.3) gets our PyTorch fallback with a reason;
- FP8 dots are refused below sm_89 by Triton and by the registry, and compile on sm_89+;
- gpu_rules.FEATURE_MIN_TRITON agrees with the release's real API;
- our launch options keep FP fusion on under TRITON_DEFAULT_FP_FUSION=0 (Triton 3.10's
  default) and silence 3.9's warning about it;
- the interpreter cases (fp16/fp32, masks, GQA, causal, odd lengths, the short-key and FP8
  kernels) match the float32 reference within child_interp.py's tolerances.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("triton_version_matrix", Path(__file__).with_name("version_matrix.py"))
vm = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = vm
_spec.loader.exec_module(vm)
gpu_rules = importlib.import_module("triton_accel.kernels.core.gpu_rules")

VERSIONS = list(vm.RELEASES)
LLD_MISSING = "ld.lld not found"
NVIDIA = {"sm75": (7, 5), "sm80": (8, 0), "sm86": (8, 6), "sm89": (8, 9), "sm90": (9, 0), "sm120": (12, 0)}


@pytest.fixture(scope="module")
def matrix():
    results = vm.run_matrix()
    text = vm.format_matrix(results) + "\n\n" + vm.format_failures(results)
    (vm.CACHE / "matrix.md").write_text(text)  # the last run's matrix, for people
    print("\n" + text)
    return results


def _version(matrix, minor):
    res = matrix[minor]
    if not res.install.ok:
        if res.install.offline:
            pytest.skip(f"package registry unreachable, triton {res.install.version} not cached: {res.install.error}")
        pytest.fail(f"pip could not install triton=={res.install.version}: {res.install.error}")
    return res


def _compile_report(matrix, minor):
    report = _version(matrix, minor).compile
    assert "error" not in report, report["error"]
    return report


def test_unreachable_registry_reads_as_offline(monkeypatch, tmp_path):
    """No network and nothing cached: the install says offline (the version tests then skip
    with pip's network error) and leaves no folder that could pass for an install."""
    monkeypatch.setattr(vm, "CACHE", tmp_path)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # a port nothing listens on
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"):
        monkeypatch.setenv(var, "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    result = vm.install("3.9", force=True)
    assert not result.ok and result.offline, result
    assert "127.0.0.1" in result.error or "Connection" in result.error, result.error
    assert not vm.install_dir("3.9").exists() and not list(tmp_path.iterdir())


def _fresh_matrix_module(monkeypatch):
    # Loaded again so that its module-level CACHE / KERNEL_CACHE read the patched environment
    # (registered first: its dataclasses look their module up in sys.modules).
    spec = importlib.util.spec_from_file_location("triton_version_matrix_env", Path(__file__).with_name("version_matrix.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_compiled_kernels_go_where_ci_keeps_them(monkeypatch, tmp_path):
    """The children's Triton cache: the clone's CACHE/kernels-X.Y by default,
    TRITON_ACCEL_VERSIONS_KERNELS/kernels-X.Y when set (.ci/run: the user's cache folder, so a
    fresh clone compiles only what changed), a new temporary folder under
    TRITON_ACCEL_VERSIONS_FRESH; the wheels stay in CACHE either way."""
    for var in ("TRITON_ACCEL_VERSIONS_KERNELS", "TRITON_ACCEL_VERSIONS_FRESH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TRITON_ACCEL_VERSIONS_CACHE", str(tmp_path / "clone"))
    default = _fresh_matrix_module(monkeypatch)
    assert default._child_env("3.6", False)["TRITON_CACHE_DIR"] == str(tmp_path / "clone" / "kernels-3.6")
    monkeypatch.setenv("TRITON_ACCEL_VERSIONS_KERNELS", str(tmp_path / "user"))
    kept = _fresh_matrix_module(monkeypatch)
    env = kept._child_env("3.6", False)
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "user" / "kernels-3.6")
    assert env["PYTHONPATH"] == str(tmp_path / "clone" / "triton-3.6")
    monkeypatch.setenv("TRITON_ACCEL_VERSIONS_FRESH", "1")
    fresh = kept._child_env("3.6", False)["TRITON_CACHE_DIR"]
    assert not fresh.startswith(str(tmp_path)) and Path(fresh).is_dir()
    Path(fresh).rmdir()
    ci = (vm.ROOT / ".ci" / "run").read_text()
    assert 'export TRITON_ACCEL_VERSIONS_KERNELS=' in ci and "bash tests/run.sh" in ci
    assert ci.index("TRITON_ACCEL_VERSIONS_KERNELS") < ci.index("bash tests/run.sh")


@pytest.mark.parametrize("minor", VERSIONS)
def test_release_installs_and_is_the_one_imported(matrix, minor):
    res = _version(matrix, minor)
    for job in ("compile", "interp"):
        report = getattr(res, job)
        assert "error" not in report, report["error"]
        assert report["triton"] == vm.RELEASES[minor], f"{job} child imported triton {report['triton']}"
    assert res.compile["triton_file"].startswith(str(vm.install_dir(minor))), res.compile["triton_file"]


@pytest.mark.parametrize("target", vm.TARGETS)
@pytest.mark.parametrize("minor", VERSIONS)
def test_kernels_compile_where_the_registry_serves(matrix, minor, target):
    report = _compile_report(matrix, minor)
    version = report["triton"]
    cases = [c for c in report["cases"] if c["target"] == target]
    rule = gpu_rules.nvidia_gpu_blocker("", NVIDIA[target], version) if target in NVIDIA else None
    assert (target in report["refused"]) == (rule is not None)
    if rule is not None:
        # Never run there: the Settings node says why and ComfyUI's attention serves.
        facts = gpu_rules.Facts(capability=NVIDIA[target], triton_version=version, torch_version="2.7.0",
                                torch_cuda="12.8")
        decision = gpu_rules.select_path(facts, "auto")
        assert decision.path == gpu_rules.PATH_PYTORCH and decision.code == rule.code, decision
        assert version in decision.reason, decision.reason
        return
    wanted = [c for c in cases if not (c["kernel"] == "fp8" and NVIDIA.get(target, (9, 9)) < (8, 9))]
    kernels = {c["kernel"] for c in wanted}
    assert "flash" in kernels, cases
    if target != "sm75":  # no short-key budget on Turing's 64 KB: the flash kernel serves it
        assert "short_kv" in kernels, cases
    if target in ("sm89", "sm90", "sm120"):
        assert {"fp8", "fp8_quant"} <= kernels, cases
    if target in ("sm89", "sm90"):
        assert {c["case"] for c in wanted if c["kernel"] == "fp8_full_quant"} == {
            "fp8_stats_kernel", "_fp8_finalize_kernel", "_fp8_quant_kernel", "_v_mean_fix_kernel"}, cases
    if target in ("sm89", "sm90"):
        assert {c["case"] for c in wanted if c["kernel"] == "fused_norms_fp8_rows"} == {
            "_layer_norm_modulate", "_gated_residual_norm", "_cat_fp8_rows"}, cases
    if target in ("sm86", "gfx1100"):  # child_compile.FUSED_NORM_TARGETS (that module reads argv at import)
        assert {c["case"] for c in wanted if c["kernel"] == "fused_norms"} == {
            "_rms_norm_rope", "_layer_norm_modulate", "_qk_rms_norm", "_gated_residual_norm",
            "_qk_rms_norm_rope"}, cases
        assert {c["case"] for c in wanted if c["kernel"] == "fused_norms_flux"} == {
            "_layer_norm_modulate", "_gated_residual_norm"}, cases
    failed = [f"{c['kernel']} {c['case']}: {c['error']}" for c in wanted if not c["ok"]]
    if failed and all(LLD_MISSING in f for f in failed):
        # Triton <= 3.4 links AMD code objects with ROCm's ld.lld, which its wheel does not
        # carry (ROCm installs and PyTorch's ROCm wheels do; 3.5+ links in-process).
        pytest.skip(f"Triton {version} needs ld.lld to link {target} code, absent here: "
                    "install lld (apt-get install lld) or set TRITON_HIP_LLD_PATH")
    assert not failed, f"Triton {version} on {target}:\n" + "\n".join(failed)
    not_elf = [f"{c['kernel']} {c['case']}" for c in wanted if not c["elf"]]
    assert not not_elf, f"no ELF binary: {not_elf}"


@pytest.mark.parametrize("target", ["sm75", "sm80", "sm86"])
@pytest.mark.parametrize("minor", VERSIONS)
def test_fp8_dot_refused_below_sm89(matrix, minor, target):
    report = _compile_report(matrix, minor)
    rule = gpu_rules.capability_refusal("nvidia", NVIDIA[target], "", fp8=True)
    assert rule is not None and rule.code == gpu_rules.NO_FP8, rule
    if target in report["refused"]:
        return  # the whole GPU is refused on this release (Turing after 3.2)
    fp8 = [c for c in report["cases"] if c["target"] == target and c["kernel"] == "fp8"]
    assert fp8, "no FP8 case tried"
    for c in fp8:
        assert not c["ok"], f"Triton {report['triton']} compiled an e4m3 dot for {target}"
        assert "fp8e4nv" in c["error"], c["error"]


@pytest.mark.parametrize("minor", VERSIONS)
def test_feature_table_matches_the_release_api(matrix, minor):
    report = _compile_report(matrix, minor)
    for feature, present in report["features"].items():
        refused = gpu_rules.feature_refusal(feature, report["triton"])
        assert (refused is None) == present, (
            f"{feature}: Triton {report['triton']} {'has' if present else 'lacks'} it, but FEATURE_MIN_TRITON "
            f"says {gpu_rules.FEATURE_MIN_TRITON[feature]}")
    assert set(report["features"]) == set(gpu_rules.FEATURE_MIN_TRITON)


@pytest.mark.parametrize("minor", VERSIONS)
def test_launch_options_keep_fp_fusion_where_the_default_turns_it_off(matrix, minor):
    """Triton 3.9 warns that its FP-fusion default turns off in 3.10, and every release turns
    it off under TRITON_DEFAULT_FP_FUSION=0. Our launches pass kernel_common.LAUNCH_OPTIONS
    (tests/kernels/test_launch_options.py checks each launch does): with them a kernel keeps
    its FMAs under that default on this release, without them it loses them."""
    report = _compile_report(matrix, minor)
    fusion = report["fp_fusion"]
    assert "error" not in fusion, fusion["error"]
    assert fusion["unpinned"] == dict(fusion["unpinned"], flag=False, fma=0), fusion  # the default bites
    assert fusion["pinned"]["flag"] and fusion["pinned"]["fma"] >= 16, fusion
    if minor == "3.9":
        assert "warned" in fusion["pinned"], f"the 3.9 warning was not looked for: {fusion}"
    if "warned" in fusion["pinned"]:  # releases with the warning about 3.10's default
        assert fusion["unpinned"]["warned"] and not fusion["pinned"]["warned"], fusion


@pytest.mark.parametrize("minor", VERSIONS)
def test_interpreter_matches_reference(matrix, minor):
    report = _version(matrix, minor).interp
    assert "error" not in report, report["error"]
    assert len(report["cases"]) >= 15
    failed = [f"{c['name']}: " + (c.get("error") or f"rel. L2 {c.get('err')} over {c['tol']} ({c.get('kernel')})")
              for c in report["cases"] if not c["ok"]]
    assert not failed, f"Triton {report['triton']}, torch {report['torch']}, NumPy {report['numpy']}:\n" + "\n".join(failed)


def test_jit_code_has_no_chained_boolean_operators():
    """Triton 3.2 and 3.3 reject `A and B and C` in @triton.jit code ("chained boolean
    operators are not supported"); newer releases accept it, so only this check and the
    old-release compiles above catch it. Offline and instant."""
    chains = []
    for path in sorted((vm.ROOT / "kernels").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in fn.decorator_list):
                chains += [f"{path.name}:{n.lineno} {fn.name}: {ast.unparse(n)}" for n in ast.walk(fn)
                           if isinstance(n, ast.BoolOp) and len(n.values) > 2]
    assert not chains, "\n".join(chains)
