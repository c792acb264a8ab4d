// Shows the Triton Accel Settings node's decision (path and reason) on the node itself.
import { app } from "../../scripts/app.js";

const WIDGET = "triton_accel_decision";

// Height of the text at the textarea's current width, whatever height the textarea has now
// (measured at height 0, so the result never feeds back into itself).
function textHeight(el) {
    if (!el?.isConnected || el.clientWidth === 0) return null;
    const previous = el.style.height;
    el.style.height = "0px";
    const height = el.scrollHeight;
    el.style.height = previous;
    return height;
}

function fit(node, widget) {
    const height = textHeight(widget.inputEl);
    if (height) widget.tritonAccelMinHeight = Math.max(50, height + 8);
    node.setSize([Math.max(node.size[0], 320), Math.max(node.size[1], node.computeSize()[1])]);
    app.graph.setDirtyCanvas(true, true);
}

function showText(node, text) {
    let widget = node.widgets?.find((w) => w.name === WIDGET);
    if (!widget) {
        const made = ComfyWidgets["STRING"](node, WIDGET, ["STRING", { multiline: true }], app);
        widget = made.widget;
        widget.inputEl.readOnly = true; // the classic (canvas) node's textarea
        widget.inputEl.style.opacity = 0.85;
        widget.options = widget.options ?? {};
        widget.options.read_only = true; // the Nodes 2.0 (Vue) node's textarea reads this
        widget.label = "decision";
        // Display only: out of the saved workflow (serialize) and out of the prompt sent to the
        // server (options.serialize; otherwise the text becomes an input of the node, the next
        // run's cache signature differs, and this node and everything after it run again).
        widget.serialize = false;
        widget.options.serialize = false;
        // Tall enough for the whole text (the default 50 px cuts off the last line of a
        // 4-line reason); the frontend asks for this when it lays the node out.
        widget.options.getMinHeight = () => widget.tritonAccelMinHeight ?? 50;
    }
    widget.value = text;
    fit(node, widget);
    requestAnimationFrame(() => fit(node, widget)); // again once the textarea is laid out
}

let ComfyWidgets;

app.registerExtension({
    name: "TritonAccel.Settings",
    async setup() {
        ({ ComfyWidgets } = await import("../../scripts/widgets.js"));
    },
    async beforeRegisterNodeDef(nodeType, nodeData) {
        if (nodeData.name !== "TritonAccelSettings") return;
        const onExecuted = nodeType.prototype.onExecuted;
        nodeType.prototype.onExecuted = function (message) {
            onExecuted?.apply(this, arguments);
            const text = message?.text;
            if (text) showText(this, Array.isArray(text) ? text.join("\n") : String(text));
        };
    },
});
