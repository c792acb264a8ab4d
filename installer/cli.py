"""install.py's command line: flags, the probe -> plan -> act -> self-check run, its text or
--json report, and the developer bootstrap (--venv PATH [--demo])."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Callable, List, Optional, Sequence

from .actions import act, self_check, verdict, write_last_report
from .checks import plan
from .common import PACK_DIR, cmdline, vstr
from .model import Facts, Options, Plan, Result
from .probe import probe

# 2: path names are gpu_rules' ("triton_fp8", not "triton-fp8"); plan has blockers and
# expected_paths; facts.config holds only checked values, facts.config_problems the rest.
REPORT_VERSION = 2
ENTRY_POINT = os.path.join(PACK_DIR, "install.py")  # what --venv runs again inside the venv


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
    inner = [py, ENTRY_POINT] + (["--fix"] if args.fix else []) + (["--no-check"] if args.no_check else [])
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
# The command: probe, plan, act, self-check, report
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
    try:
        print(json.dumps(report, indent=2) if quiet else render(f, p, results, check, v, args.dry_run))
        sys.stdout.flush()
    except BrokenPipeError:
        # A reader that stops early (`| head`) is no install failure: the rest of the output,
        # and the flush at exit, go to devnull instead of ending in a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
