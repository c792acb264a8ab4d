"""ComfyUI runs every node, and so every sampler step, under torch.inference_mode(): the
layers these tests call run without autograd recording too (a call autograd records goes to
ComfyUI's Linear: test_patch_linear.py::test_calls_autograd_records_go_to_comfyui)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _no_autograd_recording():
    with torch.no_grad():
        yield
