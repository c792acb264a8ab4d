"""Helpers for the install.py tests (a unique module name: tests/ is not a package)."""
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALL_PY = ROOT / "install.py"
CACHE = ROOT / ".cache" / "install-tests"


def load_install_module():
    """install.py is not part of the pack package (it runs before anything is importable):
    load it by path as module ``triton_accel_install``."""
    name = "triton_accel_install"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, INSTALL_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


# A small PyPI wheel (about 2 MB) that ships the VC++ runtime DLLs: msvc-runtime.
# Versions read from the DLL files themselves (VS_FIXEDFILEINFO), cross-checked with a plain
# byte search for the VS_FIXEDFILEINFO signature.
MSVC_WHEELS = {
    "14.51.36231": (14, 51, 36247, 0),  # newer than the 14.42 triton-windows needs
    "14.40.33807": (14, 40, 33810, 0),  # older than 14.42: the "DLL load failed" case
}


def _download_wheel(version: str) -> Path:
    dest = CACHE / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(f"msvc_runtime-{version}-*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--platform", "win_amd64", "--python-version", "3.12", "-d", str(dest),
           f"msvc-runtime=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    found = sorted(dest.glob(f"msvc_runtime-{version}-*.whl"))
    if proc.returncode != 0 or not found:
        reason = (f"could not download msvc-runtime=={version} from PyPI: "
                  + " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:]))
        if os.environ.get("CI"):
            pytest.fail(reason + " (CI reaches PyPI, so this is a failure there)")
        print(reason)
        pytest.skip(reason)
    return found[0]


def download_msvc_wheels():
    return {v: (_download_wheel(v), expected) for v, expected in MSVC_WHEELS.items()}


def wheel_member(wheel: Path, filename: str) -> bytes:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n == filename or n.endswith("/" + filename)]
        assert names, f"{filename} not in {wheel.name}"
        return zf.read(sorted(names)[0])


def fake_python(folder, payload: str):
    """An executable that answers install.py's probe with `payload` after the probe mark."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "probe-output.txt").write_text("@@TRITON_ACCEL_PROBE@@" + payload + "\n")
    exe = folder / "python"
    exe.write_text(f"#!/bin/sh\ncat '{folder / 'probe-output.txt'}'\n")
    exe.chmod(0o755)
    return exe


def good_probe(exe):
    """A well-formed probe report (what PROBE_SCRIPT prints) of a Python without torch."""
    d = str(exe.parent)
    return {"executable": str(exe), "machine": "x86_64", "version": [3, 12, 3], "prefix": d, "base_prefix": d,
            "exec_prefix": d, "base_exec_prefix": d, "free_threaded": False, "include_dir": None, "sys_path": [],
            "site_dirs": [], "pip": True, "dists": {}, "torch_requires": []}
