"""plan: a pure function of the facts. One check per subject (torch, wheels, GPU, CUDA, VC++
runtime, headers, build environment, shadows, cache, config, the Triton package) finds what is
wrong, says how to fix it and which actions install.py takes; fold() makes one Plan of them and
names the attention path auto takes, from kernels/core/gpu_rules.py as the Settings node does."""
from __future__ import annotations

import ntpath
import re
from typing import List, Optional, Sequence, Tuple

from .common import (CONFIG_KEY_CACHE, CONFIG_NAME, LONG_PATHS_KEY, NUGET_URL, VCRT_DLLS, cmdline, gpu_rules,
                     parse_version, vstr)
from .model import Action, Blocker, Check, Facts, Options, Plan, Target, pip_argv, python_base_argv
from .target import choose_target, expected_triton, target_minor, triton_windows_python_range

VCRT_MIN = (14, 42)
VC_REDIST_URL = "https://aka.ms/vs/17/release/vc_redist.x64.exe"

DRIVER_FOR_CUDA = {(12, 4): "550", (12, 8): "570"}  # oldest NVIDIA driver branch for that CUDA


def bundled_cuda(triton_minor: Tuple[int, int]) -> Tuple[int, int]:
    """CUDA toolchain bundled with Triton: 12.4 for 3.1-3.2, 12.8 from 3.3 on."""
    return (12, 4) if tuple(triton_minor) < (3, 3) else (12, 8)


def has_code(blockers: Sequence[Blocker], code: str) -> bool:
    return any(b.code == code for b in blockers)


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
    """triton_accel.json values the pack ignores (kernels/core/install_config.py says why)."""
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
