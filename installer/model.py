"""The installer's plain data: the facts the probe gathers, what the plan is made of, and the
results of running it. JSON-serialisable dataclasses; tests build them by hand."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .common import PACK_DIR, Version, parse_version

SEVERITIES = ("info", "warning", "error")  # error: Triton cannot work until it is fixed


@dataclass
class Facts:
    """Everything the plan looks at. Plain data, JSON-serialisable; tests build it by hand."""
    os: str = "linux"                        # windows | linux | darwin
    machine: str = "x86_64"                  # platform.machine() of the target Python
    python: str = "python"                   # the target interpreter (sys.executable there)
    python_dir: str = ""                     # folder of that interpreter
    python_kind: str = "system"              # embedded | venv | conda | system
    python_version: Version = (3, 12, 0)
    free_threaded: bool = False
    pth_file: Optional[str] = None           # python3XX._pth of an embedded Python
    pip_available: bool = True
    torch_version: Optional[str] = None      # installed dist version, e.g. "2.10.0+cu128"
    torch_error: Optional[str] = None        # import error, when torch is installed but broken
    torch_cuda: Optional[str] = None         # torch.version.cuda, e.g. "12.8"
    torch_hip: Optional[str] = None          # torch.version.hip
    torch_requires: List[str] = field(default_factory=list)  # torch Requires-Dist naming triton
    cuda_available: bool = False
    cuda_driver: Optional[str] = None        # CUDA version the driver supports, e.g. "12.8"
    gpus: List[dict] = field(default_factory=list)  # [{"name": ..., "capability": [8, 9]}]
    installed: Dict[str, str] = field(default_factory=dict)  # triton / triton-windows / ... -> version
    numpy_version: Optional[str] = None      # the Triton interpreter (no GPU) needs numpy
    vcrt_dir: Optional[str] = None           # C:\Windows\System32
    vcrt_system: Dict[str, Optional[List[int]]] = field(default_factory=dict)  # dll -> version, None = missing
    vcrt_python: Dict[str, List[int]] = field(default_factory=dict)  # copies in the Python folder
    vcrt_python_dir: Optional[str] = None    # that folder (a venv's base Python folder)
    vcrt_errors: Dict[str, str] = field(default_factory=dict)  # path -> why its version is unknown
    include_dir: Optional[str] = None        # sysconfig include dir
    python_h: bool = True
    include_minor: Optional[int] = None      # PY_MINOR_VERSION of include/patchlevel.h
    python_lib: Optional[str] = None         # libs/python3XX.lib that triton would find
    python_lib_dirs: List[str] = field(default_factory=list)  # where triton looks for libs/
    headers_target: Optional[str] = None     # folder where include/ and libs/ belong
    cuda_path: Optional[str] = None          # CUDA_PATH (or CUDA_HOME) on Windows
    cuda_path_version: Optional[List[int]] = None
    cc: Optional[str] = None
    cc_is_file: bool = True
    shadows: List[str] = field(default_factory=list)  # triton.py / triton/ that shadow the package
    long_paths_enabled: Optional[bool] = None  # Windows registry LongPathsEnabled; None = unknown
    triton_cache_dir: Optional[str] = None
    cache_from_env: bool = False
    cache_ascii: bool = True
    cache_writable: bool = True
    cache_candidates: List[dict] = field(default_factory=list)  # [{"path", "ascii", "writable"}]
    config: dict = field(default_factory=dict)  # triton_accel.json's values that passed their checks
    config_problems: List[str] = field(default_factory=list)  # why the file, or a value in it, is ignored
    pack_dir: str = PACK_DIR
    probe_error: Optional[str] = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def python_base_argv(python: str, kind: str) -> List[str]:
    """How to run the target Python: `-s` for the embedded one, as ComfyUI Manager does."""
    return [python, "-s"] if kind == "embedded" else [python]


def pip_argv(facts: Facts) -> List[str]:
    return python_base_argv(facts.python, facts.python_kind) + ["-m", "pip"]


@dataclass
class Finding:
    code: str
    severity: str  # info | warning | error
    message: str
    fix: str = ""


@dataclass
class Action:
    kind: str  # pip | write-config | fix-headers | copy-vcrt | mkdir
    description: str
    argv: Optional[List[str]] = None
    data: dict = field(default_factory=dict)
    preflight: Optional[List[str]] = None  # pip download check run before a destructive step


@dataclass
class Target:
    package: str       # triton-windows | triton
    spec: str          # what pip gets, e.g. 'triton-windows>=3.6,<3.7'
    minor: Optional[Tuple[int, int]] = None  # triton minor it must have
    exact: Optional[Version] = None          # exact release it must have (torch's pin)
    reason: str = ""

    def satisfied_by(self, version: Optional[str]) -> bool:
        if not version:
            return False
        v = parse_version(version)
        if self.exact is not None:
            return v[:len(self.exact)] == tuple(self.exact)
        if self.minor is not None:
            return v[:2] == tuple(self.minor)
        return True


@dataclass
class Blocker:
    """Why Triton cannot work here yet: `code` for programs (verdict() compares it, never the
    text), `reason` for people. GPU blockers carry gpu_rules' code and reason unchanged."""
    code: str
    reason: str


@dataclass
class Plan:
    target: Optional[Target]
    findings: List[Finding]
    actions: List[Action]
    path: str                # gpu_rules' name: triton_fp8 | triton_int8 | triton_fp16 | pytorch (before the self-check)
    path_reason: str         # the blockers' reasons, or gpu_rules.select_path()'s reason
    triton_blocked: bool
    blockers: List[Blocker] = field(default_factory=list)
    expected_paths: str = "PyTorch attention"  # gpu_rules.expected_paths(): what auto uses (or times) here

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Options:
    fix: bool = False


@dataclass
class Check:
    """What one check of plan() found: findings to show, actions to run, blockers."""
    findings: List[Finding] = field(default_factory=list)
    actions: List[Action] = field(default_factory=list)
    blockers: List[Blocker] = field(default_factory=list)

    def add(self, code: str, severity: str, message: str, fix: str = "") -> None:
        self.findings.append(Finding(code, severity, message, fix))

    def block(self, code: str, reason: str) -> None:
        self.blockers.append(Blocker(code, reason))


@dataclass
class Result:
    action: str
    ok: bool
    detail: str = ""
    seconds: float = 0.0
