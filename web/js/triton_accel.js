// Shows the Triton Accel Settings node's decision (path and reason) on the node itself.
import { app } from "../../scripts/app.js";

const WIDGET = "triton_accel_decision";

function showText(node, text) {
    let widget = node.widgets?.find((w) => w.name === WIDGET);
    if (!widget) {
        const made = ComfyWidgets["STRING"](node, WIDGET, ["STRING", { multiline: true }], app);
        widget = made.widget;
        widget.inputEl.readOnly = true;
        widget.inputEl.style.opacity = 0.85;
        widget.serialize = false;
    }
    widget.value = text;
    node.setSize([Math.max(node.size[0], 320), node.computeSize()[1]]);
    app.graph.setDirtyCanvas(true, false);
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
