"""The Triton version matrix: install each Triton release users run and try our kernels on it.

Users run many Triton versions (triton-windows 3.2-3.8 on Windows, whatever torch pins on
Linux), while the rest of the suite sees only the newest. For each release in RELEASES this
installs the Linux wheel from the package registry into its own folder
(`pip install --no-deps --target .cache/triton-versions/triton-X.Y`, kept between runs and
re-installed when broken) and runs, in one subprocess per version and job with that folder
first on PYTHONPATH:
- child_compile.py: triton.compile(...) of every shipped kernel (flash, short-key, FP8) for
  every GPU target (sm_75 ... sm_120, gfx942, gfx1100), without a GPU;
- child_interp.py: the kernels on the CPU under TRITON_INTERPRET=1 against the float32
  reference (fp16/fp32, masks, GQA, causal, odd lengths).

Compiled kernels are kept per release in .cache/triton-versions/kernels-X.Y (Triton's own
cache, keyed by the kernel's source, options, target and the Triton build), so a warm run
only compiles what changed; TRITON_ACCEL_VERSIONS_KERNELS=<folder> keeps them elsewhere (CI:
the user's cache folder, shared by fresh clones); TRITON_ACCEL_VERSIONS_FRESH=1 compiles
everything again.

Command line (one version, or several; prints the matrix):
    .venv/bin/python tests/versions/version_matrix.py 3.5 3.9 [--only compile|interp] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# TRITON_ACCEL_VERSIONS_CACHE moves it (a CI cache folder, or an empty one to time a cold run).
CACHE = Path(os.environ.get("TRITON_ACCEL_VERSIONS_CACHE") or ROOT / ".cache" / "triton-versions")
# Where each release's compiled kernels are kept (kernels-X.Y): CACHE unless
# TRITON_ACCEL_VERSIONS_KERNELS names a folder outside the checkout. .ci/run points it at the
# user's cache folder, as Triton's own ~/.triton/cache is for the rest of the suite: a fresh
# clone then compiles only the kernels whose source changed (Triton's key is the source, the
# options, the target and the Triton build, not the checkout's path) instead of all of them
# for eight releases (579 of a fresh-clone CI's 1034 s of tests, 2026-12-07). Except AMD on
# 3.2-3.8: their HIP options hash the paths of the install's ocml.bc / ockl.bc (3.9 hashes
# the files' contents), and the wheels are installed per clone.
KERNEL_CACHE = Path(os.environ.get("TRITON_ACCEL_VERSIONS_KERNELS") or CACHE)

# Triton minor -> the newest patch release on PyPI with a Linux x86_64 cp311 wheel
# (`pip index versions triton`, 2026-12-02). triton-windows follows the same minors.
RELEASES = {
    "3.2": "3.2.0",
    "3.3": "3.3.1",
    "3.4": "3.4.0",
    "3.5": "3.5.1",
    "3.6": "3.6.0",
    "3.7": "3.7.1",
    "3.8": "3.8.0",
    "3.9": "3.9.0",
}
TARGETS = ("sm75", "sm80", "sm86", "sm89", "sm90", "sm120", "gfx942", "gfx1100")
# pip's messages when the registry cannot be reached (DNS, refused or dropped connections,
# proxies): only then do the version tests skip rather than fail.
NETWORK_ERRORS = ("NewConnectionError", "Temporary failure in name resolution", "Name or service not known",
                  "Network is unreachable", "Max retries exceeded", "ConnectTimeoutError", "ProxyError",
                  "Connection refused", "Could not fetch URL", "ConnectionError", "ReadTimeoutError")
MARKER = ".installed"  # written last: a folder without it is a broken or interrupted install


@dataclass
class Install:
    minor: str
    version: str
    path: Path
    ok: bool = False
    offline: bool = False  # the registry could not be reached
    error: str = ""
    seconds: float = 0.0
    cached: bool = False


@dataclass
class VersionResult:
    install: Install
    compile: dict = field(default_factory=dict)  # child_compile's report, or {"error": ...}
    interp: dict = field(default_factory=dict)  # child_interp's report, or {"error": ...}
    seconds: dict = field(default_factory=dict)


def install_dir(minor: str) -> Path:
    return CACHE / f"triton-{minor}"


def _installed_ok(path: Path, version: str) -> bool:
    """The marker names the version and the package's files are there (a half-deleted or
    interrupted install has no marker, or lost its files)."""
    marker = path / MARKER
    return (marker.is_file() and marker.read_text().strip() == version
            and (path / "triton" / "__init__.py").is_file()
            and (path / f"triton-{version}.dist-info").is_dir())


def install(minor: str, python: str = sys.executable, force: bool = False) -> Install:
    """The release's wheel in its own folder, from the registry unless a good copy is cached."""
    version = RELEASES[minor]
    path = install_dir(minor)
    result = Install(minor, version, path)
    if not force and _installed_ok(path, version):
        result.ok = result.cached = True
        return result
    t = time.time()
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [python, "-m", "pip", "install", "--no-deps", "--no-input", "--disable-pip-version-check",
           "--retries", "1", "--timeout", "30", "--target", str(tmp), f"triton=={version}"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    result.seconds = round(time.time() - t, 1)
    if p.returncode != 0:
        out = p.stdout + p.stderr
        lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
        network = [ln for ln in lines if any(marker in ln for marker in NETWORK_ERRORS)]
        result.offline = bool(network)
        result.error = (network or [ln for ln in lines if "ERROR" in ln] or lines[-1:] or [f"pip exited {p.returncode}"])[0][:300]
        shutil.rmtree(tmp, ignore_errors=True)
        return result
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    (path / MARKER).write_text(version)
    result.ok = _installed_ok(path, version)
    if not result.ok:
        result.error = f"pip finished but {path} does not hold triton {version}"
    return result


def amd_linker() -> str | None:
    """An ld.lld for Triton <= 3.4, which links AMD code objects with an external one
    (3.5+ links in-process): TRITON_HIP_LLD_PATH, else the newest versioned ld.lld-NN on
    PATH (an old default ld.lld, LLVM 14, fails on gfx942/gfx1100 objects of Triton 3.3-3.4)."""
    if os.environ.get("TRITON_HIP_LLD_PATH"):
        return os.environ["TRITON_HIP_LLD_PATH"]
    found = {}
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        for path in Path(folder).glob("ld.lld-*") if folder and Path(folder).is_dir() else ():
            if path.name[len("ld.lld-"):].isdigit() and os.access(path, os.X_OK):
                found.setdefault(int(path.name[len("ld.lld-"):]), str(path))
    return found[max(found)] if found else shutil.which("ld.lld")


def _child_env(minor: str, interpret: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env["PYTHONPATH"] = str(install_dir(minor))  # before the venv's own site-packages
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the compiled default before 3.9; 3.9 warns when unset
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    elif amd_linker():
        env["TRITON_HIP_LLD_PATH"] = amd_linker()
    if os.environ.get("TRITON_ACCEL_VERSIONS_FRESH"):
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"triton-{minor}-kernels-")
    else:
        env["TRITON_CACHE_DIR"] = str(KERNEL_CACHE / f"kernels-{minor}")
    return env


def run_child(minor: str, job: str, python: str = sys.executable, targets=None, timeout: int = 900) -> dict:
    """Run child_<job>.py against one installed release; its JSON report, or {"error": ...}."""
    script = HERE / f"child_{job}.py"
    args = [python, str(script), str(ROOT)] + ([",".join(targets)] if targets else [])
    try:
        p = subprocess.run(args, capture_output=True, text=True, env=_child_env(minor, job == "interp"),
                           timeout=timeout, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        return {"error": f"{job} child for Triton {minor} ran over {timeout} s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = "\n".join(p.stderr.strip().splitlines()[-15:])
    return {"error": f"{job} child for Triton {minor} exited {p.returncode} without a report:\n{tail}"}


def _imports_wrong_triton(report: dict, inst: Install) -> bool:
    return "error" not in report and (report.get("triton") != inst.version
                                      or not str(report.get("triton_file", inst.path)).startswith(str(inst.path)))


def run_version(minor: str, jobs=("compile", "interp"), python: str = sys.executable) -> VersionResult:
    t = time.time()
    inst = install(minor, python)
    res = VersionResult(inst, seconds={"install": inst.seconds})
    if not inst.ok:
        return res
    for job in jobs:
        t_job = time.time()
        report = run_child(minor, job, python)
        if "error" in report and "No module named 'triton" in report["error"] or _imports_wrong_triton(report, inst):
            # A cached folder that no longer imports (files removed, another version on top):
            # install it again, once.
            inst = res.install = install(minor, python, force=True)
            report = run_child(minor, job, python) if inst.ok else {"error": inst.error}
        setattr(res, job, report)
        res.seconds[job] = round(time.time() - t_job, 1)
    res.seconds["total"] = round(time.time() - t, 1)
    return res


def run_matrix(minors=None, jobs=("compile", "interp"), workers: int | None = None) -> dict:
    """Every version, `workers` at a time (default: one per core, at most 2: each compile
    child is single-threaded and the suite must fit a 2-core CI machine)."""
    minors = list(minors or RELEASES)
    workers = workers or max(1, min(2, os.cpu_count() or 1))
    CACHE.mkdir(parents=True, exist_ok=True)
    # Installs go one at a time (pip and the disk do not gain from two); the slower compile
    # and interpreter children overlap with the next download.
    with ThreadPoolExecutor(workers) as ex:
        results = list(ex.map(lambda m: run_version(m, jobs), minors))
    return dict(zip(minors, results))


# ---- the matrix as text ---------------------------------------------------------------------

def format_matrix(results: dict) -> str:
    """One row per release: per target, kernels built / kernels tried (FP8 refusals below
    sm_89 are counted apart, as they must fail), or the registry's refusal of the target."""
    lines = ["| Triton | " + " | ".join(TARGETS) + " | interpreter |", "|---" * (len(TARGETS) + 2) + "|"]
    for minor, res in results.items():
        if not res.install.ok:
            lines.append(f"| {res.install.version} | not installed: {res.install.error} |")
            continue
        cells = []
        cases = res.compile.get("cases", [])
        for target in TARGETS:
            if target in res.compile.get("refused", {}):
                cells.append("refused: " + res.compile["refused"][target]["code"])
                continue
            mine = [c for c in cases if c["target"] == target]
            refusals = [c for c in mine if c["kernel"] == "fp8" and target in ("sm75", "sm80", "sm86")]
            built = [c for c in mine if c not in refusals]
            cell = f"{sum(c['ok'] for c in built)}/{len(built)}" if mine else "-"
            if refusals:
                cell += " (fp8 " + ("refused" if not any(c["ok"] for c in refusals) else "COMPILED") + ")"
            cells.append(cell)
        icases = res.interp.get("cases", [])
        iok = sum(c["ok"] for c in icases)
        interp = f"{iok}/{len(icases)}" if icases else res.interp.get("error", "-").splitlines()[0]
        lines.append(f"| {res.install.version} | " + " | ".join(cells) + f" | {interp} |")
    return "\n".join(lines)


def format_failures(results: dict) -> str:
    out = []
    for minor, res in results.items():
        if "error" in res.compile:
            out.append(f"{minor} compile: {res.compile['error']}")
        for c in res.compile.get("cases", []):
            if not c["ok"] and not (c["kernel"] == "fp8" and c["target"] in ("sm75", "sm80", "sm86")):
                out.append(f"{res.install.version} {c['target']} {c['kernel']} {c['case']}: {c['error']}")
        if "error" in res.interp:
            out.append(f"{minor} interpreter: {res.interp['error']}")
        for c in res.interp.get("cases", []):
            if not c["ok"]:
                out.append(f"{res.install.version} interpreter {c['name']}: {c.get('error') or c.get('err')}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="*", help=f"Triton minors (default: all of {', '.join(RELEASES)})")
    ap.add_argument("--only", choices=("compile", "interp"))
    ap.add_argument("--json", help="write every report to this file")
    ap.add_argument("--install-only", action="store_true",
                    help="install (or find cached) each release and say so; nothing is compiled or run. "
                         "tests/run.sh does this before pytest, so the compile tests that build under "
                         "other releases (tests/compile) find them in a fresh clone too")
    args = ap.parse_args(argv)
    unknown = [v for v in args.versions if v not in RELEASES]
    if unknown:
        ap.error(f"unknown Triton minor(s) {unknown}; known: {list(RELEASES)}")
    if args.install_only:
        CACHE.mkdir(parents=True, exist_ok=True)
        # Two pip processes at a time (each into its own folder): unpacking a cached wheel is
        # CPU-bound, and the eight took ~60 s one after another on the 2-core CI machine.
        with ThreadPoolExecutor(2) as ex:
            installs = list(ex.map(install, args.versions or RELEASES))
        for inst in installs:
            state = "cached" if inst.cached else f"installed in {inst.seconds} s" if inst.ok else f"NOT installed: {inst.error}"
            print(f"triton {inst.version}: {state}")
        return 0  # a release that did not install is the version tests' to report (skip or fail)
    jobs = (args.only,) if args.only else ("compile", "interp")
    t = time.time()
    results = run_matrix(args.versions or None, jobs)
    print(format_matrix(results))
    failures = format_failures(results)
    if failures:
        print("\n" + failures)
    print(f"\n{time.time() - t:.0f} s; per version: " +
          ", ".join(f"{m} {r.seconds}" for m, r in results.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {m: {"install": {k: str(v) for k, v in vars(r.install).items()}, "compile": r.compile,
                 "interp": r.interp, "seconds": r.seconds} for m, r in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
