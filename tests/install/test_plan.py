"""install.py's decision logic, fed real-world situations as plain facts.

Each scenario gives the facts (Windows embedded / venv / conda / system, Linux, macOS x
torch 2.3 ... 2.13 x Python 3.9 ... 3.14 x sm_61 ... sm_120 x VC++ runtime states) and the
exact pip command lines, findings (severity, code) and attention path the plan must
produce. The message table below checks the exact text and fix line of every finding.
"""
from pathlib import Path

import pytest

from install_helpers import load_install_module

inst = load_install_module()

SYS32 = r"C:\Windows\System32"
GOOD_VC = [14, 44, 35211, 0]
OLD_VC = [14, 29, 30133, 0]
PACK = r"C:\ComfyUI_windows_portable\ComfyUI\custom_nodes\comfyui-triton-accel"
PORTABLE = r"C:\ComfyUI_windows_portable\python_embeded"

PYTHONS = {
    # kind: (python.exe, folder, folder where include/ and libs/ belong)
    "embedded": (PORTABLE + r"\python.exe", PORTABLE, PORTABLE),
    "venv": (r"C:\ComfyUI\venv\Scripts\python.exe", r"C:\ComfyUI\venv\Scripts",
             r"C:\Users\me\AppData\Local\Programs\Python\Python312"),
    "conda": (r"C:\Users\me\miniconda3\envs\comfy\python.exe", r"C:\Users\me\miniconda3\envs\comfy",
              r"C:\Users\me\miniconda3\envs\comfy"),
    "system": (r"C:\Python312\python.exe", r"C:\Python312", r"C:\Python312"),
}
GPUS = {
    "sm61": {"name": "NVIDIA GeForce GTX 1080", "capability": [6, 1]},
    "sm75": {"name": "NVIDIA GeForce RTX 2080", "capability": [7, 5]},
    "sm80": {"name": "NVIDIA A100-SXM4-80GB", "capability": [8, 0]},
    "sm86": {"name": "NVIDIA GeForce RTX 3090", "capability": [8, 6]},
    "sm89": {"name": "NVIDIA GeForce RTX 4090", "capability": [8, 9]},
    "sm90": {"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0]},
    "sm100": {"name": "NVIDIA B200", "capability": [10, 0]},
    "sm120": {"name": "NVIDIA GeForce RTX 5090", "capability": [12, 0]},
    "gfx942": {"name": "AMD Instinct MI300X", "capability": [9, 4], "arch": "gfx942:sramecc+:xnack-"},
}


def win(kind="embedded", torch="2.10.0+cu128", py=(3, 12, 10), gpu="sm89", **kw):
    exe, folder, base = PYTHONS[kind]
    tag = "%d%d" % py[:2]
    cuda = torch.split("+cu")[1] if "+cu" in torch else None
    facts = dict(
        os="windows", python=exe, python_dir=folder, python_kind=kind, python_version=py,
        pth_file=folder + rf"\python{tag}._pth" if kind == "embedded" else None,
        torch_version=torch, torch_cuda=f"{cuda[:2]}.{cuda[2:]}" if cuda else None,
        cuda_available=bool(gpu and cuda), cuda_driver="13.0",
        gpus=[GPUS[gpu]] if gpu and cuda else [], numpy_version="2.2.6",
        vcrt_dir=SYS32, vcrt_system={d: GOOD_VC for d in inst.VCRT_DLLS},
        include_dir=base + r"\Include", python_h=True, include_minor=py[1],
        python_lib=base + rf"\libs\python{tag}.lib", python_lib_dirs=[folder, base] if folder != base else [folder],
        headers_target=base, long_paths_enabled=True, triton_cache_dir=r"C:\Users\me\.triton\cache",
        cache_candidates=[{"path": PACK + r"\.cache\triton", "ascii": True, "writable": True}],
        pack_dir=PACK,
    )
    facts.update(kw)
    return inst.Facts(**facts)


def linux(torch="2.13.0+cpu", gpu=None, kind="venv", requires=(), **kw):
    cuda = torch.split("+cu")[1] if "+cu" in torch else None
    facts = dict(
        os="linux", python="/home/me/ComfyUI/.venv/bin/python", python_dir="/home/me/ComfyUI/.venv/bin",
        python_kind=kind, python_version=(3, 12, 3), torch_version=torch,
        torch_cuda=f"{cuda[:2]}.{cuda[2:]}" if cuda else None, torch_requires=list(requires),
        cuda_available=bool(gpu), gpus=[GPUS[gpu]] if gpu else [], numpy_version="2.2.6",
        triton_cache_dir="/home/me/.triton/cache", pack_dir="/home/me/ComfyUI/custom_nodes/comfyui-triton-accel",
    )
    facts.update(kw)
    return inst.Facts(**facts)


EMB = [PYTHONS["embedded"][0], "-s", "-m", "pip"]
VENV = [PYTHONS["venv"][0], "-m", "pip"]
CONDA = [PYTHONS["conda"][0], "-m", "pip"]
SYSTEM = [PYTHONS["system"][0], "-m", "pip"]
LINUX = ["/home/me/ComfyUI/.venv/bin/python", "-m", "pip"]
TORCH29_LINUX_REQ = ['triton==3.5.0; platform_system == "Linux" and platform_machine == "x86_64"']
TORCH29_ROCM_REQ = ['pytorch-triton-rocm==3.5.0; platform_system == "Linux"']
# A torch 2.7 (CUDA 12.8) that pins Triton 3.2: Blackwell needs Triton 3.3 whatever torch is.
TORCH27_TRITON32_REQ = ['triton==3.2.0; platform_system == "Linux"']


def pip_install(base, spec, *extra):
    return ["pip", base + ["install", "--no-deps", *extra, spec]]


# (id, facts, --fix, [(action kind, argv or None)], [(severity, code)], expected path)
SCENARIOS = [
    # --- Windows: version matrix (torch minor -> triton-windows minor), every Python kind ---
    ("win-embedded-torch2.10-py3.12-sm89-fresh", win(), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")], [("info", "TRITON_MISSING")], "triton_fp8"),
    ("win-embedded-torch2.10-py3.13-sm89-installed", win(py=(3, 13, 9), installed={"triton-windows": "3.6.0.post26"}),
     False, [], [("info", "TRITON_OK")], "triton_fp8"),
    ("win-venv-torch2.9-py3.11-sm86", win("venv", "2.9.1+cu126", (3, 11, 9), "sm86"), False,
     [pip_install(VENV, "triton-windows>=3.5,<3.6")], [("info", "TRITON_MISSING")], "triton_int8"),
    ("win-conda-torch2.8-py3.10-sm120-cu128", win("conda", "2.8.0+cu128", (3, 10, 16), "sm120"), False,
     [pip_install(CONDA, "triton-windows>=3.4,<3.5")], [("info", "TRITON_MISSING")], "triton_fp8"),
    ("win-system-torch2.7-py3.13-sm80-cu126", win("system", "2.7.1+cu126", (3, 13, 2), "sm80"), False,
     [pip_install(SYSTEM, "triton-windows>=3.3,<3.4")], [("info", "TRITON_MISSING")], "triton_int8"),
    ("win-embedded-torch2.6-py3.12-sm75", win(torch="2.6.0+cu124", gpu="sm75"), False,
     [pip_install(EMB, "triton-windows>=3.2,<3.3")], [("info", "TRITON_MISSING")], "triton_int8"),
    ("win-embedded-torch2.5-py3.12-sm86", win(torch="2.5.1+cu124", gpu="sm86"), False,
     [pip_install(EMB, "triton-windows>=3.1,<3.2")], [("info", "TRITON_MISSING")], "triton_int8"),
    ("win-embedded-torch2.4-py3.11-sm89", win(torch="2.4.1+cu124", py=(3, 11, 9)), False,
     [pip_install(EMB, "triton-windows>=3.1,<3.2")], [("info", "TRITON_MISSING")], "triton_fp8"),
    ("win-embedded-torch2.11-py3.13-sm89", win(torch="2.11.0+cu130", py=(3, 13, 9)), False,
     [pip_install(EMB, "triton-windows>=3.7,<3.8")], [("info", "TRITON_MISSING")], "triton_fp8"),
    ("win-embedded-torch2.13-py3.14-sm120", win(torch="2.13.0+cu130", py=(3, 14, 1), gpu="sm120"), False,
     [pip_install(EMB, "triton-windows>=3.9,<3.10")], [("info", "TRITON_MISSING")], "triton_fp8"),
    ("win-embedded-torch2.3-too-old", win(torch="2.3.1+cu121"), False,
     [], [("error", "TORCH_TOO_OLD")], "pytorch"),
    ("win-embedded-torch3.0-unknown", win(torch="3.0.0+cu130"), False,
     [], [("error", "TORCH_UNKNOWN")], "pytorch"),
    ("win-torch-requires-dist-wins", win(torch="2.10.0+cu128",
                                          torch_requires=['triton-windows==3.7.1.post27; platform_system == "Windows"']),
     False, [pip_install(EMB, "triton-windows>=3.7,<3.8")], [("info", "TRITON_MISSING")], "triton_fp8"),
    ("win-torch-requires-linux-triton-pin", win(torch="2.9.0+cu128", torch_requires=TORCH29_LINUX_REQ), False,
     [pip_install(EMB, "triton-windows>=3.5,<3.6")], [("info", "TRITON_MISSING")], "triton_fp8"),
    # --- Windows: installed triton states ---
    ("win-mismatch-too-old", win(installed={"triton-windows": "3.4.0.post21"}), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")], [("warning", "TRITON_MISMATCH")], "triton_fp8"),
    ("win-mismatch-too-new", win(torch="2.8.0+cu128", installed={"triton-windows": "3.6.0.post26"}), False,
     [pip_install(EMB, "triton-windows>=3.4,<3.5")], [("warning", "TRITON_MISMATCH")], "triton_fp8"),
    ("win-plain-triton-conflict", win(installed={"triton": "3.2.0"}), False,
     [["pip", EMB + ["uninstall", "-y", "triton"]], pip_install(EMB, "triton-windows>=3.6,<3.7")],
     [("warning", "TRITON_CONFLICT"), ("info", "TRITON_MISSING")], "triton_fp8"),
    ("win-plain-triton-and-triton-windows", win(installed={"triton": "3.2.0", "triton-windows": "3.6.0.post26"}), False,
     [["pip", EMB + ["uninstall", "-y", "triton"]],
      pip_install(EMB, "triton-windows==3.6.0.post26", "--force-reinstall")],
     [("warning", "TRITON_CONFLICT")], "triton_fp8"),
    # --- Windows: Python version vs triton-windows wheels ---
    ("win-py3.9-torch2.10", win(py=(3, 9, 13)), False, [], [("error", "PYTHON_UNSUPPORTED")], "pytorch"),
    ("win-py3.14-torch2.8", win(torch="2.8.0+cu128", py=(3, 14, 0)), False,
     [], [("error", "PYTHON_UNSUPPORTED")], "pytorch"),
    ("win-py3.13-torch2.5", win(torch="2.5.1+cu124", py=(3, 13, 1)), False,
     [], [("error", "PYTHON_UNSUPPORTED")], "pytorch"),
    ("win-py3.9-torch2.6-ok", win(torch="2.6.0+cu126", py=(3, 9, 13)), False,
     [pip_install(EMB, "triton-windows>=3.2,<3.3")], [("info", "TRITON_MISSING")], "triton_fp8"),
    ("win-py3.14-torch2.9-ok", win(torch="2.9.1+cu128", py=(3, 14, 0)), False,
     [pip_install(EMB, "triton-windows>=3.5,<3.6")], [("info", "TRITON_MISSING")], "triton_fp8"),
    ("win-free-threaded", win(py=(3, 13, 9), free_threaded=True, python_lib=PORTABLE + r"\libs\python313t.lib"), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")], [("warning", "FREE_THREADED"), ("info", "TRITON_MISSING")],
     "triton_fp8"),
    # --- GPUs ---
    ("win-sm61", win(gpu="sm61"), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")], [("error", "GPU_TOO_OLD"), ("info", "TRITON_MISSING")], "pytorch"),
    ("win-sm75-torch2.7", win(torch="2.7.1+cu128", gpu="sm75"), False,
     [pip_install(EMB, "triton-windows>=3.3,<3.4")], [("error", "GPU_TURING_DROPPED"), ("info", "TRITON_MISSING")],
     "pytorch"),
    ("win-sm120-torch2.6", win(torch="2.6.0+cu126", gpu="sm120"), False,
     [pip_install(EMB, "triton-windows>=3.2,<3.3")], [("error", "GPU_NEEDS_CU128"), ("info", "TRITON_MISSING")],
     "pytorch"),
    ("win-sm120-torch2.7-cu126", win(torch="2.7.0+cu126", gpu="sm120"), False,
     [pip_install(EMB, "triton-windows>=3.3,<3.4")], [("error", "GPU_NEEDS_CU128"), ("info", "TRITON_MISSING")],
     "pytorch"),
    ("win-sm100-torch2.6", win(torch="2.6.0+cu124", gpu="sm100"), False,
     [pip_install(EMB, "triton-windows>=3.2,<3.3")], [("error", "GPU_NEEDS_CU128"), ("info", "TRITON_MISSING")],
     "pytorch"),
    ("win-sm100-torch2.7-cu128", win(torch="2.7.1+cu128", gpu="sm100"), False,
     [pip_install(EMB, "triton-windows>=3.3,<3.4")], [("info", "TRITON_MISSING")], "triton_fp8"),
    ("linux-sm100-torch2.7-triton3.2", linux("2.7.0+cu128", "sm100", requires=TORCH27_TRITON32_REQ,
                                             installed={"triton": "3.2.0"}), False,
     [], [("error", "GPU_BLACKWELL_NEEDS_TRITON"), ("info", "TRITON_OK")], "pytorch"),
    ("win-cuda-torch-no-gpu", win(gpu=None, torch_cuda="12.8"), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")], [("warning", "NO_GPU"), ("info", "TRITON_MISSING")], "pytorch"),
    ("win-cpu-torch", win(torch="2.10.0+cpu", numpy_version=None), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7"), pip_install(EMB, "numpy")],
     [("info", "NO_GPU"), ("info", "TRITON_MISSING"), ("info", "NUMPY_MISSING")], "pytorch"),
    # --- CUDA version mismatch between torch and Triton ---
    ("win-cu118-torch2.7-driver-unknown", win(torch="2.7.1+cu118", cuda_driver=None), False,
     [pip_install(EMB, "triton-windows>=3.3,<3.4")], [("warning", "CUDA_MISMATCH"), ("info", "TRITON_MISSING")],
     "triton_fp8"),
    ("win-cu118-torch2.7-driver-11.8", win(torch="2.7.1+cu118", cuda_driver="11.8"), False,
     [pip_install(EMB, "triton-windows>=3.3,<3.4")], [("error", "CUDA_MISMATCH"), ("info", "TRITON_MISSING")],
     "pytorch"),
    ("win-cu121-torch2.7-driver-12.4", win(torch="2.7.1+cu121", cuda_driver="12.4"), False,
     [pip_install(EMB, "triton-windows>=3.3,<3.4")], [("warning", "CUDA_MISMATCH"), ("info", "TRITON_MISSING")],
     "triton_fp8"),
    ("win-cu118-torch2.7-driver-12.8-fine", win(torch="2.7.1+cu118", cuda_driver="12.8"), False,
     [pip_install(EMB, "triton-windows>=3.3,<3.4")], [("info", "TRITON_MISSING")], "triton_fp8"),
    ("win-cu124-torch2.6-bundled-12.4-fine", win(torch="2.6.0+cu124", cuda_driver="12.4"), False,
     [pip_install(EMB, "triton-windows>=3.2,<3.3")], [("info", "TRITON_MISSING")], "triton_fp8"),
    ("win-cuda-path-11.8", win(cuda_path=r"C:\Program Files\NVIDIA GPU Computing Toolkit\CUDA\v11.8",
                               cuda_path_version=[11, 8], installed={"triton-windows": "3.6.0.post26"}), False,
     [], [("error", "CUDA_PATH_OLD"), ("info", "TRITON_OK")], "pytorch"),
    ("win-cuda-path-12.8-fine", win(cuda_path=r"C:\Program Files\NVIDIA GPU Computing Toolkit\CUDA\v12.8",
                                    cuda_path_version=[12, 8], installed={"triton-windows": "3.6.0.post26"}), False,
     [], [("info", "TRITON_OK")], "triton_fp8"),
    # --- VC++ runtime (DLL states) ---
    ("win-vcrt-missing", win(vcrt_system={"msvcp140.dll": GOOD_VC, "vcruntime140.dll": GOOD_VC,
                                          "vcruntime140_1.dll": None}), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")], [("error", "VCRT_MISSING"), ("info", "TRITON_MISSING")],
     "pytorch"),
    ("win-vcrt-old-system", win(vcrt_system={d: OLD_VC for d in inst.VCRT_DLLS}), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")],
     [("error", "VCRT_OLD")] * 3 + [("info", "TRITON_MISSING")], "pytorch"),
    ("win-vcrt-14.42-exactly-ok", win(vcrt_system={d: [14, 42, 34433, 0] for d in inst.VCRT_DLLS}), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")], [("info", "TRITON_MISSING")], "triton_fp8"),
    ("win-vcrt-shadow-embedded", win(vcrt_python={"vcruntime140.dll": OLD_VC, "vcruntime140_1.dll": OLD_VC}), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")],
     [("error", "VCRT_SHADOW"), ("error", "VCRT_SHADOW"), ("info", "TRITON_MISSING")], "pytorch"),
    ("win-vcrt-shadow-embedded-fix", win(vcrt_python={"vcruntime140.dll": OLD_VC, "vcruntime140_1.dll": OLD_VC}), True,
     [["copy-vcrt", None], pip_install(EMB, "triton-windows>=3.6,<3.7")],
     [("error", "VCRT_SHADOW"), ("error", "VCRT_SHADOW"), ("info", "TRITON_MISSING")], "pytorch"),
    ("win-vcrt-shadow-current-copy-ok", win(vcrt_python={"vcruntime140.dll": GOOD_VC}), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")], [("info", "TRITON_MISSING")], "triton_fp8"),
    ("win-vcrt-shadow-conda", win("conda", vcrt_python={"vcruntime140.dll": OLD_VC}), True,
     [pip_install(CONDA, "triton-windows>=3.6,<3.7")], [("error", "VCRT_SHADOW"), ("info", "TRITON_MISSING")],
     "pytorch"),
    ("win-vcrt-unreadable", win(vcrt_system={"msvcp140.dll": GOOD_VC, "vcruntime140.dll": GOOD_VC},
                                vcrt_errors={SYS32 + r"\vcruntime140_1.dll": "truncated file: ..."}), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")], [("warning", "VCRT_UNREADABLE"), ("info", "TRITON_MISSING")],
     "triton_fp8"),
    # --- Python headers and libs ---
    ("win-embedded-no-python-h", win(python_h=False, include_minor=None), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")], [("error", "PYTHON_H_MISSING"), ("info", "TRITON_MISSING")],
     "pytorch"),
    ("win-embedded-no-headers-fix", win(python_h=False, include_minor=None, python_lib=None), True,
     [["fix-headers", None], pip_install(EMB, "triton-windows>=3.6,<3.7")],
     [("error", "PYTHON_H_MISSING"), ("error", "PYTHON_LIB_MISSING"), ("info", "TRITON_MISSING")], "pytorch"),
    ("win-embedded-include-of-3.11", win(include_minor=11), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")], [("error", "PYTHON_H_WRONG"), ("info", "TRITON_MISSING")],
     "pytorch"),
    ("win-venv-no-libs", win("venv", python_lib=None), False,
     [pip_install(VENV, "triton-windows>=3.6,<3.7")], [("error", "PYTHON_LIB_MISSING"), ("info", "TRITON_MISSING")],
     "pytorch"),
    # --- environment ---
    ("win-cc-folder", win(cc=r"C:\Program Files\Microsoft Visual Studio\2022\BuildTools", cc_is_file=False), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")], [("error", "CC_NOT_FILE"), ("info", "TRITON_MISSING")], "pytorch"),
    ("win-cc-file-ok", win(cc=r"C:\tools\cl.exe", cc_is_file=True), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")], [("info", "TRITON_MISSING")], "triton_fp8"),
    ("win-shadow-triton-py", win(shadows=[r"C:\ComfyUI_windows_portable\ComfyUI\triton.py"]), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")], [("error", "TRITON_SHADOWED"), ("info", "TRITON_MISSING")],
     "pytorch"),
    ("win-long-paths-off", win(long_paths_enabled=False), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")], [("warning", "LONG_PATHS"), ("info", "TRITON_MISSING")],
     "triton_fp8"),
    ("win-long-paths-unknown", win(long_paths_enabled=None), False,
     [pip_install(EMB, "triton-windows>=3.6,<3.7")], [("info", "TRITON_MISSING")], "triton_fp8"),
    ("win-cache-non-ascii", win(triton_cache_dir="C:\\Users\\J\u00fcrgen\\.triton\\cache", cache_ascii=False,
                                installed={"triton-windows": "3.6.0.post26"}), False,
     [["mkdir", None], ["write-config", None]], [("warning", "CACHE_NON_ASCII"), ("info", "TRITON_OK")], "triton_fp8"),
    ("win-cache-non-ascii-configured", win(triton_cache_dir="C:\\Users\\J\u00fcrgen\\.triton\\cache",
                                           cache_ascii=False, installed={"triton-windows": "3.6.0.post26"},
                                           config={"triton_cache_dir": PACK + r"\.cache\triton"}), False,
     [], [("warning", "CACHE_NON_ASCII"), ("info", "TRITON_OK")], "triton_fp8"),
    ("win-cache-not-writable-no-safe-place", win(cache_writable=False, installed={"triton-windows": "3.6.0.post26"},
                                                 cache_candidates=[{"path": "C:\\Users\\J\u00fcrgen\\x",
                                                                    "ascii": False, "writable": True},
                                                                   {"path": r"C:\triton-accel-cache", "ascii": True,
                                                                    "writable": False}]), False,
     [], [("error", "CACHE_NOT_WRITABLE"), ("info", "TRITON_OK")], "pytorch"),
    ("linux-cache-non-ascii-is-fine", linux(triton_cache_dir="/home/j\u00fcrgen/.triton/cache", cache_ascii=False,
                                            installed={"triton": "3.9.0"}), False,
     [], [("info", "NO_GPU"), ("info", "TRITON_OK")], "pytorch"),
    ("win-embedded-no-pip", win(pip_available=False), False, [], [("error", "PIP_MISSING")], "pytorch"),
    ("win-torch-missing", win(torch_version=None, torch_cuda=None, gpus=[], cuda_available=False), False,
     [], [("error", "TORCH_MISSING")], "pytorch"),
    ("win-torch-broken", win(torch_error="OSError: [WinError 126] fbgemm.dll not found"), False,
     [], [("error", "TORCH_BROKEN")], "pytorch"),
    ("win-probe-failed", win(probe_error="probe exited with code 1: boom"), False,
     [], [("error", "PROBE_FAILED")], "pytorch"),
    # --- Linux ---
    ("linux-venv-cpu-torch2.13-fresh", linux(numpy_version=None), False,
     [pip_install(LINUX, "triton"), pip_install(LINUX, "numpy")],
     [("info", "NO_GPU"), ("info", "TRITON_MISSING"), ("info", "NUMPY_MISSING")], "pytorch"),
    ("linux-venv-cpu-torch2.13-installed", linux(installed={"triton": "3.9.0"}), False,
     [], [("info", "NO_GPU"), ("info", "TRITON_OK")], "pytorch"),
    ("linux-cuda-torch2.9-sm90-ok", linux("2.9.1+cu128", "sm90", requires=TORCH29_LINUX_REQ,
                                          installed={"triton": "3.5.0"}), False,
     [], [("info", "TRITON_OK")], "triton_fp8"),
    ("linux-cuda-torch2.9-sm86-missing", linux("2.9.1+cu128", "sm86", requires=TORCH29_LINUX_REQ), False,
     [pip_install(LINUX, "triton==3.5.0")], [("info", "TRITON_MISSING")], "triton_int8"),
    ("linux-cuda-torch2.9-wrong-triton", linux("2.9.1+cu128", "sm89", requires=TORCH29_LINUX_REQ,
                                               installed={"triton": "3.4.0"}), False,
     [pip_install(LINUX, "triton==3.5.0")], [("warning", "TRITON_MISMATCH")], "triton_fp8"),
    ("linux-cuda-torch2.9-sm75", linux("2.9.1+cu128", "sm75", requires=TORCH29_LINUX_REQ,
                                       installed={"triton": "3.5.0"}), False,
     [], [("error", "GPU_TURING_DROPPED"), ("info", "TRITON_OK")], "pytorch"),
    ("linux-cuda-torch2.6-sm75-ok", linux("2.6.0+cu124", "sm75", kind="conda",
                                          requires=['triton==3.2.0; platform_system == "Linux" and '
                                                    'platform_machine == "x86_64"'],
                                          installed={"triton": "3.2.0"}), False,
     [], [("info", "TRITON_OK")], "triton_int8"),
    ("linux-system-cuda-no-gpu", linux("2.9.1+cu128", None, kind="system", requires=TORCH29_LINUX_REQ,
                                       installed={"triton": "3.5.0"}, torch_cuda="12.8"), False,
     [], [("warning", "NO_GPU"), ("info", "TRITON_OK")], "pytorch"),
    ("linux-rocm", linux("2.9.1+rocm6.4", None, requires=TORCH29_ROCM_REQ, torch_hip="6.4.43482"), False,
     [], [("info", "ROCM"), ("warning", "TRITON_FROM_PYTORCH_INDEX")], "pytorch"),
    ("linux-rocm-installed", linux("2.9.1+rocm6.4", None, requires=TORCH29_ROCM_REQ, torch_hip="6.4.43482",
                                   installed={"pytorch-triton-rocm": "3.5.0"}), False,
     [], [("info", "ROCM")], "pytorch"),
    ("linux-rocm-mi300x", linux("2.9.1+rocm6.4", "gfx942", requires=TORCH29_ROCM_REQ, torch_hip="6.4.43482",
                                installed={"pytorch-triton-rocm": "3.5.0"}), False,
     [], [("info", "ROCM")], "pytorch"),
    ("linux-bad-config-value", linux(installed={"triton": "3.9.0"}, config_problems=[
        "triton_cache_dir in /home/me/ComfyUI/custom_nodes/comfyui-triton-accel/triton_accel.json is a number, not "
        "a folder path"]), False,
     [], [("info", "NO_GPU"), ("warning", "CONFIG_INVALID"), ("info", "TRITON_OK")], "pytorch"),
    ("linux-aarch64-requirement-marker-not-applying", linux(
        "2.9.1+cpu", requires=['triton==3.5.0; platform_system == "Linux" and platform_machine == "aarch64"']), False,
     [pip_install(LINUX, "triton")], [("info", "NO_GPU"), ("info", "TRITON_MISSING")], "pytorch"),
    ("linux-aarch64-requirement-marker-applies", linux(
        "2.9.1+cu129", "sm90", machine="aarch64", installed={"triton": "3.4.0"},
        requires=['triton==3.5.0; platform_system == "Linux" and platform_machine == "aarch64"']), False,
     [pip_install(LINUX, "triton==3.5.0")], [("warning", "TRITON_MISMATCH")], "triton_fp8"),
    ("linux-torch-missing", linux(torch_version=None), False, [], [("error", "TORCH_MISSING")], "pytorch"),
    ("macos", inst.Facts(os="darwin", python="/usr/bin/python3", torch_version="2.9.0"), False,
     [], [("info", "NO_TRITON_OS")], "pytorch"),
]


@pytest.mark.parametrize("facts, fix, actions, findings, path",
                         [s[1:] for s in SCENARIOS], ids=[s[0] for s in SCENARIOS])
def test_plan(facts, fix, actions, findings, path):
    p = inst.plan(facts, inst.Options(fix=fix))
    assert [[a.kind, a.argv] for a in p.actions] == actions
    assert [(x.severity, x.code) for x in p.findings] == findings
    assert p.path == path
    assert p.triton_blocked == (path == "pytorch")
    for x in p.findings:
        assert x.severity in inst.SEVERITIES
        assert x.message.strip() and "{" not in x.message and "{" not in x.fix
        if x.severity == "error" and x.code != "GPU_TOO_OLD":
            assert x.fix, x.code  # every error says how to fix it


def test_plan_is_pure_and_repeatable():
    f = win(installed={"triton": "3.2.0"}, vcrt_python={"vcruntime140.dll": OLD_VC})
    before = f.to_dict()
    assert inst.plan(f).to_dict() == inst.plan(f).to_dict()
    assert f.to_dict() == before


def test_never_touches_torch():
    for _id, facts, fix, _a, _f, _p in SCENARIOS:
        for a in inst.plan(facts, inst.Options(fix=fix)).actions:
            if a.argv:
                assert "--no-deps" in a.argv or a.argv[-3:-1] == ["uninstall", "-y"], _id
                assert not any(x.split("=")[0].split("<")[0].split(">")[0] in ("torch", "torchvision", "torchaudio")
                               for x in a.argv), _id


def test_conflict_removal_has_a_preflight_download():
    p = inst.plan(win(installed={"triton": "3.2.0"}))
    assert p.actions[0].preflight == EMB + ["download", "--no-deps", "-d", "{tmp}", "triton-windows>=3.6,<3.7"]


def test_fix_actions_carry_their_data():
    p = inst.plan(win(python_h=False, include_minor=None, vcrt_python={"vcruntime140.dll": OLD_VC}),
                  inst.Options(fix=True))
    by_kind = {a.kind: a for a in p.actions}
    assert by_kind["copy-vcrt"].data == {"src_dir": SYS32, "dst_dir": PORTABLE, "dlls": ["vcruntime140.dll"]}
    assert by_kind["fix-headers"].data == {"version": "3.12.10", "target": PORTABLE}
    p = inst.plan(win(triton_cache_dir="C:\\Users\\J\u00fcrgen\\.triton\\cache", cache_ascii=False))
    by_kind = {a.kind: a for a in p.actions}
    assert by_kind["write-config"].data == {"key": "triton_cache_dir", "value": PACK + r"\.cache\triton"}
    assert by_kind["mkdir"].data == {"path": PACK + r"\.cache\triton"}


def test_no_fix_for_vcrt_when_system32_is_old_too():
    f = win(vcrt_system={d: OLD_VC for d in inst.VCRT_DLLS}, vcrt_python={"vcruntime140.dll": OLD_VC})
    assert [a.kind for a in inst.plan(f, inst.Options(fix=True)).actions] == ["pip"]


def test_no_headers_fix_for_free_threaded():
    f = win(py=(3, 13, 9), free_threaded=True, python_h=False, include_minor=None)
    assert [a.kind for a in inst.plan(f, inst.Options(fix=True)).actions] == ["pip"]


# ----------------------------------------------------------------------------------------
# Every message, word for word: (id, facts, code, message, fix)
# ----------------------------------------------------------------------------------------
E = PYTHONS["embedded"][0]
MESSAGES = [
    ("TRITON_MISSING", win(), "TRITON_MISSING",
     "triton-windows is not installed; install.py installs triton-windows>=3.6,<3.7 "
     "(torch 2.10 pairs with triton-windows 3.6).",
     rf'{E} -s -m pip install --no-deps "triton-windows>=3.6,<3.7"'),
    ("TRITON_OK", win(installed={"triton-windows": "3.6.0.post26"}), "TRITON_OK",
     "triton-windows 3.6.0.post26 is installed and matches torch 2.10.0+cu128 (triton-windows>=3.6,<3.7).", ""),
    ("TRITON_MISMATCH", win(installed={"triton-windows": "3.4.0.post21"}), "TRITON_MISMATCH",
     "triton-windows 3.4.0.post21 does not match torch 2.10.0+cu128: it needs triton-windows>=3.6,<3.7 "
     "(torch 2.10 pairs with triton-windows 3.6).",
     rf'{E} -s -m pip install --no-deps "triton-windows>=3.6,<3.7"'),
    ("TRITON_MISMATCH-linux-pin", linux("2.9.1+cu128", "sm89", requires=TORCH29_LINUX_REQ,
                                        installed={"triton": "3.4.0"}), "TRITON_MISMATCH",
     "triton 3.4.0 does not match torch 2.9.1+cu128: it needs triton==3.5.0 (torch 2.9.1+cu128 requires triton==3.5.0).",
     "/home/me/ComfyUI/.venv/bin/python -m pip install --no-deps triton==3.5.0"),
    ("TRITON_CONFLICT", win(installed={"triton": "3.2.0"}), "TRITON_CONFLICT",
     "Plain 'triton' 3.2.0 is installed: it does not work on Windows and conflicts with triton-windows "
     "(both own the 'triton' folder).",
     rf"{E} -s -m pip uninstall -y triton"),
    ("TORCH_TOO_OLD", win(torch="2.3.1+cu121"), "TORCH_TOO_OLD",
     "torch 2.3.1+cu121 is too old for triton-windows (it needs torch 2.4 or newer).",
     "Update ComfyUI's torch to 2.7 or newer (portable: run update\\update_comfyui_and_python_dependencies.bat)."),
    ("TORCH_UNKNOWN", win(torch="3.0.0+cu130"), "TORCH_UNKNOWN",
     "torch 3.0.0+cu130 is newer than any triton-windows mapping install.py knows.",
     "Install the matching triton-windows by hand (see its README), or update this pack."),
    ("TORCH_MISSING", win(torch_version=None, torch_cuda=None, gpus=[], cuda_available=False), "TORCH_MISSING",
     rf"torch is not installed in {E}: the pack needs ComfyUI's torch, and install.py never installs torch.",
     "Install ComfyUI and its requirements first (portable: run update\\update_comfyui_and_python_dependencies.bat), "
     "then run install.py again."),
    ("TORCH_BROKEN", win(torch_error="OSError: [WinError 126] fbgemm.dll not found"), "TORCH_BROKEN",
     "torch 2.10.0+cu128 is installed but does not import: OSError: [WinError 126] fbgemm.dll not found",
     "Repair torch in this Python (ComfyUI cannot start without it), then run install.py again."),
    ("PROBE_FAILED", win(probe_error="probe exited with code 1: boom"), "PROBE_FAILED",
     rf"Could not inspect {E}: probe exited with code 1: boom",
     "Run install.py with the Python that runs ComfyUI (portable: python_embeded\\python.exe)."),
    ("NO_TRITON_OS", inst.Facts(os="darwin", torch_version="2.9.0"), "NO_TRITON_OS",
     "Triton does not run on macOS; the pack uses PyTorch attention there.", ""),
    ("PYTHON_UNSUPPORTED", win(py=(3, 9, 13)), "PYTHON_UNSUPPORTED",
     "import error from an unsupported Python: triton-windows 3.6 has wheels for Python 3.10 to 3.14 only, "
     "and this Python is 3.9.13, so pip finds no wheel (or 'import triton' fails).",
     rf'Use a ComfyUI portable or venv with Python 3.12 (check with: "{E}" --version).'),
    ("PYTHON_UNSUPPORTED-3.1", win(torch="2.5.1+cu124", py=(3, 13, 1)), "PYTHON_UNSUPPORTED",
     "import error from an unsupported Python: triton-windows 3.1 has wheels for Python 3.9 to 3.12 only, "
     "and this Python is 3.13.1, so pip finds no wheel (or 'import triton' fails).",
     rf'Use a ComfyUI portable or venv with Python 3.12 (check with: "{E}" --version).'),
    ("FREE_THREADED", win(py=(3, 13, 9), free_threaded=True), "FREE_THREADED",
     "Free-threaded Python 3.13.9t: triton-windows' bundled TinyCC cannot build for it; Triton then needs MSVC.",
     "Install Visual Studio Build Tools with 'Desktop development with C++', or use a regular (GIL) Python."),
    ("ROCM", linux("2.9.1+rocm6.4", None, requires=TORCH29_ROCM_REQ, torch_hip="6.4.43482"), "ROCM",
     "torch is a ROCm build (HIP 6.4.43482); the pack's Triton kernels are compile-tested for AMD (gfx942, gfx950, "
     "gfx1100, gfx1201) but not run on AMD hardware, so auto uses PyTorch attention and Linear here (fp16, int8 or "
     "fp8 in the Settings node force them where the GPU has them).", ""),
    ("TRITON_FROM_PYTORCH_INDEX", linux("2.9.1+rocm6.4", None, requires=TORCH29_ROCM_REQ, torch_hip="6.4.43482"),
     "TRITON_FROM_PYTORCH_INDEX",
     "torch needs pytorch-triton-rocm==3.5.0, which is only on the PyTorch package index (installed: none).",
     "/home/me/ComfyUI/.venv/bin/python -m pip install --no-deps pytorch-triton-rocm==3.5.0 "
     "--index-url https://download.pytorch.org/whl/rocm6.4"),
    ("NO_GPU-cuda-build", win(gpu=None, torch_cuda="12.8"), "NO_GPU",
     "torch 2.10.0+cu128 is a CUDA build but sees no NVIDIA GPU (driver missing or CUDA_VISIBLE_DEVICES empty?).",
     "Check that nvidia-smi lists the GPU; update the NVIDIA driver."),
    ("NO_GPU-cpu-build", linux(), "NO_GPU",
     "torch 2.13.0+cpu is a CPU-only build: Triton kernels need an NVIDIA GPU, so the pack uses PyTorch attention "
     "(the Triton interpreter serves tests only).",
     "For GPU acceleration install a CUDA build of torch (see ComfyUI's install instructions)."),
    ("NUMPY_MISSING", linux(numpy_version=None), "NUMPY_MISSING",
     "numpy is not installed; the Triton interpreter (what runs Triton code without a GPU, for tests) needs it, "
     "so install.py installs it.",
     "/home/me/ComfyUI/.venv/bin/python -m pip install --no-deps numpy"),
    ("GPU_TOO_OLD", win(gpu="sm61"), "GPU_TOO_OLD",
     "NVIDIA GeForce GTX 1080 is sm_61: Triton supports sm_75 and newer, so the pack uses PyTorch attention on it.",
     "Nothing to fix: the pack falls back to PyTorch attention on this GPU by itself."),
    ("GPU_TURING_DROPPED", win(torch="2.7.1+cu128", gpu="sm75"), "GPU_TURING_DROPPED",
     "NVIDIA GeForce RTX 2080 is sm_75 (Turing): Triton 3.3 and newer dropped it, and torch 2.7.1+cu128 needs "
     "triton-windows 3.3.",
     "For Triton on this GPU use torch 2.6 with triton-windows<3.3; otherwise nothing to fix: the pack uses "
     "PyTorch attention."),
    ("GPU_NEEDS_CU128", win(torch="2.7.0+cu126", gpu="sm120"), "GPU_NEEDS_CU128",
     "NVIDIA GeForce RTX 5090 is sm_120 (Blackwell): it needs torch 2.7 or newer built for CUDA 12.8 or newer, "
     "and this torch is 2.7.0+cu126 (CUDA 12.6).",
     rf"Install a cu128 build of torch: {E} -s -m pip install -U torch torchvision torchaudio "
     "--index-url https://download.pytorch.org/whl/cu128"),
    ("GPU_BLACKWELL_NEEDS_TRITON", linux("2.7.0+cu128", "sm100", requires=TORCH27_TRITON32_REQ,
                                         installed={"triton": "3.2.0"}), "GPU_BLACKWELL_NEEDS_TRITON",
     "NVIDIA B200 is sm_100 (Blackwell): it needs Triton 3.3 or newer, and torch 2.7.0+cu128 needs triton 3.2.",
     "Install a torch build that pairs with Triton 3.3 or newer (2.7+, CUDA 12.8+): /home/me/ComfyUI/.venv/bin/python "
     "-m pip install -U torch torchvision torchaudio --index-url https://download.pytorch.org/whl/cu128"),
    ("CONFIG_INVALID", linux(config_problems=["triton_cache_dir in /p/triton_accel.json is an array, not a folder path"]),
     "CONFIG_INVALID",
     "triton_cache_dir in /p/triton_accel.json is an array, not a folder path: the pack ignores it and uses Triton's "
     "default cache.",
     "Correct or delete it (triton_cache_dir must be an absolute path of a writable folder); install.py rewrites "
     "triton_accel.json when the default cache is unusable."),
    ("CUDA_MISMATCH", win(torch="2.7.1+cu118", cuda_driver="11.8"), "CUDA_MISMATCH",
     "CUDA version mismatch between torch and Triton: torch is built for CUDA 11.8 but triton-windows 3.3 compiles "
     "kernels with its bundled CUDA 12.8, which needs a driver for CUDA 12.8 or newer (this driver supports "
     "CUDA 11.8).",
     "Update the NVIDIA driver (570 or newer for CUDA 12.8), or install a cu128 build of torch."),
    ("CUDA_MISMATCH-driver-unknown", win(torch="2.7.1+cu121", cuda_driver=None), "CUDA_MISMATCH",
     "CUDA version mismatch between torch and Triton: torch is built for CUDA 12.1 but triton-windows 3.3 compiles "
     "kernels with its bundled CUDA 12.8, which needs a driver for CUDA 12.8 or newer (the driver's CUDA version "
     "is unknown).",
     "Update the NVIDIA driver (570 or newer for CUDA 12.8), or install a cu128 build of torch."),
    ("CUDA_PATH_OLD", win(cuda_path=r"C:\Program Files\NVIDIA GPU Computing Toolkit\CUDA\v11.8",
                          cuda_path_version=[11, 8]), "CUDA_PATH_OLD",
     r"CUDA version mismatch between torch and Triton: CUDA_PATH points at CUDA 11.8 (C:\Program Files\NVIDIA GPU "
     r"Computing Toolkit\CUDA\v11.8); Triton then uses that CUDA 11 toolchain instead of its bundled one, while "
     "torch uses CUDA 12.8.",
     "Clear it for ComfyUI (add 'set CUDA_PATH=' to the .bat that starts ComfyUI), or point it at CUDA 12.8 or newer."),
    ("VCRT_MISSING", win(vcrt_system={"msvcp140.dll": GOOD_VC, "vcruntime140.dll": GOOD_VC,
                                      "vcruntime140_1.dll": None}), "VCRT_MISSING",
     r"compile failure from missing VC++ runtime: vcruntime140_1.dll is not in C:\Windows\System32, so triton's "
     "libtriton cannot load ('DLL load failed while importing libtriton').",
     "Install the latest Microsoft Visual C++ Redistributable (x64): https://aka.ms/vs/17/release/vc_redist.x64.exe"),
    ("VCRT_OLD", win(vcrt_system={"msvcp140.dll": OLD_VC, "vcruntime140.dll": GOOD_VC,
                                  "vcruntime140_1.dll": GOOD_VC}), "VCRT_OLD",
     r"compile failure from missing VC++ runtime: msvcp140.dll in C:\Windows\System32 is version 14.29.30133.0; "
     "triton-windows needs 14.42 or newer.",
     "Install the latest Microsoft Visual C++ Redistributable (x64): https://aka.ms/vs/17/release/vc_redist.x64.exe"),
    ("VCRT_SHADOW", win(vcrt_python={"vcruntime140.dll": OLD_VC}), "VCRT_SHADOW",
     rf"An old vcruntime140.dll (14.29.30133.0) in the Python folder {PORTABLE} is loaded instead of the newer one "
     "in System32 (14.44.35211.0): the usual cause of 'DLL load failed while importing libtriton'.",
     rf"Copy msvcp140.dll, vcruntime140.dll and vcruntime140_1.dll from C:\Windows\System32 into {PORTABLE} "
     "(install.py --fix does it and keeps the old files as .old)"),
    ("VCRT_SHADOW-conda", win("conda", vcrt_python={"vcruntime140.dll": OLD_VC}), "VCRT_SHADOW",
     r"An old vcruntime140.dll (14.29.30133.0) in the Python folder C:\Users\me\miniconda3\envs\comfy is loaded "
     "instead of the newer one in System32 (14.44.35211.0): the usual cause of 'DLL load failed while importing "
     "libtriton'.",
     "conda install -c conda-forge vc14_runtime"),
    ("VCRT_SHADOW-venv", win("venv", vcrt_python={"vcruntime140_1.dll": OLD_VC},
                             vcrt_python_dir=PYTHONS["venv"][2]), "VCRT_SHADOW",
     r"An old vcruntime140_1.dll (14.29.30133.0) in the Python folder C:\Users\me\AppData\Local\Programs\Python"
     r"\Python312 is loaded instead of the newer one in System32 (14.44.35211.0): the usual cause of 'DLL load failed "
     "while importing libtriton'.",
     r"Copy msvcp140.dll, vcruntime140.dll and vcruntime140_1.dll from C:\Windows\System32 into "
     r"C:\Users\me\AppData\Local\Programs\Python\Python312 (install.py --fix does it and keeps the old files as .old)"),
    ("VCRT_UNREADABLE", win(vcrt_errors={SYS32 + r"\vcruntime140_1.dll": "truncated file: x"}), "VCRT_UNREADABLE",
     r"Could not read the version of C:\Windows\System32\vcruntime140_1.dll: truncated file: x",
     "Reinstall the Microsoft Visual C++ Redistributable (x64): https://aka.ms/vs/17/release/vc_redist.x64.exe"),
    ("PYTHON_H_MISSING", win(python_h=False, include_minor=None), "PYTHON_H_MISSING",
     rf"Python.h is missing ({PORTABLE}\Include\Python.h): Triton cannot build its launcher (tcc 'exit status 1' / "
     "'Python.h: No such file or directory').",
     rf"Run install.py --fix (downloads Python 3.12.10's include and libs from nuget.org into {PORTABLE}); by hand: "
     r"unzip https://api.nuget.org/v3-flatcontainer/python/3.12.10/python.3.12.10.nupkg and copy its tools\include "
     rf"and tools\libs folders into {PORTABLE}"),
    ("PYTHON_H_WRONG", win(include_minor=11), "PYTHON_H_WRONG",
     rf"The include folder {PORTABLE}\Include is for Python 3.11, but this Python is 3.12.10: Triton builds fail or "
     "crash ('DLL load failed while importing cuda_utils').",
     rf"Run install.py --fix (downloads Python 3.12.10's include and libs from nuget.org into {PORTABLE}); by hand: "
     r"unzip https://api.nuget.org/v3-flatcontainer/python/3.12.10/python.3.12.10.nupkg and copy its tools\include "
     rf"and tools\libs folders into {PORTABLE}"),
    ("PYTHON_LIB_MISSING", win("venv", python_lib=None), "PYTHON_LIB_MISSING",
     r"python312.lib is not in C:\ComfyUI\venv\Scripts\libs, C:\Users\me\AppData\Local\Programs\Python\Python312\libs: "
     "Triton warns 'Failed to find Python libs.' and cannot link its launcher.",
     r"Run install.py --fix (downloads Python 3.12.10's include and libs from nuget.org into "
     r"C:\Users\me\AppData\Local\Programs\Python\Python312); by hand: unzip "
     r"https://api.nuget.org/v3-flatcontainer/python/3.12.10/python.3.12.10.nupkg and copy its tools\include and "
     r"tools\libs folders into C:\Users\me\AppData\Local\Programs\Python\Python312"),
    ("PYTHON_LIB_MISSING-free-threaded", win(py=(3, 13, 9), free_threaded=True, python_lib=None), "PYTHON_LIB_MISSING",
     rf"python313t.lib is not in {PORTABLE}\libs: Triton warns 'Failed to find Python libs.' and cannot link its "
     "launcher.",
     "Copy the include and libs folders of a Python 3.13.9 install with the free-threaded binaries (python.org "
     rf"installer option) into {PORTABLE}"),
    ("CC_NOT_FILE", win(cc="cl.exe /nologo", cc_is_file=False), "CC_NOT_FILE",
     "CC is set to 'cl.exe /nologo', which is not the path of one compiler file; Triton runs CC as a single path "
     "and fails (PermissionError [WinError 5] or 'file not found').",
     "Unset it (set CC=) so Triton uses its bundled TinyCC, or set it to the full path of one compiler executable."),
    ("TRITON_SHADOWED", win(shadows=[r"C:\ComfyUI_windows_portable\ComfyUI\triton"]), "TRITON_SHADOWED",
     r"C:\ComfyUI_windows_portable\ComfyUI\triton shadows the triton package: 'import triton' loads it instead "
     "('triton' is not a package).",
     r"Rename or move C:\ComfyUI_windows_portable\ComfyUI\triton."),
    ("LONG_PATHS", win(long_paths_enabled=False), "LONG_PATHS",
     "Windows long paths are disabled (LongPathsEnabled=0): deep Triton / inductor cache paths fail with "
     "WinError 206 or FileNotFoundError.",
     r"As administrator run: reg add HKLM\SYSTEM\CurrentControlSet\Control\FileSystem /v LongPathsEnabled "
     "/t REG_DWORD /d 1 /f, then reboot."),
    ("CACHE_NON_ASCII", win(triton_cache_dir="C:\\Users\\J\u00fcrgen\\.triton\\cache", cache_ascii=False),
     "CACHE_NON_ASCII",
     "The Triton cache C:\\Users\\J\u00fcrgen\\.triton\\cache has non-ASCII characters in its path, which break "
     "TinyCC / ptxas builds.",
     rf"install.py sets {PACK}\.cache\triton as the pack's Triton cache (triton_accel.json, key triton_cache_dir); "
     rf"for other tools set TRITON_CACHE_DIR={PACK}\.cache\triton."),
    ("CACHE_NOT_WRITABLE", win(cache_writable=False), "CACHE_NOT_WRITABLE",
     r"The Triton cache C:\Users\me\.triton\cache is not writable (PermissionError [WinError 5] / [Errno 13]).",
     rf"install.py sets {PACK}\.cache\triton as the pack's Triton cache (triton_accel.json, key triton_cache_dir); "
     rf"for other tools set TRITON_CACHE_DIR={PACK}\.cache\triton."),
    ("CACHE_NOT_WRITABLE-nowhere", win(cache_writable=False, cache_candidates=[]), "CACHE_NOT_WRITABLE",
     r"The Triton cache C:\Users\me\.triton\cache is not writable (PermissionError [WinError 5] / [Errno 13]), "
     "and install.py found no safe folder for it.",
     r"Set TRITON_CACHE_DIR to a writable folder with an ASCII-only path, e.g. C:\triton-cache."),
    ("CACHE_NON_ASCII-from-env", win(triton_cache_dir="D:\\\u30c6\u30b9\u30c8\\cache", cache_ascii=False,
                                     cache_from_env=True), "CACHE_NON_ASCII",
     "The Triton cache D:\\\u30c6\u30b9\u30c8\\cache has non-ASCII characters in its path, which break TinyCC / "
     "ptxas builds (it comes from the TRITON_CACHE_DIR environment variable).",
     rf"Set TRITON_CACHE_DIR to a writable folder with an ASCII-only path, e.g. {PACK}\.cache\triton."),
    ("CACHE_NOT_WRITABLE-linux-nowhere", linux(cache_writable=False), "CACHE_NOT_WRITABLE",
     "The Triton cache /home/me/.triton/cache is not writable (PermissionError [WinError 5] / [Errno 13]), "
     "and install.py found no safe folder for it.",
     "Set TRITON_CACHE_DIR to a writable folder with an ASCII-only path, e.g. /tmp/triton-cache."),
    ("PIP_MISSING-embedded", win(pip_available=False), "PIP_MISSING",
     rf"pip is not available in {E}, so install.py cannot install triton-windows.",
     rf'Download https://bootstrap.pypa.io/get-pip.py and run: "{E}" get-pip.py'),
    ("PIP_MISSING-linux", linux(pip_available=False), "PIP_MISSING",
     "pip is not available in /home/me/ComfyUI/.venv/bin/python, so install.py cannot install triton.",
     "/home/me/ComfyUI/.venv/bin/python -m ensurepip --upgrade"),
]


@pytest.mark.parametrize("facts, code, message, fix", [m[1:] for m in MESSAGES], ids=[m[0] for m in MESSAGES])
def test_message(facts, code, message, fix):
    found = [x for x in inst.plan(facts).findings if x.code == code]
    assert found, [x.code for x in inst.plan(facts).findings]
    assert (found[0].message, found[0].fix) == (message, fix)


def test_every_code_has_a_message_test():
    import re
    installer = Path(inst.__file__).with_name("installer")  # install.py's implementation
    source = "".join(path.read_text(encoding="utf-8") for path in sorted(installer.glob("*.py")))
    codes = set(re.findall(r'(?:add|Finding)\(\s*"([A-Z_0-9]+)"', source))
    codes |= set(re.findall(r'\("(CACHE_[A-Z_]+)"', source))
    # check_gpu() names its findings by gpu_rules' codes, one text per NVIDIA rule.
    codes |= {inst.gpu_rules.GPU_TOO_OLD, inst.gpu_rules.TURING_DROPPED, inst.gpu_rules.BLACKWELL_TORCH,
              inst.gpu_rules.BLACKWELL_TRITON}
    assert codes == {m[2] for m in MESSAGES}


@pytest.mark.parametrize("check, facts, expected", [
    ({"mode": "gpu", "kernel_ok": True, "triton_version": "3.6.0"}, win(installed={"triton-windows": "3.6.0"}),
     ("triton_fp8", "Triton works on NVIDIA GeForce RTX 4090 (sm_89): in auto the pack uses Triton FP8, Triton INT8 "
                    "and Triton FP16/BF16 attention, each timed against PyTorch's per shape (the fastest that agrees "
                    "is kept).")),
    ({"mode": "gpu", "kernel_ok": True}, win(gpu="sm86", installed={"triton-windows": "3.6.0"}),
     ("triton_int8", "Triton works on NVIDIA GeForce RTX 3090 (sm_86): in auto the pack uses Triton INT8 and "
                     "Triton FP16/BF16 attention, each timed against PyTorch's per shape (the faster that agrees is "
                     "kept).")),
    ({"mode": "gpu", "error": "import triton: ImportError: DLL load failed while importing libtriton"},
     win(installed={"triton-windows": "3.6.0"}),
     ("pytorch", "Triton is blocked (self-check: import triton: ImportError: DLL load failed while importing "
                 "libtriton). The pack still loads and uses PyTorch attention; fix the errors above to enable Triton.")),
    ({"mode": "gpu", "kernel_ok": True}, win(gpu="sm61", installed={"triton-windows": "3.6.0"}),
     ("pytorch", "Triton is blocked (NVIDIA GeForce GTX 1080 is sm_61: Triton needs sm_75 (RTX 20xx / GTX 16xx) "
                 "or newer). The pack still loads and uses PyTorch attention; fix the errors above to enable Triton.")),
    (None, win(vcrt_python={"vcruntime140.dll": OLD_VC}, shadows=[r"C:\x\triton.py"]),
     ("pytorch", r"Triton is blocked (old VC++ runtime DLLs in the Python folder; C:\x\triton.py shadows triton). "
                 "The pack still loads and uses PyTorch attention; fix the errors above to enable Triton.")),
    ({"mode": "interpreter", "kernel_ok": True}, linux(installed={"triton": "3.9.0"}),
     ("pytorch", "No NVIDIA GPU: the pack uses PyTorch attention. The Triton interpreter works here (for tests "
                 "only).")),
    ({"mode": "interpreter", "error": "import triton: ModuleNotFoundError: No module named 'triton'"}, linux(),
     ("pytorch", "No NVIDIA GPU: the pack uses PyTorch attention. The Triton interpreter does not work here either: "
                 "import triton: ModuleNotFoundError: No module named 'triton'.")),
    (None, linux(), ("pytorch", "No NVIDIA GPU: the pack uses PyTorch attention. The Triton interpreter was not "
                                "checked.")),
    (None, win(), ("triton_fp8", "Nothing blocks Triton on NVIDIA GeForce RTX 4090 (sm_89): in auto the pack should "
                                 "use Triton FP8, Triton INT8 and Triton FP16/BF16 attention, each timed against "
                                 "PyTorch's per shape (the fastest that agrees is kept); not verified, the self-check "
                                 "did not run.")),
    (None, win(python_h=False, include_minor=None),
     ("pytorch", "Triton is blocked (Python.h is missing or wrong). The pack still loads and uses PyTorch attention; "
                 "fix the errors above to enable Triton.")),
    (None, win(include_minor=11, python_lib=None),
     ("pytorch", "Triton is blocked (Python.h and python312.lib are missing or wrong). The pack still loads and uses "
                 "PyTorch attention; fix the errors above to enable Triton.")),
    # A CPU-only machine with a shadowing triton.py: still the no-GPU sentence (decided by the NO_GPU
    # code, not by path_reason's text, which now also names the shadow).
    ({"mode": "interpreter", "error": "import triton: ModuleNotFoundError: No module named 'triton.language'; "
                                      "'triton' is not a package"},
     linux(installed={"triton": "3.9.0"}, shadows=["/home/me/ComfyUI/triton.py"]),
     ("pytorch", "No NVIDIA GPU: the pack uses PyTorch attention. The Triton interpreter does not work here either: "
                 "import triton: ModuleNotFoundError: No module named 'triton.language'; 'triton' is not a package.")),
    (None, linux(shadows=["/home/me/ComfyUI/triton.py"]),
     ("pytorch", "No NVIDIA GPU: the pack uses PyTorch attention. The Triton interpreter was not checked.")),
    ({"mode": "interpreter", "kernel_ok": True},
     linux("2.9.1+rocm6.4", "gfx942", requires=TORCH29_ROCM_REQ, torch_hip="6.4.43482",
           installed={"pytorch-triton-rocm": "3.5.0"}),
     ("pytorch", "AMD GPU (AMD Instinct MI300X): in auto the pack uses PyTorch attention and Linear; its Triton "
                 "kernels are compile-tested for it but not run on AMD hardware (fp16 in the Settings node forces "
                 "them).")),
], ids=["fp8", "fp16", "dll-load-failed", "sm61", "blocked-unchecked", "cpu-interpreter", "cpu-no-triton",
        "cpu-unchecked", "fp8-unchecked", "no-python-h", "wrong-include-no-lib", "cpu-shadowed-triton",
        "cpu-shadowed-unchecked", "amd"])
def test_verdict(check, facts, expected):
    v = inst.verdict(inst.plan(facts), facts, check)
    assert (v["path"], v["message"]) == expected
    assert v["triton_works"] == ((expected[0] != "pytorch") if check is not None else (None if expected[0] != "pytorch"
                                                                                       else False))


def test_cuda_mismatch_with_the_12_4_bundle():
    f = win(torch="2.6.0+cu118", cuda_driver="11.8")
    [x] = [x for x in inst.plan(f).findings if x.code == "CUDA_MISMATCH"]
    assert x.severity == "error"
    assert x.fix == "Update the NVIDIA driver (550 or newer for CUDA 12.4), or install a cu124 build of torch."


@pytest.mark.parametrize("facts, code", [
    (win(gpu="sm61"), "GPU_TOO_OLD"),
    (win(torch="2.7.1+cu128", gpu="sm75"), "GPU_TURING_DROPPED"),
    (win(torch="2.7.0+cu126", gpu="sm120"), "GPU_NEEDS_CU128"),
    (linux("2.7.0+cu128", "sm100", requires=TORCH27_TRITON32_REQ, installed={"triton": "3.2.0"}),
     "GPU_BLACKWELL_NEEDS_TRITON"),
], ids=["sm61", "sm75-triton3.3", "sm120-cu126", "sm100-triton3.2"])
def test_gpu_blocker_reason_is_the_rule_reason(facts, code):
    """path_reason of a GPU blocker is gpu_rules' reason word for word (the Settings node shows it)."""
    gpu = facts.gpus[0]
    triton = inst.expected_triton(facts, inst.plan(facts).target)
    rule = inst.gpu_rules.nvidia_gpu_blocker(gpu["name"], tuple(gpu["capability"]), triton, facts.torch_version,
                                             facts.torch_cuda)
    p = inst.plan(facts)
    assert rule.code == code
    assert p.path_reason == rule.reason
    assert [(b.code, b.reason) for b in p.blockers] == [(rule.code, rule.reason)]


def test_amd_reason_is_select_paths():
    f = linux("2.9.1+rocm6.4", "gfx942", requires=TORCH29_ROCM_REQ, torch_hip="6.4.43482",
              installed={"pytorch-triton-rocm": "3.5.0"})
    p = inst.plan(f)
    assert [b.code for b in p.blockers] == ["AMD_NOT_VALIDATED"]
    assert p.path_reason == ("PyTorch attention on AMD Instinct MI300X (gfx942): our kernels are compile-tested for "
                             "it but not run on AMD hardware (a GPU fault would stop ComfyUI, which auto's timing "
                             "check cannot catch); choose fp16 (or fp8 / int8 where the GPU has them) to force them")
