"""What every installer module shares: the pack folder, the two stdlib-only pack files loaded
by path, the Windows names both the probe and the checks use, and small text helpers.

kernels/core/gpu_rules.py is the one rules file the Settings node decides with too, so install.py
and the node agree; kernels/core/install_config.py reads and checks triton_accel.json. Both are
loaded by path, never through the ``kernels`` package (which imports torch and triton).
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from typing import Optional, Sequence, Tuple

# installer/ lies in the pack folder, beside install.py.
PACK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_sibling(relative_path: str, name: str):
    """A stdlib-only file of this pack, loaded by path: install.py runs before the pack is
    importable (and must never import torch or triton through the ``kernels`` package). The
    private module name cannot clash with the pack's own package, whatever its folder is called."""
    path = os.path.join(PACK_DIR, *relative_path.split("/"))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up in sys.modules while a class is built
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


gpu_rules = _load_sibling("kernels/core/gpu_rules.py", "_triton_accel_gpu_rules")
install_config = _load_sibling("kernels/core/install_config.py", "_triton_accel_install_config")

CONFIG_NAME = install_config.CONFIG_NAME  # the pack's per-machine settings (docs/install.md)
CONFIG_KEY_CACHE = install_config.KEY_CACHE_DIR  # folder for TRITON_CACHE_DIR when the env var is unset

VCRT_DLLS = ("msvcp140.dll", "vcruntime140.dll", "vcruntime140_1.dll")
LONG_PATHS_KEY = r"SYSTEM\CurrentControlSet\Control\FileSystem"
NUGET_URL = "https://api.nuget.org/v3-flatcontainer/python/{v}/python.{v}.nupkg"

Version = Tuple[int, ...]


# ----------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------

def parse_version(text: Optional[str]) -> Version:
    """Release numbers of a version string: '2.10.0+cu128' -> (2, 10, 0); '3.3.0a0.post11' -> (3, 3, 0)."""
    if not text:
        return ()
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text))
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def vstr(v: Sequence[int]) -> str:
    return ".".join(str(p) for p in v)


def quote_arg(arg: str) -> str:
    """Quote one argument the way a user would type it (cmd and POSIX shells alike)."""
    if arg and re.fullmatch(r"[A-Za-z0-9_\-.,/:\\=+@]+", arg):
        return arg
    return '"' + arg.replace('"', '\\"') + '"'


def cmdline(argv: Sequence[str]) -> str:
    return " ".join(quote_arg(a) for a in argv)


def is_ascii(text: str) -> bool:
    try:
        text.encode("ascii")
    except UnicodeEncodeError:
        return False
    return True
