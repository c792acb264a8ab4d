"""The example workflows (example_workflows/*.json, frontend format) against the real ComfyUI.

ComfyUI's template browser lists a pack's example_workflows/ folder, so each file must open
cleanly in the frontend and queue once the user's model files are in place. Per workflow:

- format: the fields the frontend saves (last_node_id, last_link_id, nodes, links, version),
  unique ids, every link row matching the `link` / `links` of the two sockets it joins;
- layout: no two nodes (title bar included) overlap, widths hold the title, a Note says what
  the Triton Accel nodes do and that the Settings node may be left unconnected;
- wiring: each sampler's model comes through a Triton Accel patch node placed after the
  loader (or LoRA); every output of our nodes is connected;
- against /object_info: every node type exists (frontend-only ones such as Note are exempt;
  a missing one fails on ComfyUI 0.3.64 and later, the versions the workflows must load in,
  and skips the workflow on an older one), each socket and link has the type ComfyUI declares
  ("*" matches anything), every required input is linked or has a widget value, widgets_values
  has one value per widget (plus one per control_after_generate), our combos hold values of
  their lists, core combos hold strings (model files differ per user);
- the workflows are saved from ComfyUI 0.29 (WORKFLOWS_MADE_FOR). On an older ComfyUI (0.3.64)
  a core node may lack a trailing widget or output that 0.29 added: its frontend ignores
  widgets_values past its last widget and keeps a saved output it does not know as an
  unconnected socket, so those are accepted there (with a warning naming them) as long as no
  link uses such an output; our nodes must match exactly everywhere, and on 0.29 core nodes too;
- against /prompt: the workflow converted to an API prompt as the frontend does it is refused
  only for model files this server lacks ("value_not_in_list" on a file name of a core node).

The session server of conftest.py is reused: the checks take a few seconds.
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKFLOW_DIR = REPO / "example_workflows"
WORKFLOWS = sorted(WORKFLOW_DIR.glob("*.json"))
EXPECTED = {"flux_dev_triton_accel.json", "wan21_t2v_triton_accel.json", "sdxl_triton_accel.json",
            "benchmark_triton_accel.json"}

OUR_PREFIX = "TritonAccel"
PATCH_TYPES = {"TritonAccelPatch", "TritonAccelPatchAttention", "TritonAccelPatchLinear"}
SETTINGS_TYPE = "TritonAccelSettings"
# Nodes the frontend draws or resolves itself: never sent to the server, not in /object_info.
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode", "PrimitiveString", "PrimitiveInt",
                 "PrimitiveFloat", "PrimitiveBoolean"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
MODEL_FILE = re.compile(r".+\.(safetensors|sft|ckpt|pt|pth|bin|gguf)$", re.IGNORECASE)
TITLE_HEIGHT = 30  # LiteGraph draws the title bar above `pos`
CHAR_WIDTH = 7  # about the width of a title character at the frontend's 14 px font
SAMPLERS = {"KSampler", "KSamplerAdvanced", "SamplerCustom", "SamplerCustomAdvanced"}
# The ComfyUI the workflows are saved from, and the oldest one they must load in (the issue:
# "loads each in ComfyUI 0.29 and 0.3.64 and validates it against object_info").
WORKFLOWS_MADE_FOR = (0, 29, 0)
OLDEST_SUPPORTED = (0, 3, 64)


class VersionDifferenceWarning(UserWarning):
    """A core node of an older ComfyUI lacks a trailing widget or output of WORKFLOWS_MADE_FOR."""


# ---- reading a workflow ------------------------------------------------------------------------

def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _nodes(wf: dict) -> dict:
    return {n["id"]: n for n in wf["nodes"]}


def _links(wf: dict) -> dict:
    """{link id: (from node, from slot, to node, to slot, type)}."""
    return {row[0]: tuple(row[1:6]) for row in wf["links"]}


def _spec_type(spec) -> str:
    return "COMBO" if isinstance(spec[0], list) else str(spec[0])


def _spec_options(spec) -> dict:
    return spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}


def _combo_values(spec) -> list | None:
    if isinstance(spec[0], list):
        return spec[0]
    if spec[0] == "COMBO":
        return _spec_options(spec).get("options")
    return None


def _is_widget(spec) -> bool:
    options = _spec_options(spec)
    return _spec_type(spec) in WIDGET_TYPES and not options.get("forceInput")


def _ordered_inputs(info: dict) -> list:
    """[(name, spec, required)] in the order the frontend creates sockets and widgets."""
    out = []
    for section in ("required", "optional"):
        specs = info.get("input", {}).get(section, {})
        order = info.get("input_order", {}).get(section, list(specs))
        out += [(name, specs[name], section == "required") for name in order if name in specs]
    return out


def _widget_slots(info: dict) -> list:
    """[(input name or None, spec, required)]: one entry per value in widgets_values; None marks
    the control_after_generate value ("randomize", "fixed"...) the frontend keeps after a seed."""
    slots = []
    for name, spec, required in _ordered_inputs(info):
        if _is_widget(spec):
            slots.append((name, spec, required))
            if _spec_options(spec).get("control_after_generate"):
                slots.append((None, spec, required))
    return slots


def _types_match(output_type: str, input_type: str) -> bool:
    if "*" in (output_type, input_type):
        return True
    return output_type in input_type.split(",")


def _title(node: dict, object_info: dict) -> str:
    if node.get("title"):
        return node["title"]
    return object_info.get(node["type"], {}).get("display_name") or node["type"]


def _version(comfy) -> tuple | None:
    """(major, minor, patch) of the server's comfyui_version.py, None if unreadable."""
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", str(getattr(comfy, "version", "")))
    return tuple(int(x) for x in found.groups()) if found else None


def _older_than_made_for(comfy) -> bool:
    version = _version(comfy)
    return version is not None and version < WORKFLOWS_MADE_FOR


def _require_node_types(wf: dict, object_info: dict, comfy) -> None:
    missing = sorted({n["type"] for n in wf["nodes"]} - FRONTEND_ONLY - set(object_info))
    ours = [t for t in missing if t.startswith(OUR_PREFIX)]
    assert not ours, f"our node types are not registered in this ComfyUI: {ours}"
    if not missing:
        return
    version = _version(comfy)
    message = f"ComfyUI {getattr(comfy, 'version', '?')} has no core node {', '.join(missing)}"
    if version is not None and version < OLDEST_SUPPORTED:
        pytest.skip(f"{message} (the example workflows must load in ComfyUI "
                    f"{'.'.join(map(str, OLDEST_SUPPORTED))} and later)")
    pytest.fail(f"{message}: the workflow does not load in this ComfyUI")


# ---- the file itself -----------------------------------------------------------------------------

def test_expected_examples_are_there():
    names = {p.name for p in WORKFLOWS}
    assert EXPECTED <= names, f"missing: {sorted(EXPECTED - names)}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_frontend_format(path):
    wf = _load(path)
    for key in ("last_node_id", "last_link_id", "nodes", "links", "version"):
        assert key in wf, f"no {key!r}"
    ids = [n["id"] for n in wf["nodes"]]
    assert len(ids) == len(set(ids)), "duplicate node ids"
    assert wf["last_node_id"] >= max(ids)
    link_ids = [row[0] for row in wf["links"]]
    assert len(link_ids) == len(set(link_ids)), "duplicate link ids"
    assert not link_ids or wf["last_link_id"] >= max(link_ids)
    nodes, rows = _nodes(wf), _links(wf)
    for node in wf["nodes"]:
        for key in ("id", "type", "pos", "size", "flags", "order", "mode", "inputs", "outputs", "properties"):
            assert key in node, f"node {node.get('id')} has no {key!r}"
        assert len(node["pos"]) == 2 and len(node["size"]) == 2
        assert node["mode"] == 0, f"node {node['id']} ({node['type']}) is muted or bypassed"
    for lid, (src, src_slot, dst, dst_slot, ltype) in rows.items():
        assert src in nodes and dst in nodes, f"link {lid} joins a node that does not exist"
        output = nodes[src]["outputs"][src_slot]
        target = nodes[dst]["inputs"][dst_slot]
        assert lid in (output.get("links") or []), f"link {lid} is missing from node {src}'s output {output['name']}"
        assert target.get("link") == lid, f"node {dst}'s input {target['name']} does not hold link {lid}"
        assert output["type"] == ltype, f"link {lid}: type {ltype} but the output is {output['type']}"
    for node in wf["nodes"]:
        for slot, inp in enumerate(node["inputs"]):
            if inp.get("link") is not None:
                assert rows.get(inp["link"], (None,) * 4)[2:4] == (node["id"], slot), \
                    f"node {node['id']} input {inp['name']}: link {inp['link']} is not in the links table for it"
        for slot, out in enumerate(node["outputs"]):
            for lid in out.get("links") or []:
                assert rows.get(lid, (None, None))[:2] == (node["id"], slot), \
                    f"node {node['id']} output {out['name']}: link {lid} is not in the links table for it"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_layout_and_note(path):
    wf = _load(path)
    boxes = []
    for node in wf["nodes"]:
        (x, y), (w, h) = node["pos"], node["size"]
        boxes.append((node, x, y - TITLE_HEIGHT, x + w, y + h))
    for i, (a, ax0, ay0, ax1, ay1) in enumerate(boxes):
        for b, bx0, by0, bx1, by1 in boxes[i + 1:]:
            overlap = ax0 < bx1 and bx0 < ax1 and ay0 < by1 and by0 < ay1
            assert not overlap, f"node {a['id']} ({a['type']}) overlaps node {b['id']} ({b['type']})"
    notes = [n for n in wf["nodes"] if n["type"] == "Note"]
    assert notes, "no Note node"
    text = " ".join(str(v) for n in notes for v in n.get("widgets_values") or [])
    assert "Triton Accel" in text
    assert "Settings" in text and "unconnected" in text and "auto" in text, \
        "the Note should say that the Settings node may be left unconnected (auto)"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_wiring(path):
    wf = _load(path)
    nodes, links = _nodes(wf), _links(wf)

    def upstream_model(node):
        for inp in node["inputs"]:
            if inp["name"] == "model" and inp.get("link") is not None:
                return nodes[links[inp["link"]][0]]
        return None

    for node in wf["nodes"]:
        if node["type"].startswith(OUR_PREFIX):
            for out in node["outputs"]:
                assert out.get("links"), f"{node['type']} {node['id']}: output {out['name']} is not connected"
        if node["type"] in PATCH_TYPES:
            source = upstream_model(node)
            assert source is not None, f"{node['type']} {node['id']} has no model"
            assert source["type"] in PATCH_TYPES or "Loader" in source["type"] or "Lora" in source["type"], \
                f"{node['type']} {node['id']} takes its model from {source['type']}, not from a loader or LoRA"
        if node["type"] in SAMPLERS:
            chain, current = [], upstream_model(node)
            while current is not None and len(chain) < len(nodes):
                chain.append(current["type"])
                current = upstream_model(current)
            assert PATCH_TYPES & set(chain), f"{node['type']} {node['id']}'s model does not pass a patch node: {chain}"


# ---- against the running ComfyUI -----------------------------------------------------------------

@pytest.fixture(scope="module")
def object_info(comfy):
    return comfy.object_info()


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_matches_object_info(path, comfy, object_info):
    wf = _load(path)
    _require_node_types(wf, object_info, comfy)
    nodes, links = _nodes(wf), _links(wf)
    problems = []
    # Core nodes of an older ComfyUI may lack trailing widgets / outputs that 0.29 added.
    lenient = _older_than_made_for(comfy)
    differences = []
    for node in wf["nodes"]:
        if node["type"] in FRONTEND_ONLY:
            continue
        where = f"node {node['id']} ({node['type']})"
        info = object_info[node["type"]]
        ours = node["type"].startswith(OUR_PREFIX)
        width = node["size"][0]
        title = _title(node, object_info)
        if width < CHAR_WIDTH * len(title) + 40:
            problems.append(f"{where}: {width} px is too narrow for the title {title!r}")

        inputs = {name: (spec, required) for name, spec, required in _ordered_inputs(info)}
        sockets = {inp["name"]: inp for inp in node["inputs"]}
        for name, inp in sockets.items():
            if name not in inputs:
                problems.append(f"{where}: input {name!r} is not an input of the node")
                continue
            declared = _spec_type(inputs[name][0])
            if not _types_match(inp["type"], declared):
                problems.append(f"{where}: input {name!r} is {inp['type']}, ComfyUI says {declared}")
        for name, (spec, required) in inputs.items():
            # A required widget has its value in widgets_values (counted below).
            if required and not _is_widget(spec) and sockets.get(name, {}).get("link") is None:
                problems.append(f"{where}: required input {name!r} is not connected")

        outputs = list(info.get("output", []))
        saved_outputs = [o["type"] for o in node["outputs"]]
        extra_outputs = node["outputs"][len(outputs):]
        if (lenient and not ours and saved_outputs[:len(outputs)] == outputs
                and not any(o.get("links") for o in extra_outputs)):
            # The frontend keeps an unknown saved output as an unconnected socket.
            if extra_outputs:
                differences.append(f"{where}: unconnected outputs {[o['name'] for o in extra_outputs]} "
                                   f"that this ComfyUI does not declare")
        elif saved_outputs != outputs:
            problems.append(f"{where}: outputs {saved_outputs} != ComfyUI's {outputs}")

        slots = _widget_slots(info)
        values = node.get("widgets_values") or []
        required_count = len([s for s in slots if s[2]])
        if ours and len(values) != len(slots):
            problems.append(f"{where}: {len(values)} widget values for {len(slots)} widgets")
        elif not ours and lenient and len(values) > len(slots):
            # The frontend ignores widgets_values past its last widget.
            differences.append(f"{where}: widget values {values[len(slots):]!r} past the {len(slots)} "
                               f"widgets this ComfyUI declares (ignored by its frontend)")
        elif not ours and not required_count <= len(values) <= len(slots):
            # Core nodes gain optional widgets between ComfyUI versions; the frontend fills them in.
            problems.append(f"{where}: {len(values)} widget values, expected {required_count}..{len(slots)}")
        for (name, spec, _required), value in zip(slots, values):
            if name is None:
                continue
            combo = _combo_values(spec)
            if combo is not None:
                if not isinstance(value, str):
                    problems.append(f"{where}: combo {name!r} holds {value!r}, not a string")
                elif ours and value not in combo:
                    problems.append(f"{where}: {name!r} = {value!r} is not one of {combo}")
            elif _spec_type(spec) in ("INT", "FLOAT"):
                options = _spec_options(spec)
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    problems.append(f"{where}: {name!r} = {value!r} is not a number")
                elif not options.get("min", value) <= value <= options.get("max", value):
                    problems.append(f"{where}: {name!r} = {value!r} is out of range")
            elif _spec_type(spec) == "STRING" and not isinstance(value, str):
                problems.append(f"{where}: {name!r} = {value!r} is not a string")

    for lid, (src, src_slot, dst, dst_slot, ltype) in links.items():
        source, target = nodes[src], nodes[dst]
        if source["type"] in FRONTEND_ONLY or target["type"] in FRONTEND_ONLY:
            continue
        declared_outputs = object_info[source["type"]].get("output", [])
        if src_slot >= len(declared_outputs):
            problems.append(f"link {lid}: {source['type']} has no output {src_slot} in this ComfyUI "
                            f"(outputs {declared_outputs})")
            continue
        out_type = declared_outputs[src_slot]
        in_name = target["inputs"][dst_slot]["name"]
        spec = dict((n, s) for n, s, _ in _ordered_inputs(object_info[target["type"]])).get(in_name)
        in_type = _spec_type(spec) if spec else "?"
        if not (_types_match(out_type, ltype) and _types_match(ltype, in_type)):
            problems.append(f"link {lid}: {source['type']} output {src_slot} ({out_type}) -> "
                            f"{target['type']}.{in_name} ({in_type}) as {ltype}")
    for difference in differences:
        warnings.warn(f"ComfyUI {comfy.version}: {difference}", VersionDifferenceWarning)
    assert not problems, "\n".join(problems)


def to_api_prompt(wf: dict, object_info: dict) -> dict:
    """The API prompt the frontend would queue: widget values by input name (control values
    dropped), links as [node id, slot], frontend-only nodes left out."""
    nodes, links = _nodes(wf), _links(wf)
    prompt = {}
    for node in wf["nodes"]:
        if node["type"] in FRONTEND_ONLY or node.get("mode", 0) != 0:
            continue
        inputs = {}
        for (name, _spec, _required), value in zip(_widget_slots(object_info[node["type"]]),
                                                    node.get("widgets_values") or []):
            if name is not None:
                inputs[name] = value
        for inp in node["inputs"]:
            if inp.get("link") is not None:
                src, src_slot = links[inp["link"]][:2]
                if nodes[src]["type"] not in FRONTEND_ONLY:
                    inputs[inp["name"]] = [str(src), src_slot]
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs,
                                   "_meta": {"title": _title(node, object_info)}}
    return prompt


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_prompt_is_refused_only_for_missing_model_files(path, comfy, object_info):
    wf = _load(path)
    _require_node_types(wf, object_info, comfy)
    prompt = to_api_prompt(wf, object_info)
    outputs = [i for i, n in prompt.items() if object_info[n["class_type"]].get("output_node")]
    # The Settings node is an output node that needs no model: left out of the targets so that
    # nothing of the workflow runs here (a ComfyUI without partial_execution_targets runs it).
    targets = [i for i in outputs if prompt[i]["class_type"] != SETTINGS_TYPE]
    assert targets, "no output node besides Settings"
    status, payload = comfy.request("POST", "/prompt", {"prompt": prompt, "client_id": comfy.client_id,
                                                         "partial_execution_targets": targets})
    assert isinstance(payload, dict), f"HTTP {status}: {payload}"
    node_errors = payload.get("node_errors") or {}
    if status == 200:
        comfy.wait(payload["prompt_id"], 120)
        failed = {o for e in node_errors.values() for o in e.get("dependent_outputs", [])}
        ran = [prompt[o]["class_type"] for o in outputs if o not in failed]
        assert set(ran) <= {SETTINGS_TYPE}, f"outputs that validated without model files: {ran}"
    else:
        assert status == 400, f"HTTP {status}: {payload}"
        assert payload["error"]["type"] == "prompt_outputs_failed_validation", payload["error"]
    unexpected = []
    missing_files = set()
    for node_id, entry in node_errors.items():
        class_type = entry.get("class_type") or prompt[node_id]["class_type"]
        for error in entry.get("errors", []):
            received = (error.get("extra_info") or {}).get("received_value")
            if (error.get("type") == "value_not_in_list" and not class_type.startswith(OUR_PREFIX)
                    and isinstance(received, str) and MODEL_FILE.match(received)):
                missing_files.add(received)
            else:
                unexpected.append(f"{class_type} {node_id}: {error.get('type')}: {error.get('message')}: "
                                  f"{error.get('details')}")
    assert not unexpected, "\n".join(unexpected)
    assert missing_files, "the server was expected to lack the workflow's model files"
