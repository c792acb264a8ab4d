"""How another node pack reaches kernels/core/extensions.py (register_attention, register_linear),
whatever our folder name and load order.

ComfyUI imports each custom-node folder as a module named after the folder, so ours may be
"ComfyUI-Triton-Accel", "comfyui-triton-accel" or anything. At load the pack publishes the
extension API as sys.modules["triton_accel"] (PUBLIC_NAME), so `import triton_accel` works in
every pack loaded after ours. Packs loaded before ours cannot import it yet: each pack
defines a module-level `register_triton_accel(api)` (HOOK_NAME), calls it itself when the
import succeeds, and we call it here for every pack that was loaded before us. A pack whose
hook raises is logged and skipped; ours keeps loading. docs/extension_api.md has the recipe.
"""
from __future__ import annotations

import logging
import os
import sys

from ..kernels.core import extensions

log = logging.getLogger("triton_accel")

PUBLIC_NAME = "triton_accel"
HOOK_NAME = "register_triton_accel"
_hooks_called: set[int] = set()


def publish(pack_module_name: str) -> bool:
    """sys.modules["triton_accel"] = the extension API, unless that name is taken. When our pack
    itself was imported as "triton_accel" (its folder has that name), the package forwards the
    API names itself (the top-level __getattr__). True when `import triton_accel` reaches the API."""
    current = sys.modules.get(PUBLIC_NAME)
    if current is None:
        sys.modules[PUBLIC_NAME] = extensions.public_module()
        return True
    if current is extensions.public_module() or getattr(current, "__name__", None) == pack_module_name:
        return True
    log.warning("Triton Accel: a module named %r (%s) is already loaded; other packs reach the extension API "
                "through their %s(api) hook only", PUBLIC_NAME, getattr(current, "__file__", "?"), HOOK_NAME)
    return False


def _custom_node_dirs() -> list[str]:
    try:
        import folder_paths

        return [os.path.realpath(d) for d in folder_paths.get_folder_paths("custom_nodes")]
    except Exception as e:
        log.debug("Triton Accel: no custom_nodes folders known (%s)", e)
        return []


def _pack_modules(dirs: list[str]):
    """Top-level modules of the custom-node packs loaded so far: (name, module)."""
    for name, module in list(sys.modules.items()):
        source = getattr(module, "__file__", None)
        if not isinstance(source, str):
            continue
        source = os.path.realpath(source)
        folder = os.path.dirname(source)
        parent = os.path.dirname(folder) if os.path.basename(source) == "__init__.py" else folder
        if parent in dirs:
            yield name, module


def call_pending_hooks(pack_module_name: str | None = None) -> list[str]:
    """Call HOOK_NAME(api) of every custom-node pack loaded before ours; their folder names."""
    dirs = _custom_node_dirs()
    called = []
    for name, module in _pack_modules(dirs):
        if name == pack_module_name:
            continue
        hook = vars(module).get(HOOK_NAME)  # vars(): never a module's __getattr__
        if not callable(hook) or id(hook) in _hooks_called:
            continue
        _hooks_called.add(id(hook))
        try:
            hook(extensions.public_module())
        except Exception:
            log.exception("Triton Accel: %s.%s(api) failed; that pack's extensions are not registered", name,
                          HOOK_NAME)
            continue
        called.append(os.path.basename(name.rstrip("/\\")) or name)  # 0.29 names a pack by its path
    return called


def setup(pack_module_name: str) -> None:
    """At our pack's load: publish the API, then register the packs that loaded before us."""
    publish(pack_module_name)
    called = call_pending_hooks(pack_module_name)
    if called:
        log.info("Triton Accel: registered the attention extensions of %s", ", ".join(called))
