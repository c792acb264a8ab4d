"""ComfyUI nodes of the pack. Imports ComfyUI only inside functions that run in ComfyUI."""
from .patch_attention import TritonAccelPatchAttention
from .settings import TritonAccelSettings

NODE_CLASS_MAPPINGS = {
    "TritonAccelSettings": TritonAccelSettings,
    "TritonAccelPatchAttention": TritonAccelPatchAttention,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "TritonAccelSettings": "Triton Accel Settings",
    "TritonAccelPatchAttention": "Triton Accel Patch Attention",
}
