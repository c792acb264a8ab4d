"""probe: gather the facts about the target Python into a Facts object. torch and triton are
only looked at in a subprocess of that Python (PROBE_SCRIPT), so nothing that goes wrong there
can crash the installer; its report is checked before anything reads it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from .common import LONG_PATHS_KEY, PACK_DIR, VCRT_DLLS, install_config, is_ascii, parse_version
from .model import Facts
from .pe import PEError, read_file_version

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
    f.include_minor = include_minor(f.include_dir) if f.python_h else None
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


def include_minor(include_dir: Optional[str]) -> Optional[int]:
    try:
        with open(os.path.join(include_dir or "", "patchlevel.h"), encoding="utf-8", errors="replace") as fh:
            m = re.search(r"#define\s+PY_MINOR_VERSION\s+(\d+)", fh.read())
        return int(m.group(1)) if m else None
    except OSError:
        return None
