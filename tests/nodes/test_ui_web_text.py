"""The web extension's node text after a run (web/js/triton_accel.js), run under Node.js where it
is installed: the calls line names each kind the node installed (attention and Linear on the
Patch node, Linear on the Linear node, 0 before any call), the server's speed-up line replaces
the one the node wrote, and times read as dates."""
import json
import shutil
import subprocess
from pathlib import Path

import pytest

JS = Path(__file__).resolve().parents[2] / "web" / "js" / "triton_accel.js"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="Node.js is not installed")


def _run(tmp_path, body: str):
    source = JS.read_text(encoding="utf-8")
    source = source.replace('import { app } from "../../scripts/app.js";',
                            "const app = { registerExtension() {} };")
    source = source.replace('import { api } from "../../scripts/api.js";', "const api = {};")
    script = tmp_path / "web_text.mjs"
    script.write_text(source + "\nconst out = (() => {" + body + "})();\nconsole.log(JSON.stringify(out));\n")
    done = subprocess.run([NODE, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


MODEL = {"label": "Flux", "speed_line": "speed-up: attention 1.40x where auto kept ours (3 of 3 shapes measured)",
         "kinds": {"attention": {"served": 40, "handed_back": 2, "paths": {"triton_fp16": 40}},
                   "step_graph": {"served": 0, "handed_back": 3, "paths": {}}}}
BASE = ("Flux on cuda:0: auto: Triton FP16/BF16\nLinear: FP8 W8A8; 50 Linear layers patched\n"
        "speed-up: not measured yet\nnext: run a generation\ninstalls: attention, Linear")


@pytest.mark.parametrize("kinds,expected", [
    (["attention", "linear"], "attention: 40 calls served (triton_fp16), 2 handed back; "
                              "Linear: 0 calls served, 0 handed back"),
    (["linear"], "Linear: 0 calls served, 0 handed back"),
    (["attention"], "attention: 40 calls served (triton_fp16), 2 handed back"),
], ids=["patch", "linear", "attention"])
def test_calls_line_on_every_patch_node(tmp_path, kinds, expected):
    assert _run(tmp_path, f"return countsLine({json.dumps(MODEL)}, {json.dumps(kinds)});") == expected


def test_node_text_after_a_run_has_one_speed_line_and_the_counts(tmp_path):
    text = _run(tmp_path, f"return patchedNodeText({json.dumps(BASE)}, {json.dumps(MODEL)}, ['attention', 'linear']);")
    lines = text.split("\n")
    assert [line for line in lines if line.startswith("speed-up:")] == [MODEL["speed_line"]]
    assert lines.index(MODEL["speed_line"]) < lines.index("installs: attention, Linear")
    assert lines[-2] == "--" and lines[-1].startswith("attention: 40 calls served")
    assert "next: run a generation" not in text  # measured now: that step is done
    again = _run(tmp_path, f"return patchedNodeText({json.dumps(text)}, {json.dumps(MODEL)}, ['attention']);")
    assert again.count("\n--\n") == 1 and again.count("speed-up:") == 1


def test_readable_time(tmp_path):
    out = _run(tmp_path, "return [readableTime('2025-12-07T18:04:00+00:00'), readableTime('junk'), readableTime(null)];")
    assert "2025" in out[0] and "T18" not in out[0] and out[1:] == ["junk", ""]
