"""act: run the plan's actions (pip with --no-deps, config writes, the --fix steps), then prove
the result in a subprocess (import triton, run a tiny kernel) and say which attention path the
pack will use."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Callable, List, Optional, Sequence, Tuple

from .common import CONFIG_KEY_CACHE, CONFIG_NAME, NUGET_URL, cmdline, gpu_rules, install_config, parse_version, vstr
from .model import Facts, Plan, Result, python_base_argv
from .pe import PEError, read_file_version
from .probe import include_minor, read_config

LAST_REPORT_NAME = "install_report.json"  # the last run's report, read by nodes/status.py


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
    old_minor = include_minor(inc) if os.path.isfile(os.path.join(inc, "Python.h")) else None
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
