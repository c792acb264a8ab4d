"""Every GPU / Triton / torch rule of the pack, in one stdlib-only file.

Which devices our Triton kernels can serve, which attention paths each may take, and why
not, decided from plain facts (vendor, compute capability, versions). Four readers use it
and must never disagree: the Settings node (`nodes/settings.py`, `nodes/device_probe.py`), the kernel registry
(`kernels/attention.py`, each kernel's refusal), and `install.py`, which loads this file by
path (ComfyUI Manager runs install.py before torch or Triton may import), so nothing here
imports anything outside the standard library.

Rules, each with a code the callers compare (never the message text):
- Triton must import, and on a GPU it must compile and run a test kernel.
- NVIDIA sm_75 (Turing) and newer; Triton 3.3 dropped Turing (triton-lang/triton#5066), so
  sm_75 needs Triton <= 3.2. Older than sm_75 (GTX 10xx, sm_61): never.
- Blackwell (sm_100, sm_120): Triton >= 3.3 (first release with its backend) and torch >= 2.7
  built for CUDA >= 12.8.
- FP8 tensor cores (e4m3 dots): sm_89 and newer. bf16 dots: sm_80 and newer.
- AMD (ROCm): our kernels compile for gfx942 / gfx1100 but have not run on AMD hardware
  here, so `auto` keeps PyTorch attention and `fp16` forces them.
- Intel and other devices: PyTorch attention. CPU: PyTorch attention; the Triton
  interpreter (TRITON_INTERPRET=1) serves tests only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Optional, Tuple

# ---- path names: one spelling everywhere (nodes, install.py's report, stats) --------------
PATH_TRITON_FP16 = "triton_fp16"  # our FP16/BF16 (and FP32) flash attention
PATH_TRITON_FP8 = "triton_fp8"  # FP8 Q.K attention, sm_89+
PATH_PYTORCH = "pytorch"  # ComfyUI's own attention (PyTorch SDPA or whatever it chose)
PATHS = (PATH_TRITON_FP8, PATH_TRITON_FP16, PATH_PYTORCH)
# The kernel registry's implementation name for each Triton path.
BACKEND_OF_PATH: Dict[str, str] = {PATH_TRITON_FP16: "triton_attention", PATH_TRITON_FP8: "triton_fp8"}
# Paths whose numbers differ from ComfyUI's beyond rounding: used only where measured and checked.
LOSSY_PATHS = frozenset({PATH_TRITON_FP8})
PATH_LABEL = {PATH_TRITON_FP16: "Triton FP16/BF16", PATH_TRITON_FP8: "Triton FP8", PATH_PYTORCH: "PyTorch"}

MODES = ("auto", "fp8", "fp16", "off")

# ---- version and capability thresholds ----------------------------------------------------
MIN_NVIDIA_CAPABILITY = (7, 5)
TURING = (7, 5)
TURING_LAST_TRITON = (3, 2)  # Triton 3.3 dropped sm_75
BLACKWELL_MAJOR = 10  # sm_100 (B200) and sm_120 (RTX 50xx)
BLACKWELL_MIN_TRITON = (3, 3)
BLACKWELL_MIN_TORCH = (2, 7)
BLACKWELL_MIN_CUDA = (12, 8)
FP8_MIN_CAPABILITY = (8, 9)
BF16_MIN_CAPABILITY = (8, 0)

# Rule codes (the `code` of a Rule); install.py maps them to its findings' codes.
TRITON_MISSING = "TRITON_MISSING"
TRITON_BROKEN = "TRITON_BROKEN"
NO_GPU = "NO_GPU"
INTERPRETER_ONLY = "INTERPRETER_ONLY"
INTEL = "INTEL_UNSUPPORTED"
UNKNOWN_DEVICE = "UNKNOWN_DEVICE"
GPU_TOO_OLD = "GPU_TOO_OLD"
TURING_DROPPED = "GPU_TURING_DROPPED"
BLACKWELL_TRITON = "GPU_BLACKWELL_NEEDS_TRITON"
BLACKWELL_TORCH = "GPU_NEEDS_CU128"
AMD_NOT_VALIDATED = "AMD_NOT_VALIDATED"
NO_FP8 = "NO_FP8_TENSOR_CORES"
NO_BF16 = "NO_BF16_TENSOR_CORES"
MACOS = "NO_TRITON_OS"


@dataclass(frozen=True)
class Rule:
    """A refusal: `code` for programs, `reason` for people (shown on the node, in install.py)."""

    code: str
    reason: str


@dataclass(frozen=True)
class Facts:
    """What was probed on one device. Plain strings and tuples, so tests can write any GPU."""

    device: str = "cuda:0"  # "cuda:0", "cpu"
    vendor: str = "nvidia"  # "nvidia", "amd", "intel", "cpu", "other"
    name: str = ""
    capability: Optional[Tuple[int, int]] = None  # NVIDIA compute capability
    arch: str = ""  # "sm_89", "gfx1100", ...
    vram_bytes: int = 0
    torch_version: str = ""
    torch_cuda: Optional[str] = None  # torch.version.cuda; None: unknown or not a CUDA build
    triton_version: Optional[str] = None  # None: not importable
    triton_error: Optional[str] = None  # why Triton failed to import or to run a test kernel
    interpreter: bool = False  # TRITON_INTERPRET=1 in this process
    # Paths this build of the pack can run at all (its kernels registered, Triton importable);
    # a path not here is never chosen, whatever the GPU could do.
    implemented: FrozenSet[str] = field(default_factory=lambda: frozenset({PATH_TRITON_FP16}))


@dataclass(frozen=True)
class Decision:
    path: str
    reason: str
    # auto: the first call of each shape class times the candidates against ComfyUI's attention
    # and keeps the fastest that agrees with it, so a GPU we have no figures for never slows down.
    measure: bool = False
    # Paths to use, best first: a call one cannot serve (fp32 inputs for FP8, say) takes the next.
    candidates: Tuple[str, ...] = ()
    code: str = ""  # the Rule code when a blocker decided it, else ""
    overridden: bool = False  # the user's forced mode could not be honoured

    def __post_init__(self):
        if not self.candidates and self.path != PATH_PYTORCH:
            object.__setattr__(self, "candidates", (self.path,))


# ---- helpers ------------------------------------------------------------------------------

def version_tuple(version: Optional[str]) -> Tuple[int, ...]:
    """'3.3.1+git' -> (3, 3, 1); '2.7.0a0' -> (2, 7, 0); None or junk -> ()."""
    out = []
    for part in (version or "").split("+")[0].split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if digits == "":
            break
        out.append(int(digits))
    return tuple(out)


def sm(capability: Tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def _who(facts: Facts) -> str:
    return facts.name or (sm(facts.capability) if facts.capability else facts.device)


def min_capability_for(triton_version: Optional[str]) -> Tuple[int, int]:
    """Oldest NVIDIA capability the installed Triton compiles for."""
    tv = version_tuple(triton_version)
    return (8, 0) if tv[:2] > TURING_LAST_TRITON else MIN_NVIDIA_CAPABILITY


# ---- the rules ----------------------------------------------------------------------------

def nvidia_gpu_blocker(name: str, capability: Tuple[int, int], triton_version: Optional[str],
                       torch_version: str = "", torch_cuda: Optional[str] = None) -> Optional[Rule]:
    """Why Triton cannot serve this NVIDIA GPU with these versions, or None.

    `triton_version` None means "not known yet" (install.py before it installs Triton): only
    the rules that do not depend on it apply. torch/CUDA rules apply only when they are known.
    """
    who = name or sm(capability)
    tv = version_tuple(triton_version)
    if capability < MIN_NVIDIA_CAPABILITY:
        return Rule(GPU_TOO_OLD, f"{who} is {sm(capability)}: Triton needs sm_75 (RTX 20xx / GTX 16xx) or newer")
    if capability[0] == TURING[0] and tv and tv[:2] > TURING_LAST_TRITON:
        return Rule(TURING_DROPPED,
                    f"{who} is Turing ({sm(capability)}), which Triton dropped in 3.3 (installed: {triton_version}); "
                    "install triton-windows<3.3 / triton<3.3 with torch 2.6")
    if capability[0] >= BLACKWELL_MAJOR:
        torch_v = version_tuple(torch_version)
        cuda_v = version_tuple(torch_cuda)
        if torch_v and (torch_v[:2] < BLACKWELL_MIN_TORCH or (torch_cuda is not None and cuda_v[:2] < BLACKWELL_MIN_CUDA)):
            return Rule(BLACKWELL_TORCH,
                        f"{who} is Blackwell ({sm(capability)}), which needs torch 2.7 or newer built for CUDA 12.8 "
                        f"or newer (installed: torch {torch_version}, CUDA {torch_cuda or 'unknown'})")
        if tv and tv[:2] < BLACKWELL_MIN_TRITON:
            return Rule(BLACKWELL_TRITON,
                        f"{who} is Blackwell ({sm(capability)}), which needs Triton 3.3 or newer "
                        f"(installed: {triton_version}) with torch 2.7+ built for CUDA 12.8+")
    return None


def device_blocker(facts: Facts) -> Optional[Rule]:
    """Why this device cannot run our Triton kernels whatever Triton does, or None."""
    if facts.vendor == "cpu":
        if facts.interpreter:
            return None
        return Rule(NO_GPU, "no GPU: Triton kernels need an NVIDIA or AMD GPU")
    if facts.vendor == "intel":
        return Rule(INTEL, "Intel GPUs are not supported by this pack's kernels yet")
    if facts.vendor == "amd":
        return None
    if facts.vendor != "nvidia" or facts.capability is None:
        return Rule(UNKNOWN_DEVICE, f"unsupported device {facts.device} ({facts.name or facts.vendor})")
    return nvidia_gpu_blocker(facts.name, facts.capability, facts.triton_version, facts.torch_version,
                              facts.torch_cuda)


def triton_blocker(facts: Facts) -> Optional[Rule]:
    """Why Triton cannot serve this device at all, or None."""
    if facts.triton_version is None:
        return Rule(TRITON_MISSING, facts.triton_error or "Triton is not installed: run install.py from this pack's folder")
    if facts.triton_error:
        return Rule(TRITON_BROKEN, facts.triton_error)
    return device_blocker(facts)


def fp8_capable(facts: Facts) -> bool:
    return facts.vendor == "nvidia" and facts.capability is not None and facts.capability >= FP8_MIN_CAPABILITY


def capability_refusal(vendor: str, capability: Optional[Tuple[int, int]], name: str,
                       dtype: str = "", fp8: bool = False) -> Optional[Rule]:
    """What the kernel registry asks per call: can this device run a dot of this kind?

    dtype is the input dtype's short name ("bfloat16"); fp8 asks for e4m3 tensor cores.
    """
    if vendor != "nvidia" or capability is None:
        return None
    who = name or sm(capability)
    if fp8 and capability < FP8_MIN_CAPABILITY:
        return Rule(NO_FP8, f"FP8 tensor cores need sm_89+ ({who} is {sm(capability)})")
    if dtype == "bfloat16" and capability < BF16_MIN_CAPABILITY:
        return Rule(NO_BF16, f"bfloat16 needs compute capability >= 8.0 ({who} is {sm(capability)})")
    return None


def _where(facts: Facts) -> str:
    where = facts.name or facts.device
    arch = sm(facts.capability) if facts.capability and facts.vendor == "nvidia" else (facts.arch or facts.vendor)
    return f"{where} ({arch})"


def select_path(facts: Facts, mode: str = "auto") -> Decision:
    """The attention path for one device, with the reason a user reads on the node."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    if mode == "off":
        return Decision(PATH_PYTORCH, "off: ComfyUI's own attention, as chosen")
    forced = mode != "auto"
    blocker = triton_blocker(facts)
    if blocker:
        prefix = f"{mode} asked, but PyTorch fallback" if forced else "PyTorch fallback"
        return Decision(PATH_PYTORCH, f"{prefix}: {blocker.reason}", code=blocker.code, overridden=forced)
    where = _where(facts)

    if facts.vendor == "cpu":
        # Only reachable with the interpreter on: a test mode, never a speed-up.
        if not forced:
            return Decision(PATH_PYTORCH, "PyTorch fallback: no GPU (the Triton interpreter is for tests; "
                                          "choose fp16 to force it)", code=INTERPRETER_ONLY)
        return Decision(PATH_TRITON_FP16, f"{mode} forced on the CPU through TRITON_INTERPRET=1: "
                                          "Triton FP16/BF16 kernel in the interpreter (tests only, very slow)",
                        overridden=mode == "fp8")

    if facts.vendor == "amd" and not forced:
        return Decision(PATH_PYTORCH, f"PyTorch attention: our kernels are not validated on AMD GPUs yet "
                                      f"({where}); choose fp16 to try them", code=AMD_NOT_VALIDATED)

    fp8 = fp8_capable(facts) and PATH_TRITON_FP8 in facts.implemented
    if mode == "fp8":
        if not fp8_capable(facts):
            return Decision(PATH_TRITON_FP16, f"fp8 asked, but {where} has no FP8 tensor cores "
                                              "(needs sm_89+): using Triton FP16/BF16 instead",
                            code=NO_FP8, overridden=True)
        if not fp8:
            return Decision(PATH_TRITON_FP16, "fp8 asked, but the FP8 kernel cannot run here: "
                                              "using Triton FP16/BF16 instead", overridden=True)
        return Decision(PATH_TRITON_FP8, f"fp8 forced on {where} (FP16/BF16 for calls FP8 cannot serve)",
                        candidates=(PATH_TRITON_FP8, PATH_TRITON_FP16))
    if mode == "fp16":
        return Decision(PATH_TRITON_FP16, f"fp16 forced: Triton FP16/BF16 attention on {where}")

    if fp8:
        return Decision(PATH_TRITON_FP8, f"auto: {where} has FP8 tensor cores: Triton FP8 and FP16/BF16 "
                                         "attention, each timed against ComfyUI's attention per shape; the "
                                         "fastest that matches it is kept", measure=True,
                        candidates=(PATH_TRITON_FP8, PATH_TRITON_FP16))
    return Decision(PATH_TRITON_FP16, f"auto: {where}: Triton FP16/BF16 attention, timed against ComfyUI's "
                                      "attention per shape; the faster one is kept", measure=True)


def expected_paths(decision: Decision) -> str:
    """One phrase for install.py's verdict: what auto will try on this device."""
    if decision.path == PATH_PYTORCH:
        return "PyTorch attention"
    names = " and ".join(PATH_LABEL[p] for p in decision.candidates)
    if decision.measure:
        return f"{names} attention, each timed against PyTorch's per shape (the faster that agrees is kept)"
    return f"{names} attention"


# ---- Triton features per version (kernel options a version lacks are refused, not tried) --

# Triton minor -> what it has, from each release's public API (checked against 3.2 ... 3.9 by
# tests/versions/): `tl.range(..., warp_specialize=)`, host TensorDescriptor
# (triton.tools.tensor_descriptor), `tl.make_tensor_descriptor`, Gluon
# (`triton.experimental.gluon` with `gluon.jit`). All four first appear in 3.4; 3.2-3.3 had
# only the experimental descriptor API (`tl._experimental_descriptor_load`).
FEATURE_MIN_TRITON: Dict[str, Tuple[int, int]] = {
    "host_tensor_descriptor": (3, 4),
    "warp_specialize": (3, 4),
    "device_tensor_descriptor": (3, 4),
    "gluon": (3, 4),
}


def feature_refusal(feature: str, triton_version: Optional[str]) -> Optional[Rule]:
    need = FEATURE_MIN_TRITON[feature]
    tv = version_tuple(triton_version)
    if not tv or tv[:2] < need:
        return Rule("TRITON_TOO_OLD_FOR_" + feature.upper(),
                    f"{feature.replace('_', ' ')} needs Triton {need[0]}.{need[1]}+ (installed: {triton_version})")
    return None


__all__ = [
    "PATH_TRITON_FP16", "PATH_TRITON_FP8", "PATH_PYTORCH", "PATHS", "BACKEND_OF_PATH", "LOSSY_PATHS",
    "MODES", "Rule", "Facts", "Decision", "version_tuple", "sm", "min_capability_for", "nvidia_gpu_blocker",
    "device_blocker", "triton_blocker", "fp8_capable", "capability_refusal", "select_path", "expected_paths",
    "feature_refusal", "FEATURE_MIN_TRITON",
]
