"""The pack's engine, which the nodes in nodes/ call: the attention override (attention_patch),
the Linear layers and their per-model state (linear_*), dynamic-VRAM streaming (dynamic_vram),
fused activations (activation_marks, fused_activations), the fused norm/RoPE passes (fused_*),
the step's CUDA graphs and their check (step_graph, step_check), the auto speed choice
(speed_choice, linear_choice, call_timing), the quality guards (guards), the settings and
decisions (settings, decision_text, device_probe), call counts (call_stats), torch.compile ops
(compiled_ops), other packs' extensions (extension_hooks), the progress bar (progress) and the
benchmark's measurements (benchmark_core, benchmark_chart).

Nothing here defines a ComfyUI node, and nothing here imports nodes/.
"""
