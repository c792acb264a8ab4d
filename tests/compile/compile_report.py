"""Helpers of the Gluon compile tests.

- compile_report(): runs a test's compile worker (a `python -c` script printing
  "RESULT <json>") in a subprocess with TRITON_INTERPRET unset, under the installed Triton or
  one that tests/versions/version_matrix.py installed under .cache/triton-versions.
- main_loop(): what a compiled kernel's main loop holds, read from its SASS (cuobjdump -sass
  text), used inside the workers to pin what a loop option removes from a key tile's
  instructions: register copies at the back edge (MOV / IMAD.MOV), the shuffles and selects of
  P's layout change, spills (LDL / STL). The main loop is the first backward branch whose body
  holds at least one tile's matrix instructions (the first consumer warpgroup's loop; the
  second one's is the same code).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)")
MMA_OPS = ("QGMMA", "HGMMA")


def disassemble(cubin: bytes, triton_module) -> str | None:
    """cuobjdump -sass of `cubin` with the cuobjdump Triton ships, or None without one."""
    tool = os.path.join(os.path.dirname(triton_module.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        p = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True)
    return p.stdout if p.returncode == 0 and "/*" in p.stdout else None


def instructions(sass: str) -> list:
    return [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(_INSTR.search, sass.splitlines()) if m]


def main_loop(sass: str, mma_per_tile: int) -> dict | None:
    """{tiles, per_tile: {opcode: count / tiles}, copies, spills} of the main loop, or None."""
    body = _loop_body(sass, mma_per_tile)
    if body is None:
        return None
    mma = sum(1 for _, o, _ in body if o.startswith(MMA_OPS))
    tiles = max(1, round(mma / mma_per_tile))
    ops = Counter(o.split(".")[0] for _, o, _ in body)
    copies = sum(1 for _, o, _ in body if o == "MOV" or o.startswith("IMAD.MOV"))
    return dict(tiles=tiles, per_tile={k: v / tiles for k, v in ops.items()}, copies=copies / tiles,
                spills=ops.get("LDL", 0) + ops.get("STL", 0), total=sum(ops.values()) / tiles)


def _loop_body(sass: str, mma_per_tile: int) -> list | None:
    """main_loop()'s loop body as (address, opcode, operands), or None."""
    ins = instructions(sass)
    for addr, op, args in ins:
        if not op.startswith("BRA"):
            continue
        target = _TARGET.search(args)
        if not target or int(target.group(1), 16) >= addr:
            continue
        lo = int(target.group(1), 16)
        body = [x for x in ins if lo <= x[0] <= addr]
        if sum(1 for _, o, _ in body if o.startswith(MMA_OPS)) >= mma_per_tile:
            return body
    return None


def register_a_mma_gaps(sass: str, mma_per_tile: int) -> list | None:
    """MUFU instructions between consecutive register-A matrix instructions (P.V: P from
    registers, `QGMMA Rd, Ra, gdesc[..]`; Q.K^T reads both operands from shared memory) of
    the main loop, in program order, or None. A tile's P.V issued in one piece shows its
    k-steps back to back (0, 0, 0 within the tile); issued in slices, the exponentials of
    the next slice sit between them."""
    body = _loop_body(sass, mma_per_tile)
    if body is None:
        return None
    gaps, mufu, seen = [], 0, False
    for _, op, args in body:
        if op.startswith(MMA_OPS) and re.search(r"\bR\d+,\s*R\d+,\s*gdesc", args):
            if seen:
                gaps.append(mufu)
            seen, mufu = True, 0
        elif op.startswith("MUFU"):
            mufu += 1
    return gaps


def spills(sass: str) -> int:
    return sum(1 for _, op, _ in instructions(sass) if op.split(".")[0] in ("LDL", "STL"))


def compile_report(worker: str, jobs: list, which: str, root: Path) -> dict:
    """{job: the worker's result} for `jobs` (tuples) compiled under Triton `which`
    ("installed" or a minor such as "3.6"), or {"skip": reason}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton >= 3.9 warns when unset
    if which != "installed":
        site = root / ".cache" / "triton-versions" / f"triton-{which}"
        if not (site / ".installed").exists():
            return dict(skip=f"{site} not installed (tests/versions/version_matrix.py {which} installs it)")
        env["PYTHONPATH"] = str(site)
    p = subprocess.run([sys.executable, "-c", worker, str(root), json.dumps(jobs)], capture_output=True,
                       text=True, env=env, timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"compile worker failed:\n{p.stderr[-3000:]}"
    rep = json.loads(lines[-1][7:])
    if rep["refusal"]:
        return dict(skip=f"Triton ({which}) cannot build the Gluon kernel: {rep['refusal']}")
    return dict(zip(jobs, rep["results"]))


def main_loop_of(result: dict) -> dict:
    """A worker result's main-loop statistics, asserted free of spills; skips the test when
    the SASS could not be read (no cuobjdump beside that Triton)."""
    import pytest

    assert result["ok"], result.get("error")
    loop = result["loop"]
    if loop is None:
        pytest.skip("no cuobjdump beside this Triton, or no main loop found in its SASS")
    assert loop["spills"] == 0, loop
    return loop


def cached_report(which: str, worker: str, jobs: list, root: Path, cache: dict) -> dict:
    """compile_report() once per Triton per test module (kept in `cache`); skips the test,
    printing why, when that Triton is absent or cannot build the kernel."""
    import pytest

    pytest.importorskip("triton")
    if which not in cache:
        cache[which] = compile_report(worker, jobs, which, root)
    rep = cache[which]
    if "skip" in rep:
        print(f"SKIP reason: {rep['skip']}")
        pytest.skip(rep["skip"])
    return rep
