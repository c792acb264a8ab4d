"""ComfyUI runs every node, and so every sampler step, under torch.inference_mode(): the
layers these tests call run without autograd recording too (a call autograd records goes to
ComfyUI's Linear: test_patch_linear.py::test_calls_autograd_records_go_to_comfyui)."""
import sys
from pathlib import Path

import pytest
import torch

PACK_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_PACKAGES = ("nodes", "runtime", "kernels")


def _is_pack_file(path: Path) -> bool:
    if path.parent == PACK_ROOT:
        return True
    return PACK_ROOT in path.parents and path.relative_to(PACK_ROOT).parts[0] in SHIPPED_PACKAGES


@pytest.fixture(autouse=True)
def _no_autograd_recording():
    with torch.no_grad():
        yield


@pytest.fixture
def pack_frames():
    """fn -> the pack's functions ("file:function") entered while fn() runs (sys.setprofile):
    what proves that a handed-back call runs nothing of ours."""
    def record(fn) -> list[str]:
        seen = []

        def profile(frame, event, arg):
            if event == "call":
                path = Path(frame.f_code.co_filename)
                if _is_pack_file(path):
                    seen.append(f"{path.name}:{frame.f_code.co_name}")

        sys.setprofile(profile)
        try:
            fn()
        finally:
            sys.setprofile(None)
        return seen
    return record
