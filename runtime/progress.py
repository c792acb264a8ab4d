"""ComfyUI's progress bar, for the engine's long first-call work (preparing weights,
autotuning) on the node that runs it."""
from __future__ import annotations

import sys
import threading


def comfy_progress_bar(total: int):
    """ComfyUI's progress bar on the node that is running; None outside ComfyUI (comfy.utils
    never loaded: tests, the command-line benchmark) or when it cannot be made."""
    utils = sys.modules.get("comfy.utils")
    if utils is None or not hasattr(utils, "ProgressBar"):
        return None
    try:
        return utils.ProgressBar(total)
    except Exception:
        return None


class AutotuneProgress:
    """kernels.core.tuning's progress hook: one ComfyUI progress bar per autotuning run.

    The bar is kept per thread: under ComfyUI's MultiGPU work units each GPU's thread may
    autotune at the same time, and one shared bar would take the other run's counts."""

    def __init__(self):
        self._local = threading.local()

    def __call__(self, done: int, total: int) -> None:
        bar = getattr(self._local, "bar", None)
        if done == 0 or bar is None:
            bar = self._local.bar = comfy_progress_bar(total)
        if bar is not None:
            bar.update_absolute(done, total)
        if done >= total:
            self._local.bar = None
