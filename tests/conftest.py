"""Shared test setup.

The pack is loaded the way ComfyUI loads it: the repository root as a package under a
name that is not its folder name (ComfyUI Manager may clone it as any folder name), so
every import inside the pack must be relative. Tests import it as ``triton_accel``.
"""
import importlib.util
import os
import sys
from pathlib import Path

# The Triton interpreter is chosen when triton is first imported and when kernels are
# decorated, so it must be set before anything imports triton. Compile tests that need
# real JITFunctions run in a subprocess with it unset.
os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
PACK_NAME = "triton_accel"


def load_pack(name: str = PACK_NAME):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


load_pack()
