"""kernels/core/env_settings.py: the one place the pack reads its environment variables.

No dtype here: the settings are strings. Cases: every false word in every case, values that
mean on, unset (the default), and the source scan that keeps every reader going through here.
"""
import ast
import importlib.util
import sys
from pathlib import Path

import pytest

from triton_accel.kernels.core import env_settings

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = [*sorted((ROOT / "kernels").rglob("*.py")), *sorted((ROOT / "nodes").rglob("*.py")),
           *sorted((ROOT / "runtime").rglob("*.py")),
           *sorted((ROOT / "installer").rglob("*.py")), ROOT / "__init__.py", ROOT / "install.py"]
SETTINGS_MODULE = ROOT / "kernels" / "core" / "env_settings.py"

OFF = ["", "0", "false", "False", "FALSE", "no", "No", "off", "OFF", " 0 ", "\toff\n"]
ON = ["1", "true", "True", "yes", "on", "2", "enabled"]
SWITCHES = [(env_settings.AUTOTUNE, env_settings.autotune_enabled, False),
            (env_settings.FAST_LAUNCH, env_settings.fast_launch_enabled, True)]


@pytest.mark.parametrize("name,read,default", SWITCHES, ids=[s[0] for s in SWITCHES])
@pytest.mark.parametrize("value", OFF + ON, ids=repr)
def test_every_switch_reads_the_same_false_words(monkeypatch, name, read, default, value):
    monkeypatch.setenv(name, value)
    assert read() is (value not in OFF)


@pytest.mark.parametrize("name,read,default", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_unset_switch_is_its_default(monkeypatch, name, read, default):
    monkeypatch.delenv(name, raising=False)
    assert read() is default


@pytest.mark.parametrize("value,expected", [(None, None), ("", None), ("  ", None), ("/x/y", "/x/y")])
def test_cache_dir(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(env_settings.CACHE_DIR, raising=False)
    else:
        monkeypatch.setenv(env_settings.CACHE_DIR, value)
    assert env_settings.cache_dir() == expected


def test_user_cache_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert env_settings.user_cache_root() == str(tmp_path / "triton_accel")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert env_settings.user_cache_root().endswith(str(Path(".cache") / "triton_accel"))


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "on", "yes", "0", "", "off", "2", " 1", "false"])
def test_interpreter_flag_reads_triton_interpret_as_triton_does(monkeypatch, value):
    libtriton = pytest.importorskip("triton._C.libtriton")
    if not hasattr(libtriton, "getenv_bool"):
        pytest.skip("this Triton reads TRITON_INTERPRET in Python, == '1' only")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert env_settings.interpreter_enabled() is bool(libtriton.getenv_bool("TRITON_INTERPRET", False))


def test_docs_list_every_setting_with_its_default():
    text = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines()
            if line.startswith("| `")}
    for setting in env_settings.SETTINGS:
        assert setting.name in rows, setting.name
        assert f"| {setting.default} |" in rows[setting.name], (setting.name, rows[setting.name])


def test_module_is_stdlib_only_and_loads_by_path():
    # install.py may load it by path: no relative import, nothing outside the stdlib.
    tree = ast.parse(SETTINGS_MODULE.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module.split(".")[0] in sys.stdlib_module_names | {"__future__"}
        elif isinstance(node, ast.Import):
            assert all(a.name.split(".")[0] in sys.stdlib_module_names for a in node.names)
    spec = importlib.util.spec_from_file_location("_env_settings_by_path", SETTINGS_MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.FALSE_WORDS == env_settings.FALSE_WORDS


def _is_ours(name: object) -> bool:
    return isinstance(name, str) and (name.startswith("TRITON_ACCEL_") or name == "TRITON_INTERPRET")


def environment_reads(source: str) -> list[str]:
    """`line: code` of every read of one of our variables (or TRITON_INTERPRET) through os.environ/getenv."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            target, names = node.func, node.args[:1]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            target, names = node.value, [node.slice]
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            target, names = node.comparators[0], [node.left]
        else:
            continue
        via_environment = any(word in ast.unparse(target) for word in ("environ", "getenv"))
        if via_environment and any(isinstance(n, ast.Constant) and _is_ours(n.value) for n in names):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("snippet", [
    'os.environ.get("TRITON_ACCEL_AUTOTUNE", "0")',
    'os.getenv("TRITON_ACCEL_CACHE_DIR")',
    'environ["TRITON_ACCEL_FAST_LAUNCH"]',
    '"TRITON_ACCEL_X" in os.environ',
    'os.environ.get("TRITON_INTERPRET") == "1"',
])
def test_the_scan_finds_a_direct_read(snippet):
    assert environment_reads(f"import os\nfrom os import environ\nx = {snippet}\n")


def test_no_shipped_code_reads_our_variables_outside_env_settings():
    offenders = []
    for path in SHIPPED:
        if path == SETTINGS_MODULE:
            continue
        offenders += [f"{path.relative_to(ROOT)}:{hit}" for hit in environment_reads(path.read_text(encoding="utf-8"))]
    assert offenders == [], "read these through kernels/core/env_settings.py:\n" + "\n".join(offenders)
