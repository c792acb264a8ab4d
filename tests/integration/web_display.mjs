// Drives a headless Chromium (playwright-core) against a running ComfyUI server and prints one
// JSON line with what it saw (plus screenshots). Used by test_web_display.py.
//
//   node web_display.mjs <server url> <screenshot prefix> <user-data-dir> <diffusion model file> [mode]
//                        [benchmark inputs as JSON: {"cond": {...}, "latent": {...}}]
//
// The graph: Triton Accel Settings (mode) -> Triton Accel Attention <- UNETLoader(model), whose
// MODEL goes to the test pack's attention probe (an output node: one attention call through the
// patched model). It queues that graph, reads both nodes' decision text and how it is laid out
// (text box vs content, and every ancestor that could cut it off), opens the "Triton Accel" side
// panel, reloads the page (the decision must come back), then runs once more with mode off (the
// same widget gets the new text). Screenshots: <prefix>_graph.png, _panel.png, _reloaded.png.
// With benchmark inputs it then builds UNETLoader + the test pack's conditioning and latent ->
// Triton Accel Benchmark (repeats 1), opens the side panel, queues the graph and waits, without
// a click, for the panel to show the new chart (it refreshes itself after a run); then reads
// the node's report. Screenshots: <prefix>_benchmark_panel.png, _benchmark_node.png.
//
// Env: PLAYWRIGHT_CORE (path of the playwright-core package folder, or "playwright-core"),
//      CHROMIUM (executable, default /usr/bin/chromium), WEB_DISPLAY_TIMEOUT_MS (default 60000).
import { createRequire } from "node:module";

const [url, shotPrefix, userDataDir, modelFile, mode = "fp16", benchmarkJson = ""] = process.argv.slice(2);
const require = createRequire(import.meta.url);
const { chromium } = require(process.env.PLAYWRIGHT_CORE || "playwright-core");
const timeout = Number(process.env.WEB_DISPLAY_TIMEOUT_MS || 60000);
const WIDGET = "triton_accel_decision";

const result = { ok: false, console: [], warnings: [], ourConsole: [], pageErrors: [], steps: [], shots: {} };
const step = (s) => result.steps.push(`${new Date().toISOString().slice(11, 23)} ${s}`);
const ours = (text) => /triton[_-]accel/i.test(text);

// In the page: each node's decision element, its text box against its content, and the first
// ancestor (up to the canvas/graph container) whose box cuts it off.
function measureInPage([ids, name]) {
    return ids.map((id) => {
        const node = window.app.graph.getNodeById(id);
        const w = node?.widgets?.find((x) => x.name === name);
        const el = w?.element;
        if (!w || !el) return { id, found: false, widgets: node?.widgets?.map((x) => x.name) ?? null };
        const r = el.getBoundingClientRect();
        const st = getComputedStyle(el);
        let clippedBy = null;
        for (let a = el.parentElement; a && a !== document.body; a = a.parentElement) {
            const s = getComputedStyle(a);
            if (s.overflow === "visible" && s.overflowY === "visible" && s.clipPath === "none") continue;
            const ar = a.getBoundingClientRect();
            if (r.bottom > ar.bottom + 1 || r.right > ar.right + 1 || r.top < ar.top - 1 || r.left < ar.left - 1) {
                clippedBy = { tag: a.tagName, cls: String(a.className).slice(0, 120), bottom: ar.bottom, elBottom: r.bottom };
                break;
            }
        }
        // The text's own height at the element's width (a copy with height auto): a box much
        // taller than this is empty space under the text.
        const copy = el.cloneNode(true);
        Object.assign(copy.style, { position: "absolute", visibility: "hidden", left: "-10000px", top: "0",
                                    height: "auto", minHeight: "0", maxHeight: "none", width: `${el.clientWidth}px` });
        document.body.appendChild(copy);
        const contentHeight = copy.offsetHeight;
        copy.remove();
        return {
            id, found: true, value: w.value, text: el.textContent, isConnected: el.isConnected,
            visible: el.isConnected && r.width > 0 && r.height > 0 && st.display !== "none" && st.visibility !== "hidden",
            rect: [r.x, r.y, r.width, r.height], scrollHeight: el.scrollHeight, clientHeight: el.clientHeight,
            scrollWidth: el.scrollWidth, clientWidth: el.clientWidth, offsetHeight: el.offsetHeight, contentHeight,
            lines: String(w.value ?? "").split("\n").length, images: node.imgs?.length ?? 0, nodeSize: [...node.size],
            serialize: w.serialize, optionsSerialize: w.options?.serialize, hideInPanel: w.options?.hideInPanel,
            widgets: node.widgets.map((x) => x.name), properties: Object.keys(node.properties ?? {}), clippedBy,
        };
    });
}

const sidebarButton = (page) => page.locator(".triton-accel-tab-button").first();

async function toggleSidebarPanel(page) {
    const button = sidebarButton(page);
    if (await button.count()) {
        await button.click();
    } else {
        await page.evaluate(() => window.app.extensionManager?.command?.execute?.("Workspace.ToggleSidebarTab.triton-accel"));
    }
}

// The panel's benchmark section: the result it shows (its `created`) and its chart <img>.
function benchmarkInPanel() {
    const panel = document.querySelector(".triton-accel-panel");
    const section = panel?.querySelector("[data-triton-accel-benchmark]");
    if (!section) return { open: !!panel, found: false };
    const img = section.querySelector("img");
    const r = (img ?? section).getBoundingClientRect();
    return { open: true, found: true, created: section.dataset.tritonAccelBenchmark, text: section.innerText.slice(0, 1000),
             img: img ? { src: img.getAttribute("src"), complete: img.complete, naturalWidth: img.naturalWidth,
                          naturalHeight: img.naturalHeight, rect: [r.x, r.y, r.width, r.height] } : null };
}

// Triton Accel Benchmark in the browser: the panel, open during the run, must show the new
// chart by itself; the node must show the whole report (and its chart preview).
async function benchmarkStage(page, spec) {
    step("benchmark: start");
    await page.setViewportSize({ width: 1600, height: 1150 }); // the report is ~35 lines of ~130 columns
    const bench = (result.benchmark = {});
    Object.assign(bench, await page.evaluate(async ([spec, modelFile]) => {
        const app = window.app, LG = window.LiteGraph;
        // Deleted as a user deletes nodes: their text boxes must go with them.
        for (const old of [...app.graph.nodes]) app.graph.remove(old);
        const add = (type, pos, values = {}) => {
            const node = LG.createNode(type);
            node.pos = pos;
            app.graph.add(node);
            for (const [name, value] of Object.entries(values)) node.widgets.find((w) => w.name === name).value = value;
            return node;
        };
        // Clear of the sidebar's icons on the left and of the tab bar and Run toolbar at the top.
        const loader = add("UNETLoader", [80, 140], { unet_name: modelFile });
        const cond = add("TritonAccelTestConditioning", [80, 310], { seed: 7, ...spec.cond });
        const latent = add("TritonAccelTestEmptyLatent", [80, 590], spec.latent);
        const node = add("TritonAccelBenchmark", [450, 140], { repeats: 1 });
        loader.connect(0, node, node.findInputSlot("model"));
        cond.connect(0, node, node.findInputSlot("positive"));
        latent.connect(0, node, node.findInputSlot("latent"));
        app.canvas?.ds && (app.canvas.ds.offset = [0, 0], app.canvas.ds.scale = 1);
        app.graph.setDirtyCanvas(true, true);
        const status = await fetch("/triton_accel/status", { cache: "no-store" }).then((r) => r.json()).catch(() => ({}));
        return { nodeId: node.id, title: node.title, createdBefore: status?.benchmark?.result?.created ?? null };
    }, [spec, modelFile]));
    await toggleSidebarPanel(page);
    await page.waitForSelector(".triton-accel-panel [data-triton-accel-device]", { timeout: 20000 });
    bench.panelBefore = await page.evaluate(benchmarkInPanel);
    await page.evaluate(async () => { await window.app.queuePrompt(0, 1); });
    step("benchmark: queued with the panel open");
    try {
        await page.waitForFunction(([id, name]) => /Triton Accel benchmark/.test(
            window.app.graph.getNodeById(id)?.widgets?.find((x) => x.name === name)?.value ?? ""),
            [bench.nodeId, WIDGET], { timeout: Number(process.env.WEB_DISPLAY_BENCHMARK_TIMEOUT_MS || 180000) });
        step("benchmark: report on the node");
    } catch (e) {
        step(`benchmark: report wait failed: ${String(e).split("\n")[0]}`);
    }
    try {
        await page.waitForFunction((before) => {
            const section = document.querySelector(".triton-accel-panel [data-triton-accel-benchmark]");
            const img = section?.querySelector("img");
            return !!(section && section.dataset.tritonAccelBenchmark !== (before ?? "") && img?.complete && img.naturalWidth > 0);
        }, bench.createdBefore, { timeout: 20000 });
        step("benchmark: new chart in the panel");
    } catch (e) {
        step(`benchmark: panel wait failed: ${String(e).split("\n")[0]}`);
    }
    await page.evaluate(() => document.querySelector(".triton-accel-panel [data-triton-accel-benchmark]")?.scrollIntoView());
    await page.waitForTimeout(300);
    bench.panel = await page.evaluate(benchmarkInPanel);
    bench.status = await page.evaluate(async () => {
        const s = await (await fetch("/triton_accel/status", { cache: "no-store" })).json();
        return { created: s?.benchmark?.result?.created ?? null, chartUrl: s?.benchmark?.chart_url ?? null };
    }).catch((e) => ({ error: String(e) }));
    result.shots.benchmark_panel = `${shotPrefix}_benchmark_panel.png`;
    await page.screenshot({ path: result.shots.benchmark_panel });
    await toggleSidebarPanel(page); // closed again: the node is what the next screenshot shows
    await page.waitForTimeout(700);
    bench.node = (await page.evaluate(measureInPage, [[bench.nodeId], WIDGET]))[0];
    // Every text box on the page: only the benchmark node's may be left (no box of a deleted node).
    bench.textBoxes = await page.evaluate(() => [...document.querySelectorAll("[data-triton-accel=decision]")]
        .filter((e) => { const r = e.getBoundingClientRect(), st = getComputedStyle(e);
                         return e.isConnected && r.width > 0 && r.height > 0 && st.display !== "none" && st.visibility !== "hidden"; })
        .map((e) => e.textContent.slice(0, 80)));
    result.shots.benchmark_node = `${shotPrefix}_benchmark_node.png`;
    await page.screenshot({ path: result.shots.benchmark_node });
    step("benchmark: screenshots");
}

let context;
try {
    context = await chromium.launchPersistentContext(userDataDir, {
        executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
        headless: true,
        viewport: { width: 1400, height: 900 },
        args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"],
    });
    const page = context.pages()[0] || (await context.newPage());
    // Only the loopback server: anything else (fonts, telemetry) is refused.
    const origin = new URL(url).origin;
    await page.route("**/*", (route) => {
        const u = route.request().url();
        if (u.startsWith(origin) || u.startsWith("data:") || u.startsWith("blob:")) return route.continue();
        return route.abort();
    });
    page.on("console", (m) => {
        const where = m.location()?.url ?? "";
        const line = `${m.type()}: ${m.text()} @${where}`.slice(0, 600);
        result.console.push(line);
        if (m.type() !== "warning" && m.type() !== "error") return;
        result.warnings.push(line);
        // Ours: naming our files, or the frontend's notices about what an extension imports or
        // uses (the shim of an internal module warns from its own file, not from the importer's).
        if (ours(m.text()) || ours(where) || /internal module|inputEl|widget\.\w+ is deprecated/i.test(m.text())) {
            result.ourConsole.push(line);
        }
    });
    page.on("pageerror", (e) => result.pageErrors.push(String(e && e.stack || e).slice(0, 1500)));

    const ready = async () => {
        await page.waitForFunction(() => {
            const app = window.app;
            return !!(app && app.canvas && app.isGraphReady !== false && app.graph && app.graph.nodes?.length > 0
                      && window.LiteGraph?.registered_node_types?.TritonAccelSettings);
        }, null, { timeout });
        await page.waitForTimeout(1000);
    };
    step("goto");
    await page.goto(url, { waitUntil: "domcontentloaded", timeout });
    await ready();
    step("app ready");
    result.frontendVersion = await page.evaluate(() => window.__COMFYUI_FRONTEND_VERSION__ ?? null);

    Object.assign(result, await page.evaluate(([mode, modelFile]) => {
        const app = window.app, LG = window.LiteGraph;
        app.graph.clear();
        const add = (type, pos) => {
            const node = LG.createNode(type);
            node.pos = pos;
            app.graph.add(node);
            return node;
        };
        const settings = add("TritonAccelSettings", [110, 110]);
        const loader = add("UNETLoader", [110, 470]);
        const patch = add("TritonAccelPatchAttention", [480, 110]);
        const probe = add("TritonAccelTestAttentionProbe", [880, 110]);
        settings.widgets.find((w) => w.name === "mode").value = mode;
        loader.widgets.find((w) => w.name === "unet_name").value = modelFile;
        probe.widgets.find((w) => w.name === "case").value = "fp32_plain";
        loader.connect(0, patch, patch.findInputSlot("model"));
        settings.connect(0, patch, patch.findInputSlot("settings"));
        patch.connect(0, probe, probe.findInputSlot("model"));
        app.canvas?.ds && (app.canvas.ds.offset = [0, 0], app.canvas.ds.scale = 1);
        app.graph.setDirtyCanvas(true, true);
        const size = (n) => [...n.size];
        return { settingsId: settings.id, patchId: patch.id, titles: [settings.title, patch.title],
                 defaultSizes: [size(settings), size(patch)] };
    }, [mode, modelFile]));
    step(`graph built: settings ${result.settingsId}, patch ${result.patchId}`);

    result.queued = await page.evaluate(async () => {
        const r = await window.app.queuePrompt(0, 1);
        return r === undefined ? null : JSON.parse(JSON.stringify(r));
    });
    step("queued");
    const ids = [result.settingsId, result.patchId];
    try {
        // The patch node's text gains its call counts once the run succeeded (execution_success).
        await page.waitForFunction(([ids, name]) => {
            const v = ids.map((id) => window.app.graph.getNodeById(id)?.widgets?.find((x) => x.name === name)?.value);
            return !!(v[0] && v[1] && / served/.test(v[1]));
        }, [ids, WIDGET], { timeout });
        step("both nodes have their text");
    } catch (e) {
        step(`text wait failed: ${String(e).split("\n")[0]}`);
    }
    await page.waitForTimeout(700);
    result.first = await page.evaluate(measureInPage, [ids, WIDGET]);
    result.shots.graph = `${shotPrefix}_graph.png`;
    await page.screenshot({ path: result.shots.graph });
    step("graph screenshot");

    // What the workflow and the prompt carry: the decision must stay out of both.
    Object.assign(result, await page.evaluate(async (id) => {
        const p = await window.app.graphToPrompt();
        const wf = (p.workflow?.nodes ?? window.app.graph.serialize().nodes).find((n) => String(n.id) === String(id));
        return { workflowWidgetsValues: wf?.widgets_values ?? null, promptInputs: p.output?.[String(id)]?.inputs ?? null };
    }, result.settingsId));

    // The side panel.
    try {
        const button = page.locator(".triton-accel-tab-button").first();
        if (await button.count()) {
            await button.click();
        } else {
            await page.evaluate(() => window.app.extensionManager?.command?.execute?.("Workspace.ToggleSidebarTab.triton-accel"));
        }
        await page.waitForSelector(".triton-accel-panel [data-triton-accel-device]", { timeout: 20000 });
        await page.waitForTimeout(500);
        result.panel = await page.evaluate(() => {
            const panel = document.querySelector(".triton-accel-panel");
            const r = panel.getBoundingClientRect();
            return { text: panel.innerText.slice(0, 4000), rect: [r.x, r.y, r.width, r.height],
                     devices: [...panel.querySelectorAll("[data-triton-accel-device]")].map((d) => d.dataset.tritonAccelDevice) };
        });
        result.shots.panel = `${shotPrefix}_panel.png`;
        await page.screenshot({ path: result.shots.panel });
        step("panel screenshot");
        const button2 = page.locator(".triton-accel-tab-button").first();
        if (await button2.count()) await button2.click(); // close it again
    } catch (e) {
        step(`panel failed: ${String(e).split("\n")[0]}`);
    }

    // The properties panel (frontends that have one): select the Settings node, open the panel,
    // read which inputs it lists. The decision must not be one of them (options.hideInPanel).
    try {
        await page.evaluate((id) => {
            const app = window.app;
            app.canvas.deselectAll?.();
            app.canvas.selectNode(app.graph.getNodeById(id));
        }, result.settingsId);
        const toggle = page.locator("button[aria-label*='propert' i], button[aria-label*='right side' i], " +
                                    "button[title*='propert' i]").first();
        if (await toggle.count()) {
            await toggle.click();
            await page.waitForTimeout(1200);
            result.propertiesPanel = await page.evaluate(() => {
                // The panel docks on the right: the largest element there that lists the node's inputs.
                const area = (e) => { const r = e.getBoundingClientRect(); return r.width * r.height; };
                const panel = [...document.querySelectorAll("div, aside, section")].filter((e) => {
                    const r = e.getBoundingClientRect();
                    return r.left > window.innerWidth * 0.6 && r.width > 150 && /\bmode\b/.test(e.innerText)
                           && /\blinear\b|\bdevice\b/.test(e.innerText);
                }).sort((x, y) => area(y) - area(x))[0];
                return panel ? { text: panel.innerText.slice(0, 3000) } : { text: null };
            });
            result.shots.properties = `${shotPrefix}_properties.png`;
            await page.screenshot({ path: result.shots.properties });
            await toggle.click();
            step("properties panel read");
        } else {
            result.propertiesPanel = { text: null, why: "no properties-panel button in this frontend" };
        }
    } catch (e) {
        step(`properties panel failed: ${String(e).split("\n")[0]}`);
    }

    // Reload: the frontend restores the open workflow; the decision must come back with it.
    await page.waitForTimeout(1500); // the workflow is persisted shortly after each change
    await page.reload({ waitUntil: "domcontentloaded", timeout });
    await ready();
    try {
        await page.waitForFunction(([ids, name]) => ids.every((id) => window.app.graph.getNodeById(id)?.widgets
            ?.find((x) => x.name === name)?.value), [ids, WIDGET], { timeout: 20000 });
        step("reloaded: text back");
    } catch (e) {
        step(`reload wait failed: ${String(e).split("\n")[0]}`);
    }
    await page.waitForTimeout(700);
    result.reloaded = await page.evaluate(measureInPage, [ids, WIDGET]);
    result.shots.reloaded = `${shotPrefix}_reloaded.png`;
    await page.screenshot({ path: result.shots.reloaded });
    step("reloaded screenshot");

    // Run again with mode off: the same widget gets the new text (no second widget).
    const before = result.reloaded[0]?.value;
    await page.evaluate(async (id) => {
        window.app.graph.getNodeById(id).widgets.find((w) => w.name === "mode").value = "off";
        await window.app.queuePrompt(0, 1);
    }, result.settingsId);
    try {
        await page.waitForFunction(([id, name, before]) => {
            const w = window.app.graph.getNodeById(id)?.widgets?.find((x) => x.name === name);
            return !!(w && w.value && w.value !== before);
        }, [result.settingsId, WIDGET, before], { timeout: 30000 });
        step("second run: text updated");
    } catch (e) {
        step(`second run wait failed: ${String(e).split("\n")[0]}`);
    }
    result.second = (await page.evaluate(measureInPage, [[result.settingsId], WIDGET]))[0];
    if (benchmarkJson) await benchmarkStage(page, JSON.parse(benchmarkJson));
    result.ok = true;
} catch (e) {
    result.error = String(e && e.stack || e);
} finally {
    if (context) await context.close().catch(() => {});
}
console.log(JSON.stringify(result));
