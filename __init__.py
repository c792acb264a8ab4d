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
    """
    import json
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_accel.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        log.warning("Triton Accel: ignoring unreadable %s", path)
        return
    cache_dir = config.get("triton_cache_dir") if isinstance(config, dict) else None
    if cache_dir:
        os.environ.setdefault("TRITON_CACHE_DIR", cache_dir)


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

        register_routes()
    except Exception:
        log.exception("Triton Accel: the nodes could not be loaded; ComfyUI continues without them")

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY", "__version__"]
