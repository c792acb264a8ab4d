"""Fixtures for the install.py tests (helpers live in install_helpers.py)."""
import importlib.util
import sys
from pathlib import Path

import pytest


def _load_by_path(name):
    """The suite runs with --import-mode=importlib (nothing on sys.path): register the helper
    modules under their unique names so the tests can `from install_helpers import ...`."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(name + ".py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_load_by_path("install_pe_builder")
download_msvc_wheels = _load_by_path("install_helpers").download_msvc_wheels
load_install_module = _load_by_path("install_helpers").load_install_module


@pytest.fixture(scope="session")
def inst():
    """install.py loaded by path as module triton_accel_install."""
    return load_install_module()


@pytest.fixture(scope="session")
def msvc_wheels():
    """{msvc-runtime version: (wheel path, expected DLL file version)}, downloaded once into
    .cache/ (git-ignored). Fails under CI=... when PyPI cannot be reached, skips otherwise."""
    return download_msvc_wheels()
