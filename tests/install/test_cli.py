"""install.py as a command: flags, exit codes, --json, the --venv bootstrap's plan, and that
it runs with nothing but the standard library on every Python it may meet (3.9 ... 3.14)."""
import ast
import glob
import json
import shutil
import subprocess
import sys

import pytest

from install_helpers import INSTALL_PY, ROOT


def run(*args, python=sys.executable, cwd=ROOT, env=None, timeout=300):
    return subprocess.run([python, str(INSTALL_PY), *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


@pytest.mark.parametrize("args, needle", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--demo"], "--demo needs --venv"),
], ids=["unknown-flag", "demo-without-venv"])
def test_broken_invocation_exits_2(args, needle):
    proc = run(*args)
    assert proc.returncode == 2
    assert needle in proc.stderr


def test_help_runs_without_site_packages():
    # -I -S: no site-packages, no user site, no PYTHONPATH: only the standard library.
    proc = subprocess.run([sys.executable, "-I", "-S", str(INSTALL_PY), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--dry-run", "--json", "--fix", "--venv", "--torch-spec", "--demo", "--python", "--no-check"):
        assert flag in proc.stdout


def test_imports_only_the_standard_library():
    """Nothing but the stdlib, the installer/ package and the two pack files install.py loads
    by path (stdlib-only themselves: whatever they imported would show up here too)."""
    code = ("import sys, importlib.util; before = set(sys.modules); "
            "spec = importlib.util.spec_from_file_location('m', sys.argv[1]); m = importlib.util.module_from_spec(spec); "
            "sys.modules['m'] = m; spec.loader.exec_module(m); "
            "new = sorted({k.split('.')[0] for k in set(sys.modules) - before}); "
            "std = sys.stdlib_module_names; print([k for k in new if k not in std and k not in ('m', '_distutils_hack')])")
    proc = subprocess.run([sys.executable, "-c", code, str(INSTALL_PY)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['_triton_accel_gpu_rules', '_triton_accel_install_config', '_triton_accel_installer']"


def test_installer_modules_are_stdlib_only_and_relative():
    """installer/ is loaded by path under a private name, so its modules reach each other only
    through relative imports, and reach nothing outside the standard library."""
    for path in sorted((ROOT / "installer").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] in sys.stdlib_module_names | {"__future__"}, (path.name, node.module)
            elif isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] in sys.stdlib_module_names for a in node.names), path.name


def test_json_dry_run_report(tmp_path):
    proc = run("--dry-run", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report) == {"version", "dry_run", "facts", "plan", "results", "self_check", "verdict", "seconds"}
    assert report["dry_run"] is True and report["results"] is None and report["self_check"] is None
    assert report["facts"]["python"] == sys.executable
    assert report["verdict"]["path"] == "pytorch"
    for finding in report["plan"]["findings"]:
        assert set(finding) == {"code", "severity", "message", "fix"}


def test_python_flag_targets_another_interpreter(tmp_path):
    """--python points the probe (and pip) at another interpreter than the one running install.py."""
    if not PYTHONS:
        pytest.skip("no other Python 3.9+ interpreters on this machine")
    version, exe = sorted(PYTHONS.items())[0]
    proc = run("--python", exe, "--dry-run", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["facts"]["python_version"][:2] == [int(x) for x in version.split(".")]
    for action in report["plan"]["actions"]:
        assert action["argv"][0] == report["facts"]["python"]


def _pythons():
    """Other interpreters on this machine (pyenv on the dev/CI image), one per minor >= 3.9."""
    found = {}
    cands = sorted(glob.glob("/root/.pyenv/versions/3.*/bin/python3"))
    cands += [shutil.which(f"python3.{m}") for m in range(9, 15)]
    for exe in filter(None, cands):
        try:
            out = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        version = out.stdout.strip()
        if out.returncode == 0 and tuple(map(int, version.split("."))) >= (3, 9):
            found.setdefault(version, exe)
    return found


PYTHONS = _pythons()


@pytest.mark.parametrize("version", sorted(PYTHONS) or ["none"])
def test_runs_on_old_and_new_pythons(version, tmp_path):
    if version == "none":
        pytest.skip("no other Python 3.9+ interpreters on this machine")
    exe = PYTHONS[version]
    proc = run("--dry-run", "--json", python=exe, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["facts"]["python_version"][:2] == [int(x) for x in version.split(".")]
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('m', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); sys.modules['m'] = m; spec.loader.exec_module(m); "
            "compile(m.SELF_CHECK_SCRIPT, 'check', 'exec'); compile(m.PROBE_SCRIPT, 'probe', 'exec')")
    assert subprocess.run([exe, "-c", code, str(INSTALL_PY)], capture_output=True).returncode == 0


def test_bootstrap_dry_run_plans_and_creates_nothing(tmp_path):
    target = tmp_path / "new-venv"
    proc = run("--venv", str(target), "--demo", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    py = target / "bin" / "python"
    lines = proc.stdout.splitlines()
    assert lines[0] == f"Bootstrap plan for {target} (--dry-run: nothing is changed):"
    assert lines[1] == f"  create the venv: {sys.executable} -m venv {target}"
    assert lines[2] == f"  install torch==2.13.0 into the new venv: {py} -m pip install torch==2.13.0"
    assert f"  run install.py inside the venv: {py} {INSTALL_PY}" in lines
    assert lines[-1] == f"  run the demo: {py} {ROOT / 'benchmarks' / 'demo.py'}"
    if (ROOT / "requirements.txt").exists():
        assert f"  install requirements.txt: {py} -m pip install -r {ROOT / 'requirements.txt'}" in lines
    assert not target.exists()


def test_bootstrap_torch_spec_is_configurable(tmp_path):
    proc = run("--venv", str(tmp_path / "v"), "--torch-spec", "torch==2.12.1", "--dry-run")
    assert f"{tmp_path / 'v' / 'bin' / 'python'} -m pip install torch==2.12.1" in proc.stdout


def test_bootstrap_refuses_torch_in_a_venv_it_did_not_create(tmp_path):
    fake = tmp_path / "theirs" / "bin"
    fake.mkdir(parents=True)
    (fake / "python").write_text("#!/bin/sh\nexit 1\n")  # 'import torch metadata' fails: no torch
    (fake / "python").chmod(0o755)
    proc = run("--venv", str(tmp_path / "theirs"))
    assert proc.returncode == 1
    assert "was not created by install.py and has no torch" in proc.stdout
