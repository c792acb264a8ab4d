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
       kernels/core/gpu_rules.py, the file the Settings node decides with, so the two agree.
act    runs the actions, then proves the result in a subprocess: import triton, compile
       and run a tiny kernel (on the GPU, or through the Triton interpreter on a CPU-only
       machine) and says which attention path the pack will use.

Rules it keeps: standard library only (kernels/core/gpu_rules.py and kernels/core/install_config.py
are stdlib-only and loaded by path, never through the ``kernels`` package); never installs,
upgrades or downgrades torch (pip always runs with --no-deps); idempotent (a second run has
nothing to do); ``--dry-run`` changes nothing. A Triton that cannot work is not an install
failure of the pack (the pack falls back to PyTorch attention), so the exit code is 0 then too; only a broken
invocation (an unknown flag, a ``--python`` that does not exist, a failed ``--venv``
bootstrap) exits non-zero.

Developer bootstrap on a fresh clone: ``python3 install.py --venv .venv --demo``.

This file is the entry point only: the implementation is the ``installer/`` package beside it
(one module per job: probe, target, checks, actions, cli), loaded by path like the two kernels/
files. Its names are re-exported here, so a module loaded from this file still offers
``plan``, ``Facts``, ``probe`` and the rest.
"""
from __future__ import annotations

import importlib.util
import os
import sys

INSTALLER_PACKAGE = "_triton_accel_installer"


def load_installer():
    """installer/ as a package under a private name, loaded by path: install.py runs before the
    pack is importable, and the pack's package name is whatever its folder is called, so the
    installer cannot be a submodule of it. A second load from the same folder reuses the first;
    one from another copy of the pack replaces it, so the two copies' modules never mix."""
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "installer")
    loaded = sys.modules.get(INSTALLER_PACKAGE)
    if loaded is not None and list(getattr(loaded, "__path__", [])) == [folder]:
        return loaded
    for name in [n for n in sys.modules if n == INSTALLER_PACKAGE or n.startswith(INSTALLER_PACKAGE + ".")]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location(INSTALLER_PACKAGE, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    package = importlib.util.module_from_spec(spec)
    sys.modules[INSTALLER_PACKAGE] = package  # relative imports inside it look the package up here
    try:
        spec.loader.exec_module(package)
    except BaseException:
        del sys.modules[INSTALLER_PACKAGE]
        raise
    return package


load_installer()

# Tests and scripts load this file by path and use the implementation's names through it.
from _triton_accel_installer import cli
from _triton_accel_installer.actions import (  # noqa: F401
    LAST_REPORT_NAME, SELF_CHECK_SCRIPT, act, copy_vcrt, fetch_url, fix_python_headers, run_command, self_check,
    verdict, write_config, write_last_report)
from _triton_accel_installer.checks import (  # noqa: F401
    DRIVER_FOR_CUDA, VC_REDIST_URL, VCRT_MIN, bundled_cuda, check_build_environment, check_config,
    check_cuda_toolchain, check_gpu, check_probe_and_os, check_python_headers, check_python_wheels, check_shadows,
    check_torch, check_triton_cache, check_triton_install, check_vc_runtime, device_facts, fold, gpu_finding_text,
    has_code, plan, visible_gpu)
from _triton_accel_installer.cli import (  # noqa: F401
    BOOTSTRAP_MARK, REPORT_VERSION, bootstrap, build_parser, render, resolve_python, venv_python)
from _triton_accel_installer.common import (  # noqa: F401
    CONFIG_KEY_CACHE, CONFIG_NAME, LONG_PATHS_KEY, NUGET_URL, PACK_DIR, VCRT_DLLS, Version, cmdline, gpu_rules,
    install_config, is_ascii, parse_version, quote_arg, vstr)
from _triton_accel_installer.model import (  # noqa: F401
    SEVERITIES, Action, Blocker, Check, Facts, Finding, Options, Plan, Result, Target, pip_argv, python_base_argv)
from _triton_accel_installer.pe import (  # noqa: F401
    RT_VERSION, VS_FIXEDFILEINFO_SIGNATURE, PEError, pe_file_version, read_file_version)
from _triton_accel_installer.probe import (  # noqa: F401
    PROBE_MARK, PROBE_SCRIPT, cache_candidates, cuda_version_of, default_triton_cache_dir, detect_python_kind,
    dir_writable, find_shadows, include_minor, pth_entries, probe, probe_output_problem, read_config,
    read_long_paths_enabled, run_probe_script)
from _triton_accel_installer.target import (  # noqa: F401
    TRITON_WINDOWS_PYTHON, TRITON_WINDOWS_PYTHON_LATEST, _requirement, choose_target, expected_triton,
    marker_applies, target_minor, triton_windows_python_range)

_include_minor = include_minor  # the private name that callers of install.py know it by


def main(argv=None) -> int:
    """Run the installer's command line; the exit code (see the module docstring)."""
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
