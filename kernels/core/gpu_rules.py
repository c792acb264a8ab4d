"""Every GPU / Triton / torch rule of the pack, in one stdlib-only file.

Which devices our Triton kernels can serve, which attention paths each may take, and why
not, decided from plain facts (vendor, compute capability, versions). Four readers use it
and must never disagree: the Settings node (`nodes/settings_node.py`, `runtime/settings.py`,
`runtime/device_probe.py`), the kernel registry (`kernels/attention/dispatch.py`, each
kernel's refusal), and `install.py`, which loads this file by path (ComfyUI Manager runs
install.py before torch or Triton may import), so nothing here imports anything outside the
standard library.

Rules, each with a code the callers compare (never the message text):
- Triton must import, and on a GPU it must compile and run a test kernel.
- NVIDIA sm_75 (Turing) and newer; Triton 3.3 dropped Turing (triton-lang/triton#5066), so
  sm_75 needs Triton <= 3.2. Older than sm_75 (GTX 10xx, sm_61): never.
- Blackwell (sm_100, sm_120): Triton >= 3.3 (first release with its backend) and torch >= 2.7
  built for CUDA >= 12.8.
- FP8 tensor cores (e4m3 dots): sm_89 and newer. bf16 dots: sm_80 and newer. INT8 dots: sm_75+.
- auto times, per shape class, these paths against ComfyUI's attention (auto_candidates):
  sm_90 / sm_100: FP8, FP16/BF16; sm_89 / sm_120: FP8 (INT8 Q.K + FP8 P.V where the INT8
  kernel offers it, else full FP8), INT8, FP16/BF16; sm_80 / sm_86 / sm_87 and sm_75 with
  Triton <= 3.2: INT8, FP16/BF16. A quantized path is kept only where it measured faster and
  agreed with ComfyUI's output (runtime/speed_choice.py).
- AMD (ROCm): per gfx family (amd_family): CDNA3 gfx942, CDNA4 gfx950, RDNA3 gfx11, RDNA4
  gfx12 are what our kernels are compile-tested for (tests/compile/test_compile_amd.py);
  other gfx archs get PyTorch. None has run on AMD hardware here, so `auto` keeps PyTorch
  attention and Linear (see select_path) and a forced mode runs ours: fp16 everywhere; fp8
  only where the matrix cores take OCP e4m3 (gfx950, gfx12; gfx942's FP8 is the fnuz format
  our quantisers do not write, gfx11 has no FP8 dot); int8 on all four (i8 MFMA / iu8 WMMA).
- Intel (XPU) and other devices Triton cannot serve: PyTorch attention and Linear. CPU:
  PyTorch attention (SDPA); the Triton interpreter (TRITON_INTERPRET=1) serves tests only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Optional, Tuple

# ---- path names: one spelling everywhere (nodes, install.py's report, stats) --------------
PATH_TRITON_FP16 = "triton_fp16"  # our FP16/BF16 (and FP32) flash attention
PATH_TRITON_FP8 = "triton_fp8"  # FP8 attention (full FP8, Gluon, INT8 Q.K + FP8 P.V, FP8 Q.K), sm_89+
PATH_TRITON_INT8 = "triton_int8"  # INT8 Q.K, FP16 P.V (SageAttention 1 recipe), sm_75+
PATH_PYTORCH = "pytorch"  # ComfyUI's own attention (PyTorch SDPA or whatever it chose)
PATHS = (PATH_TRITON_FP8, PATH_TRITON_INT8, PATH_TRITON_FP16, PATH_PYTORCH)
# Every path our kernels serve: what a complete build of the pack ships (install.py assumes it).
TRITON_PATHS = frozenset({PATH_TRITON_FP8, PATH_TRITON_INT8, PATH_TRITON_FP16})
# The kernel registry's implementation name for each Triton path.
BACKEND_OF_PATH: Dict[str, str] = {PATH_TRITON_FP16: "triton_attention", PATH_TRITON_FP8: "triton_fp8",
                                   PATH_TRITON_INT8: "triton_int8"}
# Paths whose numbers differ from ComfyUI's beyond rounding: used only where measured and checked.
LOSSY_PATHS = frozenset({PATH_TRITON_FP8, PATH_TRITON_INT8})
PATH_LABEL = {PATH_TRITON_FP16: "Triton FP16/BF16", PATH_TRITON_FP8: "Triton FP8", PATH_TRITON_INT8: "Triton INT8",
              PATH_PYTORCH: "PyTorch"}

# Saved workflows store the mode by value: never rename or drop one.
MODES = ("auto", "fp8", "int8", "fp16", "off")

# The kernels that may serve PATH_TRITON_FP8 (kernels/attention/dispatch.py picks one per call, in the
# order fp8_kernel_order() gives, the first whose limits accept the call).
FP8_KERNEL_GLUON = "fp8_gluon"  # Q.K and P.V in e4m3, warp-specialised Gluon kernel (sm_90)
FP8_KERNEL_INT8_FP8PV = "int8_fp8pv"  # INT8 Q.K, e4m3 P.V with FP16 accumulation in a block (Sage2++)
FP8_KERNEL_FULL = "fp8_full"  # Q.K and P.V in e4m3, plain Triton; no mask, causal or GQA, head dim <= 128
FP8_KERNEL_QK = "fp8_qk"  # e4m3 Q.K, FP16/BF16 P.V: masks, GQA, causal, head dims to 256
# Kernels that need more than the FP8 path itself (a Triton with Gluon, the INT8 module's FP8 P.V).
OPTIONAL_FP8_KERNELS = frozenset({FP8_KERNEL_GLUON, FP8_KERNEL_INT8_FP8PV})
PRECISION_OF_FP8_KERNEL = {
    FP8_KERNEL_GLUON: "FP8 Q.K and P.V, warp-specialised Gluon kernel",
    FP8_KERNEL_INT8_FP8PV: "INT8 Q.K, FP8 P.V with FP16 accumulation",
    FP8_KERNEL_FULL: "FP8 Q.K and P.V",
    FP8_KERNEL_QK: "FP8 Q.K, FP16/BF16 P.V",
}
PRECISION_OF_PATH = {PATH_TRITON_INT8: "INT8 Q.K, FP16 P.V", PATH_TRITON_FP16: "FP16/BF16"}

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
INT8_MIN_CAPABILITY = (7, 5)  # int8 x int8 -> int32 mma.sync from Turing on
# wgmma and setmaxnreg are sm_90a instructions (H100 / H200 / H20), absent on sm_100 and sm_120:
# the Gluon FP8 kernel's only target (kernels/attention/gluon_hopper.py asks this, not a literal).
GLUON_CAPABILITY = (9, 0)

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
AMD_ARCH_UNTESTED = "AMD_ARCH_UNTESTED"
AMD_FP8_FNUZ = "AMD_FP8_FNUZ"
AMD_FP8_TRITON = "AMD_FP8_NEEDS_TRITON"
NO_FP8 = "NO_FP8_TENSOR_CORES"
NO_BF16 = "NO_BF16_TENSOR_CORES"
NO_INT8 = "NO_INT8_ATTENTION"
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
    # OPTIONAL_FP8_KERNELS that can run on this device (kernels.attention.fp8_kernels_available);
    # None: not known (install.py, before Triton runs), and the reason names both candidates.
    fp8_kernels: Optional[FrozenSet[str]] = None


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


# ---- AMD (ROCm): what each gfx family's matrix cores take ----------------------------------
# From AMD's ISA manuals, and what Triton 3.9 emits for our kernels (pinned in the AMDGCN by
# tests/compile/test_compile_amd.py):
# - CDNA3 (gfx940/941/942, MI300): MFMA f16/bf16 and i8; FP8 MFMA only in the fnuz formats
#   (float8_e4m3fnuz: exponent bias 8, max 240, no negative zero). Our quantisers write OCP
#   float8_e4m3fn (max 448); Triton compiles those dots for gfx942 by converting to f16 and
#   using f16 MFMAs, so FP8 would cost a conversion and buy no matrix speed there.
# - CDNA4 (gfx950, MI350): MFMA f16/bf16, i8 and OCP FP8 (v_mfma_f32_32x32x64_f8f6f4).
# - RDNA3 (gfx1100-1103, gfx1150/1151): WMMA f16/bf16 and iu8; no FP8 dot (Triton upcasts).
# - RDNA4 (gfx1200/1201): WMMA f16/bf16, iu8 and OCP FP8 (v_wmma_f32_16x16x16_fp8_fp8).
AMD_CDNA3, AMD_CDNA4, AMD_RDNA3, AMD_RDNA4 = "CDNA3", "CDNA4", "RDNA3", "RDNA4"
AMD_ARCH_PREFIXES = (("gfx94", AMD_CDNA3), ("gfx950", AMD_CDNA4), ("gfx110", AMD_RDNA3), ("gfx115", AMD_RDNA3),
                     ("gfx120", AMD_RDNA4))
AMD_FP8_FORMAT = {AMD_CDNA3: "fnuz", AMD_CDNA4: "ocp", AMD_RDNA4: "ocp"}  # RDNA3: none
AMD_INT8_FAMILIES = frozenset({AMD_CDNA3, AMD_CDNA4, AMD_RDNA3, AMD_RDNA4})
# First Triton whose HIP backend accepts fp8e4nv (OCP e4m3) for the family: its
# backends/amd/compiler.py supported_fp8_dtypes (3.2: none on AMD; 3.3: gfx950; 3.4: gfx12),
# checked against the releases in tests/compile/test_compile_amd.py. Compiled here: 3.5, 3.6, 3.9.
AMD_FP8_MIN_TRITON = {AMD_CDNA4: (3, 3), AMD_RDNA4: (3, 4)}
# One arch per family, compiled by the compile tests (kernels and the instruction each must use).
AMD_COMPILE_TARGETS = ("gfx942", "gfx950", "gfx1100", "gfx1201")
# Why auto does not time our kernels on AMD (select_path, install.py say it in these words).
AMD_AUTO_WHY = ("our kernels are compile-tested for it but not run on AMD hardware (a GPU fault would stop "
                "ComfyUI, which auto's timing check cannot catch)")


def amd_family(arch: str) -> str:
    """"CDNA3" / "CDNA4" / "RDNA3" / "RDNA4" for a gfx arch ("gfx942:sramecc+:xnack-" too), else ""."""
    arch = (arch or "").split(":")[0]
    return next((family for prefix, family in AMD_ARCH_PREFIXES if arch.startswith(prefix)), "")


def amd_arch_blocker(arch: str, name: str = "") -> Optional[Rule]:
    """Why our kernels do not serve this AMD GPU at all (a gfx family they are not built and
    compile-tested for), or None."""
    if amd_family(arch):
        return None
    return Rule(AMD_ARCH_UNTESTED,
                f"{name or 'this AMD GPU'} ({(arch or 'gfx arch unknown').split(':')[0]}) is not an AMD target our "
                f"kernels are compile-tested for ({', '.join(AMD_COMPILE_TARGETS)}: CDNA3, CDNA4, RDNA3, RDNA4)")


def amd_fp8_refusal(arch: str, name: str = "", triton_version: Optional[str] = None) -> Optional[Rule]:
    """Why this AMD GPU cannot run our FP8 (OCP e4m3) dots, or None where its matrix cores take them
    (and the installed Triton, when known, compiles e4m3 for it)."""
    family = amd_family(arch)
    who = f"{name or 'this AMD GPU'} ({(arch or 'gfx?').split(':')[0]})"
    fmt = AMD_FP8_FORMAT.get(family)
    if fmt == "ocp":
        need = AMD_FP8_MIN_TRITON[family]
        tv = version_tuple(triton_version)
        if tv and tv[:2] < need:
            return Rule(AMD_FP8_TRITON, f"{who}: Triton {need[0]}.{need[1]} is the first release that compiles OCP "
                                        f"FP8 (e4m3) for {family} (installed: {triton_version})")
        return None
    if fmt == "fnuz":
        return Rule(AMD_FP8_FNUZ,
                    f"{who} is CDNA3, whose FP8 matrix cores take the fnuz format (float8_e4m3fnuz, max 240); "
                    "our kernels quantise to OCP float8_e4m3fn, which Triton runs there as FP16 MFMAs (no FP8 "
                    "speed-up)")
    what = "RDNA3 has no FP8 matrix instructions" if family == AMD_RDNA3 else "no FP8 matrix instructions known"
    return Rule(NO_FP8, f"{who}: {what}")


def amd_int8_refusal(arch: str, name: str = "") -> Optional[Rule]:
    """Why this AMD GPU cannot run our INT8 dots, or None (i8 MFMA on CDNA, iu8 WMMA on RDNA3/4)."""
    if amd_family(arch) in AMD_INT8_FAMILIES:
        return None
    return Rule(NO_INT8, f"{name or 'this AMD GPU'} ({arch or 'gfx?'}): no INT8 matrix instructions known")


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
        return Rule(INTEL, "Intel GPUs (XPU) are not served by this pack's Triton kernels: PyTorch runs them")
    if facts.vendor == "amd":
        return amd_arch_blocker(facts.arch, facts.name)
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
    if facts.vendor == "amd":
        return amd_fp8_refusal(facts.arch, triton_version=facts.triton_version) is None
    return facts.vendor == "nvidia" and facts.capability is not None and facts.capability >= FP8_MIN_CAPABILITY


def int8_capable(facts: Facts) -> bool:
    if facts.vendor == "amd":
        return amd_int8_refusal(facts.arch) is None
    return facts.vendor == "nvidia" and facts.capability is not None and facts.capability >= INT8_MIN_CAPABILITY


def capability_refusal(vendor: str, capability: Optional[Tuple[int, int]], name: str,
                       dtype: str = "", fp8: bool = False, arch: str = "") -> Optional[Rule]:
    """What the kernel registry asks per call: can this device run a dot of this kind?

    dtype is the input dtype's short name ("bfloat16"); fp8 asks for e4m3 tensor cores. On AMD
    the gfx `arch` decides (every family we serve has bf16 dots); without it FP8 is refused.
    """
    if vendor == "amd":
        return amd_fp8_refusal(arch, name) if fp8 else None
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


def _consumer_fp8(capability: Tuple[int, int]) -> bool:
    """Ada (sm_89) and consumer Blackwell (sm_120/121): FP8 and INT8 MMAs with FP16 accumulation run
    at twice the FP32-accumulating rate, so both quantized recipes are worth timing there."""
    return capability == (8, 9) or capability[0] == 12


def auto_candidates(capability: Tuple[int, int]) -> Tuple[str, ...]:
    """What auto times against ComfyUI's attention on an NVIDIA GPU, best first (before
    Facts.implemented filters it). Hopper and datacenter Blackwell accumulate FP8 in FP32 at full
    rate, so INT8 Q.K buys nothing over full FP8 there; Ampere and Turing (sm_75, Triton <= 3.2:
    triton_blocker refuses newer) have no FP8 tensor cores, and INT8 runs at twice FP16."""
    if capability >= FP8_MIN_CAPABILITY:
        if _consumer_fp8(capability):
            return (PATH_TRITON_FP8, PATH_TRITON_INT8, PATH_TRITON_FP16)
        return (PATH_TRITON_FP8, PATH_TRITON_FP16)
    return (PATH_TRITON_INT8, PATH_TRITON_FP16)


def fp8_kernel_order(capability: Optional[Tuple[int, int]], optional: FrozenSet[str]) -> Tuple[str, ...]:
    """The FP8 path's kernels, best first, on this GPU given the OPTIONAL_FP8_KERNELS that run here.

    sm_90: the warp-specialised Gluon kernel; sm_89/sm_120: INT8 Q.K with FP8 P.V accumulated in
    FP16 inside a block (SageAttention 2++); everywhere: the plain full-FP8 kernel, then the FP8 Q.K
    kernel for what the others refuse (masks, causal, GQA, head dims over 128)."""
    first: Tuple[str, ...] = ()
    if capability == GLUON_CAPABILITY and FP8_KERNEL_GLUON in optional:
        first = (FP8_KERNEL_GLUON,)
    elif capability is not None and _consumer_fp8(capability) and FP8_KERNEL_INT8_FP8PV in optional:
        first = (FP8_KERNEL_INT8_FP8PV,)
    return first + (FP8_KERNEL_FULL, FP8_KERNEL_QK)


def fp8_precision(facts: Facts) -> str:
    """The precision the FP8 path runs at on this device, in words."""
    if facts.fp8_kernels is None:  # not known yet (install.py): what runs where it can
        best = fp8_kernel_order(facts.capability, OPTIONAL_FP8_KERNELS)[0]
        if best in OPTIONAL_FP8_KERNELS:
            return (f"{PRECISION_OF_FP8_KERNEL[best]} where available, "
                    f"else {PRECISION_OF_FP8_KERNEL[FP8_KERNEL_FULL]}")
        return PRECISION_OF_FP8_KERNEL[FP8_KERNEL_FULL]
    return PRECISION_OF_FP8_KERNEL[fp8_kernel_order(facts.capability, facts.fp8_kernels)[0]]


def path_label(path: str, facts: Facts) -> str:
    """'Triton FP8 (FP8 Q.K and P.V)': the path and, for a quantized one, the precision that runs."""
    if path == PATH_TRITON_FP8:
        return f"{PATH_LABEL[path]} ({fp8_precision(facts)})"
    if path == PATH_TRITON_INT8:
        return f"{PATH_LABEL[path]} ({PRECISION_OF_PATH[path]})"
    return PATH_LABEL[path]


def _joined(names) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _forced_quantized(facts: Facts, mode: str, where: str) -> Decision:
    """fp8 / int8 forced on a GPU: that path (FP16/BF16 for the calls it cannot serve), or FP16/BF16
    with "<mode> asked, but ..." where it cannot run."""
    path = PATH_TRITON_FP8 if mode == "fp8" else PATH_TRITON_INT8
    amd_refusal = None
    if facts.vendor == "amd":
        amd_refusal = amd_fp8_refusal(facts.arch, facts.name, facts.triton_version) if mode == "fp8" \
            else amd_int8_refusal(facts.arch, facts.name)
    if amd_refusal is not None:
        return Decision(PATH_TRITON_FP16, f"{mode} asked, but {amd_refusal.reason}: using Triton FP16/BF16 instead",
                        code=amd_refusal.code, overridden=True)
    if mode == "fp8" and not fp8_capable(facts):
        return Decision(PATH_TRITON_FP16, f"fp8 asked, but {where} has no FP8 tensor cores "
                                          "(needs sm_89+): using Triton FP16/BF16 instead",
                        code=NO_FP8, overridden=True)
    if mode == "int8" and not int8_capable(facts):
        return Decision(PATH_TRITON_FP16, f"int8 asked, but our INT8 attention runs on NVIDIA sm_75+ and AMD "
                                          f"CDNA3/4, RDNA3/4 only ({where}): using Triton FP16/BF16 instead",
                        code=NO_INT8, overridden=True)
    if path not in facts.implemented:
        return Decision(PATH_TRITON_FP16, f"{mode} asked, but the {mode.upper()} kernel cannot run here: "
                                          "using Triton FP16/BF16 instead", overridden=True)
    amd = " (OCP e4m3 on AMD; not run on AMD hardware here)" if facts.vendor == "amd" and mode == "fp8" else (
        " (not run on AMD hardware here)" if facts.vendor == "amd" else "")
    return Decision(path, f"{mode} forced on {where}: {path_label(path, facts)}{amd} "
                          "(Triton FP16/BF16 for calls it cannot serve)",
                    candidates=(path, PATH_TRITON_FP16))


def _amd_decision(facts: Facts, mode: str, where: str) -> Decision:
    """AMD, a gfx family our kernels are compile-tested for: auto keeps PyTorch (AMD_AUTO_WHY; and
    ROCm's PyTorch SDPA already runs AMD's own flash-attention kernels); a forced mode runs ours
    where the family has the dot (fp8: OCP FP8 only, gfx950 / gfx12)."""
    if mode == "auto":
        return Decision(PATH_PYTORCH, f"PyTorch attention on {where}: {AMD_AUTO_WHY}; choose fp16 "
                                      "(or fp8 / int8 where the GPU has them) to force them",
                        code=AMD_NOT_VALIDATED)
    if mode == "fp16":
        return Decision(PATH_TRITON_FP16, f"fp16 forced: Triton FP16/BF16 attention on {where} "
                                          f"({amd_family(facts.arch)}; not run on AMD hardware here)")
    return _forced_quantized(facts, mode, where)


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
        if mode != "fp16":
            return Decision(PATH_TRITON_FP16, f"{mode} asked, but on the CPU (TRITON_INTERPRET=1) only the "
                                              "Triton FP16/BF16 kernel runs, in the interpreter (tests only, "
                                              "very slow)", overridden=True)
        return Decision(PATH_TRITON_FP16, "fp16 forced on the CPU through TRITON_INTERPRET=1: "
                                          "Triton FP16/BF16 kernel in the interpreter (tests only, very slow)")

    if facts.vendor == "amd":
        return _amd_decision(facts, mode, where)
    if mode in ("fp8", "int8"):
        return _forced_quantized(facts, mode, where)
    if mode == "fp16":
        return Decision(PATH_TRITON_FP16, f"fp16 forced: Triton FP16/BF16 attention on {where}")

    candidates = tuple(p for p in auto_candidates(facts.capability)
                       if p == PATH_TRITON_FP16 or p in facts.implemented)
    if candidates == (PATH_TRITON_FP16,):
        return Decision(PATH_TRITON_FP16, f"auto: {where}: Triton FP16/BF16 attention, timed against ComfyUI's "
                                          "attention per shape; the faster one is kept", measure=True)
    labels = _joined(path_label(p, facts) for p in candidates)
    return Decision(candidates[0], f"auto: {where}: {labels} attention, each timed against ComfyUI's attention "
                                   "per shape; the fastest that agrees with it is kept",
                    measure=True, candidates=candidates)


def expected_paths(decision: Decision) -> str:
    """One phrase for install.py's verdict: what auto will try on this device."""
    if decision.path == PATH_PYTORCH:
        return "PyTorch attention"
    names = _joined(PATH_LABEL[p] for p in decision.candidates)
    if decision.measure:
        best = "faster" if len(decision.candidates) == 2 else "fastest"
        return f"{names} attention, each timed against PyTorch's per shape (the {best} that agrees is kept)"
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



# ---- Gluon kernels per Triton release, as run on a GPU --------------------------------------

# Gluon (`triton.experimental.gluon`) is experimental: its layouts and their lowering change
# between minors, so a kernel that compiles on a release (tests/compile, tests/versions) can
# still compute something else there. Each Gluon Hopper kernel ("fp8": attention_gluon_hopper,
# "bf16": attention_gluon_hopper_bf16) runs only on the Triton minors where it ran on an H100 /
# H200 and matched float32 (benchmarks/triton_release_check.py; benchmarks/RESULTS.md);
# on any other minor it is refused with the reason and the plain-Triton kernels serve.
GLUON_GPU_VERIFIED: Dict[str, Tuple[Tuple[int, int], ...]] = {
    "fp8": ((3, 6),),
    "bf16": ((3, 6),),
}


def gluon_release_refusal(kernel: str, triton_version: Optional[str]) -> Optional[Rule]:
    """Why the Gluon `kernel` ("fp8" / "bf16") does not run with this Triton, or None."""
    if version_tuple(triton_version)[:2] in GLUON_GPU_VERIFIED[kernel]:
        return None
    verified = ", ".join(f"{a}.{b}" for a, b in GLUON_GPU_VERIFIED[kernel])
    return Rule("GLUON_NOT_RUN_ON_TRITON",
                f"the Gluon {kernel.upper()} attention kernel has been checked on a GPU only with Triton {verified} "
                f"(installed: {triton_version}); the plain-Triton kernels serve instead")


# ---- Linear layers (kernels/linear/dispatch.py): which quantised matmul each device runs ------------

# Node modes: "fp8" = FP8 W8A8, "int8" = INT8 W8A8, "fp8_weight_only" = FP8 weights
# dequantised to FP16/BF16 inside the GEMM, "off" = ComfyUI's own Linear layers.
LINEAR_MODES = ("auto", "fp8", "int8", "fp8_weight_only", "off")
LINEAR_FP8_W8A8 = "fp8_w8a8"
LINEAR_INT8_W8A8 = "int8_w8a8"
LINEAR_FP8_WEIGHT_ONLY = "fp8_weight_only"
LINEAR_METHODS = (LINEAR_FP8_W8A8, LINEAR_INT8_W8A8, LINEAR_FP8_WEIGHT_ONLY)
LINEAR_METHOD_OF_MODE = {"fp8": LINEAR_FP8_W8A8, "int8": LINEAR_INT8_W8A8,
                         "fp8_weight_only": LINEAR_FP8_WEIGHT_ONLY}
LINEAR_LABEL = {LINEAR_FP8_W8A8: "Triton FP8 W8A8", LINEAR_INT8_W8A8: "Triton INT8 W8A8",
                LINEAR_FP8_WEIGHT_ONLY: "Triton FP8 weight-only", PATH_PYTORCH: "PyTorch"}
# int8 x int8 -> int32 tensor cores (mma.sync s8) exist from Turing; Triton's INT8 dot runs
# from the oldest target it compiles for. The weight-only GEMM computes in FP16/BF16 and is
# meant for Ampere (sm_80/86), where FP8 weights halve the weight traffic of BF16 ones.
LINEAR_MIN_CAPABILITY = {LINEAR_FP8_W8A8: FP8_MIN_CAPABILITY, LINEAR_INT8_W8A8: MIN_NVIDIA_CAPABILITY,
                         LINEAR_FP8_WEIGHT_ONLY: BF16_MIN_CAPABILITY}
LINEAR_NVIDIA_ONLY = "LINEAR_NVIDIA_ONLY"


def linear_capability_refusal(method: str, vendor: str, capability: Optional[Tuple[int, int]],
                              name: str = "", arch: str = "", triton_version: Optional[str] = None) -> Optional[Rule]:
    """Why this GPU cannot run `method`'s Linear kernel (None: it can). CPUs are not judged here.
    AMD is judged by its gfx `arch` (refused without one): FP8 W8A8 needs OCP FP8 dots (gfx950,
    gfx12), INT8 W8A8 i8/iu8 dots, weight-only only 16-bit dots (its e4m3 decode is shifts)."""
    if vendor == "cpu":
        return None
    if vendor == "amd":
        rule = amd_arch_blocker(arch, name)
        if rule is None and method == LINEAR_FP8_W8A8:
            rule = amd_fp8_refusal(arch, name, triton_version)
        if rule is None and method == LINEAR_INT8_W8A8:
            rule = amd_int8_refusal(arch, name)
        return rule
    if vendor != "nvidia" or capability is None:
        return Rule(LINEAR_NVIDIA_ONLY, f"our Linear kernels support NVIDIA and AMD GPUs only ({name or vendor})")
    need = LINEAR_MIN_CAPABILITY[method]
    if capability < need:
        code = NO_FP8 if method == LINEAR_FP8_W8A8 else (NO_BF16 if method == LINEAR_FP8_WEIGHT_ONLY else GPU_TOO_OLD)
        what = {LINEAR_FP8_W8A8: "FP8 tensor cores", LINEAR_INT8_W8A8: "INT8 tensor cores",
                LINEAR_FP8_WEIGHT_ONLY: "the FP8 weight-only Linear (BF16/FP16 tensor cores)"}[method]
        return Rule(code, f"{what} need {sm(need)}+ ({name or sm(capability)} is {sm(capability)})")
    return None


def _linear_auto_method(facts: Facts, weight_is_fp8: bool) -> str:
    cap = facts.capability
    if cap >= FP8_MIN_CAPABILITY:
        return LINEAR_FP8_W8A8
    if weight_is_fp8 and cap >= BF16_MIN_CAPABILITY:
        return LINEAR_FP8_WEIGHT_ONLY  # sm_80/86 with FP8 checkpoint weights: half the weight bytes
    return LINEAR_INT8_W8A8


def select_linear_method(facts: Facts, mode: str = "auto", weight_is_fp8: bool = False) -> Decision:
    """The Linear method for one device (a name of LINEAR_METHODS, or "pytorch"), with the reason.

    auto: FP8 W8A8 on sm_89+; on sm_80/86 the FP8 weight-only GEMM when the checkpoint's
    weights are already FP8, else INT8 W8A8 (also sm_75); PyTorch on AMD (forced modes run ours
    where the gfx family has the dot: _amd_linear_decision), Intel, CPU and unknown devices. A
    forced mode the device cannot honour takes auto's choice there and says "<mode> asked,
    but ..." with overridden=True.
    """
    if mode not in LINEAR_MODES:
        raise ValueError(f"unknown Linear mode {mode!r}; expected one of {LINEAR_MODES}")
    if mode == "off":
        return Decision(PATH_PYTORCH, "off: ComfyUI's own Linear layers, as chosen")
    forced = mode != "auto"
    blocker = triton_blocker(facts)
    if blocker:
        prefix = f"{mode} asked, but PyTorch Linear" if forced else "PyTorch Linear"
        return Decision(PATH_PYTORCH, f"{prefix}: {blocker.reason}", code=blocker.code, overridden=forced)
    where = _where(facts)
    if facts.vendor == "cpu":
        if not forced:
            return Decision(PATH_PYTORCH, "PyTorch Linear: no GPU (the Triton interpreter is for tests; "
                                          "force a mode to run it)", code=INTERPRETER_ONLY)
        method = LINEAR_METHOD_OF_MODE[mode]
        return Decision(method, f"{mode} forced on the CPU through TRITON_INTERPRET=1: {LINEAR_LABEL[method]} "
                                "in the interpreter (tests only, very slow)")
    if facts.vendor == "amd":
        return _amd_linear_decision(facts, mode, where)
    refusal = linear_capability_refusal(LINEAR_INT8_W8A8, facts.vendor, facts.capability, facts.name)
    if refusal is not None:  # unknown vendors: no method at all
        prefix = f"{mode} asked, but PyTorch Linear" if forced else "PyTorch Linear"
        return Decision(PATH_PYTORCH, f"{prefix}: {refusal.reason} ({where})", code=refusal.code,
                        overridden=forced)
    auto_method = _linear_auto_method(facts, weight_is_fp8)
    if not forced:
        why = {LINEAR_FP8_W8A8: "FP8 tensor cores: FP8 W8A8 Linear (weights per channel, activations per token)",
               LINEAR_FP8_WEIGHT_ONLY: "no FP8 tensor cores, FP8 checkpoint weights: FP8 weight-only Linear "
                                       "(dequantised in the GEMM, half the weight memory of BF16)",
               LINEAR_INT8_W8A8: "no FP8 tensor cores: INT8 W8A8 Linear (rotated activations per token)"}
        return Decision(auto_method, f"auto: {where} has {why[auto_method]}")
    method = LINEAR_METHOD_OF_MODE[mode]
    refusal = linear_capability_refusal(method, facts.vendor, facts.capability, facts.name)
    if refusal is not None:
        return Decision(auto_method, f"{mode} asked, but {refusal.reason}: using {LINEAR_LABEL[auto_method]} "
                                     "instead", code=refusal.code, overridden=True)
    return Decision(method, f"{mode} forced: {LINEAR_LABEL[method]} Linear on {where}")


def _amd_linear_decision(facts: Facts, mode: str, where: str) -> Decision:
    """AMD (a compile-tested gfx family): auto keeps PyTorch Linear for the reason attention does
    (AMD_AUTO_WHY); a forced method runs where the family has its dot, else PyTorch Linear."""
    if mode == "auto":
        return Decision(PATH_PYTORCH, f"PyTorch Linear on {where}: {AMD_AUTO_WHY}; force int8, fp8_weight_only "
                                      "(or fp8 where the GPU has OCP FP8) to run them", code=AMD_NOT_VALIDATED)
    method = LINEAR_METHOD_OF_MODE[mode]
    refusal = linear_capability_refusal(method, facts.vendor, facts.capability, facts.name, facts.arch,
                                        facts.triton_version)
    if refusal is not None:
        return Decision(PATH_PYTORCH, f"{mode} asked, but {refusal.reason}: PyTorch Linear", code=refusal.code,
                        overridden=True)
    return Decision(method, f"{mode} forced: {LINEAR_LABEL[method]} Linear on {where} "
                            f"({amd_family(facts.arch)}; not run on AMD hardware here)")

__all__ = [
    "PATH_TRITON_FP16", "PATH_TRITON_FP8", "PATH_TRITON_INT8", "PATH_PYTORCH", "PATHS", "TRITON_PATHS",
    "BACKEND_OF_PATH", "LOSSY_PATHS", "MODES", "Rule", "Facts", "Decision", "version_tuple", "sm",
    "min_capability_for", "nvidia_gpu_blocker", "device_blocker", "triton_blocker", "fp8_capable", "int8_capable",
    "capability_refusal", "select_path", "expected_paths", "auto_candidates", "fp8_kernel_order", "fp8_precision",
    "path_label", "FP8_KERNEL_GLUON", "FP8_KERNEL_INT8_FP8PV", "FP8_KERNEL_FULL", "FP8_KERNEL_QK",
    "OPTIONAL_FP8_KERNELS", "GLUON_CAPABILITY", "feature_refusal", "FEATURE_MIN_TRITON",
    "GLUON_GPU_VERIFIED", "gluon_release_refusal",
    "LINEAR_MODES", "LINEAR_METHODS", "LINEAR_FP8_W8A8", "LINEAR_INT8_W8A8", "LINEAR_FP8_WEIGHT_ONLY",
    "LINEAR_MIN_CAPABILITY", "linear_capability_refusal", "select_linear_method",
    "amd_family", "amd_arch_blocker", "amd_fp8_refusal", "amd_int8_refusal", "AMD_COMPILE_TARGETS",
    "AMD_FP8_FORMAT", "AMD_INT8_FAMILIES", "AMD_FP8_MIN_TRITON",
]
