"""install.py --python PROG where PROG answers the probe with something malformed, or does not
exist: a PROBE_FAILED finding in a clean report (never a KeyError / TypeError traceback), and a
non-zero exit with a clear message for a Python that is not there."""
import json
import subprocess
import sys

import pytest

from install_helpers import INSTALL_PY, fake_python, good_probe


def run(*args, cwd):
    return subprocess.run([sys.executable, str(INSTALL_PY), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def _with(exe, **changes):
    raw = good_probe(exe)
    for key, value in changes.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    return json.dumps(raw)


def _gpu_torch(exe, gpus=None, **torch):
    t = {"version": "2.9.1+cu128", "cuda": "12.8", "hip": None, "cuda_available": True,
         "gpus": gpus if gpus is not None else [{"name": "NVIDIA GeForce RTX 4090", "capability": [8, 9],
                                                 "arch": None}]}
    t.update(torch)
    return _with(exe, dists={"torch": "2.9.1+cu128"}, torch=t)


# (id, payload builder, what the PROBE_FAILED message must say after "unreadable probe output: ")
MALFORMED = [
    ("not-json", lambda exe: "{this is not json", "JSONDecodeError"),
    ("a-list", lambda exe: "[1, 2, 3]", "expected a JSON object, got list"),
    ("a-string", lambda exe: '"hello"', "expected a JSON object, got str"),
    ("deeply-nested", lambda exe: "[" * 100_000 + "]" * 100_000, "RecursionError"),
    ("missing-executable", lambda exe: _with(exe, executable=None), "missing 'executable'"),
    ("missing-version", lambda exe: _with(exe, version=None), "missing 'version'"),
    ("version-a-string", lambda exe: _with(exe, version="3.12.3"), "'version' has the wrong type (str)"),
    ("version-of-strings", lambda exe: _with(exe, version=["3", "12"]), "'version' is not a list of numbers"),
    ("prefix-a-number", lambda exe: _with(exe, prefix=5), "'prefix' has the wrong type (int)"),
    ("free-threaded-a-string", lambda exe: _with(exe, free_threaded="no"), "'free_threaded' has the wrong type (str)"),
    ("sys-path-a-string", lambda exe: _with(exe, sys_path="/usr/lib"), "'sys_path' has the wrong type (str)"),
    ("dists-with-a-number", lambda exe: _with(exe, dists={"torch": 2}), "'dists' has the wrong type (dict)"),
    ("torch-a-list", lambda exe: _with(exe, torch=[]), "'torch' has the wrong type (list)"),
    ("torch-cuda-available-a-string", lambda exe: _gpu_torch(exe, cuda_available="yes"),
     "'torch.cuda_available' has the wrong type (str)"),
    ("gpu-without-capability", lambda exe: _gpu_torch(exe, gpus=[{"name": "NVIDIA GeForce RTX 4090"}]),
     "GPU 'NVIDIA GeForce RTX 4090' has no [major, minor] capability"),
    ("gpu-capability-a-string", lambda exe: _gpu_torch(exe, gpus=[{"name": "X", "capability": "8.9"}]),
     "GPU 'X' has no [major, minor] capability"),
    ("gpu-a-string", lambda exe: _gpu_torch(exe, gpus=["NVIDIA GeForce RTX 4090"]), "a GPU entry without a name"),
]


@pytest.mark.parametrize("build, says", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_probe_output_is_a_probe_failed_finding(build, says, tmp_path):
    exe = tmp_path / "bin" / "python"
    fake_python(exe.parent, build(exe))
    proc = run("--python", str(exe), "--dry-run", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    [finding] = report["plan"]["findings"]
    assert (finding["code"], finding["severity"]) == ("PROBE_FAILED", "error")
    assert finding["message"].startswith(f"Could not inspect {exe}: unreadable probe output: "), finding["message"]
    assert says in finding["message"]
    assert report["verdict"]["path"] == "pytorch" and report["plan"]["triton_blocked"] is True


def test_well_formed_fake_probe_is_accepted(tmp_path):
    """The control case: the same fake Python with a well-formed report (a GPU torch) is read."""
    exe = tmp_path / "bin" / "python"
    fake_python(exe.parent, _gpu_torch(exe))
    proc = run("--python", str(exe), "--dry-run", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["facts"]["gpus"][0]["capability"] == [8, 9]
    assert "PROBE_FAILED" not in [x["code"] for x in report["plan"]["findings"]]


def test_malformed_probe_without_json_is_readable_too(tmp_path):
    """Human output (no --json) of the same failure: the finding and its fix, exit code 0."""
    exe = tmp_path / "bin" / "python"
    fake_python(exe.parent, "[1]")
    proc = run("--python", str(exe), "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"[ERROR] Could not inspect {exe}: unreadable probe output: expected a JSON object, got list" in proc.stdout


@pytest.mark.parametrize("python", ["/nonexistent/python3", "no-such-python-anywhere-3.99"],
                         ids=["path", "bare-name"])
@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["text", "json"])
def test_missing_python_exits_non_zero(python, json_flag, tmp_path):
    proc = run("--python", python, "--dry-run", *json_flag, cwd=tmp_path)
    assert proc.returncode == 2
    assert f"install.py: error: --python {python}: no such executable file" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_python_that_is_not_executable_exits_non_zero(tmp_path):
    exe = tmp_path / "python"
    exe.write_text("print('hi')\n")  # a file, but not executable
    proc = run("--python", str(exe), "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2
    assert f"--python {exe}: no such executable file" in proc.stderr


def test_python_by_bare_name_is_found_on_path(tmp_path):
    """--python python (a name, not a path) still works: it is looked up on PATH."""
    import os
    folder, name = os.path.split(sys.executable)
    proc = subprocess.run([sys.executable, str(INSTALL_PY), "--python", name, "--dry-run", "--json"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300, env={"PATH": folder})
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)["facts"]
    assert facts["probe_error"] is None and facts["python_version"][:2] == list(sys.version_info[:2])
