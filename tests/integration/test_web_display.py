"""The pack's web extension (web/js/triton_accel.js) in a real browser against real ComfyUI.

A headless Chromium, driven by playwright-core from Node (web_display.mjs beside this file),
opens the harness server's page and builds Triton Accel Settings (mode fp16) -> Triton Accel
Attention <- UNETLoader (the tiny Flux), feeding the test pack's attention probe (one attention
call through the patched model, served by our kernel in the interpreter). Checked, in the
classic canvas and in Nodes 2.0 (Vue nodes, frontend >= 1.47):
- no console warning or error, and no page error, from our files (the old extension imported
  the internal scripts/widgets.js and used widget.inputEl: two warnings per page load);
- both nodes show their text, fully: the text box is as tall as its content and no ancestor
  cuts it off; the patch node's text gains the model's call counts after the run;
- the decision is kept out of the workflow's widgets_values and out of the prompt, and it is
  hidden from the properties panel (options.hideInPanel);
- the "Triton Accel" side panel opens and names the device;
- after a page reload the decision is shown again (node properties), still unclipped;
- a second run (mode off) replaces the text in the same widget;
- every text box is as tall as its text (no empty space under it: the classic canvas used to
  hand the node's spare height to the box) and as wide (nothing cut off on the right);
- Triton Accel Benchmark (tiny Flux, the test pack's conditioning and latent, repeats 1), queued
  with the side panel open: the panel shows the new chart by itself (an <img> of
  /triton_accel/benchmark.png, loaded), the node shows the whole report;
- /object_info carries the search aliases of the Linear, Patch and Benchmark nodes.
Screenshots go to tests/integration/artifacts/ (git-ignored; WEB_DISPLAY_SCREENSHOT_DIR to
change), one per stage: _graph, _panel, _properties, _reloaded, _benchmark_panel, _benchmark_node.
With ComfyUI 0.3.64 (frontend 1.27.10) only the classic run is checked.

Skipped, with the reason, without COMFYUI_PATH (conftest), without node, without a Chromium
(CHROMIUM, else chromium / chromium-browser / google-chrome on PATH) or without playwright-core
(PLAYWRIGHT_CORE: the package folder; else whatever `node` resolves from this folder, from
NODE_PATH or from the global npm root).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from it_workflows import family_spec

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "web_display.mjs"
ARTIFACTS = HERE / "artifacts"
WIDGET = "triton_accel_decision"
NODES2_FROM = (1, 47)  # Nodes 2.0 (Vue nodes) seen working with frontend 1.47.10; 1.27.10's preview is broken
EMPTY_SPACE_PX = 8  # a text box may exceed its text's own height by rounding, never by a line (15 px)
BENCHMARK = "TritonAccelBenchmark"
# What users type to find the nodes (checked where /object_info sends SEARCH_ALIASES: ComfyUI 0.4+).
WANTED_ALIASES = {
    "TritonAccelPatchLinear": {"linear", "matmul", "fp8", "int8", "speed", "triton"},
    "TritonAccelPatch": {"attention", "sage", "linear", "fp8", "int8", "speed", "triton"},
    BENCHMARK: {"benchmark", "speed test", "chart", "speed"},
}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


def _chromium() -> str | None:
    explicit = os.environ.get("CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _playwright_core(node: str) -> str | None:
    explicit = os.environ.get("PLAYWRIGHT_CORE")
    if explicit:
        return explicit if (Path(explicit) / "package.json").exists() else None
    env = dict(os.environ)
    npm = shutil.which("npm")
    if npm:
        try:
            root = subprocess.run([npm, "root", "-g"], capture_output=True, text=True, timeout=20).stdout.strip()
            if root:
                env["NODE_PATH"] = os.pathsep.join(p for p in (env.get("NODE_PATH", ""), root) if p)
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        proc = subprocess.run([node, "-p", "require.resolve('playwright-core/package.json')"], cwd=HERE,
                              env=env, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return str(Path(proc.stdout.strip()).parent) if proc.returncode == 0 and proc.stdout.strip() else None


def _tools():
    node = shutil.which("node")
    if not node:
        pytest.skip("node (Node.js) is not on PATH: the browser test drives Chromium through playwright-core")
    chromium = _chromium()
    if not chromium:
        pytest.skip("no Chromium (set CHROMIUM, or install chromium, e.g. `apt-get install chromium`)")
    pw = _playwright_core(node)
    if not pw:
        pytest.skip("playwright-core is not installed (`npm install playwright-core` somewhere, then "
                    "PLAYWRIGHT_CORE=<that folder>/node_modules/playwright-core)")
    return node, chromium, pw


def _layout_problems(where: str, shown: dict, nodes2: bool, max_height: float | None = 400) -> list[str]:
    problems = []
    if not shown.get("found"):
        return [f"{where}: no {WIDGET} widget (widgets {shown.get('widgets')})"]
    if not shown.get("visible"):
        problems.append(f"{where}: the text element is not visible (rect {shown.get('rect')})")
    if (shown.get("text") or "") != (shown.get("value") or ""):
        problems.append(f"{where}: the element shows {shown.get('text')!r}, the widget holds {shown.get('value')!r}")
    if shown.get("scrollHeight", 0) > shown.get("clientHeight", 0) + 2:
        problems.append(f"{where}: the text is cut off: box {shown.get('clientHeight')} px, text "
                        f"{shown.get('scrollHeight')} px")
    if shown.get("scrollWidth", 0) > shown.get("clientWidth", 0) + 2:
        problems.append(f"{where}: the text is cut off on the right: box {shown.get('clientWidth')} px, text "
                        f"{shown.get('scrollWidth')} px")
    if shown.get("clippedBy"):
        problems.append(f"{where}: an ancestor cuts the text off: {shown['clippedBy']}")
    if shown.get("offsetHeight", 0) > shown.get("contentHeight", 0) + EMPTY_SPACE_PX:
        problems.append(f"{where}: the text box is {shown['offsetHeight']} px tall for {shown.get('contentHeight')} px "
                        "of text (empty space under the text)")
    if not nodes2 and max_height and shown.get("rect") and shown["rect"][3] > max_height:
        problems.append(f"{where}: the text box grew to {shown['rect'][3]:.0f} px (a height feeding on itself)")
    if shown.get("serialize") is not False or shown.get("optionsSerialize") is not False:
        problems.append(f"{where}: the decision widget is serialized ({shown.get('serialize')}, "
                        f"options {shown.get('optionsSerialize')})")
    if shown.get("hideInPanel") is not True:
        problems.append(f"{where}: the decision would be listed as an input in the properties panel")
    return problems


def _benchmark_problems(bench: dict, nodes2: bool) -> list[str]:
    """The Benchmark stage: the report on the node, whole; the panel's chart, new and loaded."""
    if not bench:
        return ["the benchmark stage did not run (see steps)"]
    problems = []
    if bench.get("title") != "Triton Accel Benchmark":
        problems.append(f"benchmark node title {bench.get('title')!r}")
    shown = bench.get("node") or {}
    value = shown.get("value") or ""
    if not (value.startswith("Triton Accel benchmark") and re.search(r"recorded: \d+ attention shapes", value)):
        problems.append(f"the benchmark node does not show its report: {value[:300]!r}")
    boxes = bench.get("textBoxes") or []
    if len(boxes) != 1 or not boxes[0].startswith("Triton Accel benchmark"):
        problems.append(f"text boxes on the page after the graph was replaced (only the benchmark's may be): {boxes}")
    # A table of ~35 lines: taller than the decision's 400 px bound on its own.
    problems += _layout_problems("benchmark node", shown, nodes2, max_height=None)
    before, panel, status = bench.get("panelBefore") or {}, bench.get("panel") or {}, bench.get("status") or {}
    img = panel.get("img") or {}
    if not panel.get("found") or panel.get("created") in (None, "", bench.get("createdBefore")):
        problems.append(f"the open panel did not show the new benchmark by itself (before {before}, after "
                        f"{ {k: panel.get(k) for k in ('found', 'created', 'text')} }, server {status})")
    elif panel.get("created") != status.get("created"):
        problems.append(f"the panel shows the benchmark of {panel.get('created')}, the server has {status.get('created')}")
    if "/triton_accel/benchmark.png" not in (img.get("src") or "") or not img.get("complete") or not img.get("naturalWidth"):
        problems.append(f"the panel's chart is not a loaded <img> of /triton_accel/benchmark.png: {img or panel}")
    elif (img.get("rect") or [0, 0, 0, 0])[2] < 150:
        problems.append(f"the panel's chart is drawn {img['rect'][2]:.0f} px wide")
    return problems


def test_search_aliases_of_the_other_nodes(comfy):
    """The Linear, Patch and Benchmark nodes are found by what users type (attention/settings: test_routes)."""
    info = comfy.object_info()
    for node, wanted in WANTED_ALIASES.items():
        aliases = info[node].get("search_aliases")
        if aliases is None:
            assert comfy.version.startswith("0.3."), f"ComfyUI {comfy.version} sent no search_aliases for {node}"
            pytest.skip(f"ComfyUI {comfy.version} does not send SEARCH_ALIASES in /object_info")
        assert wanted <= set(aliases), (node, aliases)


def _frontend_required(comfy) -> tuple[int, ...] | None:
    """The frontend version this ComfyUI pins (/system_stats), before starting a browser."""
    try:
        text = comfy.get_json("/system_stats").get("system", {}).get("required_frontend_version") or ""
    except (RuntimeError, OSError, AttributeError):
        return None
    return _version(text) or None


@pytest.mark.parametrize("nodes2", [False, True], ids=["classic", "nodes2"])
def test_ui_in_browser(request, nodes2):
    """nodes2: the frontend's "Modern Node Design (Nodes 2.0)" (Vue nodes) instead of the canvas."""
    node, chromium, pw = _tools()
    comfy = request.getfixturevalue("comfy")  # the server starts only once the tools are there
    required = _frontend_required(comfy)
    if nodes2 and required and required < NODES2_FROM:  # saves the browser run (~40 s on 2 cores)
        pytest.skip(f"Nodes 2.0 checked from frontend {'.'.join(map(str, NODES2_FROM))} on; ComfyUI {comfy.version} "
                    f"pins frontend {'.'.join(map(str, required))}, whose early Vue nodes (no DOM widgets, widget "
                    "values not synced) are left out")
    model_file = comfy.models["flux"]["file"]
    spec = family_spec("flux", comfy.models)
    # Server-side user settings (the harness's temporary user folder): a first visit would open the
    # templates browser over the canvas; a returning user gets the default graph.
    for key, value in (("Comfy.TutorialCompleted", True), ("Comfy.VueNodes.Enabled", nodes2)):
        status, _ = comfy.request("POST", f"/settings/{key}", value)
        assert status == 200, f"POST /settings/{key} -> HTTP {status}"

    shots = Path(os.environ.get("WEB_DISPLAY_SCREENSHOT_DIR") or ARTIFACTS)
    shots.mkdir(parents=True, exist_ok=True)
    prefix = shots / f"ui_comfyui-{comfy.version}_{'nodes2' if nodes2 else 'classic'}"
    profile = Path(request.getfixturevalue("tmp_path")) / "chromium-profile"  # a fresh profile every run
    env = dict(os.environ, PLAYWRIGHT_CORE=pw, CHROMIUM=chromium)
    proc = subprocess.run([node, str(SCRIPT), comfy.url, str(prefix), str(profile), model_file, "fp16",
                           json.dumps({"cond": spec["cond"], "latent": spec["latent"]})], cwd=HERE,
                          env=env, capture_output=True, text=True, timeout=480)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"web_display.mjs failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(lines[-1])
    frontend = result.get("frontendVersion") or "0"
    print(f"\n[web display] frontend {frontend}, screenshots {result.get('shots')}, steps {result.get('steps')}")
    print("[web display] console warnings/errors (all files):\n  " + "\n  ".join(result.get("warnings") or ["none"]))
    details = json.dumps({k: result.get(k) for k in ("error", "steps", "first", "reloaded", "second", "panel",
                                                     "pageErrors", "ourConsole", "workflowWidgetsValues",
                                                     "promptInputs", "titles", "defaultSizes", "benchmark")},
                         indent=1)[:16000]
    console = "\n".join(result.get("console", [])[-40:])
    assert not result.get("error"), f"browser run failed:\n{details}\nconsole:\n{console}"
    ours = result.get("ourConsole") or [e for e in result.get("pageErrors", []) if "triton" in e.lower()]
    assert not ours, f"warnings or errors from our files (frontend {frontend}): {ours}"
    if nodes2 and _version(frontend) < NODES2_FROM:
        pytest.skip(f"Nodes 2.0 checked from frontend {'.'.join(map(str, NODES2_FROM))} on; frontend {frontend}'s "
                    "early Vue nodes (1.27.10: no DOM widgets, widget values not synced) are left out")

    problems = []
    if result.get("ourConsole"):
        problems.append(f"console warnings/errors from our files: {result['ourConsole']}")
    if [e for e in result.get("pageErrors", []) if "triton" in e.lower()]:
        problems.append(f"page errors from our files: {result['pageErrors']}")
    settings, patch = (result.get("first") or [{}, {}]) + [{}] * (2 - len(result.get("first") or []))
    if "TRITON_INTERPRET" not in (settings.get("value") or ""):
        problems.append(f"the Settings node did not get its decision: {settings.get('value')!r}")
    if not (patch.get("value") and re.search(r"attention: \d+ calls? served", patch["value"]) and " on cpu: " in patch["value"]):
        problems.append(f"the patch node did not get its label, decision and call counts: {patch.get('value')!r}")
    problems += _layout_problems("Settings node", settings, nodes2) + _layout_problems("patch node", patch, nodes2)
    values = result.get("workflowWidgetsValues") or []
    if any(isinstance(v, str) and "TRITON_INTERPRET" in v for v in values) or values[:2] != ["fp16", "auto"]:
        problems.append(f"the decision is saved into the workflow's widgets_values: {values}")
    if WIDGET in (result.get("promptInputs") or {}):
        problems.append(f"the decision text is sent to the server as an input of the node "
                        f"({sorted(result['promptInputs'])}): it enters the cache signature")
    if result.get("titles", [None, None])[1] != "Triton Accel Attention":
        problems.append(f"patch node title {result.get('titles')}")
    panel = result.get("panel") or {}
    if "cpu" not in (panel.get("devices") or []) or "Patched models" not in (panel.get("text") or ""):
        problems.append(f"the side panel did not open or does not name the device: {panel}")
    properties = (result.get("propertiesPanel") or {}).get("text")
    print(f"[web display] properties panel: {properties!r}"[:600])
    if not nodes2 and _version(frontend) >= NODES2_FROM and properties is None:
        problems.append("the properties panel could not be opened or read (see the _properties screenshot)")
    if properties is not None and re.search(r"\bdecision\b", properties):
        problems.append(f"the properties panel lists the decision: {properties[:500]!r}")
    reloaded = result.get("reloaded") or [{}, {}]
    if (reloaded[0].get("value") or "") != (settings.get("value") or "") or not reloaded[1].get("value"):
        problems.append(f"after a reload the decision is gone: {[r.get('value') for r in reloaded]}")
    problems += _layout_problems("Settings node after reload", reloaded[0], nodes2)
    problems += _layout_problems("patch node after reload", reloaded[1], nodes2)
    second = result.get("second") or {}
    if (second.get("widgets") or []).count(WIDGET) != 1:
        problems.append(f"after a second run the node has widgets {second.get('widgets')}")
    if not (second.get("value") and second["value"] != settings.get("value") and "off" in second["value"].lower()):
        problems.append(f"a second run (mode off) did not replace the text: {second.get('value')!r}")
    problems += _benchmark_problems(result.get("benchmark") or {}, nodes2)
    for name, path in (result.get("shots") or {}).items():
        if not Path(path).exists():
            problems.append(f"no {name} screenshot at {path}")
    assert not problems, "\n".join(["the UI runs, but:"] + [f"- {p}" for p in problems] + [details])
