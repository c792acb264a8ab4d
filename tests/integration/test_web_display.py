"""The Settings node shows its decision on the node, in a real browser (web/js/triton_accel.js).

A headless Chromium, driven by playwright-core from Node (web_display.mjs beside this file),
opens the harness server's page, adds one TritonAccelSettings node (mode fp16), queues it and
reads the node's `triton_accel_decision` widget. On the CPU with TRITON_INTERPRET=1 (the
harness sets it) the fp16 decision names TRITON_INTERPRET.

Skipped, with the reason, without COMFYUI_PATH (conftest), without node, without a Chromium
(CHROMIUM, else chromium / chromium-browser / google-chrome on PATH) or without playwright-core
(PLAYWRIGHT_CORE: the package folder; else whatever `node` resolves from this folder, from
NODE_PATH or from the global npm root). The screenshot goes to WEB_DISPLAY_SCREENSHOT_DIR
(default: the test's temporary folder); its path is printed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "web_display.mjs"
WIDGET = "triton_accel_decision"
NODES2_FROM = (1, 47)  # Nodes 2.0 (Vue nodes) seen working with frontend 1.47.10; 1.27.10's preview is broken


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


@pytest.mark.parametrize("nodes2", [False, True], ids=["classic", "nodes2"])
def test_settings_node_shows_decision_in_browser(request, tmp_path, nodes2):
    """nodes2: the frontend's "Modern Node Design (Nodes 2.0)" (Vue nodes) instead of the canvas."""
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
    comfy = request.getfixturevalue("comfy")  # the server starts only once the tools are there

    # Server-side user settings (the harness's temporary user folder): a first visit would open the
    # templates browser over the canvas; a returning user gets the default graph.
    for key, value in (("Comfy.TutorialCompleted", True), ("Comfy.VueNodes.Enabled", nodes2)):
        status, _ = comfy.request("POST", f"/settings/{key}", value)
        assert status == 200, f"POST /settings/{key} -> HTTP {status}"

    shots = Path(os.environ.get("WEB_DISPLAY_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    shot = shots / f"settings_node_comfyui-{comfy.version}_{'nodes2' if nodes2 else 'classic'}.png"
    profile = tmp_path / "chromium-profile"  # a fresh profile every run
    env = dict(os.environ, PLAYWRIGHT_CORE=pw, CHROMIUM=chromium)
    proc = subprocess.run([node, str(SCRIPT), comfy.url, str(shot), str(profile), "fp16"], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"web_display.mjs failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(lines[-1])
    print(f"\n[web display] screenshot: {shot}")
    print(f"[web display] frontend {result.get('frontendVersion')}, widgets {result.get('widgets')}, "
          f"steps {result.get('steps')}")
    print(f"[web display] {WIDGET} = {result.get('value')!r}; textarea {result.get('domText')}")
    details = json.dumps({k: result.get(k) for k in ("error", "steps", "widgets", "value", "domText", "pageErrors",
                                                     "queued", "promptInputs", "second")}, indent=1)
    console = "\n".join(result.get("console", [])[-40:])
    assert not result.get("error"), f"browser run failed:\n{details}\nconsole:\n{console}"
    frontend = result.get("frontendVersion") or "0"
    if nodes2 and _version(frontend) < NODES2_FROM:
        pytest.skip(f"Nodes 2.0 checked from frontend {'.'.join(map(str, NODES2_FROM))} on; frontend {frontend}'s "
                    "early Vue nodes (1.27.10: no DOM widgets, widget values not synced) are left out")
    value = result.get("value")
    assert isinstance(value, str) and "TRITON_INTERPRET" in value, (
        f"the node's {WIDGET} widget did not get the decision text:\n{details}\nconsole:\n{console}")
    assert shot.exists()

    # The text is there; now how it is shown and what it does to the workflow (all problems at once).
    problems = []
    dom = result.get("domText")
    if not (dom and dom["visible"]):
        problems.append("no visible textarea on the page holds the decision text")
    else:
        if not dom["readOnly"]:
            problems.append("the decision textarea can be edited (classic: inputEl.readOnly; Nodes 2.0: "
                            "widget.options.read_only)")
        if not nodes2 and dom["rect"][3] > 300:  # a 4-line text; a min height feeding on itself grows forever
            problems.append(f"the decision textarea grew to {dom['rect'][3]:.0f} px for a 4-line text")
        if not nodes2 and dom["scrollHeight"] > dom["clientHeight"] + 2:
            problems.append(f"the node cuts the text off: textarea {dom['clientHeight']} px high, text "
                            f"{dom['scrollHeight']} px (the widget's min height does not follow the text)")
    if result.get("serialize") is not False or result.get("workflowWidgetsValues") != ["fp16", "auto"]:
        problems.append(f"the decision is saved into the workflow: widgets_values "
                        f"{result.get('workflowWidgetsValues')} (widget.serialize = false)")
    if WIDGET in (result.get("promptInputs") or {}):
        problems.append(f"the decision text is sent to the server as an input of the node "
                        f"({sorted(result['promptInputs'])}): it enters the cache signature, so the next run "
                        "re-executes this node and everything downstream (widget.options.serialize = false)")
    if [e for e in result.get("pageErrors", []) if "triton_accel" in e.lower()]:
        problems.append("page errors from triton_accel.js")
    second = result.get("second") or {}  # run again with mode off: the same widget gets the new text
    print(f"[web display] after a second run with mode off: {second.get('value')!r}")
    if (second.get("widgets") or []).count(WIDGET) != 1:
        problems.append(f"after a second run the node has widgets {second.get('widgets')}")
    if not (second.get("value") and second["value"] != value and "off" in second["value"].lower()):
        problems.append(f"a second run (mode off) did not replace the text: {second.get('value')!r}")
    assert not problems, "\n".join(["the decision shows, but:"] + [f"- {p}" for p in problems]
                                    + [f"screenshot: {shot}", details])
