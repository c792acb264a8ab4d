"""Triton Accel: faster attention for diffusion models in ComfyUI, through Triton kernels.

ComfyUI imports this folder as a package under whatever name it was cloned as, so every
import inside the pack is relative. Outside ComfyUI (tests, benchmarks) the import still
succeeds and the nodes are simply not registered; ``kernels`` stays usable on its own.
"""
import logging

__version__ = "0.1.0"

log = logging.getLogger("triton_accel")

NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}
WEB_DIRECTORY = "./web/js"


def _apply_install_config() -> None:
    """Settings install.py wrote for this machine, applied before anything imports triton.

    install.py writes triton_accel.json only when the default Triton cache is unusable (a
    non-ASCII or read-only user folder on Windows); a TRITON_CACHE_DIR the user set wins.
    kernels/core/install_config.py reads and checks it; it is loaded by path because importing the
    ``kernels`` package imports torch and triton, and TRITON_CACHE_DIR must be set before that.
    An invalid value is ignored with a warning; nothing here may stop the pack from loading.
    """
    import importlib.util
    import os
    import sys

    pack_dir = os.path.dirname(os.path.abspath(__file__))
    source = os.path.join(pack_dir, "kernels", "core", "install_config.py")
    name = "_triton_accel_install_config"  # private: never clashes with the pack's own package name
    try:
        spec = importlib.util.spec_from_file_location(name, source)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # registered before it runs, as the import system does
        spec.loader.exec_module(module)
        module.apply_cache_dir(pack_dir)
    except Exception:
        sys.modules.pop(name, None)
        log.warning("Triton Accel: could not apply the settings in %s", os.path.join(pack_dir, "triton_accel.json"),
                    exc_info=True)


_apply_install_config()


def _inside_comfyui() -> bool:
    try:
        import comfy.model_patcher  # noqa: F401
    except Exception:
        return False
    return True


if _inside_comfyui():
    # A broken pack must never take ComfyUI down with it: log, register nothing.
    try:
        from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811
        from .nodes.routes import register_routes
        from .nodes.status import log_startup

        register_routes()
        log_startup()
    except Exception:
        log.exception("Triton Accel: the nodes could not be loaded; ComfyUI continues without them")
    try:
        # Other packs' attention implementations: `import triton_accel` from now on, and the
        # register_triton_accel(api) hooks of packs loaded before this one (docs/extension_api.md).
        from .runtime.extension_hooks import setup as _setup_extension_api

        _setup_extension_api(__name__)
    except Exception:
        log.exception("Triton Accel: the extension API could not be published; other packs cannot register")

# The extension API's names, read from the package itself when it was imported as
# "triton_accel" (tests; a clone into a folder of that name), where sys.modules holds the package.
_EXTENSION_API_NAMES = frozenset({"API_VERSION", "Constraints", "LinearConstraints", "ExtensionCallError",
                                  "BackendUnavailableError", "register_attention", "register_linear",
                                  "unregister", "list_extensions", "reset_counts", "run_linear",
                                  "linear_call_refusal"})


def __getattr__(name):
    if name in _EXTENSION_API_NAMES:
        from .kernels.core import extensions

        return getattr(extensions, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY", "__version__"]
