"""Which Triton package and version fit the installed torch: torch's own pin where it names one,
else triton-windows' table on Windows, and the Python versions each triton-windows minor has
wheels for."""
from __future__ import annotations

import re
from typing import List, Optional, Tuple

from .common import parse_version, vstr
from .model import Facts, Finding, Target

# Python versions with triton-windows wheels on PyPI, per triton-windows minor (checked
# 2026-12-02 with `pip download --platform win_amd64 --python-version 3.X`): 3.1: 3.9-3.12,
# 3.2-3.4: 3.9-3.13, 3.5-3.8: 3.10-3.14. Later minors are assumed to keep 3.10-3.14.
TRITON_WINDOWS_PYTHON = {1: (9, 12), 2: (9, 13), 3: (9, 13), 4: (9, 13)}
TRITON_WINDOWS_PYTHON_LATEST = (10, 14)


def _requirement(text: str) -> Tuple[str, str, str]:
    """('triton', '==3.5.0', 'platform_system == "Linux"') from a Requires-Dist line."""
    req, _, marker = text.partition(";")
    m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*\(?([^)]*)\)?\s*$", req)
    if not m:
        return "", "", marker.strip()
    return m.group(1).lower().replace("_", "-"), m.group(2).replace(" ", ""), marker.strip()


def marker_applies(marker: str, os_name: str, machine: str = "x86_64") -> bool:
    """Tiny evaluator for the markers torch uses on its triton requirement."""
    if not marker:
        return True
    values = {"platform_system": {"linux": "Linux", "windows": "Windows", "darwin": "Darwin"}[os_name],
              "sys_platform": {"linux": "linux", "windows": "win32", "darwin": "darwin"}[os_name],
              "platform_machine": machine if os_name != "windows" else "AMD64"}
    for alternative in re.split(r"\s+or\s+", marker):
        ok = True
        for atom in re.split(r"\s+and\s+", alternative.strip().strip("()")):
            m = re.match(r"\s*\(?\s*(\w+)\s*(==|!=)\s*['\"]([^'\"]*)['\"]\s*\)?\s*$", atom)
            if not m or m.group(1) not in values:
                continue  # python_version etc.: not what decides here
            equal = values[m.group(1)] == m.group(3)
            ok = ok and (equal if m.group(2) == "==" else not equal)
        if ok:
            return True
    return False


def triton_windows_python_range(minor: int) -> Tuple[int, int]:
    return TRITON_WINDOWS_PYTHON.get(minor, TRITON_WINDOWS_PYTHON_LATEST)


def choose_target(f: Facts) -> Tuple[Optional[Target], List[Finding]]:
    """Which Triton package and version range fits this torch (None: none does)."""
    tv = parse_version(f.torch_version)
    pins = [_requirement(line) for line in f.torch_requires]  # (name, spec, marker)
    if f.os == "windows":
        if len(tv) < 2:
            return None, []
        minor = None
        reason = ""
        for name, spec, _marker in pins:  # torch's own pin wins over the table
            m = re.match(r"==\s*(\d+)\.(\d+)", spec)
            if name in ("triton-windows", "triton") and m:
                minor = (int(m.group(1)), int(m.group(2)))
                reason = f"torch {f.torch_version} requires {name}{spec}"
                break
        if minor is None:
            if tv[0] != 2:
                return None, [Finding(
                    "TORCH_UNKNOWN", "error",
                    f"torch {f.torch_version} is newer than any triton-windows mapping install.py knows.",
                    "Install the matching triton-windows by hand (see its README), or update this pack.")]
            if tv[1] <= 3:
                return None, [Finding(
                    "TORCH_TOO_OLD", "error",
                    f"torch {f.torch_version} is too old for triton-windows (it needs torch 2.4 or newer).",
                    "Update ComfyUI's torch to 2.7 or newer (portable: run "
                    "update\\update_comfyui_and_python_dependencies.bat).")]
            minor = (3, 1) if tv[1] <= 5 else (3, tv[1] - 4)
            reason = f"torch {tv[0]}.{tv[1]} pairs with triton-windows {minor[0]}.{minor[1]}"
        spec = f"triton-windows>={minor[0]}.{minor[1]},<{minor[0]}.{minor[1] + 1}"
        return Target("triton-windows", spec, minor=minor, reason=reason), []
    if f.os == "linux":
        for name, spec, marker in pins:
            if not marker_applies(marker, "linux", f.machine):
                continue
            if name in ("triton", "pytorch-triton-rocm", "pytorch-triton"):
                exact = parse_version(spec.lstrip("=")) if spec.startswith("==") else None
                return Target(name, f"{name}{spec}", exact=exact,
                              reason=f"torch {f.torch_version} requires {name}{spec}"), []
        return Target("triton", "triton", reason="plain triton for the Triton interpreter (torch names no triton)"), []
    return None, []


def target_minor(target: Optional[Target]) -> Optional[Tuple[int, int]]:
    """The Triton minor the target pins (triton-windows' minor, or torch's exact pin), if any."""
    if target is None:
        return None
    if target.minor:
        return tuple(target.minor)
    if target.exact:
        return tuple(target.exact[:2])
    return None


def expected_triton(f: Facts, target: Optional[Target]) -> Optional[str]:
    """The Triton version the pack imports once install.py's actions are done: the installed one
    when it fits torch, else what pip is asked for (torch's exact pin, or the triton-windows
    minor); None: unknown (a target without a version and nothing installed: pip picks)."""
    if target is None:
        return None
    have = f.installed.get(target.package)
    if target.satisfied_by(have):
        return have
    if target.exact:
        return vstr(target.exact)
    if target.minor:
        return vstr(target.minor)
    return None
