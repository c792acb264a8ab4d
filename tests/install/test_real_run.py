"""A real run of install.py in a fresh venv with CPU torch (torch==2.13.0 resolves to a
local CPU wheel on the project's machines; triton and numpy come from PyPI).

The tests run in order and share the venv: --dry-run changes nothing, the first run
installs what is missing and proves Triton through the interpreter, the second run has
nothing to do and is fast, and the --venv bootstrap on that venv reaches the demo and
passes its exit code through. About 80 s on 2 cores, hence `slow` (CI still runs it).
"""
import json
import subprocess
import sys
import time

import pytest

from install_helpers import INSTALL_PY, ROOT

pytestmark = pytest.mark.slow

TORCH_SPEC = "torch==2.13.0"


def pip_freeze(py):
    out = subprocess.run([str(py), "-m", "pip", "freeze", "--all"], capture_output=True, text=True, check=True)
    return sorted(out.stdout.splitlines())


def run_install(py, *args, cwd=ROOT):
    t0 = time.monotonic()
    proc = subprocess.run([str(py), str(INSTALL_PY), "--json", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), elapsed


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("install-real") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    py = root / "bin" / "python"
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", TORCH_SPEC], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"could not install {TORCH_SPEC} into a fresh venv: {proc.stderr[-2000:]}")
    return py


def test_dry_run_changes_nothing(venv, tmp_path):
    before = pip_freeze(venv)
    report, _ = run_install(venv, "--dry-run")
    assert pip_freeze(venv) == before
    assert not any(line.lower().startswith(("triton==", "numpy==")) for line in before)
    assert [a["argv"] for a in report["plan"]["actions"]] == [
        [str(venv), "-m", "pip", "install", "--no-deps", "triton"],
        [str(venv), "-m", "pip", "install", "--no-deps", "numpy"],
    ]
    assert report["results"] is None and report["self_check"] is None
    assert [f["code"] for f in report["plan"]["findings"]] == ["NO_GPU", "TRITON_MISSING", "NUMPY_MISSING"]


def test_first_run_installs_and_proves_triton(venv):
    torch_before = [x for x in pip_freeze(venv) if x.startswith("torch==")]
    report, _ = run_install(venv)
    assert [r["ok"] for r in report["results"]] == [True, True]
    frozen = pip_freeze(venv)
    assert [x for x in frozen if x.startswith("torch==")] == torch_before  # torch untouched
    assert any(x.startswith("triton==") for x in frozen) and any(x.startswith("numpy==") for x in frozen)
    check = report["self_check"]
    assert check["mode"] == "interpreter" and check["import_ok"] and check["kernel_ok"], check
    assert report["verdict"] == {
        "path": "pytorch", "triton_works": False,
        "message": "No NVIDIA GPU: the pack uses PyTorch attention. The Triton interpreter works here (for tests only)."}
    assert [f["code"] for f in report["plan"]["findings"]] == ["NO_GPU", "TRITON_OK"]


def test_second_run_has_nothing_to_do_and_is_fast(venv):
    before = pip_freeze(venv)
    report, elapsed = run_install(venv)
    assert report["plan"]["actions"] == [] and report["results"] is None
    assert report["self_check"]["kernel_ok"]
    assert pip_freeze(venv) == before
    assert elapsed < 60, f"a run with nothing to do took {elapsed:.1f} s"


def test_human_output_of_a_run_with_nothing_to_do(venv):
    proc = subprocess.run([str(venv), str(INSTALL_PY)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0
    assert "Nothing for install.py to do." in proc.stdout
    assert proc.stdout.rstrip().endswith(
        "No NVIDIA GPU: the pack uses PyTorch attention. The Triton interpreter works here (for tests only).")


def test_bootstrap_on_the_venv_passes_the_demo_exit_code(venv, tmp_path):
    demo = tmp_path / "demo.py"
    demo.write_text("import sys, torch\nprint('demo ran with', torch.__version__)\nsys.exit(3)\n")
    torch_before = [x for x in pip_freeze(venv) if x.startswith("torch==")]
    vdir = venv.parent.parent
    proc = subprocess.run([sys.executable, str(INSTALL_PY), "--venv", str(vdir), "--demo", "--demo-script", str(demo)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "demo ran with 2.13.0" in proc.stdout
    assert "the demo exited with code 3" in proc.stdout
    assert "install torch" not in proc.stdout  # torch is there: never reinstalled
    assert [x for x in pip_freeze(venv) if x.startswith("torch==")] == torch_before
