"""Which attention path a device gets, decided from probed facts alone.

Kept free of torch, Triton and ComfyUI so the whole decision table can be tested with
made-up devices (an sm_61 card, a Turing card on Triton 3.3, an AMD card...) on a machine
that has none of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("auto", "fp8", "fp16", "off")

# Paths the patch node knows how to run.
PATH_TRITON_FP16 = "triton_fp16"  # our FP16/BF16 flash attention
PATH_TRITON_FP8 = "triton_fp8"  # FP8 Q.K / P.V attention (sm_89+), when the pack ships it
PATH_TRITON_INT8 = "triton_int8"  # INT8 Q.K attention (sm_75..sm_86), when the pack ships it
PATH_PYTORCH = "pytorch"  # ComfyUI's own attention function, untouched


@dataclass(frozen=True)
class DeviceFacts:
    """What was probed on one device. Strings and tuples only, so tests can write them."""

    device: str  # "cuda:0", "cpu"
    vendor: str  # "nvidia", "amd", "intel", "cpu", "other"
    name: str = ""
    capability: tuple[int, int] | None = None  # NVIDIA compute capability
    arch: str = ""  # "sm_89", "gfx1100", ...
    vram_bytes: int = 0
    torch_version: str = ""
    triton_version: str | None = None  # None: not importable
    triton_error: str | None = None  # why Triton failed to import or to run a kernel
    interpreter: bool = False  # TRITON_INTERPRET=1 in this process
    # Attention paths this build of the pack actually implements; a path that is not here is
    # never chosen, whatever the GPU could do.
    implemented: frozenset[str] = field(default_factory=lambda: frozenset({PATH_TRITON_FP16}))


@dataclass(frozen=True)
class Decision:
    path: str
    reason: str
    # auto mode: the first calls of each shape class time our kernel against the original
    # function and keep the faster (a GPU we have no measured speed for must never slow down).
    measure: bool = False
    # Paths to use, best first: a call one cannot serve (fp32 inputs for FP8, say) takes the
    # next; in auto all of them are timed against ComfyUI's attention.
    candidates: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.candidates and self.path != PATH_PYTORCH:
            object.__setattr__(self, "candidates", (self.path,))

    @property
    def uses_triton(self) -> bool:
        return self.path != PATH_PYTORCH


def _version_tuple(version: str | None) -> tuple[int, ...]:
    out = []
    for part in (version or "").split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if digits == "" or not part[0].isdigit():
            break
        out.append(int(digits))
    return tuple(out)


def _sm(cap: tuple[int, int]) -> str:
    return f"sm_{cap[0]}{cap[1]}"


def triton_blocker(facts: DeviceFacts) -> str | None:
    """Why Triton cannot serve this device at all, or None."""
    if facts.triton_version is None:
        return facts.triton_error or "Triton is not installed: run install.py from this pack's folder"
    if facts.triton_error:
        return facts.triton_error
    triton = _version_tuple(facts.triton_version)
    if facts.vendor == "cpu":
        if facts.interpreter:
            return None
        return "no GPU: Triton kernels need an NVIDIA or AMD GPU"
    if facts.vendor == "intel":
        return "Intel GPUs are not supported by this pack's kernels yet"
    if facts.vendor == "amd":
        return None
    if facts.vendor != "nvidia" or facts.capability is None:
        return f"unsupported device {facts.device} ({facts.name or facts.vendor})"
    cap = facts.capability
    if cap < (7, 5):
        return f"{facts.name or _sm(cap)} is {_sm(cap)}: Triton needs sm_75 (RTX 20xx / GTX 16xx) or newer"
    if cap == (7, 5) and triton >= (3, 3):
        return (f"{facts.name or 'this GPU'} is Turing (sm_75), which Triton dropped in 3.3 "
                f"(installed: {facts.triton_version}); install triton-windows<3.3 / triton<3.3 with torch 2.6")
    if cap >= (12, 0) and triton < (3, 3):
        return (f"{facts.name or 'this GPU'} is Blackwell ({_sm(cap)}), which needs Triton 3.3 or newer "
                f"(installed: {facts.triton_version}) with torch 2.7+ built for CUDA 12.8+")
    return None


def select_path(facts: DeviceFacts, mode: str = "auto") -> Decision:
    """The attention path for one device, with the reason a user reads on the node."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    where = facts.name or facts.device
    if mode == "off":
        return Decision(PATH_PYTORCH, "off: ComfyUI's own attention, as chosen")
    blocker = triton_blocker(facts)
    if blocker:
        return Decision(PATH_PYTORCH, f"PyTorch fallback: {blocker}")

    if facts.vendor == "cpu":
        # Only reachable with the interpreter on: a test mode, never a speed-up.
        if mode == "auto":
            return Decision(PATH_PYTORCH, "PyTorch fallback: no GPU (the Triton interpreter is for tests; "
                                          "choose fp16 to force it)")
        return Decision(PATH_TRITON_FP16, f"{mode} forced on the CPU through TRITON_INTERPRET=1: "
                                          "Triton FP16/BF16 kernel in the interpreter (tests only, very slow)")

    if facts.vendor == "amd" and mode == "auto":
        # The kernels compile for gfx942 / gfx1100 but have never run on AMD hardware here.
        return Decision(PATH_PYTORCH, f"PyTorch attention: our kernels are not validated on AMD GPUs yet "
                                      f"({where}, {facts.arch}); choose fp16 to try them")

    fp8_capable = facts.vendor == "nvidia" and facts.capability >= (8, 9)
    arch = _sm(facts.capability) if facts.capability and facts.vendor == "nvidia" else (facts.arch or facts.vendor)

    if mode == "fp8":
        if not fp8_capable:
            return Decision(PATH_TRITON_FP16, f"fp8 asked, but {where} ({arch}) has no FP8 tensor cores "
                                              "(needs sm_89+): using Triton FP16/BF16 instead")
        if PATH_TRITON_FP8 not in facts.implemented:
            return Decision(PATH_TRITON_FP16, "fp8 asked, but this release has no FP8 attention kernel yet: "
                                              "using Triton FP16/BF16 instead")
        return Decision(PATH_TRITON_FP8, f"fp8 forced on {where} ({arch}) (FP16/BF16 for calls FP8 cannot serve)",
                        candidates=(PATH_TRITON_FP8, PATH_TRITON_FP16))
    if mode == "fp16":
        return Decision(PATH_TRITON_FP16, f"fp16 forced: Triton FP16/BF16 attention on {where} ({arch})")

    # auto
    if fp8_capable and PATH_TRITON_FP8 in facts.implemented:
        return Decision(PATH_TRITON_FP8, f"auto: {where} ({arch}) has FP8 tensor cores: Triton FP8 and FP16/BF16 "
                                         "attention, each timed against ComfyUI's attention per shape; the "
                                         "fastest that matches it is kept", measure=True,
                        candidates=(PATH_TRITON_FP8, PATH_TRITON_FP16))
    if not fp8_capable and PATH_TRITON_INT8 in facts.implemented:
        return Decision(PATH_TRITON_INT8, f"auto: {where} ({arch}): Triton INT8 Q.K and FP16/BF16 attention, "
                                          "timed against ComfyUI's attention per shape", measure=True,
                        candidates=(PATH_TRITON_INT8, PATH_TRITON_FP16))
    note = " (FP8 attention is not in this release yet)" if fp8_capable else ""
    return Decision(PATH_TRITON_FP16, f"auto: {where} ({arch}): Triton FP16/BF16 attention{note}, "
                                      "timed against ComfyUI's attention per shape; the faster one is kept",
                    measure=True)
