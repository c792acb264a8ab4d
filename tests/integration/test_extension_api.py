"""Issue 14, extension API: examples/triton_accel_example_ext next to this pack in a real ComfyUI.

The example registers one attention (ext:example-sdpa) and one Linear (ext:example-linear);
both are checked here: listed by the status route, offered by the Settings node's dropdowns,
forced in a sampling run that they serve, and agreeing with the unpatched run.

A server of its own (this module's fixture, built with conftest's harness): the shared session
server must keep exactly our five modes in the Settings dropdown (test_attention_patch checks
that), and this one has the example pack installed as a third custom-node folder. ComfyUI
loads custom-node folders in os.listdir order (not sorted), so either pack may load first;
the test reads from the server log which way the registration went and checks it happened.
A fourth folder, a test-only pack that registers with a plain `import triton_accel` (no hook),
is named so that os.listdir lists it after our pack: that load order is covered whatever order
the example got.

Tolerance: the latent sampled with the extension forced against the unpatched run: relative L2
< 1e-4, the bound test_attention_patch uses for Wan (fp32 on the CPU on both sides; the
extension is PyTorch SDPA on [B, H, L, D] views, ComfyUI's attention the same SDPA or its
sub-quadratic attention: summation order only, ~1e-7 measured there; a 1 % attention error
moves this latent by 2.4e-3).

The Linear extension forced through TritonAccelPatchLinear (Settings `linear` =
ext:example-linear) is held to the same 1e-4: it is torch's F.linear in float32 on the float32
weight and input ComfyUI's own Linear uses on the CPU (the only difference: ComfyUI passes
the bias to F.linear too, the same call), and the default skip patterns leave the embedders,
head and modulation to ComfyUI exactly.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import conftest as harness
from it_workflows import linear_patch, patch, read_latent, rel_l2, sampling_workflow

EXAMPLE = harness.REPO / "examples" / "triton_accel_example_ext"
EXAMPLE_FOLDER = "triton_accel_example_ext"
LATE_PATH = "ext:late-probe"
LATE_PACK = """import torch.nn.functional as F

import triton_accel  # only works when Triton Accel loaded first: ImportError fails this pack's load

NODE_CLASS_MAPPINGS = {}


def sdpa(q, k, v, attn_mask=None, scale=None, is_causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal)


triton_accel.register_attention("late-probe", sdpa, constraints={"device_types": ["cpu"]}, pack="late_probe")
"""


def _add_late_pack(custom_nodes: Path) -> str:
    """A folder os.listdir lists after our pack's (ComfyUI loads in that order)."""
    for i in range(200):
        folder = custom_nodes / f"late_probe_{i}"
        folder.mkdir()
        listing = os.listdir(custom_nodes)
        if listing.index(folder.name) > listing.index(harness.PACK_FOLDER_NAME):
            (folder / "__init__.py").write_text(LATE_PACK)
            return folder.name
        folder.rmdir()
    pytest.fail(f"no folder name lists after {harness.PACK_FOLDER_NAME} here")
PATH = "ext:example-sdpa"
LINEAR_PATH = "ext:example-linear"
FAMILY = "wan21"
LATENT_TOL = 1e-4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    comfy_path = os.environ.get("COMFYUI_PATH")
    if not comfy_path:
        pytest.skip(harness.SKIP_REASON)
    comfy_path = Path(comfy_path).resolve()
    python = os.environ.get("COMFYUI_PYTHON", harness.sys.executable)
    env = harness._server_env()
    base = tmp_path_factory.mktemp("comfyui-ext-base")
    custom_nodes = base / "custom_nodes"
    custom_nodes.mkdir()
    os.symlink(harness.REPO, custom_nodes / harness.PACK_FOLDER_NAME, target_is_directory=True)
    shutil.copytree(harness.HERE / "testnodes", custom_nodes / harness.TESTNODES_FOLDER_NAME,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(EXAMPLE, custom_nodes / EXAMPLE_FOLDER, ignore=shutil.ignore_patterns("__pycache__"))
    _add_late_pack(custom_nodes)
    models_folder, manifest = harness._tiny_models(comfy_path, python, env)
    target = base / "models" / "diffusion_models"
    target.mkdir(parents=True)
    for entry in manifest:
        os.symlink(models_folder / entry["file"], target / entry["file"])
    comfy = harness.ComfyServer(comfy_path, base, python, env)
    comfy.version = harness._comfy_version(comfy_path)
    comfy.models = {e["family"]: e for e in manifest}
    comfy.load_order = [name for name in os.listdir(custom_nodes)]
    try:
        comfy.start(float(os.environ.get("COMFYUI_START_TIMEOUT", "180")))
        yield comfy
    finally:
        comfy.stop()
        print(f"\n[integration] ComfyUI {comfy.version} (extension API) log: {comfy.log_path}")


def _extension(status: dict) -> dict:
    found = [e for e in status.get("extensions", []) if e["path"] == PATH]
    assert found, f"{PATH} is not listed: {status.get('extensions')}"
    return found[0]


def _sample(server, chain, tag):
    prompt, save, _ = sampling_workflow(FAMILY, model_chain=chain, tag=tag, models=server.models)
    server.reset_stats()
    entry = server.run(prompt)
    return read_latent(server, entry, save), server.stats()


def test_example_pack_registers_whatever_the_load_order(server):
    log = server.log()
    assert "Triton Accel example extension: registered ext:example-sdpa" in log, server.log_tail(80)
    early = "Triton Accel is not loaded yet" in log
    if early:  # the example loaded first: our pack called its hook
        assert "registered the attention extensions of" in log and EXAMPLE_FOLDER in log
    print(f"\n[integration] custom_nodes listing order {server.load_order}: example loaded "
          f"{'before' if early else 'after'} Triton Accel")
    assert "extension API could not be published" not in log
    # The test-only pack listed after ours imported triton_accel directly.
    assert LATE_PATH in [e["path"] for e in server.get_json("/triton_accel/status")["extensions"]], \
        server.log_tail(80)


def test_status_route_lists_the_extension(server):
    status = server.get_json("/triton_accel/status")
    ext = _extension(status)
    assert status["extension_api_version"] == 1
    assert ext["pack"] == EXAMPLE_FOLDER and ext["priority"] == 10 and ext["lossy"] is False
    assert ext["label"] == "PyTorch SDPA (example pack)"
    c = ext["constraints"]
    assert c["device_types"] == ["cpu", "cuda"] and c["head_dims"] == [1, 256] and c["causal"] is False
    assert c["dtypes"] == ["bfloat16", "float16", "float32"]
    cpu = [d for d in ext["devices"] if d["device"] == "cpu"]
    assert cpu and cpu[0]["eligible"] is True and cpu[0]["refusal"] is None, ext["devices"]


def test_settings_dropdown_offers_the_extension(server):
    info = server.object_info("TritonAccelSettings")["TritonAccelSettings"]
    mode = info["input"]["required"]["mode"]
    options = mode[0] if isinstance(mode[0], list) else mode[1]["options"]
    assert options == ["auto", "fp8", "int8", "fp16", "off", PATH, LATE_PATH], options  # priority 10, then 0
    assert mode[-1]["triton_accel_labels"][PATH].startswith(f"{PATH} (PyTorch SDPA (example pack)")


def test_forced_extension_serves_sampling_and_matches_comfyui(server):
    reference, ref_stats = _sample(server, (), "ref")
    latent, stats = _sample(server, [patch(PATH)], "ext")
    served = stats["paths"].get(PATH, 0)
    assert served > 0, f"the extension served no call: {stats}"
    assert stats["calls"].get("original", 0) == 0, stats["reasons"]
    assert rel_l2(latent, reference) < LATENT_TOL
    status = server.get_json("/triton_accel/status")
    ext = _extension(status)
    assert ext["served"] >= served and ext["handed_back"] == {}
    cpu = next(d for d in ext["devices"] if d["device"] == "cpu")
    assert cpu["forced"] is True and cpu["chosen"] is True, cpu


def test_saved_workflow_with_an_extension_not_installed_still_runs(server):
    """A workflow saved on a machine with another extension: it validates, runs on ComfyUI's
    attention, and the reason is counted per call."""
    reference, _ = _sample(server, (), "ref2")
    latent, stats = _sample(server, [patch("ext:not-installed-here")], "missing")
    assert stats["paths"].get(PATH, 0) == 0 and stats["calls"].get("original", 0) > 0
    assert any(r.startswith("ext:not-installed-here asked, but no extension of that name is registered")
               for r in stats["reasons"]), stats["reasons"]
    # Attention and Linear are ComfyUI's; the Wan blocks' fused norms (on by default) still run,
    # differing from torch's LayerNorm / RMSNorm only in the order of fp32 row sums.
    assert rel_l2(latent, reference) < 1e-6


def test_invalid_mode_is_still_refused_by_validation(server):
    prompt, _, _ = sampling_workflow(FAMILY, model_chain=[patch("fp9")], tag="bad", models=server.models)
    with pytest.raises(harness.PromptError, match="not one of"):
        server.queue_prompt(prompt)


def test_side_panel_and_dropdown_show_the_extension(server, tmp_path):
    """The web extension in a real browser: the Extensions section of the side panel names the
    example (label, pack, priority, constraints, its use on the CPU) and the mode dropdown shows
    its label. Screenshot: tests/integration/artifacts/ui_comfyui-<version>_extension_panel.png."""
    from test_web_display import ARTIFACTS, _tools

    node, chromium, pw = _tools()
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / f"ui_comfyui-{server.version}_extension_panel.png"
    proc = subprocess.run([node, str(harness.HERE / "web_extension_panel.mjs"), server.url, str(shot),
                           str(tmp_path / "profile"), PATH],
                          env=dict(os.environ, PLAYWRIGHT_CORE=pw, CHROMIUM=chromium),
                          capture_output=True, text=True, timeout=240, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no result from the browser (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    seen = json.loads(lines[-1])
    assert seen["ok"], json.dumps(seen)[:4000]
    # As test_web_display: errors from our files only (ComfyUI 0.3.64's frontend 1.27 throws one of its own
    # from GraphView's onChange when a node is added by script).
    ours = seen["ourConsole"] + [e for e in seen["pageErrors"] if "triton" in e.lower()]
    assert not ours, seen
    assert PATH in seen["mode"]["values"] and seen["mode"]["label"].startswith(f"{PATH} (PyTorch SDPA"), seen["mode"]
    text = seen["box"]["text"]
    for words in (f"{PATH}: PyTorch SDPA (example pack) (from {EXAMPLE_FOLDER}), priority 10", "head dims 1–256",
                  "devices cpu, cuda", "cpu: "):
        assert words in text, text
    assert seen["box"]["rect"][2] > 100 and seen["box"]["rect"][3] > 40, seen["box"]


# ---- the Linear extension -------------------------------------------------------------------

def _linear_extension(status: dict) -> dict:
    found = [e for e in status.get("extensions", []) if e["path"] == LINEAR_PATH]
    assert found, f"{LINEAR_PATH} is not listed: {status.get('extensions')}"
    return found[0]


def test_linear_extension_is_listed_and_offered(server):
    status = server.get_json("/triton_accel/status")
    ext = _linear_extension(status)
    assert ext["kind"] == "linear" and _extension(status)["kind"] == "attention"
    assert ext["pack"] == EXAMPLE_FOLDER and ext["priority"] == 10 and ext["lossy"] is False
    c = ext["constraints"]
    assert c["device_types"] == ["cpu", "cuda"] and c["in_features_multiple_of"] == 8 and c["min_tokens"] == 1
    cpu = next(d for d in ext["devices"] if d["device"] == "cpu")
    # auto on the CPU runs none of our Linear methods, so it considers no extension there either.
    assert cpu["eligible"] is True and cpu["auto_considers_here"] is False, ext["devices"]
    info = server.object_info("TritonAccelSettings")["TritonAccelSettings"]
    linear = info["input"]["optional"]["linear"]
    options = linear[0] if isinstance(linear[0], list) else linear[1]["options"]
    assert options == ["auto", "fp8", "int8", "fp8_weight_only", "off", LINEAR_PATH], options
    assert linear[-1]["triton_accel_labels"][LINEAR_PATH].startswith(f"{LINEAR_PATH} (torch Linear")
    # The attention dropdown lists attention extensions only.
    mode = info["input"]["required"]["mode"]
    assert LINEAR_PATH not in (mode[0] if isinstance(mode[0], list) else mode[1]["options"])


def test_forced_linear_extension_serves_sampling_and_matches_comfyui(server):
    reference, _ = _sample(server, (), "linear-ref")
    latent, stats = _sample(server, [linear_patch(LINEAR_PATH, min_tokens=1)], "linear-ext")
    linear = stats["kinds"]["linear"]
    served = linear["paths"].get(LINEAR_PATH, 0)
    assert served > 0, f"the Linear extension served no call: {linear}"
    assert linear["served"] == served, linear  # nothing of ours ran
    # What went back is what the default skip patterns leave to ComfyUI, never a failure.
    assert all(r.startswith("name matches skip pattern") for r in linear["reasons"]), linear["reasons"]
    err = rel_l2(latent, reference)
    print(f"\n[integration] {LINEAR_PATH}: {served} calls served, {linear['handed_back']} handed back; "
          f"latent rel. L2 vs unpatched {err:.3e}")
    assert err < LATENT_TOL
    status = server.get_json("/triton_accel/status")
    ext = _linear_extension(status)
    assert ext["served"] >= served and ext["handed_back"] == {}, ext
    cpu = next(d for d in ext["devices"] if d["device"] == "cpu")
    assert cpu["forced"] is True and cpu["chosen"] is True, cpu
    # The stats reset route zeroes the extensions' counts too (the panel's numbers restart together).
    server.reset_stats()
    after = server.get_json("/triton_accel/status")
    assert _linear_extension(after)["served"] == 0 and _extension(after)["served"] == 0


def test_saved_workflow_with_a_linear_extension_not_installed_still_runs(server):
    reference, _ = _sample(server, (), "linear-ref2")
    latent, stats = _sample(server, [linear_patch("ext:not-installed-linear", min_tokens=1)], "linear-missing")
    linear = stats["kinds"]["linear"]
    assert linear["served"] == 0 and linear["handed_back"] > 0, linear
    assert any(r.startswith("ext:not-installed-linear asked, but no Linear extension of that name is registered")
               for r in linear["reasons"]), linear["reasons"]
    assert rel_l2(latent, reference) == 0.0


def test_side_panel_and_linear_dropdown_show_the_linear_extension(server, tmp_path):
    """The web extension in a real browser: the Extensions section shows the Linear extension
    as such (its kind, feature constraints) and the Settings node's `linear` dropdown shows its
    label. Screenshot: tests/integration/artifacts/ui_comfyui-<version>_linear_extension_panel.png."""
    from test_web_display import ARTIFACTS, _tools

    node, chromium, pw = _tools()
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / f"ui_comfyui-{server.version}_linear_extension_panel.png"
    proc = subprocess.run([node, str(harness.HERE / "web_extension_panel.mjs"), server.url, str(shot),
                           str(tmp_path / "profile"), LINEAR_PATH, "linear"],
                          env=dict(os.environ, PLAYWRIGHT_CORE=pw, CHROMIUM=chromium),
                          capture_output=True, text=True, timeout=240, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no result from the browser (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    seen = json.loads(lines[-1])
    assert seen["ok"], json.dumps(seen)[:4000]
    ours = seen["ourConsole"] + [e for e in seen["pageErrors"] if "triton" in e.lower()]
    assert not ours, seen
    assert LINEAR_PATH in seen["mode"]["values"], seen["mode"]
    assert seen["mode"]["label"].startswith(f"{LINEAR_PATH} (torch Linear"), seen["mode"]
    text = seen["box"]["text"]
    for words in (f"[Linear] {LINEAR_PATH}: torch Linear, fp32 accumulation (example pack) (from {EXAMPLE_FOLDER}), "
                  "priority 10", "in features 8–65536 (multiples of 8)", "min tokens 1", "devices cpu, cuda",
                  "cpu: "):
        assert words in text, text
