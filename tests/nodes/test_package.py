"""The pack as ComfyUI sees it: any folder name, and the settings install.py leaves behind."""
import importlib.util
import json
import shutil
import sys

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(folder, name):
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_pack_loads_whatever_its_folder_is_called(tmp_path):
    folder = tmp_path / "ComfyUI-Triton-Accel"
    shutil.copytree(ROOT, folder, ignore=shutil.ignore_patterns(".git", ".venv*", ".ext", ".whl", ".cache", "tests"))
    module = _load(folder, "ComfyUI-Triton-Accel")  # a dashed name, as ComfyUI Manager may clone it
    assert module.WEB_DIRECTORY == "./web/js"
    assert (folder / "web" / "js" / "triton_accel.js").is_file()


def test_install_config_sets_triton_cache_dir_unless_the_user_did(tmp_path, monkeypatch):
    folder = tmp_path / "pack"
    (folder / "kernels" / "core").mkdir(parents=True)
    shutil.copy(ROOT / "__init__.py", folder / "__init__.py")
    shutil.copy(ROOT / "kernels" / "core" / "install_config.py", folder / "kernels" / "core" / "install_config.py")  # read by path
    (folder / "triton_accel.json").write_text(json.dumps({"triton_cache_dir": str(tmp_path / "cache")}))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    _load(folder, "pack_a")
    import os
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/users/own/choice")
    _load(folder, "pack_b")
    assert os.environ["TRITON_CACHE_DIR"] == "/users/own/choice"


def test_unreadable_install_config_is_ignored(tmp_path, monkeypatch):
    folder = tmp_path / "pack"
    (folder / "kernels" / "core").mkdir(parents=True)
    shutil.copy(ROOT / "__init__.py", folder / "__init__.py")
    shutil.copy(ROOT / "kernels" / "core" / "install_config.py", folder / "kernels" / "core" / "install_config.py")  # read by path
    (folder / "triton_accel.json").write_text("{broken")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    _load(folder, "pack_c")
    import os
    assert "TRITON_CACHE_DIR" not in os.environ
