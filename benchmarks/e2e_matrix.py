"""The end-to-end matrix: every family x memory mode x checkpoint kind x step graphs, one command.

Each cell is one variant of benchmarks/e2e_comfyui.py run in a process of its own (a host-bound
step's time then does not depend on what ran before it), on ComfyUI 0.29's own model code with
full-size random weights (benchmarks/e2e_models.py):

  memory mode   static (weights resident) | dynamic (ComfyUI's dynamic VRAM: comfy-aimdo,
                weights on the CPU, streamed per call; needs CUDA and comfy-aimdo)
  checkpoint    bf16 (BF16 weights) | fp8 (an FP8 checkpoint: weight_dtype fp8_e4m3fn,
                ComfyUI upcasting per call)
  variants      ComfyUI's default on that checkpoint (default / default-fp8ckpt), ComfyUI's
                fp8_e4m3fn_fast (comfy-fp8-fast: the same FP8 model from either checkpoint, so
                one cell per mode, shown under both, its cosine against the first checkpoint
                kind's default), our Patch in auto (ours-all /
                ours-fp8ckpt) with step graphs on (+graph) and off (+nograph)

A cell's JSON is written to OUT/cells/ as soon as it finishes, so a run stopped at a time limit
keeps what finished; a later run with the same OUT skips the cells already there (--retry-errors
runs the failed ones again). The default of a checkpoint kind runs first and its output is the
reference of that kind's cosines (OUT/refs/; a run without it leaves the cosines out).

    python benchmarks/e2e_matrix.py --comfyui .ext/comfy-slim --families sd15 sdxl flux qwen_image wan \\
        --modes static dynamic --ckpt bf16 fp8 --out DIR [--max-seconds 500] [--plan]
    python benchmarks/e2e_matrix.py --report DIR [DIR or .tgz ...]     (one Markdown table)

On the GPU machine benchmarks/gpu_matrix.sh installs the carried wheels and tars OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
E2E = HERE / "e2e_comfyui.py"
FAMILIES = ("sd15", "sdxl", "flux", "qwen_image", "wan")
MODES = ("static", "dynamic")
CKPTS = ("bf16", "fp8")
FP8_FAST = "comfy-fp8-fast"
# checkpoint kind -> (ComfyUI's default on it, our Patch on it)
DEFAULT_OF = {"bf16": "default", "fp8": "default-fp8ckpt"}
OURS_OF = {"bf16": "ours-all", "fp8": "ours-fp8ckpt"}
GRAPHS = {"on": "+graph", "off": "+nograph"}
# Seconds a cell takes on an H100 (static, dynamic): the process's start (~15 s), the build, the
# first call (our auto's timings and weight quantisation, the step graph's capture) and 1 + steps
# calls; Qwen-Image and Wan under dynamic VRAM also move 41 / 29 GB of weights to the CPU.
SECONDS = {"sd15": (25, 35), "sdxl": (30, 45), "flux": (40, 70), "qwen_image": (60, 120), "wan": (60, 120)}
# The first cell of our Patch in a process tree compiles its Triton kernels (cached after).
COMPILE_SECONDS = 45


def cells(families, modes, ckpts, tiny=False, only=None) -> list[dict]:
    """The cells in the order they run: per family and mode, each checkpoint kind's default
    first (the reference of its cosines), comfy-fp8-fast once, after the BF16 default; `only`:
    these variants alone."""
    out = []
    for family in families:
        for mode in modes:
            for ckpt in ckpts:
                todo = [(DEFAULT_OF[ckpt], None)]
                if ckpt == ckpts[0]:
                    todo.append((FP8_FAST, None))
                todo += [(OURS_OF[ckpt] + GRAPHS[g], g) for g in ("on", "off")]
                for variant, graph in todo:
                    if only and variant not in only:
                        continue
                    kind = "either" if variant == FP8_FAST else ckpt
                    out.append(dict(family=family, mode=mode, ckpt=kind, graph=graph, variant=variant, tiny=tiny,
                                    ref_ckpt=ckpts[0] if variant == FP8_FAST else ckpt))
    return out


def cell_id(cell: dict) -> str:
    return "__".join([cell["family"], cell["mode"], cell["ckpt"], cell["variant"]]) + ("__tiny" if cell["tiny"] else "")


def estimate(cell: dict) -> float:
    return SECONDS[cell["family"]][cell["mode"] == "dynamic"]


def ref_file(out: Path, cell: dict) -> Path:
    return out / "refs" / f"{cell['family']}_{cell['ref_ckpt']}{'_tiny' if cell['tiny'] else ''}.pt"


def is_default(cell: dict) -> bool:
    return cell["variant"] in DEFAULT_OF.values()


def last_error_line(log: str) -> str:
    """The child's own reason: its last line (a SystemExit's message, an exception's last line)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    failed = [ln for ln in lines if "FAILED" in ln]
    return (failed[-1] if failed else lines[-1] if lines else "no output")[:400]


def run_cell(cell: dict, args, out: Path, timeout: float, extra=()) -> dict:
    """One variant in a fresh e2e_comfyui.py process; its row (or its error) as the cell's JSON."""
    work = out / "work" / cell_id(cell)
    ref = ref_file(out, cell)
    ref.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(E2E), "--comfyui", args.comfyui, "--models", cell["family"], "--variants",
           cell["variant"], "--steps", str(args.steps), "--out", str(work)]
    cmd += ["--tiny"] if cell["tiny"] else []
    cmd += ["--dynamic-vram"] if cell["mode"] == "dynamic" else []
    cmd += list(extra)
    # The default writes the reference when there is none yet; the others compare with it only
    # when it exists (without one, e2e_comfyui compares a variant with itself).
    with_ref = is_default(cell) or ref.exists()
    cmd += ["--ref-file", str(ref)] if with_ref else []
    env = dict(os.environ, TRITON_ACCEL_CACHE_DIR=str(out / "cache"))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              timeout=timeout)
        log, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        log, rc = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or "", None
    wall = time.perf_counter() - t0
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "logs" / f"{cell_id(cell)}.log").write_text(log)
    result = dict(cell=cell, wall_s=round(wall, 1), finished=time.strftime("%Y-%m-%d %H:%M:%S"),
                  ref=with_ref and ref.exists(), log_tail=log.splitlines()[-25:])
    report = work / ("e2e_comfyui_dynamic_vram.json" if cell["mode"] == "dynamic" else "e2e_comfyui.json")
    if rc is None:
        result["error"] = f"timed out after {timeout:.0f} s"
    elif rc != 0 or not report.exists():
        result["error"] = f"exit {rc}: {last_error_line(log)}"
    else:
        child = json.loads(report.read_text())
        row = child["results"][0] if child["results"] else {"error": "no row"}
        result.update(meta=child["meta"], row=row)
        if "error" in row:
            result["error"] = row["error"]
    return result


def environment_error(result: dict) -> str | None:
    """An error every later cell of that memory mode would meet (dynamic VRAM unavailable)."""
    reason = result.get("error", "").split(": ", 1)[-1]  # after "exit N"
    # e2e_comfyui's own SystemExit when comfy-aimdo, CUDA or ModelPatcherDynamic is missing
    return reason if reason.startswith("dynamic VRAM") and result["cell"]["mode"] == "dynamic" else None


def run_matrix(args) -> None:
    out = Path(args.out)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    todo = cells(args.families, args.modes, args.ckpt, args.tiny, args.only)
    t_start = time.perf_counter()
    blocked: dict[str, str] = {}  # mode -> why none of its cells can run here
    compiled = False
    sensed = set()  # families whose sensitivity a cell of this run has checked
    for i, cell in enumerate(todo):
        path = out / "cells" / f"{cell_id(cell)}.json"
        if path.exists():
            previous = json.loads(path.read_text())
            if "error" not in previous or not args.retry_errors:
                print(f"[matrix] {i + 1}/{len(todo)} {cell_id(cell)}: already in {out}, skipped", flush=True)
                continue
        elapsed = time.perf_counter() - t_start
        cost = estimate(cell) + (0 if compiled or not cell["variant"].startswith("ours") else COMPILE_SECONDS)
        if args.max_seconds and elapsed + cost > args.max_seconds:
            print(f"[matrix] stopping at {elapsed:.0f} s: {cell_id(cell)} (~{cost:.0f} s) would pass --max-seconds "
                  f"{args.max_seconds}; {len(todo) - i} cells left for a later run with the same --out", flush=True)
            break
        if cell["mode"] in blocked:
            result = dict(cell=cell, wall_s=0, error=f"not run: {blocked[cell['mode']]}")
        else:
            timeout = args.cell_timeout
            if args.max_seconds:
                timeout = min(timeout, max(60.0, args.max_seconds - elapsed + 60))
            print(f"[matrix] {i + 1}/{len(todo)} {cell_id(cell)} (~{cost:.0f} s)", flush=True)
            # --check-sensitivity: on the family's first default, before its timed steps (which
            # its first call then does not include: that cell's "first step ms" is a warm one)
            sense = args.check_sensitivity and is_default(cell) and cell["family"] not in sensed
            result = run_cell(cell, args, out, timeout, ["--check-sensitivity"] if sense else [])
            if sense and "sensitivity" in result.get("meta", {}):
                sensed.add(cell["family"])
            compiled = compiled or (cell["variant"].startswith("ours") and "error" not in result)
            why = environment_error(result)
            if why:
                blocked[cell["mode"]] = why
        path.write_text(json.dumps(result, indent=1))
        row = result.get("row", {})
        status = result.get("error") or f"{row.get('ms_per_step', float('nan')):.1f} ms/step"
        print(f"[matrix] {cell_id(cell)}: {status} ({result['wall_s']:.0f} s)", flush=True)
    table = report(load_results([out]))
    (out / "report.md").write_text(table + "\n")
    print("\n" + table)


def print_plan(args) -> None:
    out = Path(args.out) if args.out else None
    todo = cells(args.families, args.modes, args.ckpt, args.tiny, args.only)
    total = 0.0
    print("| # | model | memory mode | checkpoint | step graphs | variant | ~s | status |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, cell in enumerate(todo):
        done = out is not None and (out / "cells" / f"{cell_id(cell)}.json").exists()
        total += 0 if done else estimate(cell)
        print(f"| {i + 1} | {cell['family']} | {cell['mode']} | {cell['ckpt']} | {cell['graph'] or '-'} | "
              f"{cell['variant']} | {estimate(cell):.0f} | {'done' if done else 'to run'} |")
    print(f"\n{len(todo)} cells, ~{total:.0f} s to run (H100 estimates, the first Patch cell ~{COMPILE_SECONDS} s more "
          f"for Triton's compile; dynamic cells need CUDA and comfy-aimdo)")


def load_results(paths) -> list[dict]:
    """Cell JSONs from folders (their cells/ or the folder itself) and .tgz files of them; of a
    cell found twice, the successful, then the latest."""
    found = []
    for p in map(Path, paths):
        if p.is_file() and p.name.endswith((".tgz", ".tar.gz")):
            with tarfile.open(p) as tar:
                for member in tar.getmembers():
                    if member.isfile() and "/cells/" in f"/{member.name}" and member.name.endswith(".json"):
                        found.append(json.load(tar.extractfile(member)))
            continue
        folder = p / "cells" if (p / "cells").is_dir() else p
        found += [json.loads(f.read_text()) for f in sorted(folder.glob("*.json"))]
    best: dict[str, dict] = {}
    for r in found:
        if "cell" not in r:
            continue
        key = cell_id(r["cell"])
        rank = ("error" not in r, r.get("finished", ""))
        if key not in best or rank >= ("error" not in best[key], best[key].get("finished", "")):
            best[key] = r
    return list(best.values())


def _ms(result: dict | None) -> float | None:
    return None if result is None or "error" in result else result["row"]["ms_per_step"]


def _fmt(value, spec=".1f", missing="-") -> str:
    return missing if value is None else format(value, spec)


def report_table(results: list[dict]) -> str:
    """One Markdown table of the cells (see the module's docstring for the columns' meaning)."""
    by_key = {(r["cell"]["family"], r["cell"]["mode"], r["cell"]["ckpt"], r["cell"]["variant"]): r for r in results}
    order = {name: i for i, name in enumerate(FAMILIES)}
    variant_order = ["default", "default-fp8ckpt", FP8_FAST]
    lines = ["| model | memory mode | checkpoint | step graphs | variant | ms/step | vs default | vs fp8_e4m3fn_fast | "
             "host ms/step | first step ms | peak GiB | cosine vs default | Linear calls ours/back | "
             "attention calls ours/back | note |",
             "| " + " | ".join(["---"] * 15) + " |"]
    groups = sorted({(f, m, c) for f, m, c, _ in by_key if c != "either"},
                    key=lambda g: (order.get(g[0], 99), MODES.index(g[1]) if g[1] in MODES else 9, g[2]))
    fast_only = {(f, m) for f, m, c, _ in by_key if c == "either"} - {(f, m) for f, m, _ in groups}
    groups += sorted((f, m, "bf16") for f, m in fast_only)
    for family, mode, ckpt in groups:
        fast = by_key.get((family, mode, "either", FP8_FAST))
        default = by_key.get((family, mode, ckpt, DEFAULT_OF.get(ckpt, "default")))
        rows = [r for (f, m, c, _), r in by_key.items() if (f, m, c) == (family, mode, ckpt)] + ([fast] if fast else [])
        rows.sort(key=lambda r: (variant_order.index(r["cell"]["variant"]) if r["cell"]["variant"] in variant_order
                                 else 9, r["cell"]["variant"]))
        for r in rows:
            lines.append(_table_row(r, ckpt, _ms(default), _ms(fast)))
    return "\n".join(lines)


def report(results: list[dict]) -> str:
    """The table, then each checked family's sensitivity (e2e_comfyui.py --check-sensitivity)."""
    lines = [report_table(results)]
    for r in results:
        sens = r.get("meta", {}).get("sensitivity", {}).get(r["cell"]["family"])
        if sens:
            changes = ", ".join(f"{m.replace('diffusion_model.', '')} {c:.2e}" for m, c in sens["changes"].items())
            ratio = sens["block_update_ratio"]
            lines.append(f"\n{r['cell']['family']} ({r['cell']['mode']}, {r['cell']['ckpt']}): a 1 % change of one "
                         f"attention's output moves the step output by {changes} (noise {sens['noise']:.1e}); blocks "
                         f"write {ratio['min']:.2f} to {ratio['max']:.2f} (median {ratio['median']:.2f}) of their "
                         f"residual")
    return "\n".join(lines)


def _table_row(r: dict, ckpt: str, default_ms, fast_ms) -> str:
    cell, row = r["cell"], r.get("row", {})
    ms = _ms(r)
    host = row.get("step_host_ms") or []
    calls = row.get("calls", {})
    peak = row.get("peak_gib")
    if peak is not None and peak != peak:  # NaN: no CUDA
        peak = None
    peak_text = _fmt(peak)
    if cell["mode"] == "dynamic" and row.get("device_used_gib") is not None:
        peak_text += f" (device {row['device_used_gib']:.1f})"
    cosine = row.get("cosine_vs_default") if r.get("ref") else None
    note = r.get("error", "")
    if cell["variant"] == FP8_FAST and not note:
        note = f"one run for both checkpoints; cosine against the {cell['ref_ckpt']} default"
    return " | ".join(["", cell["family"], cell["mode"], ckpt, cell["graph"] or "-", cell["variant"], _fmt(ms),
                       _fmt(default_ms / ms if default_ms and ms else None, ".3f") + ("x" if default_ms and ms else ""),
                       _fmt(fast_ms / ms if fast_ms and ms else None, ".3f") + ("x" if fast_ms and ms else ""),
                       _fmt(statistics.median(host) if host else None), _fmt(row.get("first_call_ms"), ".0f"),
                       peak_text, _fmt(cosine, ".6f"), calls.get("linear", "-"), calls.get("attention", "-"),
                       note.replace("|", "/")[:200], ""]).strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH", str(HERE.parent / ".ext" / "comfy-slim")))
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--ckpt", nargs="+", default=list(CKPTS), choices=CKPTS)
    ap.add_argument("--only", nargs="+", metavar="VARIANT",
                    help="these variants' cells alone (as --plan names them, e.g. default ours-all+graph)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per cell (after the warm-up calls)")
    ap.add_argument("--tiny", action="store_true", help="TINY models (a CPU smoke run; TRITON_INTERPRET=1 there)")
    ap.add_argument("--out", help="folder of the cells' JSON (and a run's refs/, logs/, report.md)")
    ap.add_argument("--max-seconds", type=float, default=0,
                    help="launch no cell whose estimate would end past this many seconds of the run")
    ap.add_argument("--cell-timeout", type=float, default=1200, help="seconds one cell's process may run")
    ap.add_argument("--retry-errors", action="store_true", help="run again the cells whose JSON holds an error")
    ap.add_argument("--check-sensitivity", action="store_true",
                    help="each family's first default also checks that every block shows in the output "
                         "(e2e_comfyui.py --check-sensitivity), printed under the table")
    ap.add_argument("--plan", action="store_true", help="print the cells (and which --out already holds), run none")
    ap.add_argument("--report", nargs="+", metavar="DIR", help="merge these folders' (or .tgz files') cells into one "
                                                               "Markdown table, run none")
    args = ap.parse_args()
    if args.report:
        print(report(load_results(args.report)))
    elif args.plan:
        print_plan(args)
    elif not args.out:
        ap.error("--out is needed to run the matrix")
    else:
        run_matrix(args)


if __name__ == "__main__":
    main()
