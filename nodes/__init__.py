"""ComfyUI nodes of the pack. Imports ComfyUI only inside functions that run in ComfyUI."""
from .benchmark import TritonAccelBenchmark
from .patch_attention import TritonAccelPatchAttention
from .patch_linear import TritonAccelPatch, TritonAccelPatchLinear
from .settings import TritonAccelSettings

NODE_CLASS_MAPPINGS = {
    "TritonAccelSettings": TritonAccelSettings,
    "TritonAccelPatchAttention": TritonAccelPatchAttention,
    "TritonAccelPatchLinear": TritonAccelPatchLinear,
    "TritonAccelPatch": TritonAccelPatch,
    "TritonAccelBenchmark": TritonAccelBenchmark,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "TritonAccelSettings": "Triton Accel Settings",
    # Short titles: "Triton Accel Patch Attention" was cut to "Triton Accel Patch Atte..." at the
    # default node width. The class ids stay, so saved workflows keep loading.
    "TritonAccelPatchAttention": "Triton Accel Attention",
    "TritonAccelPatchLinear": "Triton Accel Linear",
    "TritonAccelPatch": "Triton Accel Patch",  # attention + Linear; "... Attention + Linear" was cut off too
    "TritonAccelBenchmark": "Triton Accel Benchmark",
}
