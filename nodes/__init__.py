"""ComfyUI nodes of the pack: the node classes (inputs, outputs, the text on the node), the
server routes and the status payload; the engine they call is the runtime package. Imports
ComfyUI only inside functions that run in ComfyUI."""
from .benchmark_node import TritonAccelBenchmark
from .patch_nodes import TritonAccelPatch, TritonAccelPatchAttention, TritonAccelPatchLinear
from .settings_node import TritonAccelSettings

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
