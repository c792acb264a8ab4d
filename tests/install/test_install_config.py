"""triton_accel.json with values a hand edit (or a broken disk) may leave: the pack's import
must not break, install.py --json must not crash, each ignored value is logged once, naming the
file, and install.py reports it as CONFIG_INVALID.

The pack side loads the real __init__.py from a copy of the pack (only __init__.py and
kernels/core/install_config.py, which it reads by path before anything imports torch); the
install.py side runs the real install.py from a copy too, against a fake Python whose probe
report is fixed, so each case takes a fraction of a second."""
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from install_helpers import ROOT, fake_python, good_probe

DEEP = 100_000  # json's decoder recurses once per level: far past any recursion limit


def _config_cases(tmp_path):
    a_file = tmp_path / "a-file.txt"
    a_file.write_text("not a folder")
    return {
        "number": ('{"triton_cache_dir": 5}', "is a number, not a folder path"),
        "list": ('{"triton_cache_dir": ["/tmp/x"]}', "is an array, not a folder path"),
        "dict": ('{"triton_cache_dir": {"path": "/tmp/x"}}', "is an object, not a folder path"),
        "bool": ('{"triton_cache_dir": true}', "is a boolean, not a folder path"),
        "null": ('{"triton_cache_dir": null}', "is null, not a folder path"),
        "nul-char": ('{"triton_cache_dir": "\\u0000"}', "contains a NUL character"),
        "nested-value": ('{"triton_cache_dir": ' + "[" * DEEP + "]" * DEEP + "}", "is nested too deeply to read"),
        "nested-file": ("[" * DEEP + "]" * DEEP, "is nested too deeply to read"),
        "regular-file": (json.dumps({"triton_cache_dir": str(a_file)}), f"{str(a_file)!r} is a file, not a folder"),
        "under-a-file": (json.dumps({"triton_cache_dir": str(a_file / "cache")}),
                         f"cannot be created: {str(a_file)!r} is a file, not a folder"),
        "proc": ('{"triton_cache_dir": "/proc/self/triton-cache"}',
                 "'/proc/self/triton-cache' is under /proc, a pseudo-filesystem that cannot hold a cache"),
        "relative": ('{"triton_cache_dir": "cache/triton"}', "'cache/triton' is not an absolute path"),
        "empty": ('{"triton_cache_dir": ""}', "is empty"),
        "not-an-object": ('["triton_cache_dir"]', "is not a JSON object (it holds an array)"),
        "bad-utf8": (b'{"triton_cache_dir": "\xff"}', "is unreadable (UnicodeDecodeError"),
    }


CASES = [
    "number", "list", "dict", "bool", "null", "nul-char", "nested-value", "nested-file", "regular-file",
    "under-a-file", "proc", "relative", "empty", "not-an-object", "bad-utf8"]


def _write(folder, content):
    path = folder / "triton_accel.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def _pack_copy(tmp_path, name="pack"):
    """__init__.py, install.py, its installer/ package and the two files they load by path, in a
    folder called `name`."""
    folder = tmp_path / name
    (folder / "kernels" / "core").mkdir(parents=True)
    (folder / "installer").mkdir()
    installer = [path.relative_to(ROOT).as_posix() for path in (ROOT / "installer").glob("*.py")]
    for rel in ("__init__.py", "install.py", "kernels/core/install_config.py", "kernels/core/gpu_rules.py", *installer):
        shutil.copy(ROOT / rel, folder / rel)
    return folder


def _load_pack(folder, name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


# ---- the reader itself ----------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_reader_ignores_the_value_and_says_why(case, tmp_path, inst):
    content, why = _config_cases(tmp_path)[case]
    path = _write(tmp_path, content)
    config = inst.install_config.load(str(tmp_path))
    assert config.values == {}
    assert len(config.problems) == 1, config.problems
    assert str(path) in config.problems[0] and why in config.problems[0], config.problems


def test_reader_keeps_a_good_value(tmp_path, inst):
    _write(tmp_path, json.dumps({"triton_cache_dir": str(tmp_path / "new" / "cache"), "other": 1}))
    config = inst.install_config.load(str(tmp_path))
    assert (config.values, config.problems) == ({"triton_cache_dir": str(tmp_path / "new" / "cache")}, [])
    assert inst.install_config.load(str(tmp_path / "no-such-folder")) == (
        str(tmp_path / "no-such-folder" / "triton_accel.json"), {}, [])


# ---- the pack's import ----------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_pack_import_survives_and_warns_once(case, tmp_path, monkeypatch, caplog):
    folder = _pack_copy(tmp_path)
    content, why = _config_cases(tmp_path)[case]
    path = _write(folder, content)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    with caplog.at_level(logging.WARNING, logger="triton_accel"):
        module = _load_pack(folder, f"pack_config_{case.replace('-', '_')}")
    assert module.WEB_DIRECTORY == "./web/js"
    assert "TRITON_CACHE_DIR" not in os.environ
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(path) in warnings[0] and why in warnings[0]


def test_pack_import_applies_a_good_value_before_torch(tmp_path):
    """In a fresh interpreter: TRITON_CACHE_DIR is set, and neither torch nor triton was imported
    to do it (it only counts when set before triton's first import)."""
    folder = _pack_copy(tmp_path)
    _write(folder, json.dumps({"triton_cache_dir": str(tmp_path / "cache")}))
    code = ("import importlib.util, os, sys; os.environ.pop('TRITON_CACHE_DIR', None); "
            "spec = importlib.util.spec_from_file_location('any_name', sys.argv[1], "
            "submodule_search_locations=[os.path.dirname(sys.argv[1])]); m = importlib.util.module_from_spec(spec); "
            "sys.modules['any_name'] = m; spec.loader.exec_module(m); "
            "print(os.environ.get('TRITON_CACHE_DIR'), 'torch' in sys.modules, 'triton' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(folder / "__init__.py")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(tmp_path / "cache"), "False", "False"]


def test_pack_import_survives_a_missing_reader(tmp_path, monkeypatch, caplog):
    folder = _pack_copy(tmp_path)
    (folder / "kernels" / "core" / "install_config.py").unlink()
    _write(folder, json.dumps({"triton_cache_dir": str(tmp_path / "cache")}))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    with caplog.at_level(logging.WARNING, logger="triton_accel"):
        _load_pack(folder, "pack_without_reader")
    assert "TRITON_CACHE_DIR" not in os.environ
    assert [r.getMessage() for r in caplog.records] == [
        f"Triton Accel: could not apply the settings in {folder / 'triton_accel.json'}"]


# ---- install.py --json ----------------------------------------------------------------

def run_install(install_py, *args, cwd):
    proc = subprocess.run([sys.executable, str(install_py), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("case", CASES)
def test_install_json_reports_config_invalid(case, tmp_path):
    folder = _pack_copy(tmp_path)
    content, why = _config_cases(tmp_path)[case]
    path = _write(folder, content)
    exe = tmp_path / "bin" / "python"
    fake_python(exe.parent, json.dumps(good_probe(exe)))
    proc = run_install(folder / "install.py", "--python", str(exe), "--dry-run", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    [finding] = [x for x in report["plan"]["findings"] if x["code"] == "CONFIG_INVALID"]
    assert finding["severity"] == "warning"
    assert str(path) in finding["message"] and why in finding["message"]
    assert report["facts"]["config"] == {}


@pytest.mark.parametrize("folder_name", ["comfyui-triton-accel", "ComfyUI Triton Accel (copy)", "pack.\u00e4"])
def test_install_runs_from_any_folder_name_and_cwd(folder_name, tmp_path):
    folder = _pack_copy(tmp_path, folder_name)
    exe = tmp_path / "bin" / "python"
    fake_python(exe.parent, json.dumps(good_probe(exe)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_install(folder / "install.py", "--python", str(exe), "--dry-run", "--json", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["facts"]["pack_dir"] == str(folder)
    assert [x["code"] for x in report["plan"]["findings"]] == ["TORCH_MISSING"]
