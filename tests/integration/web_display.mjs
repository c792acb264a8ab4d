// Drives a headless Chromium (playwright-core) against a running ComfyUI server: adds one
// TritonAccelSettings node, queues it, waits for the node's `triton_accel_decision` widget and
// prints one JSON line with what it found (plus a screenshot). Used by test_web_display.py.
//
//   node web_display.mjs <server url> <screenshot.png> <user-data-dir> [mode]
//
// Env: PLAYWRIGHT_CORE (path of the playwright-core package folder, or "playwright-core"),
//      CHROMIUM (executable, default /usr/bin/chromium), WEB_DISPLAY_TIMEOUT_MS (default 45000).
import { createRequire } from "node:module";

const [url, shot, userDataDir, mode = "fp16"] = process.argv.slice(2);
const require = createRequire(import.meta.url);
const { chromium } = require(process.env.PLAYWRIGHT_CORE || "playwright-core");
const timeout = Number(process.env.WEB_DISPLAY_TIMEOUT_MS || 45000);
const WIDGET = "triton_accel_decision";

const result = { ok: false, console: [], pageErrors: [], steps: [] };
const step = (s) => result.steps.push(`${new Date().toISOString().slice(11, 23)} ${s}`);
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
    page.on("console", (m) => result.console.push(`${m.type()}: ${m.text()}`.slice(0, 500)));
    page.on("pageerror", (e) => result.pageErrors.push(String(e && e.stack || e).slice(0, 1500)));

    step("goto");
    await page.goto(url, { waitUntil: "domcontentloaded", timeout });
    // The frontend sets window.app during its setup, then loads the first workflow; wait for
    // both (the default graph has nodes once loaded), so our graph is not replaced afterwards.
    await page.waitForFunction(() => {
        const app = window.app;
        return !!(app && app.canvas && app.isGraphReady !== false && app.graph && app.graph.nodes?.length > 0
                  && window.LiteGraph?.registered_node_types?.TritonAccelSettings);
    }, null, { timeout });
    await page.waitForTimeout(1000);
    step("app ready");
    result.frontendVersion = await page.evaluate(() => window.__COMFYUI_FRONTEND_VERSION__ ?? null);

    result.nodeId = await page.evaluate((mode) => {
        const app = window.app;
        app.graph.clear();
        const node = window.LiteGraph.createNode("TritonAccelSettings");
        node.pos = [120, 120];
        app.graph.add(node);
        node.widgets.find((w) => w.name === "mode").value = mode;
        app.canvas?.ds && (app.canvas.ds.offset = [0, 0], app.canvas.ds.scale = 1);
        app.graph.setDirtyCanvas(true, true);
        return node.id;
    }, mode);
    step(`node ${result.nodeId} added`);

    result.queued = await page.evaluate(async () => {
        const app = window.app;
        const r = await app.queuePrompt(0, 1);
        return r === undefined ? null : JSON.parse(JSON.stringify(r));
    });
    step("queued");

    const read = () => page.evaluate(([id, name]) => {
        const app = window.app;
        const node = app.graph.getNodeById(id);
        const w = node?.widgets?.find((x) => x.name === name);
        const el = w?.inputEl ?? w?.element;
        return {
            widgets: node?.widgets?.map((x) => x.name) ?? null,
            value: w ? w.value : null,
            readOnly: el ? !!el.readOnly : null,
            serialize: w ? w.serialize : null,
            size: node ? [...node.size] : null,
        };
    }, [result.nodeId, WIDGET]);
    try {
        await page.waitForFunction(([id, name]) => {
            const app = window.app;
            const w = app.graph.getNodeById(id)?.widgets?.find((x) => x.name === name);
            return !!(w && w.value);
        }, [result.nodeId, WIDGET], { timeout });
        step("widget has text");
    } catch (e) {
        step(`widget wait failed: ${String(e).split("\n")[0]}`);
    }
    Object.assign(result, await read());
    // The text as the user sees it: the textarea in the DOM (DOM widget) holding the value.
    result.domText = await page.evaluate((value) => {
        if (!value) return null;
        const ta = [...document.querySelectorAll("textarea")].find((t) => t.value === value);
        if (!ta) return null;
        const r = ta.getBoundingClientRect();
        const st = getComputedStyle(ta);
        return { visible: r.width > 0 && r.height > 0 && st.display !== "none" && st.visibility !== "hidden",
                 rect: [r.x, r.y, r.width, r.height], readOnly: ta.readOnly,
                 scrollHeight: ta.scrollHeight, clientHeight: ta.clientHeight };
    }, result.value);
    await page.waitForTimeout(500);
    await page.screenshot({ path: shot });
    step("screenshot");
    // What the workflow and the prompt carry: the decision widget must stay out of both.
    Object.assign(result, await page.evaluate(async (id) => {
        const app = window.app;
        const p = await app.graphToPrompt();
        const wf = (p.workflow?.nodes ?? app.graph.serialize().nodes).find((n) => String(n.id) === String(id));
        return { workflowWidgetsValues: wf?.widgets_values ?? null,
                 workflowNodes: (p.workflow?.nodes ?? []).map((n) => [n.id, n.type, n.widgets_values]),
                 promptInputs: p.output?.[String(id)]?.inputs ?? null };
    }, result.nodeId));
    // Run again with another mode: the same widget gets the new text (no second widget).
    const first = result.value;
    await page.evaluate(async (id) => {
        const app = window.app;
        app.graph.getNodeById(id).widgets.find((w) => w.name === "mode").value = "off";
        await app.queuePrompt(0, 1);
    }, result.nodeId);
    try {
        await page.waitForFunction(([id, name, first]) => {
            const w = window.app.graph.getNodeById(id)?.widgets?.find((x) => x.name === name);
            return !!(w && w.value && w.value !== first);
        }, [result.nodeId, WIDGET, first], { timeout: 20000 });
        step("second run: text updated");
    } catch (e) {
        step(`second run wait failed: ${String(e).split("\n")[0]}`);
    }
    const again = await read();
    result.second = { value: again.value, widgets: again.widgets };
    result.ok = typeof result.value === "string" && result.value.length > 0;
} catch (e) {
    result.error = String(e && e.stack || e);
} finally {
    if (context) await context.close().catch(() => {});
}
console.log(JSON.stringify(result));
