"""The Comfy Registry manifest and ComfyUI Manager's requirements file.

`comfy node validate` alone accepts a manifest with no PublisherId or a version like
"abc", so the manifest is also loaded with comfy-cli's own parser and the fields the
registry requires are checked here.
"""
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]

# The registry's rules for these fields (docs.comfy.org/registry/specifications).
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,98}[a-z0-9]$")
SEMVER_RE = re.compile(r"^\d+\.\d+\.\d+$")
PUBLISHER_RE = re.compile(r"^[a-z][a-z0-9-]{0,98}$")


def registry_problems(pyproject: Path) -> list[str]:
    from comfy_cli.registry.config_parser import extract_node_configuration

    config = extract_node_configuration(str(pyproject))
    if config is None:
        return ["comfy-cli could not parse the manifest"]
    project, comfy = config.project, config.tool_comfy
    problems = []
    if not NAME_RE.match(project.name or ""):
        problems.append(f"[project] name {project.name!r} is not a registry node id")
    if not SEMVER_RE.match(project.version or ""):
        problems.append(f"[project] version {project.version!r} is not X.Y.Z")
    if not project.description:
        problems.append("[project] description is empty")
    license_file = project.license.file
    if not (project.license.text or (license_file and (pyproject.parent / license_file).is_file())):
        problems.append("[project] license names no text and no existing file")
    if not project.urls.repository.startswith("https://"):
        problems.append("[project.urls] Repository is missing")
    if not PUBLISHER_RE.match(comfy.publisher_id or ""):
        problems.append(f"[tool.comfy] PublisherId {comfy.publisher_id!r} is missing or malformed")
    if not comfy.display_name:
        problems.append("[tool.comfy] DisplayName is missing")
    for dep in project.dependencies:
        if Requirement(dep).name in {"torch", "torchvision", "torchaudio"}:
            problems.append(f"dependency {dep!r}: ComfyUI owns torch, never list it")
    return problems


def _comfy(*args, cwd):
    exe = shutil.which("comfy", path=str(Path(sys.executable).parent)) or shutil.which("comfy")
    assert exe, "comfy-cli is not installed in this environment"
    return subprocess.run(
        [exe, "--skip-prompt", "--no-enable-telemetry", *args],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )


def test_manifest_has_every_field_the_registry_requires():
    assert registry_problems(ROOT / "pyproject.toml") == []
    from comfy_cli.registry.config_parser import extract_node_configuration

    config = extract_node_configuration(str(ROOT / "pyproject.toml"))
    assert config.project.name == "comfyui-triton-accel"
    assert config.tool_comfy.display_name == "Triton Accel"


@pytest.mark.parametrize(
    "edit, expected",
    [
        pytest.param(('PublisherId = "triton-accel"', 'PublisherId = ""'), "PublisherId", id="no-publisher"),
        pytest.param(('version = "0.1.0"', 'version = "abc"'), "version", id="version-abc"),
        pytest.param(('name = "comfyui-triton-accel"', 'name = "Triton Accel!"'), "name", id="bad-name"),
        pytest.param(('DisplayName = "Triton Accel"', 'DisplayName = ""'), "DisplayName", id="no-display-name"),
        pytest.param(('Repository = "https', 'Homepage = "https'), "Repository", id="no-repository"),
        pytest.param(('    "safetensors",\n', '    "safetensors",\n    "torch>=2.4",\n'), "torch", id="lists-torch"),
    ],
)
def test_broken_manifest_is_caught(tmp_path, edit, expected):
    text = (ROOT / "pyproject.toml").read_text()
    old, new = edit
    assert old in text
    (tmp_path / "pyproject.toml").write_text(text.replace(old, new, 1))
    shutil.copy(ROOT / "LICENSE", tmp_path / "LICENSE")
    problems = registry_problems(tmp_path / "pyproject.toml")
    assert any(expected in p for p in problems), problems


def test_comfy_node_validate_and_pack(tmp_path):
    # Both commands work on git-tracked files, so run them in a throwaway repository that
    # holds the pack's shipped files, never in the developer's checkout.
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    tracked = sorted(set(tracked) | {"pyproject.toml", "LICENSE", "__init__.py", "requirements.txt", ".comfyignore"})
    for rel in tracked:
        src = ROOT / rel
        if src.is_file():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, tmp_path / rel)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)

    validate = _comfy("node", "validate", cwd=tmp_path)
    assert validate.returncode == 0, validate.stdout + validate.stderr
    assert "passed" in validate.stdout + validate.stderr

    pack = _comfy("node", "pack", cwd=tmp_path)
    assert pack.returncode == 0, pack.stdout + pack.stderr
    names = set(zipfile.ZipFile(tmp_path / "node.zip").namelist())
    for needed in ("__init__.py", "pyproject.toml", "requirements.txt", "install.py"):
        if needed in tracked:
            assert needed in names
    # .comfyignore keeps the development files out of the registry archive.
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", ".ci/"))]
    assert all(any(n.startswith(package) for n in names) for package in ("kernels/", "nodes/", "runtime/"))


LINES = [l.strip() for l in (ROOT / "requirements.txt").read_text().splitlines()]
REQS = [Requirement(l) for l in LINES if l and not l.startswith("#")]

WINDOWS = {"sys_platform": "win32", "platform_system": "Windows", "platform_machine": "AMD64", "os_name": "nt"}
LINUX = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix"}


def _installed_on(env):
    return {r.name for r in REQS if r.marker is None or r.marker.evaluate(env)}


def test_requirements_never_name_torch():
    assert not {r.name for r in REQS} & {"torch", "torchvision", "torchaudio"}


@pytest.mark.parametrize(
    "env, expected",
    [
        pytest.param(WINDOWS, {"triton-windows", "safetensors"}, id="windows"),
        pytest.param(LINUX, {"triton", "safetensors"}, id="linux-x86_64"),
        pytest.param({**LINUX, "platform_machine": "aarch64"}, {"safetensors"}, id="linux-aarch64"),
        pytest.param({**LINUX, "sys_platform": "darwin", "platform_system": "Darwin"}, {"safetensors"}, id="macos"),
    ],
)
def test_requirements_per_platform(env, expected):
    assert _installed_on(env) == expected
    # Both Triton distributions on one machine shadow each other's `triton` module.
    assert not {"triton", "triton-windows"} <= _installed_on(env)


def test_every_requirement_line_is_one_pip_argument():
    # Manager passes each line as a single argv element to pip, so it must parse alone.
    for line in LINES:
        if line and not line.startswith("#"):
            Requirement(line)
            if ";" in line:
                Marker(line.split(";", 1)[1])
