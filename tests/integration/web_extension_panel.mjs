// The "Triton Accel" side panel's Extensions section and the Settings node's mode labels, in a
// headless Chromium (playwright-core) against a running ComfyUI that has an extension pack
// installed. Prints one JSON line with what it saw. Used by test_extension_api.py.
//
//   node web_extension_panel.mjs <server url> <screenshot file> <user-data-dir> <extension path> [widget]
//
// widget: the Settings node dropdown that lists the extension ("mode" for attention, the
// default; "linear" for a Linear extension).
//
// Env: PLAYWRIGHT_CORE (path of the playwright-core package folder), CHROMIUM (executable).
import { createRequire } from "node:module";

const [url, shot, userDataDir, extPath, widgetName = "mode"] = process.argv.slice(2);
const require = createRequire(import.meta.url);
const { chromium } = require(process.env.PLAYWRIGHT_CORE || "playwright-core");
const timeout = 60000;
const result = { ok: false, ourConsole: [], pageErrors: [], steps: [] };

let context;
try {
    context = await chromium.launchPersistentContext(userDataDir, {
        executablePath: process.env.CHROMIUM || "/usr/bin/chromium", headless: true,
        viewport: { width: 1400, height: 900 },
        args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"],
    });
    const page = context.pages()[0] || (await context.newPage());
    const origin = new URL(url).origin;
    await page.route("**/*", (route) => {
        const u = route.request().url();
        return u.startsWith(origin) || u.startsWith("data:") || u.startsWith("blob:") ? route.continue() : route.abort();
    });
    page.on("console", (m) => {
        const where = m.location()?.url ?? "";
        if ((m.type() === "warning" || m.type() === "error") && /triton[_-]accel/i.test(`${m.text()} ${where}`)) {
            result.ourConsole.push(`${m.type()}: ${m.text()} @${where}`.slice(0, 600));
        }
    });
    page.on("pageerror", (e) => result.pageErrors.push(String(e && e.stack || e).slice(0, 1500)));
    await page.goto(url, { waitUntil: "domcontentloaded", timeout });
    await page.waitForFunction(() => !!(window.app?.graph && window.LiteGraph?.registered_node_types?.TritonAccelSettings),
                               null, { timeout });
    await page.waitForTimeout(1000);
    result.steps.push("app ready");
    // The mode dropdown of a new Settings node: its values and the label our extension shows.
    result.mode = await page.evaluate(([extPath, widgetName]) => {
        const node = window.LiteGraph.createNode("TritonAccelSettings");
        window.app.graph.add(node);
        const mode = node.widgets.find((w) => w.name === widgetName);
        const values = typeof mode.options.values === "function" ? mode.options.values() : mode.options.values;
        return { values, label: mode.options.getOptionLabel?.(extPath) ?? null };
    }, [extPath, widgetName]);
    // A first-run dialog (templates, release notes) may cover the page: close it first.
    for (let i = 0; i < 3; i++) await page.keyboard.press("Escape");
    const opened = await page.evaluate(async () => {
        const command = window.app.extensionManager?.command;
        if (!command?.execute) return false;
        await command.execute("Workspace.ToggleSidebarTab.triton-accel");
        return true;
    }).catch(() => false);
    if (!opened) await page.locator(".triton-accel-tab-button").first().click({ force: true });
    await page.waitForSelector(`.triton-accel-panel [data-triton-accel-extension="${extPath}"]`, { timeout: 20000 });
    result.steps.push("panel shows the extension");
    result.box = await page.evaluate((extPath) => {
        const box = document.querySelector(`.triton-accel-panel [data-triton-accel-extension="${extPath}"]`);
        box.scrollIntoView();
        const r = box.getBoundingClientRect();
        return { text: box.innerText, rect: [r.x, r.y, r.width, r.height] };
    }, extPath);
    await page.waitForTimeout(300);
    await page.screenshot({ path: shot });
    result.ok = true;
} catch (e) {
    result.error = String(e && e.stack || e).slice(0, 2000);
} finally {
    await context?.close();
}
console.log(JSON.stringify(result));
