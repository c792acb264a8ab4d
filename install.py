#!/usr/bin/env python3
"""Triton Accel installer: make Triton work for this pack, or say plainly why it cannot.

Run by ComfyUI Manager (``[sys.executable, "install.py"]``, cwd = this folder) after it
installed requirements.txt, or by hand::

    python_embeded\\python.exe custom_nodes\\comfyui-triton-accel\\install.py [--dry-run] [--json] [--fix]

It works in three separate steps:

probe  gathers facts (OS, which Python, torch and its CUDA/ROCm build, GPUs, installed
       triton / triton-windows, VC++ runtime DLL versions, Python headers, env vars ...)
       into a plain ``Facts`` object. torch and triton are only looked at in a subprocess
       of the target Python, so nothing that goes wrong there can crash this script.
plan   a pure function ``plan(facts, options) -> Plan``: findings (severity, message,
       one-line fix) and actions (exact pip command lines, config writes, --fix steps),
       folded from one check per subject (torch, wheels, GPU, CUDA, VC++ runtime, headers,
       cache, config, the Triton package). Every GPU rule and path name comes from
       kernels/gpu_rules.py, the file the Settings node decides with, so the two agree.
act    runs the actions, then proves the result in a subprocess: import triton, compile
       and run a tiny kernel (on the GPU, or through the Triton interpreter on a CPU-only
       machine) and says which attention path the pack will use.

Rules it keeps: standard library only (kernels/gpu_rules.py and kernels/install_config.py
are stdlib-only and loaded by path, never through the ``kernels`` package); never installs,
upgrades or downgrades torch (pip always runs with --no-deps); idempotent (a second run has
nothing to do); ``--dry-run`` changes nothing. A Triton that cannot work is not an install failure of the pack (the
pack falls back to PyTorch attention), so the exit code is 0 then too; only a broken
invocation (an unknown flag, a ``--python`` that does not exist, a failed ``--venv``
bootstrap) exits non-zero.

Developer bootstrap on a fresh clone: ``python3 install.py --venv .venv --demo``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import io
import json
import ntpath
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

PACK_DIR = os.path.dirname(os.path.abspath(__file__))


def _load_sibling(relative_path: str, name: str):
    """A stdlib-only file of this pack, loaded by path: install.py runs before the pack is
    importable (and must never import torch or triton through the ``kernels`` package). The
    private module name cannot clash with the pack's own package, whatever its folder is called."""
    path = os.path.join(PACK_DIR, *relative_path.split("/"))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up in sys.modules while a class is built
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


gpu_rules = _load_sibling("kernels/gpu_rules.py", "_triton_accel_gpu_rules")
install_config = _load_sibling("kernels/install_config.py", "_triton_accel_install_config")

CONFIG_NAME = install_config.CONFIG_NAME  # the pack's per-machine settings (docs/install.md)
CONFIG_KEY_CACHE = install_config.KEY_CACHE_DIR  # folder for TRITON_CACHE_DIR when the env var is unset
# 2: path names are gpu_rules' ("triton_fp8", not "triton-fp8"); plan has blockers and
# expected_paths; facts.config holds only checked values, facts.config_problems the rest.
REPORT_VERSION = 2
LAST_REPORT_NAME = "install_report.json"  # the last run's report, read by nodes/status.py

VCRT_DLLS = ("msvcp140.dll", "vcruntime140.dll", "vcruntime140_1.dll")
VCRT_MIN = (14, 42)
VC_REDIST_URL = "https://aka.ms/vs/17/release/vc_redist.x64.exe"
LONG_PATHS_KEY = r"SYSTEM\CurrentControlSet\Control\FileSystem"
NUGET_URL = "https://api.nuget.org/v3-flatcontainer/python/{v}/python.{v}.nupkg"

# Python versions with triton-windows wheels on PyPI, per triton-windows minor (checked
# 2026-12-02 with `pip download --platform win_amd64 --python-version 3.X`): 3.1: 3.9-3.12,
# 3.2-3.4: 3.9-3.13, 3.5-3.8: 3.10-3.14. Later minors are assumed to keep 3.10-3.14.
TRITON_WINDOWS_PYTHON = {1: (9, 12), 2: (9, 13), 3: (9, 13), 4: (9, 13)}
TRITON_WINDOWS_PYTHON_LATEST = (10, 14)

SEVERITIES = ("info", "warning", "error")  # error: Triton cannot work until it is fixed

Version = Tuple[int, ...]


# ----------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------

def parse_version(text: Optional[str]) -> Version:
    """Release numbers of a version string: '2.10.0+cu128' -> (2, 10, 0); '3.3.0a0.post11' -> (3, 3, 0)."""
    if not text:
        return ()
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text))
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def vstr(v: Sequence[int]) -> str:
    return ".".join(str(p) for p in v)


def quote_arg(arg: str) -> str:
    """Quote one argument the way a user would type it (cmd and POSIX shells alike)."""
    if arg and re.fullmatch(r"[A-Za-z0-9_\-.,/:\\=+@]+", arg):
        return arg
    return '"' + arg.replace('"', '\\"') + '"'


def cmdline(argv: Sequence[str]) -> str:
    return " ".join(quote_arg(a) for a in argv)


def is_ascii(text: str) -> bool:
    try:
        text.encode("ascii")
    except UnicodeEncodeError:
        return False
    return True


# ----------------------------------------------------------------------------------------
# PE file version reader (pure Python; works on any OS, used for the VC++ runtime DLLs)
# ----------------------------------------------------------------------------------------

class PEError(ValueError):
    """The file is not a PE image, is truncated, or has no version resource."""


RT_VERSION = 16
VS_FIXEDFILEINFO_SIGNATURE = 0xFEEF04BD


def _unpack(fmt: str, data: bytes, offset: int, what: str) -> tuple:
    size = struct.calcsize(fmt)
    if offset < 0 or offset + size > len(data):
        raise PEError(f"truncated file: {what} at offset {offset} needs {size} bytes, file has {len(data)}")
    return struct.unpack_from(fmt, data, offset)


def pe_file_version(data: bytes) -> Tuple[int, int, int, int]:
    """File version (dwFileVersionMS/LS of VS_FIXEDFILEINFO) of a PE image given as bytes.

    DOS header -> PE header -> optional header data directory 2 (resources) -> section
    table (RVA -> file offset) -> resource directory tree type RT_VERSION -> first name ->
    first language -> data entry -> VS_VERSIONINFO -> VS_FIXEDFILEINFO.
    """
    if len(data) < 64:
        raise PEError(f"not a PE file: only {len(data)} bytes")
    if data[:2] != b"MZ":
        raise PEError("not a PE file: no 'MZ' DOS header")
    (e_lfanew,) = _unpack("<I", data, 0x3C, "e_lfanew")
    if data[e_lfanew:e_lfanew + 4] != b"PE\0\0":
        if e_lfanew + 4 > len(data):
            raise PEError(f"truncated file: PE header offset {e_lfanew} is past the end ({len(data)} bytes)")
        raise PEError("not a PE file: no 'PE' signature (a DOS-only executable?)")
    coff = e_lfanew + 4
    _machine, n_sections, _ts, _sym, _nsym, opt_size, _ch = _unpack("<HHIIIHH", data, coff, "COFF header")
    opt = coff + 20
    (magic,) = _unpack("<H", data, opt, "optional header")
    if magic == 0x10B:  # PE32
        n_dirs_off, dirs_off = 92, 96
    elif magic == 0x20B:  # PE32+
        n_dirs_off, dirs_off = 108, 112
    else:
        raise PEError(f"not a PE image: unknown optional header magic 0x{magic:x}")
    (n_dirs,) = _unpack("<I", data, opt + n_dirs_off, "NumberOfRvaAndSizes")
    if n_dirs <= 2:
        raise PEError("no version resource: the image has no resource directory")
    rsrc_rva, rsrc_size = _unpack("<II", data, opt + dirs_off + 2 * 8, "resource data directory")
    if rsrc_rva == 0 or rsrc_size == 0:
        raise PEError("no version resource: the image has no resource directory")

    sections = []
    sec_off = opt + opt_size
    for i in range(n_sections):
        name, vsize, va, raw_size, raw_ptr = _unpack("<8sIIII", data, sec_off + 40 * i, f"section header {i}")
        sections.append((va, max(vsize, raw_size), raw_ptr, raw_size))

    def rva_to_offset(rva: int, what: str) -> int:
        for va, span, raw_ptr, raw_size in sections:
            if va <= rva < va + span:
                delta = rva - va
                if delta >= raw_size:
                    raise PEError(f"{what} (RVA 0x{rva:x}) lies in uninitialised section data")
                return raw_ptr + delta
        raise PEError(f"{what} (RVA 0x{rva:x}) is in no section")

    base = rva_to_offset(rsrc_rva, "resource directory")

    def entries(dir_off: int, what: str):
        _c, _t, _maj, _min, n_named, n_ids = _unpack("<IIHHHH", data, base + dir_off, what)
        if n_named + n_ids > 4096:
            raise PEError(f"corrupt {what}: {n_named + n_ids} entries")
        for k in range(n_named + n_ids):
            yield _unpack("<II", data, base + dir_off + 16 + 8 * k, f"{what} entry {k}")

    version_dir = None
    for name_id, target in entries(0, "resource root directory"):
        if not name_id & 0x80000000 and name_id == RT_VERSION:
            version_dir = target
            break
    if version_dir is None:
        raise PEError("no version resource (RT_VERSION) in the resource directory")
    node, depth = version_dir, 0
    while node & 0x80000000:  # descend name -> language, first entry each time
        depth += 1
        if depth > 4:
            raise PEError("corrupt resource directory: too deep")
        first = next(iter(entries(node & 0x7FFFFFFF, "version resource directory")), None)
        if first is None:
            raise PEError("no version resource: empty RT_VERSION directory")
        node = first[1]
    data_rva, data_size, _cp, _res = _unpack("<IIII", data, base + node, "version resource data entry")
    start = rva_to_offset(data_rva, "version resource data")
    block = data[start:start + data_size]
    if len(block) < data_size:
        raise PEError("truncated file: the version resource runs past the end of the file")
    # VS_VERSIONINFO: wLength, wValueLength, wType, szKey "VS_VERSION_INFO\0" (UTF-16), pad to 4.
    key = "VS_VERSION_INFO\0".encode("utf-16-le")
    if block[6:6 + len(key)] != key:
        raise PEError("no version resource: RT_VERSION data is not a VS_VERSIONINFO block")
    fixed = (6 + len(key) + 3) & ~3
    (wvalue_len,) = _unpack("<H", block, 2, "VS_VERSIONINFO")
    if wvalue_len == 0:
        raise PEError("no version resource: VS_VERSIONINFO has no VS_FIXEDFILEINFO")
    sig, _struc, ms, ls = _unpack("<IIII", block, fixed, "VS_FIXEDFILEINFO")
    if sig != VS_FIXEDFILEINFO_SIGNATURE:
        raise PEError(f"no version resource: bad VS_FIXEDFILEINFO signature 0x{sig:08x}")
    return (ms >> 16, ms & 0xFFFF, ls >> 16, ls & 0xFFFF)


def read_file_version(path: str) -> Tuple[int, int, int, int]:
    """File version of a DLL/EXE on disk; PEError (with the path) for anything unreadable."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise PEError(f"{path}: cannot read: {exc}") from exc
    try:
        return pe_file_version(data)
    except PEError as exc:
        raise PEError(f"{path}: {exc}") from exc


# ----------------------------------------------------------------------------------------
# Facts
# ----------------------------------------------------------------------------------------

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


# Runs inside the target Python (which may be 3.9 and must not import anything of ours).
PROBE_SCRIPT = r'''
import json, os, platform, sys, sysconfig
r = {"executable": sys.executable, "machine": platform.machine(), "version": list(sys.version_info[:3]),
     "prefix": sys.prefix, "base_prefix": getattr(sys, "base_prefix", sys.prefix),
     "exec_prefix": sys.exec_prefix, "base_exec_prefix": getattr(sys, "base_exec_prefix", sys.exec_prefix),
     "free_threaded": bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
     "include_dir": sysconfig.get_paths().get("include"), "sys_path": list(sys.path), "site_dirs": []}
try:
    import site
    r["site_dirs"] += list(site.getsitepackages())
except Exception:
    pass
for k in ("purelib", "platlib"):
    p = sysconfig.get_paths().get(k)
    if p:
        r["site_dirs"].append(p)
try:
    import importlib.util
    r["pip"] = importlib.util.find_spec("pip") is not None
except Exception:
    r["pip"] = False
from importlib import metadata
r["dists"] = {}
for name in ("torch", "numpy", "triton", "triton-windows", "pytorch-triton", "pytorch-triton-rocm"):
    try:
        r["dists"][name] = metadata.version(name)
    except Exception:
        pass
try:
    r["torch_requires"] = [q for q in (metadata.distribution("torch").requires or [])
                           if q.lower().replace("_", "-").startswith(("triton", "pytorch-triton"))]
except Exception:
    r["torch_requires"] = []
if "torch" in r["dists"]:
    try:
        import torch
        r["torch"] = {"version": str(torch.__version__), "cuda": torch.version.cuda,
                      "hip": getattr(torch.version, "hip", None), "cuda_available": False, "gpus": []}
        try:
            r["torch"]["cuda_available"] = bool(torch.cuda.is_available())
            if r["torch"]["cuda_available"]:
                for i in range(torch.cuda.device_count()):
                    p = torch.cuda.get_device_properties(i)
                    r["torch"]["gpus"].append({"name": p.name, "capability": [p.major, p.minor],
                                              "arch": getattr(p, "gcnArchName", None)})
                d = 0
                try:
                    d = int(torch._C._cuda_getDriverVersion())
                except Exception:
                    try:  # the driver API itself: cuDriverGetVersion
                        import ctypes
                        lib = ctypes.WinDLL("nvcuda.dll") if os.name == "nt" else ctypes.CDLL("libcuda.so.1")
                        v = ctypes.c_int(0)
                        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
                            d = v.value
                    except Exception:
                        pass
                if d > 0:
                    r["torch"]["driver"] = "%d.%d" % (d // 1000, (d % 1000) // 10)
        except Exception as e:
            r["torch"]["cuda_error"] = "%s: %s" % (type(e).__name__, e)
    except BaseException as e:
        r["torch_error"] = "%s: %s" % (type(e).__name__, e)
print("@@TRITON_ACCEL_PROBE@@" + json.dumps(r))
'''

PROBE_MARK = "@@TRITON_ACCEL_PROBE@@"


def python_base_argv(python: str, kind: str) -> List[str]:
    """How to run the target Python: `-s` for the embedded one, as ComfyUI Manager does."""
    return [python, "-s"] if kind == "embedded" else [python]


def pip_argv(facts: Facts) -> List[str]:
    return python_base_argv(facts.python, facts.python_kind) + ["-m", "pip"]


def run_probe_script(python: str, extra_flags: Sequence[str] = (),
                     timeout: float = 300) -> Tuple[Optional[dict], Optional[str]]:
    """Run PROBE_SCRIPT in the target Python: (its checked report, None) or (None, why not)."""
    try:
        proc = subprocess.run([python, *extra_flags, "-c", PROBE_SCRIPT], capture_output=True,
                              text=True, timeout=timeout, errors="replace")
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"could not run {python}: {exc}"
    for line in proc.stdout.splitlines():
        if line.startswith(PROBE_MARK):
            try:
                raw = json.loads(line[len(PROBE_MARK):])
            except (ValueError, RecursionError) as exc:
                return None, f"unreadable probe output: {type(exc).__name__}: {exc}"
            problem = probe_output_problem(raw)
            return (None, f"unreadable probe output: {problem}") if problem else (raw, None)
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return None, f"probe exited with code {proc.returncode}: " + " | ".join(tail)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _list_of(value, kinds) -> bool:
    return isinstance(value, list) and all(isinstance(x, kinds) for x in value)


def _gpu_problem(gpu) -> Optional[str]:
    if not isinstance(gpu, dict) or not isinstance(gpu.get("name"), str):
        return "a GPU entry without a name"
    cap = gpu.get("capability")
    if not (isinstance(cap, list) and len(cap) == 2 and all(_is_int(x) for x in cap)):
        return f"GPU {gpu['name']!r} has no [major, minor] capability"
    if not isinstance(gpu.get("arch"), (str, type(None))):
        return f"GPU {gpu['name']!r} has a non-string arch"
    return None


def probe_output_problem(raw) -> Optional[str]:
    """What is wrong with a probe report (not our PROBE_SCRIPT's output, or a Python that
    answers oddly), or None: probe() then reads it without a KeyError or TypeError."""
    if not isinstance(raw, dict):
        return f"expected a JSON object, got {type(raw).__name__}"
    for key, kinds in (("executable", str), ("prefix", str), ("base_prefix", str), ("exec_prefix", str),
                       ("base_exec_prefix", str), ("free_threaded", bool), ("version", list)):
        if key not in raw:
            return f"missing {key!r}"
        if not isinstance(raw[key], kinds):
            return f"{key!r} has the wrong type ({type(raw[key]).__name__})"
    if len(raw["version"]) < 2 or not all(_is_int(x) for x in raw["version"]):
        return "'version' is not a list of numbers"
    optional = {
        "machine": lambda v: isinstance(v, str), "include_dir": lambda v: isinstance(v, (str, type(None))),
        "pip": lambda v: isinstance(v, bool), "sys_path": lambda v: _list_of(v, str),
        "site_dirs": lambda v: _list_of(v, str), "torch_requires": lambda v: _list_of(v, str),
        "torch_error": lambda v: isinstance(v, str), "torch": lambda v: isinstance(v, dict),
        "dists": lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
    }
    for key, ok in optional.items():
        if key in raw and not ok(raw[key]):
            return f"{key!r} has the wrong type ({type(raw[key]).__name__})"
    t = raw.get("torch") or {}
    for key, kinds in (("version", str), ("cuda", (str, type(None))), ("hip", (str, type(None))),
                       ("cuda_available", bool), ("driver", str), ("gpus", list)):
        if key in t and not isinstance(t[key], kinds):
            return f"'torch.{key}' has the wrong type ({type(t[key]).__name__})"
    for gpu in t.get("gpus", []):
        problem = _gpu_problem(gpu)
        if problem:
            return problem
    return None


def detect_python_kind(python_dir: str, prefix: str, base_prefix: str) -> Tuple[str, Optional[str]]:
    pth = sorted(f for f in _listdir(python_dir) if re.fullmatch(r"python\d+\._pth", f))
    if pth:
        return "embedded", os.path.join(python_dir, pth[0])
    if os.path.normcase(os.path.abspath(prefix)) != os.path.normcase(os.path.abspath(base_prefix)):
        return "venv", None
    if os.path.isdir(os.path.join(prefix, "conda-meta")):
        return "conda", None
    return "system", None


def _listdir(path: Optional[str]) -> List[str]:
    try:
        return os.listdir(path) if path else []
    except OSError:
        return []


def pth_entries(pth_file: Optional[str]) -> List[str]:
    """Folders named in an embedded Python's ._pth file, resolved against its folder."""
    if not pth_file:
        return []
    try:
        with open(pth_file, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    base = os.path.dirname(pth_file)
    out = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#") or line.startswith("import "):
            continue
        out.append(os.path.normpath(os.path.join(base, line)))
    return out


def find_shadows(dirs: Sequence[str], site_dirs: Sequence[str]) -> List[str]:
    """triton.py files or triton/ folders in dirs that would be imported instead of the package."""
    def norm(p):
        return os.path.normcase(os.path.realpath(p))
    sites = {norm(s) for s in site_dirs if s}
    found, seen = [], set()
    for d in dirs:
        if not d or norm(d) in sites or norm(d) in seen:
            continue
        seen.add(norm(d))
        if any(norm(d).startswith(s + os.sep) for s in sites):
            continue
        for name in ("triton.py", "triton"):
            p = os.path.join(d, name)
            if (name == "triton.py" and os.path.isfile(p)) or (name == "triton" and os.path.isdir(p)):
                found.append(p)
    return found


def dir_writable(path: str) -> bool:
    """Whether files can be created in path (or, if it does not exist yet, in its nearest
    existing parent). Leaves nothing behind."""
    probe_dir = path
    while probe_dir and not os.path.isdir(probe_dir):
        parent = os.path.dirname(probe_dir)
        if parent == probe_dir:
            return False
        probe_dir = parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=".triton-accel-", dir=probe_dir)
        os.close(fd)
        os.unlink(tmp)
        return True
    except OSError:
        return False


def default_triton_cache_dir(env: Dict[str, str]) -> Tuple[str, bool]:
    if env.get("TRITON_CACHE_DIR"):
        return env["TRITON_CACHE_DIR"], True
    home = env.get("TRITON_HOME") or os.path.expanduser("~")
    return os.path.join(home, ".triton", "cache"), False


def cache_candidates(os_name: str, pack_dir: str, env: Dict[str, str]) -> List[str]:
    cands = [os.path.join(pack_dir, ".cache", "triton")]
    if os_name == "windows":
        drive = env.get("SYSTEMDRIVE", "C:")
        cands.append(drive + "\\triton-accel-cache")
        if env.get("PROGRAMDATA"):
            cands.append(os.path.join(env["PROGRAMDATA"], "triton-accel", "cache"))
    cands.append(os.path.join(tempfile.gettempdir(), "triton-accel-cache"))
    return cands


def read_config(pack_dir: str) -> dict:
    """Everything in triton_accel.json, unchecked (write_config keeps keys it does not know);
    {} when the file is missing or unreadable."""
    return install_config.read_json_object(install_config.config_path(pack_dir))[0]


def cuda_version_of(path: str) -> Optional[List[int]]:
    m = re.search(r"v?(\d+)\.(\d+)[\\/]*$", path.rstrip("\\/"))
    if m:
        return [int(m.group(1)), int(m.group(2))]
    try:
        with open(os.path.join(path, "version.json"), encoding="utf-8") as fh:
            v = parse_version(json.load(fh)["cuda"]["version"])
        return list(v[:2]) or None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_long_paths_enabled() -> Optional[bool]:
    try:
        import winreg  # Windows only
        with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, LONG_PATHS_KEY) as key:
            value, _ = winreg.QueryValueEx(key, "LongPathsEnabled")
        return bool(value)
    except Exception:
        return None


def probe(python: Optional[str] = None, env: Optional[Dict[str, str]] = None,
          pack_dir: str = PACK_DIR) -> Facts:
    """Gather the facts about the target Python (default: the one running this script)."""
    python = python or sys.executable
    os_name = {"win32": "windows", "darwin": "darwin"}.get(sys.platform, "linux")
    env = dict(os.environ if env is None else env)
    if os_name == "windows":  # names are case-insensitive there (os.environ says SYSTEMROOT)
        env = {k.upper(): v for k, v in env.items()}
    f = Facts(os=os_name, python=python, python_dir=os.path.dirname(os.path.abspath(python)),
              pack_dir=pack_dir)
    f.python_kind, f.pth_file = detect_python_kind(f.python_dir, sys.prefix, sys.base_prefix)
    raw, f.probe_error = run_probe_script(python, ["-s"] if f.python_kind == "embedded" else [])
    if raw is None:
        return f
    f.python = raw["executable"] or python
    f.python_dir = os.path.dirname(f.python)
    f.python_kind, f.pth_file = detect_python_kind(f.python_dir, raw["prefix"], raw["base_prefix"])
    f.python_version = tuple(raw["version"])
    f.machine = raw.get("machine") or f.machine
    f.free_threaded = raw["free_threaded"]
    f.pip_available = raw.get("pip", False)
    f.installed = {k: v for k, v in raw.get("dists", {}).items() if k not in ("torch", "numpy")}
    f.numpy_version = raw.get("dists", {}).get("numpy")
    f.torch_version = raw.get("dists", {}).get("torch")
    f.torch_requires = raw.get("torch_requires", [])
    f.torch_error = raw.get("torch_error")
    t = raw.get("torch") or {}
    f.torch_cuda, f.torch_hip = t.get("cuda"), t.get("hip")
    f.cuda_available, f.gpus, f.cuda_driver = bool(t.get("cuda_available")), t.get("gpus", []), t.get("driver")

    # Python headers and import libraries (what triton's build needs).
    f.include_dir = raw.get("include_dir")
    f.python_h = bool(f.include_dir) and os.path.isfile(os.path.join(f.include_dir, "Python.h"))
    f.include_minor = _include_minor(f.include_dir) if f.python_h else None
    if os_name == "windows":
        ver = "%d%d%s" % (f.python_version[0], f.python_version[1], "t" if f.free_threaded else "")
        f.python_lib_dirs = []
        for d in (raw["exec_prefix"], raw["base_exec_prefix"], f.python_dir):
            if d and d not in f.python_lib_dirs:
                f.python_lib_dirs.append(d)
        f.python_lib = next((os.path.join(d, "libs", f"python{ver}.lib") for d in f.python_lib_dirs
                             if os.path.isfile(os.path.join(d, "libs", f"python{ver}.lib"))), None)
        f.headers_target = raw["base_exec_prefix"] or f.python_dir

        # VC++ runtime: System32 and copies in the Python folder.
        f.vcrt_dir = os.path.join(env.get("SYSTEMROOT", r"C:\Windows"), "System32")
        # The folder of the python.exe that really runs: a venv's Scripts\python.exe only
        # starts the base interpreter, whose folder's DLLs are then loaded first.
        f.vcrt_python_dir = raw["base_exec_prefix"] if f.python_kind == "venv" else f.python_dir
        for dll in VCRT_DLLS:
            path = os.path.join(f.vcrt_dir, dll)
            if not os.path.isfile(path):
                f.vcrt_system[dll] = None
            else:
                try:
                    f.vcrt_system[dll] = list(read_file_version(path))
                except PEError as exc:
                    f.vcrt_errors[path] = str(exc)
            local = os.path.join(f.vcrt_python_dir, dll)
            if os.path.isfile(local):
                try:
                    f.vcrt_python[dll] = list(read_file_version(local))
                except PEError as exc:
                    f.vcrt_errors[local] = str(exc)
        for var in ("CUDA_PATH", "CUDA_HOME"):
            if env.get(var):
                f.cuda_path = env[var]
                f.cuda_path_version = cuda_version_of(env[var])
                break
        f.long_paths_enabled = read_long_paths_enabled()
    f.cc = env.get("CC") or None
    f.cc_is_file = f.cc is None or os.path.isfile(f.cc)

    # Folders that come before site-packages when ComfyUI imports triton.
    dirs = [os.getcwd()]
    if env.get("COMFYUI_PATH"):
        dirs.append(env["COMFYUI_PATH"])
    if os.path.basename(os.path.dirname(pack_dir)) == "custom_nodes":
        dirs.append(os.path.dirname(os.path.dirname(pack_dir)))  # ComfyUI/, where main.py runs
    dirs += pth_entries(f.pth_file)
    dirs += [p for p in raw.get("sys_path", []) if p]
    f.shadows = find_shadows(dirs, raw.get("site_dirs", []))

    f.triton_cache_dir, f.cache_from_env = default_triton_cache_dir(env)
    f.cache_ascii = is_ascii(f.triton_cache_dir)
    f.cache_writable = dir_writable(f.triton_cache_dir)
    f.cache_candidates = [{"path": p, "ascii": is_ascii(p), "writable": dir_writable(p)}
                          for p in cache_candidates(os_name, pack_dir, env)]
    config = install_config.load(pack_dir)
    f.config, f.config_problems = dict(config.values), list(config.problems)
    return f


def _include_minor(include_dir: Optional[str]) -> Optional[int]:
    try:
        with open(os.path.join(include_dir or "", "patchlevel.h"), encoding="utf-8", errors="replace") as fh:
            m = re.search(r"#define\s+PY_MINOR_VERSION\s+(\d+)", fh.read())
        return int(m.group(1)) if m else None
    except OSError:
        return None


# ----------------------------------------------------------------------------------------
# Plan (pure: facts -> findings + actions)
# ----------------------------------------------------------------------------------------

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


DRIVER_FOR_CUDA = {(12, 4): "550", (12, 8): "570"}  # oldest NVIDIA driver branch for that CUDA


def bundled_cuda(triton_minor: Tuple[int, int]) -> Tuple[int, int]:
    """CUDA toolchain bundled with Triton: 12.4 for 3.1-3.2, 12.8 from 3.3 on."""
    return (12, 4) if tuple(triton_minor) < (3, 3) else (12, 8)


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


def has_code(blockers: Sequence[Blocker], code: str) -> bool:
    return any(b.code == code for b in blockers)


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


def visible_gpu(f: Facts) -> Optional[dict]:
    """The first GPU torch sees (NVIDIA, or AMD through ROCm), as ComfyUI will use it."""
    return f.gpus[0] if f.cuda_available and f.gpus else None


def device_facts(f: Facts, gpu: dict, triton_version: Optional[str]):
    """gpu_rules' Facts for this GPU, as the Settings node will probe it after install.py's
    actions. An unknown Triton version (None) becomes "": installed, version not known, so only
    the rules that do not depend on it apply (gpu_rules reads None as "not importable")."""
    amd = bool(f.torch_hip)
    return gpu_rules.Facts(
        device="cuda:0", vendor="amd" if amd else "nvidia", name=gpu.get("name") or "",
        capability=None if amd else tuple(gpu["capability"]), arch=(gpu.get("arch") or "").split(":")[0],
        torch_version=f.torch_version or "", torch_cuda=f.torch_cuda,
        triton_version="" if triton_version is None else triton_version,
        implemented=gpu_rules.TRITON_PATHS)  # every path this build ships


# ---- the checks plan() folds, in the order their findings are shown -------------------

def check_probe_and_os(f: Facts) -> Check:
    """Nothing else can be checked when the probe failed, and there is no Triton on macOS."""
    c = Check()
    if f.probe_error:
        c.add("PROBE_FAILED", "error", f"Could not inspect {f.python}: {f.probe_error}",
              "Run install.py with the Python that runs ComfyUI (portable: python_embeded\\python.exe).")
        c.block("PROBE_FAILED", "the target Python could not be inspected")
    elif f.os == "darwin":
        c.add("NO_TRITON_OS", "info", "Triton does not run on macOS; the pack uses PyTorch attention there.")
        c.block("NO_TRITON_OS", "Triton does not run on macOS")
    return c


def check_torch(f: Facts) -> Tuple[Check, Optional[Target]]:
    """torch present and importable, and the Triton package that matches it."""
    c = Check()
    if not f.torch_version:
        c.add("TORCH_MISSING", "error",
              f"torch is not installed in {f.python}: the pack needs ComfyUI's torch, and install.py never installs "
              "torch.",
              "Install ComfyUI and its requirements first (portable: run "
              "update\\update_comfyui_and_python_dependencies.bat), then run install.py again.")
        c.block("TORCH_MISSING", "torch is not installed")
        return c, None
    if f.torch_error:
        c.add("TORCH_BROKEN", "error", f"torch {f.torch_version} is installed but does not import: {f.torch_error}",
              "Repair torch in this Python (ComfyUI cannot start without it), then run install.py again.")
        c.block("TORCH_BROKEN", "torch does not import")
        return c, None
    target, findings = choose_target(f)
    c.findings.extend(findings)
    if target is None and f.os == "windows":
        c.block(findings[0].code if findings else "TORCH_UNKNOWN", f"no triton-windows fits torch {f.torch_version}")
    return c, target


def check_python_wheels(f: Facts, target: Optional[Target]) -> Check:
    """Windows: does triton-windows have a wheel for this Python (and can its TinyCC build for it)?"""
    c = Check()
    if f.os != "windows":
        return c
    pyver = vstr(f.python_version)
    if target is not None and target.minor:
        lo, hi = triton_windows_python_range(target.minor[1])
        if not (3, lo) <= tuple(f.python_version[:2]) <= (3, hi):
            c.add("PYTHON_UNSUPPORTED", "error",
                  f"import error from an unsupported Python: triton-windows {vstr(target.minor)} has wheels for "
                  f"Python 3.{lo} to 3.{hi} only, and this Python is {pyver}, so pip finds no wheel "
                  f"(or 'import triton' fails).",
                  f"Use a ComfyUI portable or venv with Python 3.{min(max(12, lo), hi)} "
                  f"(check with: \"{f.python}\" --version).")
            c.block("PYTHON_UNSUPPORTED", f"Python {pyver} is not supported by triton-windows {vstr(target.minor)}")
    if f.free_threaded:
        c.add("FREE_THREADED", "warning",
              f"Free-threaded Python {pyver}t: triton-windows' bundled TinyCC cannot build for it; "
              f"Triton then needs MSVC.",
              "Install Visual Studio Build Tools with 'Desktop development with C++', or use a regular (GIL) Python.")
    return c


def gpu_finding_text(rule, f: Facts, name: str, cap: Tuple[int, int], target: Optional[Target],
                     triton: Optional[str]) -> Tuple[str, str]:
    """install.py's message and fix line for one of gpu_rules' NVIDIA rules (chosen by code)."""
    sm = gpu_rules.sm(cap)
    pkg = target.package if target else "triton"
    minor = vstr(parse_version(triton)[:2])
    cu128 = (f"{cmdline(pip_argv(f))} install -U torch torchvision torchaudio "
             "--index-url https://download.pytorch.org/whl/cu128")
    if rule.code == gpu_rules.GPU_TOO_OLD:
        return (f"{name} is {sm}: Triton supports sm_75 and newer, so the pack uses PyTorch attention on it.",
                "Nothing to fix: the pack falls back to PyTorch attention on this GPU by itself.")
    if rule.code == gpu_rules.TURING_DROPPED:
        return (f"{name} is {sm} (Turing): Triton 3.3 and newer dropped it, and torch {f.torch_version} "
                f"needs {pkg} {minor}.",
                f"For Triton on this GPU use torch 2.6 with {pkg}<3.3; otherwise nothing to fix: "
                f"the pack uses PyTorch attention.")
    if rule.code == gpu_rules.BLACKWELL_TORCH:
        return (f"{name} is {sm} (Blackwell): it needs torch 2.7 or newer built for CUDA 12.8 or newer, "
                f"and this torch is {f.torch_version} (CUDA {f.torch_cuda}).",
                f"Install a cu128 build of torch: {cu128}")
    if rule.code == gpu_rules.BLACKWELL_TRITON:
        return (f"{name} is {sm} (Blackwell): it needs Triton 3.3 or newer, and torch {f.torch_version} "
                f"needs {pkg} {minor}.",
                f"Install a torch build that pairs with Triton 3.3 or newer (2.7+, CUDA 12.8+): {cu128}")
    return (f"{rule.reason}.", "Nothing to fix here: the pack uses PyTorch attention on this GPU.")


def check_gpu(f: Facts, target: Optional[Target]) -> Check:
    """gpu_rules' blockers for the first GPU, in install.py's words; codes and the blockers'
    reasons are gpu_rules' own, so the Settings node and install.py cannot disagree."""
    c = Check()
    if not f.torch_version or f.torch_error:
        return c  # check_torch said why
    gpu = visible_gpu(f)
    no_gpu = gpu_rules.device_blocker(gpu_rules.Facts(device="cpu", vendor="cpu"))
    if f.torch_hip:
        # select_path() decides AMD in fold(): auto keeps PyTorch there (AMD_NOT_VALIDATED); a gfx
        # arch outside the compile-tested families is a GPU blocker, as on the Settings node.
        c.add("ROCM", "info",
              f"torch is a ROCm build (HIP {f.torch_hip}); the pack's Triton kernels are compile-tested for AMD "
              f"({', '.join(gpu_rules.AMD_COMPILE_TARGETS)}) but not run on AMD hardware, so auto uses PyTorch "
              f"attention and Linear here (fp16, int8 or fp8 in the Settings node force them where the GPU has them).")
        if gpu is None:
            c.block(no_gpu.code, no_gpu.reason)
        else:
            rule = gpu_rules.device_blocker(device_facts(f, gpu, None))
            if rule is not None:
                c.block(rule.code, rule.reason)
        return c
    if gpu is None:
        if f.torch_cuda:
            c.add("NO_GPU", "warning",
                  f"torch {f.torch_version} is a CUDA build but sees no NVIDIA GPU (driver missing or "
                  f"CUDA_VISIBLE_DEVICES empty?).",
                  "Check that nvidia-smi lists the GPU; update the NVIDIA driver.")
        else:
            c.add("NO_GPU", "info",
                  f"torch {f.torch_version} is a CPU-only build: Triton kernels need an NVIDIA GPU, so the pack "
                  f"uses PyTorch attention (the Triton interpreter serves tests only).",
                  "For GPU acceleration install a CUDA build of torch (see ComfyUI's install instructions).")
        c.block(no_gpu.code, no_gpu.reason)
        return c
    name, cap = gpu.get("name") or "GPU", tuple(gpu["capability"])
    triton = expected_triton(f, target)
    rule = gpu_rules.nvidia_gpu_blocker(name, cap, triton, f.torch_version, f.torch_cuda)
    if rule is not None:
        message, fix = gpu_finding_text(rule, f, name, cap, target, triton)
        c.add(rule.code, "error", message, fix)
        c.block(rule.code, rule.reason)
    return c


def check_cuda_toolchain(f: Facts, target: Optional[Target]) -> Check:
    """Windows: the CUDA triton-windows compiles with vs torch's build, the driver, and CUDA_PATH."""
    c = Check()
    if f.os != "windows":
        return c
    tminor = target_minor(target)
    if f.torch_cuda and not f.torch_hip and tminor is not None:
        tc = parse_version(f.torch_cuda)[:2]
        bc = bundled_cuda(tminor)
        driver = parse_version(f.cuda_driver)[:2]
        if tc and tc < bc and not (driver and driver >= bc):
            drv = f"this driver supports CUDA {vstr(driver)}" if driver else "the driver's CUDA version is unknown"
            hard = bool(driver) and driver[0] < bc[0]
            c.add("CUDA_MISMATCH", "error" if hard else "warning",
                  f"CUDA version mismatch between torch and Triton: torch is built for CUDA {f.torch_cuda} but "
                  f"{target.package} {vstr(tminor)} compiles kernels with its bundled "
                  f"CUDA {vstr(bc)}, which needs a driver for CUDA {vstr(bc)} or newer ({drv}).",
                  f"Update the NVIDIA driver ({DRIVER_FOR_CUDA.get(bc, 'a recent one')} or newer for CUDA "
                  f"{vstr(bc)}), or install a cu{bc[0]}{bc[1]} build of torch.")
            if hard:
                c.block("CUDA_MISMATCH", f"the driver is older than CUDA {vstr(bc)}")
    if f.cuda_path and f.cuda_path_version and f.cuda_path_version[0] < 12:
        torch_part = f"torch uses CUDA {f.torch_cuda}" if f.torch_cuda else "Triton needs CUDA 12"
        c.add("CUDA_PATH_OLD", "error",
              f"CUDA version mismatch between torch and Triton: CUDA_PATH points at CUDA "
              f"{vstr(f.cuda_path_version)} ({f.cuda_path}); Triton then uses that CUDA {f.cuda_path_version[0]} "
              f"toolchain instead of its bundled one, while {torch_part}.",
              "Clear it for ComfyUI (add 'set CUDA_PATH=' to the .bat that starts ComfyUI), or point it at CUDA "
              "12.8 or newer.")
        c.block("CUDA_PATH_OLD", f"CUDA_PATH points at CUDA {f.cuda_path_version[0]}")
    return c


def check_vc_runtime(f: Facts, options: Options) -> Check:
    """Windows: the VC++ runtime DLLs libtriton loads (System32's, and older copies that shadow them)."""
    c = Check()
    if f.os != "windows":
        return c
    sysdir = f.vcrt_dir or r"C:\Windows\System32"
    bad_codes = []
    for dll in VCRT_DLLS:
        if dll not in f.vcrt_system:
            continue  # unknown (read error reported below)
        ver = f.vcrt_system[dll]
        if ver is None:
            c.add("VCRT_MISSING", "error",
                  f"compile failure from missing VC++ runtime: {dll} is not in {sysdir}, so triton's libtriton "
                  f"cannot load ('DLL load failed while importing libtriton').",
                  f"Install the latest Microsoft Visual C++ Redistributable (x64): {VC_REDIST_URL}")
            bad_codes.append("VCRT_MISSING")
        elif tuple(ver[:2]) < VCRT_MIN:
            c.add("VCRT_OLD", "error",
                  f"compile failure from missing VC++ runtime: {dll} in {sysdir} is version {vstr(ver)}; "
                  f"triton-windows needs {vstr(VCRT_MIN)} or newer.",
                  f"Install the latest Microsoft Visual C++ Redistributable (x64): {VC_REDIST_URL}")
            bad_codes.append("VCRT_OLD")
    for path, err in sorted(f.vcrt_errors.items()):
        c.add("VCRT_UNREADABLE", "warning", f"Could not read the version of {path}: {err}",
              f"Reinstall the Microsoft Visual C++ Redistributable (x64): {VC_REDIST_URL}")
    stale = []
    pydir = f.vcrt_python_dir or f.python_dir
    for dll, ver in sorted(f.vcrt_python.items()):
        sys_ver = f.vcrt_system.get(dll)
        if tuple(ver[:2]) < VCRT_MIN:
            stale.append(dll)
            newer = f"the newer one in System32 ({vstr(sys_ver)})" if sys_ver else "a current one"
            if f.python_kind == "conda":
                fix = "conda install -c conda-forge vc14_runtime"
            else:
                fix = (f"Copy msvcp140.dll, vcruntime140.dll and vcruntime140_1.dll from {sysdir} into "
                       f"{pydir} (install.py --fix does it and keeps the old files as .old)")
            c.add("VCRT_SHADOW", "error",
                  f"An old {dll} ({vstr(ver)}) in the Python folder {pydir} is loaded instead of {newer}: "
                  f"the usual cause of 'DLL load failed while importing libtriton'.", fix)
    if bad_codes:
        c.block(bad_codes[0], "the VC++ runtime is missing or too old")
    if stale:
        c.block("VCRT_SHADOW", "old VC++ runtime DLLs in the Python folder")
        sys_good = all(f.vcrt_system.get(d) and tuple(f.vcrt_system[d][:2]) >= VCRT_MIN for d in stale)
        if options.fix and f.python_kind != "conda" and sys_good:
            c.actions.append(Action(
                "copy-vcrt", f"copy {', '.join(stale)} from {sysdir} into {pydir} (old files kept as .old)",
                data={"src_dir": sysdir, "dst_dir": pydir, "dlls": stale}))
    return c


def check_python_headers(f: Facts, options: Options) -> Check:
    """Windows: include/Python.h and libs/python3XX.lib, which Triton's launcher build needs."""
    c = Check()
    if f.os != "windows":
        return c
    pyver = vstr(f.python_version)
    tag = "%d%d%s" % (f.python_version[0], f.python_version[1], "t" if f.free_threaded else "")
    target_dir = f.headers_target or f.python_dir
    nuget_ok = not f.free_threaded and re.fullmatch(r"\d+\.\d+\.\d+", pyver) is not None
    by_hand = (f"by hand: unzip {NUGET_URL.format(v=pyver)} and copy its tools\\include and tools\\libs "
               f"folders into {target_dir}")
    fix_line = (f"Run install.py --fix (downloads Python {pyver}'s include and libs from nuget.org into "
                f"{target_dir}); {by_hand}") if nuget_ok else (
        f"Copy the include and libs folders of a Python {pyver} install with the free-threaded binaries "
        f"(python.org installer option) into {target_dir}" if f.free_threaded else
        f"Copy the include and libs folders of a Python {pyver} install into {target_dir}")
    header_wrong = f.python_h and f.include_minor is not None and f.include_minor != f.python_version[1]
    if not f.python_h:
        c.add("PYTHON_H_MISSING", "error",
              f"Python.h is missing ({ntpath.join(f.include_dir or target_dir, 'Python.h')}): Triton cannot build "
              f"its launcher (tcc 'exit status 1' / 'Python.h: No such file or directory').", fix_line)
    elif header_wrong:
        c.add("PYTHON_H_WRONG", "error",
              f"The include folder {f.include_dir} is for Python 3.{f.include_minor}, but this Python is {pyver}: "
              f"Triton builds fail or crash ('DLL load failed while importing cuda_utils').", fix_line)
    if not f.python_lib:
        where = ", ".join(ntpath.join(d, "libs") for d in f.python_lib_dirs) or target_dir
        c.add("PYTHON_LIB_MISSING", "error",
              f"python{tag}.lib is not in {where}: Triton warns 'Failed to find Python libs.' and cannot link "
              f"its launcher.", fix_line)
    missing = [n for n, bad in (("Python.h", not f.python_h or header_wrong), (f"python{tag}.lib", not f.python_lib))
               if bad]
    if missing:
        verb = " is" if len(missing) == 1 else " are"
        c.block(c.findings[0].code, " and ".join(missing) + verb + " missing or wrong")
        if options.fix and nuget_ok:
            c.actions.append(Action("fix-headers",
                                    f"download Python {pyver} include/libs from nuget.org into {target_dir}",
                                    data={"version": pyver, "target": target_dir}))
    return c


def check_build_environment(f: Facts) -> Check:
    """Windows: a CC Triton cannot run, and long paths (deep cache paths)."""
    c = Check()
    if f.os != "windows":
        return c
    if f.cc and not f.cc_is_file:
        c.add("CC_NOT_FILE", "error",
              f"CC is set to '{f.cc}', which is not the path of one compiler file; Triton runs CC as a single "
              f"path and fails (PermissionError [WinError 5] or 'file not found').",
              "Unset it (set CC=) so Triton uses its bundled TinyCC, or set it to the full path of one compiler "
              "executable.")
        c.block("CC_NOT_FILE", "CC is not a compiler path")
    if f.long_paths_enabled is False:
        c.add("LONG_PATHS", "warning",
              "Windows long paths are disabled (LongPathsEnabled=0): deep Triton / inductor cache paths fail "
              "with WinError 206 or FileNotFoundError.",
              f"As administrator run: reg add HKLM\\{LONG_PATHS_KEY} /v LongPathsEnabled /t REG_DWORD /d 1 /f, "
              "then reboot.")
    return c


def check_shadows(f: Facts) -> Check:
    c = Check()
    for path in f.shadows:
        c.add("TRITON_SHADOWED", "error",
              f"{path} shadows the triton package: 'import triton' loads it instead ('triton' is not a package).",
              f"Rename or move {path}.")
        c.block("TRITON_SHADOWED", f"{path} shadows triton")
    return c


def check_triton_cache(f: Facts) -> Check:
    """The Triton cache folder: non-ASCII on Windows, or not writable; pick a safe one if we may."""
    c = Check()
    if f.triton_cache_dir and not f.cache_ascii and f.os == "windows":
        code, msg = ("CACHE_NON_ASCII", f"The Triton cache {f.triton_cache_dir} has non-ASCII characters in its "
                                        f"path, which break TinyCC / ptxas builds")
    elif f.triton_cache_dir and not f.cache_writable:
        code, msg = ("CACHE_NOT_WRITABLE", f"The Triton cache {f.triton_cache_dir} is not writable "
                                           f"(PermissionError [WinError 5] / [Errno 13])")
    else:
        return c
    safe = next((x["path"] for x in f.cache_candidates if x.get("ascii") and x.get("writable")), None)
    example = safe or ("C:\\triton-cache" if f.os == "windows" else "/tmp/triton-cache")
    if f.cache_from_env:  # the user's own setting wins over the pack's config: they must change it
        c.add(code, "error", msg + " (it comes from the TRITON_CACHE_DIR environment variable).",
              f"Set TRITON_CACHE_DIR to a writable folder with an ASCII-only path, e.g. {example}.")
        c.block(code, "TRITON_CACHE_DIR is unusable")
    elif safe is None:
        c.add(code, "error", msg + ", and install.py found no safe folder for it.",
              f"Set TRITON_CACHE_DIR to a writable folder with an ASCII-only path, e.g. {example}.")
        c.block(code, "no usable Triton cache folder")
    else:
        c.add(code, "warning", msg + ".",
              f"install.py sets {safe} as the pack's Triton cache ({CONFIG_NAME}, key {CONFIG_KEY_CACHE}); "
              f"for other tools set TRITON_CACHE_DIR={safe}.")
        if f.config.get(CONFIG_KEY_CACHE) != safe:
            c.actions.append(Action("mkdir", f"create the Triton cache folder {safe}", data={"path": safe}))
            c.actions.append(Action("write-config", f"write {CONFIG_KEY_CACHE}={safe} to {CONFIG_NAME}",
                                    data={"key": CONFIG_KEY_CACHE, "value": safe}))
    return c


def check_config(f: Facts) -> Check:
    """triton_accel.json values the pack ignores (kernels/install_config.py says why)."""
    c = Check()
    for problem in f.config_problems:
        c.add("CONFIG_INVALID", "warning", f"{problem}: the pack ignores it and uses Triton's default cache.",
              f"Correct or delete it ({CONFIG_KEY_CACHE} must be an absolute path of a writable folder); "
              f"install.py rewrites {CONFIG_NAME} when the default cache is unusable.")
    return c


def check_triton_install(f: Facts, target: Optional[Target], installable: bool, gpu_ok: bool) -> Check:
    """pip, then the Triton package (install, replace, or remove plain triton on Windows), and
    numpy for the Triton interpreter where no GPU can run Triton."""
    c = Check()
    if target is None:
        return c
    pip = pip_argv(f)
    if not f.pip_available:
        fix = (f"Download https://bootstrap.pypa.io/get-pip.py and run: \"{f.python}\" get-pip.py"
               if f.python_kind == "embedded"
               else f"{cmdline(python_base_argv(f.python, f.python_kind))} -m ensurepip --upgrade")
        c.add("PIP_MISSING", "error",
              f"pip is not available in {f.python}, so install.py cannot install {target.package}.", fix)
        c.block("PIP_MISSING", "pip is missing")
        installable = False
    if target.package in ("pytorch-triton-rocm", "pytorch-triton"):
        have = f.installed.get(target.package)
        if not target.satisfied_by(have):
            local = re.search(r"\+((?:rocm|cu)[0-9.]+)$", f.torch_version or "")
            build = local.group(1) if local else "<your torch build, e.g. rocm6.4>"
            index = "https://download.pytorch.org/whl/" + build
            c.add("TRITON_FROM_PYTORCH_INDEX", "warning",
                  f"torch needs {target.spec}, which is only on the PyTorch package index "
                  f"(installed: {have or 'none'}).",
                  cmdline(pip + ["install", "--no-deps", target.spec, "--index-url", index]))
        return c
    if not installable:
        return c
    have = f.installed.get(target.package)
    conflict = f.os == "windows" and "triton" in f.installed
    if conflict:
        c.add("TRITON_CONFLICT", "warning",
              f"Plain 'triton' {f.installed['triton']} is installed: it does not work on Windows and conflicts with "
              f"triton-windows (both own the 'triton' folder).", cmdline(pip + ["uninstall", "-y", "triton"]))
    install_argv = pip + ["install", "--no-deps", target.spec]
    if conflict and target.satisfied_by(have):
        # Removing plain triton deletes files triton-windows shares with it: reinstall it afterwards.
        install_argv = pip + ["install", "--no-deps", "--force-reinstall", f"triton-windows=={have}"]
    if target.satisfied_by(have) and not conflict:
        c.add("TRITON_OK", "info",
              f"{target.package} {have} is installed and matches torch {f.torch_version} ({target.spec}).")
    else:
        if have and not target.satisfied_by(have):
            c.add("TRITON_MISMATCH", "warning",
                  f"{target.package} {have} does not match torch {f.torch_version}: it needs {target.spec} "
                  f"({target.reason}).", cmdline(install_argv))
        elif not have:
            c.add("TRITON_MISSING", "info",
                  f"{target.package} is not installed; install.py installs {target.spec} ({target.reason}).",
                  cmdline(install_argv))
        if conflict:
            pre = pip + ["download", "--no-deps", "-d", "{tmp}", install_argv[-1]]
            c.actions.append(Action("pip", "remove the conflicting plain triton",
                                    pip + ["uninstall", "-y", "triton"], preflight=pre))
        c.actions.append(Action("pip", f"install {install_argv[-1]}", install_argv))
    if not gpu_ok and not f.numpy_version and not f.torch_hip:
        argv = pip + ["install", "--no-deps", "numpy"]
        c.add("NUMPY_MISSING", "info",
              "numpy is not installed; the Triton interpreter (what runs Triton code without a GPU, for tests) "
              "needs it, so install.py installs it.", cmdline(argv))
        c.actions.append(Action("pip", "install numpy (for the Triton interpreter)", argv))
    return c


def fold(f: Facts, target: Optional[Target], checks: Sequence[Check]) -> Plan:
    """One plan from the checks, and the path auto takes once their actions are done: PyTorch
    while anything blocks Triton, else gpu_rules.select_path() for the first GPU."""
    findings = [x for c in checks for x in c.findings]
    actions = [a for c in checks for a in c.actions]
    blockers: List[Blocker] = []
    for b in (b for c in checks for b in c.blockers):
        if (b.code, b.reason) not in {(x.code, x.reason) for x in blockers}:
            blockers.append(b)
    gpu = visible_gpu(f)
    decision = None
    if not blockers and gpu is not None:
        decision = gpu_rules.select_path(device_facts(f, gpu, expected_triton(f, target)), "auto")
        if decision.path == gpu_rules.PATH_PYTORCH:  # AMD: not validated yet, so auto keeps PyTorch
            blockers.append(Blocker(decision.code, decision.reason))
    if blockers or decision is None:
        reason = "; ".join(b.reason for b in blockers) or "Triton cannot run here"
        return Plan(target, findings, actions, gpu_rules.PATH_PYTORCH, reason, True, blockers)
    return Plan(target, findings, actions, decision.path, decision.reason, False, blockers,
                gpu_rules.expected_paths(decision))


def plan(f: Facts, options: Optional[Options] = None) -> Plan:
    """Facts -> findings, actions and the expected attention path. Pure: reads nothing but f."""
    options = options or Options()
    first = check_probe_and_os(f)
    if first.blockers:
        return fold(f, None, [first])
    torch_check, target = check_torch(f)
    wheels = check_python_wheels(f, target)
    gpu = check_gpu(f, target)
    installable = target is not None and not has_code(wheels.blockers, "PYTHON_UNSUPPORTED")
    gpu_ok = visible_gpu(f) is not None and not f.torch_hip and not gpu.blockers
    checks = [torch_check, wheels, gpu, check_cuda_toolchain(f, target), check_vc_runtime(f, options),
              check_python_headers(f, options), check_build_environment(f), check_shadows(f),
              check_triton_cache(f), check_config(f), check_triton_install(f, target, installable, gpu_ok)]
    return fold(f, target, checks)


# ----------------------------------------------------------------------------------------
# Act
# ----------------------------------------------------------------------------------------

def fetch_url(url: str, timeout: float = 120) -> bytes:
    import urllib.request
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (fixed https URL)
        return resp.read()


def fix_python_headers(version: str, target: str, fetch: Callable[[str], bytes] = fetch_url,
                       log: Callable[[str], None] = print) -> List[str]:
    """Put include/ and libs/ of Python `version` (from the python.org NuGet package) into
    target. Existing files are never overwritten; an include/ of another minor version is
    renamed to include.old-3.X first. Returns the paths it created."""
    major, minor = parse_version(version)[:2]
    data = fetch(NUGET_URL.format(v=version))
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise RuntimeError(f"the download for Python {version} is not a NuGet package (zip): {exc}") from exc
    names = zf.namelist()
    need_h, need_lib = "tools/include/Python.h", f"tools/libs/python{major}{minor}.lib"
    for need in (need_h, need_lib):
        if need not in names:
            raise RuntimeError(f"the NuGet package for Python {version} has no {need}")
    inc = os.path.join(target, "include")
    old_minor = _include_minor(inc) if os.path.isfile(os.path.join(inc, "Python.h")) else None
    created = []
    if old_minor is not None and old_minor != minor:
        backup = inc + f".old-{major}.{old_minor}"
        n = 1
        while os.path.exists(backup):
            n += 1
            backup = inc + f".old-{major}.{old_minor}-{n}"
        os.rename(inc, backup)
        log(f"renamed {inc} (Python {major}.{old_minor}) to {backup}")
    for name in names:
        if name.endswith("/") or not (name.startswith("tools/include/") or name.startswith("tools/libs/")):
            continue
        rel = name[len("tools/"):]
        parts = rel.split("/")
        if any(p in ("", ".", "..") for p in parts) or ":" in rel or "\\" in rel:
            raise RuntimeError(f"refusing unsafe path in the NuGet package: {name}")
        dest = os.path.join(target, *parts)
        if os.path.exists(dest):
            continue
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = dest + ".part"
        with zf.open(name) as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out)
        os.replace(tmp, dest)
        created.append(dest)
    return created


def copy_vcrt(src_dir: str, dst_dir: str, dlls: Sequence[str], log: Callable[[str], None] = print) -> None:
    for dll in dlls:
        dst = os.path.join(dst_dir, dll)
        if os.path.exists(dst):
            try:
                tag = vstr(read_file_version(dst))
            except PEError:
                tag = "unknown"
            backup = f"{dst}.old-{tag}"
            if os.path.exists(backup):
                os.unlink(backup)
            os.rename(dst, backup)  # Windows allows renaming a DLL that is in use
            log(f"kept the old {dll} as {backup}")
        shutil.copy2(os.path.join(src_dir, dll), dst)


def write_last_report(pack_dir: str, report: dict, log) -> Optional[str]:
    """The --json report of the last real run, kept for the pack's status panel
    (/triton_accel/status shows its verdict and every remaining fix). Best effort: a read-only
    pack folder only costs the panel its install section."""
    path = os.path.join(pack_dir, LAST_REPORT_NAME)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
    except OSError as e:
        log(f"(could not keep this report in {path}: {e})")
        return None
    return path


def write_config(pack_dir: str, key: str, value) -> str:
    path = os.path.join(pack_dir, CONFIG_NAME)
    data = read_config(pack_dir)
    data[key] = value
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)
    return path


@dataclass
class Result:
    action: str
    ok: bool
    detail: str = ""
    seconds: float = 0.0


def run_command(argv: Sequence[str], quiet: bool) -> Tuple[int, str]:
    """Run a command; its output goes to our stderr when quiet (--json keeps stdout clean)."""
    proc = subprocess.run(list(argv), stdout=subprocess.PIPE if quiet else None,
                          stderr=subprocess.STDOUT if quiet else None, text=True, errors="replace")
    out = proc.stdout or ""
    if quiet and out:
        sys.stderr.write(out)
    return proc.returncode, out


def act(p: Plan, f: Facts, quiet: bool = False, log: Callable[[str], None] = print,
        fetch: Callable[[str], bytes] = fetch_url) -> List[Result]:
    results: List[Result] = []
    for a in p.actions:
        t0 = time.monotonic()
        log(f"-> {a.description}")
        try:
            if a.kind == "pip":
                if a.preflight:
                    with tempfile.TemporaryDirectory() as tmp:
                        pre = [tmp if x == "{tmp}" else x for x in a.preflight]
                        rc, _ = run_command(pre, quiet)
                    if rc != 0:
                        results.append(Result(a.description, False, f"skipped: {cmdline(pre)} failed (rc {rc}), "
                                                                    "so nothing was removed", time.monotonic() - t0))
                        break
                rc, out = run_command(a.argv, quiet)
                ok = rc == 0
                detail = cmdline(a.argv) + ("" if ok else f" failed with exit code {rc}")
                if not ok:
                    tail = [ln for ln in out.strip().splitlines() if ln.strip()][-2:]
                    if tail:
                        detail += ": " + " | ".join(tail)
                results.append(Result(a.description, ok, detail, time.monotonic() - t0))
                if not ok:
                    break  # pip rolls back its own step; later steps depend on this one
            elif a.kind == "mkdir":
                os.makedirs(a.data["path"], exist_ok=True)
                results.append(Result(a.description, True, a.data["path"], time.monotonic() - t0))
            elif a.kind == "write-config":
                path = write_config(f.pack_dir, a.data["key"], a.data["value"])
                results.append(Result(a.description, True, path, time.monotonic() - t0))
            elif a.kind == "fix-headers":
                made = fix_python_headers(a.data["version"], a.data["target"], fetch=fetch, log=log)
                results.append(Result(a.description, True, f"{len(made)} files added", time.monotonic() - t0))
            elif a.kind == "copy-vcrt":
                copy_vcrt(a.data["src_dir"], a.data["dst_dir"], a.data["dlls"], log=log)
                results.append(Result(a.description, True, "", time.monotonic() - t0))
            else:
                results.append(Result(a.description, False, f"unknown action kind {a.kind}"))
        except Exception as exc:  # an action failing must not crash the installer
            results.append(Result(a.description, False, f"{type(exc).__name__}: {exc}", time.monotonic() - t0))
    return results


# ----------------------------------------------------------------------------------------
# Self-check: import triton and run a tiny kernel in a subprocess
# ----------------------------------------------------------------------------------------

SELF_CHECK_SCRIPT = r'''
import json, os, sys, time
out = {"mode": "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "gpu"}
def done():
    print("@@TRITON_ACCEL_CHECK@@" + json.dumps(out))
    sys.exit(0)
try:
    import torch
except BaseException as e:
    out["error"] = "import torch: %s: %s" % (type(e).__name__, e); done()
try:
    import triton
    import triton.language as tl
    out["triton_version"] = triton.__version__
    out["triton_file"] = getattr(triton, "__file__", None)
except BaseException as e:
    out["error"] = "import triton: %s: %s" % (type(e).__name__, e); done()
out["import_ok"] = True
try:
    @triton.jit
    def _add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)
    dev = "cuda" if out["mode"] == "gpu" else "cpu"
    x = torch.arange(1000, dtype=torch.float32, device=dev)
    y = torch.empty_like(x)
    t0 = time.time()
    # FP fusion named, as the pack's launches name it: Triton 3.9 warns on a launch that
    # leaves it to its default (which turns off in 3.10).
    _add_one[(triton.cdiv(1000, 256),)](x, y, 1000, BLOCK=256, enable_fp_fusion=True)
    if dev == "cuda":
        torch.cuda.synchronize()
    out["seconds"] = round(time.time() - t0, 3)
    out["kernel_ok"] = bool(torch.equal(y.cpu(), x.cpu() + 1))
    if not out["kernel_ok"]:
        out["error"] = "the kernel ran but returned wrong values"
except BaseException as e:
    out["error"] = "kernel: %s: %s" % (type(e).__name__, str(e).strip().splitlines()[-1:] or "")
done()
'''


def self_check(f: Facts, timeout: float = 600) -> dict:
    env = dict(os.environ)
    gpu = f.cuda_available and bool(f.gpus) and not f.torch_hip
    if gpu:
        env.pop("TRITON_INTERPRET", None)
    else:
        env["TRITON_INTERPRET"] = "1"
    cache = install_config.load(f.pack_dir).values.get(CONFIG_KEY_CACHE)  # checked, as the pack reads it
    if cache and not env.get("TRITON_CACHE_DIR"):
        env["TRITON_CACHE_DIR"] = cache
    fd, script = tempfile.mkstemp(prefix="triton_accel_check_", suffix=".py")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(SELF_CHECK_SCRIPT)
        argv = python_base_argv(f.python, f.python_kind) + [script]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, errors="replace")
    except (OSError, subprocess.SubprocessError) as exc:
        return {"mode": "gpu" if gpu else "interpreter", "error": f"could not run the self-check: {exc}"}
    finally:
        try:
            os.unlink(script)
        except OSError:
            pass
    for line in proc.stdout.splitlines():
        if line.startswith("@@TRITON_ACCEL_CHECK@@"):
            try:
                out = json.loads(line[len("@@TRITON_ACCEL_CHECK@@"):])
            except (ValueError, RecursionError) as exc:
                out = f"{type(exc).__name__}: {exc}"
            if isinstance(out, dict):
                return out
            return {"mode": "gpu" if gpu else "interpreter", "error": f"unreadable self-check output: {out}"}
    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    return {"mode": "gpu" if gpu else "interpreter", "error": f"self-check crashed (exit code {proc.returncode}): {tail}"}


def verdict(p: Plan, f: Facts, check: Optional[dict]) -> dict:
    """Which attention path the pack will use, and one sentence that says it plainly."""
    gpu = f.gpus[0] if f.gpus else {}
    where = gpu.get("name")
    if gpu.get("capability") and not f.torch_hip:
        where = f"{where} ({gpu_rules.sm(tuple(gpu['capability']))})"
    if check is not None and check.get("mode") == "gpu" and check.get("kernel_ok") and not p.triton_blocked:
        return {"path": p.path, "triton_works": True,
                "message": f"Triton works on {where}: in auto the pack uses {p.expected_paths}."}
    if check is None and not p.triton_blocked:
        return {"path": p.path, "triton_works": None,
                "message": f"Nothing blocks Triton on {where}: in auto the pack should use {p.expected_paths}; "
                           f"not verified, the self-check did not run."}
    codes = {b.code for b in p.blockers}
    if gpu_rules.NO_GPU in codes:
        if check is not None and check.get("kernel_ok"):
            interp = "The Triton interpreter works here (for tests only)."
        elif check is not None:
            interp = f"The Triton interpreter does not work here either: {check.get('error')}."
        else:
            interp = "The Triton interpreter was not checked."
        return {"path": gpu_rules.PATH_PYTORCH, "triton_works": False,
                "message": f"No NVIDIA GPU: the pack uses PyTorch attention. {interp}"}
    if gpu_rules.AMD_NOT_VALIDATED in codes:
        return {"path": gpu_rules.PATH_PYTORCH, "triton_works": False,
                "message": f"AMD GPU ({where}): in auto the pack uses PyTorch attention and Linear; its Triton "
                           f"kernels are compile-tested for it but not run on AMD hardware (fp16 in the Settings "
                           f"node forces them)."}
    reasons = p.path_reason if p.triton_blocked or check is None else ""
    if check is not None and check.get("error"):
        reasons = (reasons + "; " if reasons else "") + "self-check: " + check["error"]
    return {"path": gpu_rules.PATH_PYTORCH, "triton_works": False,
            "message": f"Triton is blocked ({reasons or 'not checked'}). The pack still loads and uses PyTorch "
                       f"attention; fix the errors above to enable Triton."}


# ----------------------------------------------------------------------------------------
# Developer bootstrap: --venv PATH [--demo]
# ----------------------------------------------------------------------------------------

BOOTSTRAP_MARK = ".triton-accel-bootstrap"


def venv_python(path: str) -> str:
    if sys.platform == "win32":
        return os.path.join(path, "Scripts", "python.exe")
    return os.path.join(path, "bin", "python")


def bootstrap(args, log: Callable[[str], None]) -> int:
    vdir = os.path.abspath(args.venv)
    py = venv_python(vdir)
    reqs = os.path.join(PACK_DIR, "requirements.txt")
    steps = []
    created_by_us = os.path.isfile(os.path.join(vdir, BOOTSTRAP_MARK))
    new = not os.path.isfile(py)
    if new:
        steps.append(("create the venv", [sys.executable, "-m", "venv", vdir]))
        created_by_us = True
    have_torch = False
    if not new:
        rc = subprocess.run([py, "-c", "import importlib.metadata as m; m.version('torch')"],
                            capture_output=True).returncode
        have_torch = rc == 0
    if not have_torch:
        if not created_by_us:
            log(f"error: {vdir} exists, was not created by install.py and has no torch; install torch in it yourself "
                f"(install.py only installs torch into a venv it created).")
            return 1
        steps.append((f"install {args.torch_spec} into the new venv", [py, "-m", "pip", "install", args.torch_spec]))
    if os.path.isfile(reqs):
        steps.append(("install requirements.txt", [py, "-m", "pip", "install", "-r", reqs]))
    inner = [py, os.path.abspath(__file__)] + (["--fix"] if args.fix else []) + (["--no-check"] if args.no_check else [])
    steps.append(("run install.py inside the venv", inner))
    demo = os.path.abspath(args.demo_script or os.path.join(PACK_DIR, "benchmarks", "demo.py"))
    if args.demo:
        steps.append(("run the demo", [py, demo]))
    if args.dry_run:
        log(f"Bootstrap plan for {vdir} (--dry-run: nothing is changed):")
        for what, argv in steps:
            log(f"  {what}: {cmdline(argv)}")
        return 0
    for what, argv in steps:
        log(f"== {what}: {cmdline(argv)}")
        if what == "run the demo" and not os.path.isfile(demo):
            log(f"error: {demo} does not exist")
            return 1
        rc = subprocess.call(argv, cwd=PACK_DIR)
        if what == "create the venv" and rc == 0:
            with open(os.path.join(vdir, BOOTSTRAP_MARK), "w", encoding="utf-8") as fh:
                fh.write("created by triton-accel install.py --venv; it may install torch here\n")
        if rc != 0:
            if what == "run the demo":
                log(f"the demo exited with code {rc}")
            else:
                log(f"error: '{what}' failed with exit code {rc}")
            return rc
    return 0


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------

def render(f: Facts, p: Plan, results: Optional[List[Result]], check: Optional[dict], v: dict,
           dry_run: bool) -> str:
    lines = []
    gpu = ", ".join(f"{g.get('name')} (sm_{g['capability'][0]}{g['capability'][1]})" for g in f.gpus) or "none"
    torch_desc = f.torch_version or "not installed"
    if f.torch_version:
        torch_desc += f" (CUDA {f.torch_cuda})" if f.torch_cuda else (f" (ROCm {f.torch_hip})" if f.torch_hip else " (CPU)")
    lines.append("Triton Accel install check")
    lines.append(f"  OS: {f.os}   Python: {vstr(f.python_version)} ({f.python_kind}) {f.python}")
    lines.append(f"  torch: {torch_desc}   GPU: {gpu}")
    inst = ", ".join(f"{k} {v_}" for k, v_ in sorted(f.installed.items())) or "none"
    lines.append(f"  Triton packages: {inst}" + (f"   target: {p.target.spec}" if p.target else ""))
    if p.findings:
        lines.append("Findings:")
        for x in p.findings:
            lines.append(f"  [{x.severity.upper()}] {x.message}")
            if x.fix:
                lines.append(f"      fix: {x.fix}")
    if not p.actions:
        lines.append("Nothing for install.py to do." if p.triton_blocked else "Nothing to install: everything is in place.")
    else:
        lines.append("Plan:" if dry_run or results is None else "Actions:")
        for i, a in enumerate(p.actions):
            r = results[i] if results is not None and i < len(results) else None
            state = "" if r is None else (" [done]" if r.ok else " [FAILED]")
            lines.append(f"  - {a.description}{state}" + (f": {cmdline(a.argv)}" if a.argv else ""))
            if r is not None and not r.ok:
                lines.append(f"      {r.detail}")
    if dry_run:
        lines.append("--dry-run: nothing was changed.")
    if check is not None:
        if check.get("kernel_ok"):
            lines.append(f"Self-check: triton {check.get('triton_version')} imported and a test kernel ran "
                         f"({'on the GPU' if check.get('mode') == 'gpu' else 'through the Triton interpreter'}).")
        else:
            lines.append(f"Self-check failed: {check.get('error')}")
    lines.append(v["message"])
    return "\n".join(lines)


def resolve_python(python: str) -> Optional[str]:
    """--python's interpreter as a path: an executable file, or a bare name found on PATH."""
    if os.path.isfile(python) and os.access(python, os.X_OK):
        return python
    if os.path.basename(python) == python:
        return shutil.which(python)
    return None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="install.py", description="Install and check Triton for Triton Accel.")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and change nothing")
    ap.add_argument("--json", action="store_true", help="print a machine-readable report on stdout")
    ap.add_argument("--fix", action="store_true",
                    help="also fix what can be fixed outside pip: Python include/libs (from nuget.org), "
                         "old VC++ runtime DLLs in the Python folder")
    ap.add_argument("--no-check", action="store_true", help="skip the self-check (import triton, run a tiny kernel)")
    ap.add_argument("--python", help="target Python (default: the one running install.py)")
    ap.add_argument("--venv", metavar="PATH", help="developer bootstrap: create/use a venv at PATH, install torch "
                                                   "there (only into a venv it created), requirements.txt, then run "
                                                   "install.py inside it")
    ap.add_argument("--torch-spec", default="torch==2.13.0", help="torch requirement for --venv (default: %(default)s)")
    ap.add_argument("--demo", action="store_true", help="with --venv: run benchmarks/demo.py at the end")
    ap.add_argument("--demo-script", help=argparse.SUPPRESS)
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    for stream in (sys.stdout, sys.stderr):  # a cp1252 console must not crash on a non-ASCII path
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError):
            pass
    args = build_parser().parse_args(argv)
    if (args.demo or args.demo_script) and not args.venv:
        build_parser().error("--demo needs --venv")
    if args.python is not None:
        python = resolve_python(args.python)
        if python is None:
            build_parser().error(f"--python {args.python}: no such executable file (give the path of the Python "
                                 f"that runs ComfyUI)")
        args.python = python
    quiet = args.json
    log = (lambda s: print(s, file=sys.stderr)) if quiet else print
    if args.venv:
        return bootstrap(args, log)
    t0 = time.monotonic()
    f = probe(args.python)
    p = plan(f, Options(fix=args.fix))
    results = None
    check = None
    if not args.dry_run:
        if p.actions:
            results = act(p, f, quiet=quiet, log=log)
            if any(r.ok for r in results):
                f = probe(args.python)  # facts after the changes, for the report
                p = dataclasses.replace(plan(f, Options(fix=args.fix)), actions=p.actions)
        if not args.no_check and f.torch_version and not f.torch_error and f.os != "darwin" and not f.probe_error:
            check = self_check(f)
    v = verdict(p, f, check)
    report = {"version": REPORT_VERSION, "dry_run": args.dry_run, "facts": f.to_dict(), "plan": p.to_dict(),
              "results": [dataclasses.asdict(r) for r in results] if results is not None else None,
              "self_check": check, "verdict": v, "seconds": round(time.monotonic() - t0, 2)}
    if not args.dry_run:
        write_last_report(PACK_DIR, report, log)
    if quiet:
        print(json.dumps(report, indent=2))
    else:
        print(render(f, p, results, check, v, args.dry_run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
