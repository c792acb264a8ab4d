// Triton Accel in ComfyUI's frontend, through its public extension API only (app, api,
// registerExtension, addDOMWidget, extensionManager.registerSidebarTab):
// - the decision text of the Settings / patch nodes, sized to its lines in the classic canvas
//   and in Nodes 2.0, kept with the workflow (node.properties) so a reload shows it again;
// - mode labels that say what each stored value means (fp16 runs FP16 and BF16);
// - after each run, the calls served / handed back of each patched model on its Patch, Attention and
//   Linear nodes, with its speed-up line;
// - the "Triton Accel" side panel: /triton_accel/status (a header, devices, one entry per loaded model,
//   auto's measurements, other packs' attention and Linear extensions, install health, the last benchmark chart).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const WIDGET = "triton_accel_decision";
const PROPERTY = "triton_accel_decision"; // saved in the workflow, shown again after a reload
const MODEL_PROPERTY = "triton_accel_model"; // the patched model's label, to show its call counts
const KINDS_PROPERTY = "triton_accel_kinds"; // what the node installed: "attention", "linear"
const KIND_TITLES = { attention: "attention", linear: "Linear" };
const STATUS_URL = "/triton_accel/status";
const TAB_ID = "triton-accel";
const NODE_PREFIX = "TritonAccel";

const STYLE = `
.triton-accel-decision { box-sizing: border-box; width: 100%; padding: 4px 6px; margin: 0;
  font: 11px/1.35 ui-monospace, Menlo, Consolas, monospace; white-space: pre-wrap; overflow-wrap: anywhere;
  color: var(--input-text, #ddd); background: var(--comfy-input-bg, #222); border-radius: 4px;
  opacity: 0.9; overflow: hidden; user-select: text; }
/* A table (the benchmark report): rows wrap only where the node is narrower than them, at spaces. */
.triton-accel-decision.triton-accel-table { overflow-wrap: normal; }
.triton-accel-panel { padding: 8px 10px; font-size: 12px; line-height: 1.4; overflow-y: auto; height: 100%;
  box-sizing: border-box; color: var(--fg-color, #ddd); }
.triton-accel-panel h2 { font-size: 15px; margin: 0 0 2px; }
.triton-accel-panel h3 { font-size: 13px; margin: 12px 0 4px; }
.triton-accel-panel .ta-muted { opacity: 0.7; }
.triton-accel-panel .ta-box { border: 1px solid var(--border-color, #444); border-radius: 4px; padding: 6px;
  margin: 4px 0; }
.triton-accel-panel table { border-collapse: collapse; width: 100%; font-size: 11px; table-layout: fixed;
  overflow-wrap: anywhere; }
.triton-accel-panel td, .triton-accel-panel th { border-bottom: 1px solid var(--border-color, #444);
  padding: 2px 4px; text-align: left; vertical-align: top; }
.triton-accel-panel .ta-fix { font-family: ui-monospace, monospace; font-size: 11px; margin: 2px 0; }
.triton-accel-panel img { max-width: 100%; margin-top: 4px; display: block; }
.triton-accel-panel button { margin: 4px 0; }
.triton-accel-floating { position: fixed; right: 12px; bottom: 12px; z-index: 1000; }
.triton-accel-floating .triton-accel-panel { width: 380px; max-height: 70vh; background: var(--comfy-menu-bg, #333);
  border: 1px solid var(--border-color, #444); border-radius: 6px; margin-bottom: 6px; }
`;

function injectStyle() {
    if (document.getElementById("triton-accel-style")) return;
    const style = document.createElement("style");
    style.id = "triton-accel-style";
    style.textContent = STYLE;
    document.head.appendChild(style);
}

// ---- the decision text on a node -----------------------------------------------------------

// Nodes whose text is a table (the benchmark report): the node as wide as the widest line, up to
// MAX_TABLE_WIDTH px (wrapped table rows are hard to read); past that, lines wrap at spaces.
const TABLE_NODES = new Set(["TritonAccelBenchmark"]);
const MIN_NODE_WIDTH = 320;
const MAX_TABLE_WIDTH = 900;
const IMAGE_ROOM = 260; // classic canvas: space kept under the text for a node's image preview

// Size the text needs: measured on an invisible copy (at `width` px for the height), so the
// answer never depends on the size the frontend gave the element last time (no growth feeding
// on itself).
function textSize(element, width) {
    const copy = element.cloneNode(true);
    Object.assign(copy.style, { position: "absolute", visibility: "hidden", left: "-10000px", top: "0",
                                height: "auto", width: width === undefined ? "max-content" : `${Math.max(60, width)}px` });
    document.body.appendChild(copy);
    const size = [copy.scrollWidth, copy.scrollHeight];
    copy.remove();
    return size;
}

function isTableNode(node) {
    return TABLE_NODES.has(String(node.comfyClass ?? node.type ?? ""));
}

function decisionWidget(node) {
    let widget = node.widgets?.find((w) => w.name === WIDGET);
    if (widget) return widget;
    const element = document.createElement("div");
    element.className = "triton-accel-decision" + (isTableNode(node) ? " triton-accel-table" : "");
    element.dataset.tritonAccel = "decision";
    let text = "";
    // Classic canvas: the row is exactly as tall as the text at the node's current width, plus the
    // margin the frontend keeps above and below a DOM widget. Without a maximum the frontend hands
    // the node's spare height to the text box (empty space under the text).
    const rowHeight = () => textSize(element, (node.size?.[0] ?? MIN_NODE_WIDTH) - 20)[1] + 2 * (widget?.margin ?? 10);
    widget = node.addDOMWidget(WIDGET, "triton_accel_text", element, {
        // Display only: out of the saved widgets_values and out of the prompt (otherwise the text
        // becomes an input of the node, the cache signature changes and everything re-runs).
        serialize: false,
        hideInPanel: true, // not an editable input in the properties panel
        getValue: () => text,
        setValue: (value) => {
            text = String(value ?? "");
            element.textContent = text;
        },
        getMinHeight: rowHeight,
        getMaxHeight: rowHeight,
    });
    widget.serialize = false;
    widget.label = "decision";
    return widget;
}

// imageRoom: px kept under the text for an image preview the node shows (0: none). Without
// one the node's height follows its text (shrinks too), as Nodes 2.0 lays it out.
function showText(node, text, imageRoom = 0) {
    injectStyle();
    const widget = decisionWidget(node);
    widget.value = text;
    widget.options?.setValue?.(text); // frontends whose value setter does not call options.setValue
    node.properties = node.properties ?? {};
    node.properties[PROPERTY] = text;
    const fit = () => {
        const [width, height] = node.size ?? [MIN_NODE_WIDTH, 100];
        let newWidth = Math.max(width, MIN_NODE_WIDTH);
        if (isTableNode(node) && widget.element) {
            newWidth = Math.max(newWidth, Math.min(MAX_TABLE_WIDTH, textSize(widget.element)[0] + 24));
        }
        if (newWidth !== width) node.setSize?.([newWidth, height]); // the text height depends on the width
        const needed = node.computeSize?.()?.[1] ?? height;
        // Nodes 2.0 lays the image preview out itself (spare height there would stretch the text box).
        const room = window.LiteGraph?.vueNodesMode ? 0 : imageRoom;
        node.setSize?.([newWidth, room ? Math.max(height, needed + room) : needed]);
        node.setDirtyCanvas?.(true, true);
        app.graph?.setDirtyCanvas?.(true, true);
    };
    fit();
    requestAnimationFrame(fit); // again once the element is laid out
}

function messageText(message) {
    const text = message?.text;
    if (!text) return null;
    return Array.isArray(text) ? text.join("\n") : String(text);
}

// ---- patched models: their call counts under the decision ----------------------------------

// The node's calls line: served / handed back for each kind the node installed (attention,
// Linear: 0 until a call arrives), on the Patch, Attention and Linear nodes alike.
function countsLine(model, kinds) {
    const calls = (n) => `${n} call${n === 1 ? "" : "s"}`;
    const parts = (kinds?.length ? kinds : ["attention", "linear"]).map((kind) => {
        const c = model?.kinds?.[kind] ?? { served: 0, handed_back: 0, paths: {} };
        const paths = Object.keys(c.paths ?? {}).join(", ");
        return `${KIND_TITLES[kind] ?? kind}: ${calls(c.served)} served${paths ? ` (${paths})` : ""}, ` +
            `${c.handed_back} handed back`;
    });
    return parts.join("; ");
}

// The node's text after a run: its own lines, the speed-up line the server has now for the model
// (replacing the one written when the node ran) and the calls line.
function patchedNodeText(base, model, kinds) {
    const lines = String(base ?? "").split("\n--\n")[0].split("\n");
    const speed = model?.speed_line;
    const measured = speed && speed !== "speed-up: not measured yet";
    // The next step "run a generation ... to measure" is done once the server has a speed-up.
    const own = speed ? lines.filter((line) => !line.startsWith("speed-up:") &&
                                               !(measured && line.startsWith("next: run a generation"))) : lines;
    const at = own.findIndex((line) => line.startsWith("next:") || line.startsWith("installs:"));
    const extra = speed ? [speed] : [];
    if (at < 0) own.push(...extra);
    else own.splice(at, 0, ...extra);
    return `${own.join("\n")}\n--\n${countsLine(model, kinds)}`;
}

async function fetchStatus() {
    const response = await api.fetchApi(STATUS_URL, { cache: "no-store" });
    if (!response.ok) throw new Error(`${STATUS_URL}: HTTP ${response.status}`);
    return response.json();
}

async function refreshPatchedNodes(status) {
    const models = new Map((status.models ?? []).map((m) => [m.label, m]));
    for (const node of app.graph?.nodes ?? []) {
        const label = node.properties?.[MODEL_PROPERTY];
        const model = label && models.get(label);
        if (!model) continue;
        showText(node, patchedNodeText(node.properties[PROPERTY], model, node.properties[KINDS_PROPERTY]));
    }
}

// ---- the side panel ------------------------------------------------------------------------

function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
}

function table(head, rows) {
    const t = el("table");
    const tr = el("tr");
    head.forEach((h) => tr.appendChild(el("th", h)));
    t.appendChild(tr);
    for (const row of rows) {
        const r = el("tr");
        row.forEach((cell) => r.appendChild(el("td", cell)));
        t.appendChild(r);
    }
    return t;
}

function renderDevices(root, status) {
    root.appendChild(el("h3", "Devices"));
    for (const d of status.devices ?? []) {
        const box = el("div", null, "ta-box");
        box.dataset.tritonAccelDevice = d.device;
        box.appendChild(el("div", `${d.device}: ${d.summary}`));
        box.appendChild(el("div", `attention, auto: ${d.auto?.label} — ${d.auto?.reason}` +
                                  (d.auto?.code ? ` [${d.auto.code}]` : "")));
        if (d.linear_auto) box.appendChild(el("div", `Linear, auto: ${d.linear_auto.reason}`));
        for (const u of d.in_use ?? []) {
            box.appendChild(el("div", `mode ${u.mode} in use: ${u.label} — ${u.reason}` +
                                      (u.code ? ` [${u.code}]` : ""), u.overridden ? "ta-overridden" : undefined));
        }
        box.appendChild(el("div", `self-check: ${d.selfcheck}`, "ta-muted"));
        root.appendChild(box);
    }
}

// One box per loaded model: its calls per kind, its speed-up line and why calls were handed
// back, each reason once (in plain words; the recorded text is the tooltip).
function renderModels(root, status) {
    root.appendChild(el("h3", "Patched models"));
    const models = status.models ?? [];
    if (!models.length) {
        root.appendChild(el("div", "No model patched since the server started.", "ta-muted"));
        return;
    }
    for (const m of models) {
        const box = el("div", null, "ta-box");
        box.dataset.tritonAccelModel = m.label;
        box.appendChild(el("div", m.label));
        const kinds = Object.entries(m.kinds ?? {});
        if (kinds.length) {
            box.appendChild(table(["", "served", status.handed_back_label ?? "handed back"],
                                  kinds.map(([kind, c]) => [c.kind_label ?? kind, c.served, c.handed_back])));
        } else {
            box.appendChild(el("div", "no calls yet", "ta-muted"));
        }
        if (m.speed_line) box.appendChild(el("div", m.speed_line));
        const seen = new Map();
        for (const [kind, c] of kinds) {
            for (const r of c.reasons ?? []) {
                const key = `${c.kind_label ?? kind}: ${r.plain ?? r.reason}`;
                const entry = seen.get(key) ?? { calls: 0, raw: r.reason };
                entry.calls += r.calls;
                seen.set(key, entry);
            }
        }
        if (seen.size) box.appendChild(el("div", "Why calls were handed back:", "ta-muted"));
        for (const [text, { calls, raw }] of seen) {
            const line = el("div", `${text} (${calls} call${calls === 1 ? "" : "s"})`, "ta-fix");
            line.title = raw;
            box.appendChild(line);
        }
        root.appendChild(box);
    }
}

function renderMeasurements(root, status) {
    const rows = status.measurements?.rows ?? [];
    root.appendChild(el("h3", "auto's measurements"));
    const original = status.measurements?.original_label ?? "ComfyUI";
    if (!rows.length) {
        root.appendChild(el("div", status.measurements?.note || "None yet.", "ta-muted"));
    } else {
        root.appendChild(table(["shape class", "kept", "timings (ms)", `vs ${original}`], rows.map((r) => [
            r.shape_class, r.choice === "original" ? original : r.choice,
            Object.entries(r.timings_ms ?? {}).map(([k, v]) => `${k === "original" ? "ComfyUI" : k} ${v}`).join(", "),
            r.speedup_vs_original ? `${r.speedup_vs_original}×` : "",
        ])));
    }
    const linear = status.linear_measurements ?? [];
    if (linear.length) {
        root.appendChild(el("div", "Linear call classes (ms per call as the step issues it):", "ta-muted"));
        root.appendChild(table(["call class", "step", "kept", "ours", "ComfyUI", "speed-up"], linear.map((r) => [
            r.shape_class, r.mode, r.ours ? "ours" : "ComfyUI", r.ours_ms, r.theirs_ms,
            r.ours_ms > 0 ? `${(r.theirs_ms / r.ours_ms).toFixed(2)}×` : "",
        ])));
    }
}

// Other packs' attention and Linear implementations (docs/extension_api.md): one box each,
// with its kind, its constraints, its priority and, per device, whether it may run there and
// whether it is used.
function extensionConstraintsText(x) {
    const c = x.constraints ?? {};
    const caps = c.min_capability || c.max_capability ?
        `, capability ${[c.min_capability, c.max_capability].map((v) => (v ? v.join(".") : "any")).join("–")}` : "";
    const devices = `devices ${(c.device_types ?? []).join(", ")}` + (c.vendors ? ` (${c.vendors.join(", ")})` : "") +
        `${caps}, ${(c.dtypes ?? []).join("/")}`;
    if (x.kind === "linear") {
        const features = (name) => {
            const range = c[name] ?? [];
            const multiple = c[`${name}_multiple_of`] ?? 1;
            return `${name.replace("_", " ")} ${range.join("–")}` + (multiple > 1 ? ` (multiples of ${multiple})` : "");
        };
        return `${devices}, ${features("in_features")}, ${features("out_features")}, min tokens ${c.min_tokens ?? 1}`;
    }
    return `${devices}, head dims ${(c.head_dims ?? []).join("–")}, ` +
        `masks ${(c.masks ?? []).join("/")}${c.gqa ? ", GQA" : ""}${c.causal ? ", causal" : ""}`;
}

function extensionUseText(x, d) {
    if (!d.eligible) return `cannot run: ${d.refusal}`;
    if (d.forced) return "forced by a Settings node";
    if (x.kind === "linear") {
        return d.auto_considers_here ? "auto considers it by priority next to ours (checked per layer)" :
            `may run; auto does not use Linear extensions on this device (Settings linear ${x.path} forces it)`;
    }
    if (d.measured_shape_classes) return `auto kept it at ${d.kept_shape_classes} of ${d.measured_shape_classes} shape classes`;
    if (d.auto_times_here === false) return `may run; auto does not time on this device (mode ${x.path} forces it)`;
    return "not timed by auto yet";
}

function renderExtensions(root, status) {
    const list = status.extensions ?? [];
    root.appendChild(el("h3", "Extensions"));
    if (!list.length) {
        root.appendChild(el("div", "No other pack registered an attention or Linear implementation.", "ta-muted"));
        return;
    }
    for (const x of list) {
        const box = el("div", null, "ta-box");
        box.dataset.tritonAccelExtension = x.path;
        const kind = x.kind === "linear" ? "Linear" : "attention";
        box.dataset.tritonAccelExtensionKind = x.kind ?? "attention";
        box.appendChild(el("div", `[${kind}] ${x.path}: ${x.label} (from ${x.pack}), priority ${x.priority}` +
                                  (x.lossy ? ", lossy" : "")));
        box.appendChild(el("div", extensionConstraintsText(x), "ta-muted"));
        const handed = Object.entries(x.handed_back ?? {});
        box.appendChild(el("div", `${x.served} calls served, ${handed.reduce((n, [, c]) => n + c, 0)} handed back`));
        for (const [reason, calls] of handed) box.appendChild(el("div", `${calls}× ${reason}`, "ta-fix"));
        for (const d of x.devices ?? []) box.appendChild(el("div", `${d.device}: ${extensionUseText(x, d)}`));
        root.appendChild(box);
    }
}

function renderInstall(root, status) {
    const install = status.install ?? {};
    root.appendChild(el("h3", "Install health"));
    if (!install.found) {
        root.appendChild(el("div", `${install.why ?? "no report"}: ${install.hint ?? ""}`, "ta-muted"));
        return;
    }
    root.appendChild(el("div", install.verdict ?? ""));
    if (!install.fixes?.length) root.appendChild(el("div", "Nothing left to fix.", "ta-muted"));
    for (const fix of install.fixes ?? []) root.appendChild(el("div", fix, "ta-fix"));
    if (install.written) root.appendChild(el("div", `install.py ran ${install.written}`, "ta-muted"));
}

// "7 Dec 2025, 18:04" in the browser's language and time zone; the text as it came otherwise.
function readableTime(iso) {
    if (!iso) return "";
    const moment = new Date(iso);
    if (Number.isNaN(moment.getTime())) return String(iso);
    return moment.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "short" });
}

function renderBenchmark(root, status) {
    const bench = status.benchmark ?? {};
    if (!bench.found) return; // nothing to show until the Benchmark node has run
    const section = el("div");
    section.dataset.tritonAccelBenchmark = String(bench.result?.created ?? "");
    section.appendChild(el("h3", "Last benchmark"));
    const result = bench.result ?? {};
    const where = [result.source, result.device_name || result.device].filter(Boolean).join(" on ");
    const when = readableTime(result.created);
    if (where || when) section.appendChild(el("div", `${where}${when ? `, ${when}` : ""}`, "ta-muted"));
    const both = result.summary?.both;
    if (typeof both?.speedup === "number") {
        section.appendChild(el("div", `attention + Linear at the recorded shapes: ${both.speedup.toFixed(2)}× PyTorch`));
    }
    if (bench.chart_url) {
        // The query string only defeats the browser's cache: the route ignores it.
        const src = api.apiURL(`${bench.chart_url}?t=${encodeURIComponent(result.created ?? Date.now())}`);
        const link = el("a");
        link.href = src;
        link.target = "_blank";
        link.rel = "noopener";
        link.title = "Open the chart at full size";
        const img = el("img");
        img.alt = "Triton Accel benchmark chart";
        img.src = src;
        link.appendChild(img);
        section.appendChild(link);
    } else {
        section.appendChild(el("div", "No chart (no plotting library): the report on the node has the numbers.", "ta-muted"));
    }
    root.appendChild(section);
}

async function renderPanel(root) {
    injectStyle();
    root.classList.add("triton-accel-panel");
    let status;
    try {
        status = await fetchStatus();
    } catch (e) {
        root.replaceChildren(el("div", `Triton Accel: the status could not be read (${e.message ?? e}).`));
        return;
    }
    const content = document.createDocumentFragment();
    const refresh = el("button", "Refresh");
    refresh.onclick = () => renderPanel(root);
    content.appendChild(el("h2", "Triton Accel"));
    content.appendChild(el("div", `version ${status.pack_version} · Triton ${status.triton_version ?? "not installed"}` +
                                  ` · torch ${status.torch_version}`, "ta-muted"));
    for (const line of status.header ?? []) content.appendChild(el("div", line));
    content.appendChild(refresh);
    for (const section of [renderDevices, renderModels, renderMeasurements, renderExtensions, renderInstall,
                           renderBenchmark]) {
        section(content, status);
    }
    root.replaceChildren(content);
}

let panelRoot = null; // the open panel, refreshed after each run

function addPanel() {
    const sidebar = app.extensionManager;
    if (typeof sidebar?.registerSidebarTab === "function") {
        sidebar.registerSidebarTab({
            id: TAB_ID, icon: "pi pi-bolt", title: "Triton Accel", tooltip: "Triton Accel: paths, calls, install",
            type: "custom",
            render: (root) => {
                panelRoot = root;
                renderPanel(root);
            },
            destroy: () => {
                panelRoot = null;
            },
        });
        return;
    }
    // Frontends without side panels for extensions: a small button in the corner.
    const holder = el("div", null, "triton-accel-floating");
    const button = el("button", "Triton Accel");
    const root = el("div");
    root.style.display = "none";
    button.onclick = () => {
        const open = root.style.display === "none";
        root.style.display = open ? "block" : "none";
        panelRoot = open ? root : null;
        if (open) renderPanel(root);
    };
    holder.append(root, button);
    document.body.appendChild(holder);
}

// ---- the extension -------------------------------------------------------------------------

app.registerExtension({
    name: "TritonAccel.UI",
    setup() {
        injectStyle();
        addPanel();
        api.addEventListener("execution_success", async () => {
            try {
                const status = await fetchStatus();
                await refreshPatchedNodes(status);
                if (panelRoot?.isConnected) renderPanel(panelRoot);
            } catch (e) {
                // The counts are a courtesy; a failed refresh leaves the last text in place.
            }
        });
    },
    async beforeRegisterNodeDef(nodeType, nodeData) {
        if (!String(nodeData?.name ?? "").startsWith(NODE_PREFIX)) return;
        // Dropdowns whose options carry labels: the Settings node's mode and linear (extensions).
        const labelled = {};
        for (const group of [nodeData.input?.required, nodeData.input?.optional]) {
            for (const [name, spec] of Object.entries(group ?? {})) {
                const labels = spec?.[1]?.triton_accel_labels;
                if (labels) labelled[name] = labels;
            }
        }
        const onNodeCreated = nodeType.prototype.onNodeCreated;
        nodeType.prototype.onNodeCreated = function () {
            const result = onNodeCreated?.apply(this, arguments);
            for (const [name, labels] of Object.entries(labelled)) {
                const widget = this.widgets?.find((w) => w.name === name);
                if (!widget) continue;
                widget.options = widget.options ?? {};
                widget.options.getOptionLabel = (value) => labels[value] ?? String(value ?? "");
            }
            return result;
        };
        const onExecuted = nodeType.prototype.onExecuted;
        nodeType.prototype.onExecuted = function (message) {
            onExecuted?.apply(this, arguments);
            const text = messageText(message);
            if (!text) return;
            const model = message?.[MODEL_PROPERTY];
            this.properties = this.properties ?? {};
            if (model) this.properties[MODEL_PROPERTY] = Array.isArray(model) ? model[0] : String(model);
            const kinds = message?.[KINDS_PROPERTY];
            if (kinds) this.properties[KINDS_PROPERTY] = Array.isArray(kinds) ? kinds.map(String) : [String(kinds)];
            showText(this, text, message?.images?.length ? IMAGE_ROOM : 0);
        };
    },
    // A workflow opened or the page reloaded: the saved decision comes back with the node.
    loadedGraphNode(node) {
        const text = node.properties?.[PROPERTY];
        if (typeof text === "string" && text && String(node.comfyClass ?? node.type ?? "").startsWith(NODE_PREFIX)) {
            showText(node, text);
        }
    },
});
