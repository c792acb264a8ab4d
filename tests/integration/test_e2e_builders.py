"""The end-to-end benchmark's models (benchmarks/e2e_models.py) and matrix (benchmarks/e2e_matrix.py)
against a real ComfyUI, on the CPU.

- Each FULL unet config is what ComfyUI's detection makes of the real checkpoint: the model built
  on the meta device (no memory) is detected back to the same config and supported model.
- Each family's TINY build steps through e2e_comfyui.py (a process of its own, as the GPU runs
  it): a finite output, and a 1 % change of one attention's output moves the step's output well
  above fp32 rounding (the blocks are not lost in the residual adds).
- The matrix: its plan, one real cell, a dynamic-VRAM cell's error row (no CUDA here), and the
  report merging two folders of cells.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
FAMILIES = ("sd15", "sdxl", "flux", "qwen_image", "wan")
# Relative L2 change of the step output that a 1 % change of one attention output must pass: a
# hundred times a reordered fp32 sum's rounding (~1e-7 relative) and then some; the TINY models
# give 7e-4 to 4e-3.
MIN_CHANGE = 1e-4


def _comfy_path() -> str:
    return str(Path(os.environ["COMFYUI_PATH"]).resolve())


def _run(args, timeout=300, **env) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, TRITON_INTERPRET="1", **env))
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


DETECT = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import comfy.cli_args
comfy.cli_args.args.cpu = True
import torch, comfy.model_detection as md, e2e_models
out = {}
for family in e2e_models.FAMILIES:
    spec = e2e_models.FULL[family]
    model = e2e_models.build_model(spec, torch.bfloat16, torch.device("meta"))
    sd = model.diffusion_model.state_dict()
    detected = md.detect_unet_config(sd, "")
    config = md.model_config_from_unet_config(detected, sd)
    out[family] = dict(config=type(config).__name__, wanted=e2e_models.FAMILY[family]["config_class"],
                       detected=json.loads(json.dumps(detected, default=str)),
                       spec=json.loads(json.dumps(spec["unet"], default=str)),
                       params=sum(p.numel() for p in model.diffusion_model.parameters()))
print(json.dumps(out))
"""
# Parameters of the real checkpoints' diffusion models, in billions (to 2 %).
PARAMS_B = {"sd15": 0.86, "sdxl": 2.57, "flux": 11.9, "qwen_image": 20.4, "wan": 14.3}


def test_full_configs_are_what_comfyui_detects():
    proc = _run(["-c", DETECT, _comfy_path(), BENCH])
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for family in FAMILIES:
        entry = found[family]
        assert entry["config"] == entry["wanted"], (family, entry["config"])
        assert entry["detected"] == entry["spec"], (family, entry["detected"], entry["spec"])
        assert abs(entry["params"] / 1e9 - PARAMS_B[family]) < 0.02 * PARAMS_B[family], (family, entry["params"])


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_step_is_finite_and_sees_one_attention(family, tmp_path):
    _run([BENCH / "e2e_comfyui.py", "--comfyui", _comfy_path(), "--tiny", "--models", family, "--variants", "default",
          "default-fp8ckpt", "--steps", "1", "--check-sensitivity", "--out", tmp_path])
    report = json.loads((tmp_path / "e2e_comfyui.json").read_text())
    rows = {r["variant"]: r for r in report["results"]}
    assert set(rows) == {"default", "default-fp8ckpt"} and all(r.get("finite") for r in rows.values()), rows
    # the FP8 checkpoint is the same model rounded: close to, not equal to, the BF16 one's output
    assert 0.95 < rows["default-fp8ckpt"]["cosine_vs_default"] < 1.0, rows["default-fp8ckpt"]
    sens = report["meta"]["sensitivity"][family]
    print(f"{family}: {sens}")
    assert sens["finite"] and sens["changes"], sens
    assert sens["noise"] < 1e-6, sens  # the CPU steps are deterministic
    for module, change in sens["changes"].items():
        assert change > MIN_CHANGE and change > 100 * sens["noise"], (module, change)
    ratios = sens["block_update_ratio"]
    assert ratios["n"] > 0 and ratios["min"] > 0.05, ratios  # each block writes a sizeable update


def test_matrix_plan_lists_every_cell():
    proc = _run([BENCH / "e2e_matrix.py", "--plan", "--families", "sd15", "wan", "--modes", "static", "dynamic",
                 "--ckpt", "bf16", "fp8"])
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    # per family and mode: 2 defaults, comfy-fp8-fast once, the Patch with step graphs on and off on 2 checkpoints
    assert len(rows) == 2 * 2 * 7, proc.stdout
    variants = {ln.split(" | ")[5] for ln in rows}
    assert variants == {"default", "default-fp8ckpt", "comfy-fp8-fast", "ours-all+graph", "ours-all+nograph",
                        "ours-fp8ckpt+graph", "ours-fp8ckpt+nograph"}, variants
    assert "28 cells" in proc.stdout


def test_matrix_runs_a_cell_and_rows_a_dynamic_cell_without_cuda(tmp_path):
    out = tmp_path / "m"
    args = [BENCH / "e2e_matrix.py", "--comfyui", _comfy_path(), "--tiny", "--families", "wan", "--ckpt", "bf16",
            "--steps", "1", "--out", out]
    _run([*args, "--modes", "static", "dynamic"], timeout=600)
    cells = {p.stem: json.loads(p.read_text()) for p in (out / "cells").glob("*.json")}
    default = cells["wan__static__bf16__default__tiny"]
    assert "error" not in default and default["row"]["finite"] and default["ref"], default
    assert (out / "refs" / "wan_bf16_tiny.pt").exists()
    dynamic = [c for c in cells.values() if c["cell"]["mode"] == "dynamic"]
    assert len(dynamic) == 4 and all("dynamic VRAM" in c["error"] for c in dynamic), dynamic
    # the next run skips what is there
    again = _run([*args, "--modes", "static"])
    assert again.stdout.count("skipped") == 4, again.stdout
    table = (out / "report.md").read_text()
    assert "| wan | dynamic | bf16 | - | default | - |" in table and "dynamic VRAM" in table, table


def _cell(family, mode, ckpt, variant, ms, graph=None, host=(), **row):
    cell = dict(family=family, mode=mode, ckpt=ckpt, graph=graph, variant=variant, tiny=False,
                ref_ckpt="bf16" if ckpt == "either" else ckpt)
    return dict(cell=cell, ref=True, finished="2026-12-07 12:00:00",
                row=dict(ms_per_step=ms, step_host_ms=list(host), first_call_ms=10 * ms, peak_gib=20.0,
                         cosine_vs_default=row.pop("cos", 1.0), calls=row.pop("calls", {}), **row))


def test_matrix_report_merges_folders(tmp_path):
    first, second = tmp_path / "call1" / "cells", tmp_path / "call2" / "cells"
    first.mkdir(parents=True)
    second.mkdir(parents=True)
    synthetic = {
        first: [_cell("flux", "static", "bf16", "default", 400.0, host=(100, 120, 110)),
                _cell("flux", "static", "either", "comfy-fp8-fast", 320.0, cos=0.9995)],
        second: [_cell("flux", "static", "bf16", "ours-all+graph", 200.0, graph="on", cos=0.99999,
                       calls={"linear": "500 ours/4 back", "attention": "57 ours/0 back"}),
                 dict(cell=dict(family="flux", mode="dynamic", ckpt="bf16", graph=None, variant="default", tiny=False,
                                ref_ckpt="bf16"), error="not run: dynamic VRAM needs comfy-aimdo")],
    }
    for folder, results in synthetic.items():
        for i, result in enumerate(results):
            (folder / f"c{i}.json").write_text(json.dumps(result))
    proc = _run([BENCH / "e2e_matrix.py", "--report", first.parent, second.parent])
    lines = proc.stdout.splitlines()
    ours = next(ln for ln in lines if "ours-all+graph" in ln)
    cols = [c.strip() for c in ours.strip("|").split("|")]
    assert cols[:8] == ["flux", "static", "bf16", "on", "ours-all+graph", "200.0", "2.000x", "1.600x"], cols
    assert cols[11:14] == ["0.999990", "500 ours/4 back", "57 ours/0 back"], cols
    default = next(ln for ln in lines if "| default |" in ln and "static" in ln)
    assert "| 110.0 | 4000 |" in default, default  # host ms/step: the median of the timed steps
    assert any("dynamic" in ln and "comfy-aimdo" in ln for ln in lines), proc.stdout
