"""Step graphs (runtime/step_graph.py, TRITON_ACCEL_STEP_GRAPH=1) in a real ComfyUI sampler, on the CPU.

The CPU server has no CUDA graphs, so a plain patched model's calls stay eager with the reason
"not a CUDA call". TritonAccelTestStepGraph turns them on and gives the model's step graphs a CPU stand-in with a
graph's contract (the recording reads its static inputs and writes its output tensors; a
replay refills them): with it the real KSampler's calls show what a GPU would record and
replay. What that proves: ComfyUI's call signature (transformer_options included) repeats from
step to step, none of the refusals fires on a plain workflow, the replayed inputs reach the
model (the latent equals the eager run's), and the graphs are dropped when sampling ends (the
next prompt warms up again). Whether a CUDA recording of our kernels is right is the GPU's
to show (benchmarks/e2e_comfyui.py, +graph variants).
"""

import pytest

from it_workflows import (MAX_INTERPRETED_WIDTH, linear_patch, model_width, patch, read_latent, rel_l2,
                          sampling_workflow)

STEPS = 6
STEP_GRAPH_ON = ("TritonAccelTestStepGraph", {"cpu_stand_in": False})
CPU_GRAPHS = ("TritonAccelTestStepGraph", {"cpu_stand_in": True})
WARMING, RECORDING = "warming up", "recorded (this call ran eagerly)"


def _sample(comfy, family, chain, tag, cfg=1.0):
    prompt, save, _ = sampling_workflow(family, model_chain=chain, tag=tag, models=comfy.models, steps=STEPS,
                                        cfg=cfg)
    comfy.reset_stats()
    entry = comfy.run(prompt)
    kinds = comfy.stats().get("kinds", {})
    return read_latent(comfy, entry, save), kinds.get("step_graph", {"served": 0, "handed_back": 0, "reasons": {}})


@pytest.mark.parametrize("family, cfg", [("flux", 1.0), ("wan21", 1.0), ("wan21", 3.0)])
def test_a_plain_workflow_records_and_replays_its_steps(comfy, family, cfg):
    chain = [patch("fp16")]
    eager, eager_graph = _sample(comfy, family, chain + [STEP_GRAPH_ON], f"{family}_eager", cfg)
    assert eager_graph["served"] == 0 and list(eager_graph["reasons"]) == ["not a CUDA call"], eager_graph
    calls = eager_graph["handed_back"]
    assert calls == STEPS, eager_graph  # cfg > 1: cond and uncond in one batched call a step
    chain = chain + [CPU_GRAPHS]
    replayed, graph = _sample(comfy, family, chain, f"{family}_graph", cfg)
    print(f"\n[{family} cfg {cfg}] step graph: {graph}; latent vs eager rel L2 {rel_l2(replayed, eager):.2e}")
    assert graph["reasons"] == {WARMING: 2, RECORDING: 1}, graph
    assert graph["served"] == STEPS - 3 and graph["paths"] == {"replay": STEPS - 3}, graph
    assert rel_l2(replayed, eager) == 0.0
    # sampling's end dropped the graphs: the next prompt warms up again
    _, again = _sample(comfy, family, chain, f"{family}_graph_again", cfg)
    assert again["reasons"] == {WARMING: 2, RECORDING: 1}, again


def test_with_the_linear_patch(comfy):
    """The combined patch (our Linear on the interpreter, GELUs fused into its GEMM) records too;
    its Linear states ride along (a step graph drops its recording when they change). Two eager
    prompts of this chain repeat bit for bit (they did not before session 34: a lost GELU mark),
    and so does the replayed one."""
    if model_width(comfy.models, "flux") > MAX_INTERPRETED_WIDTH:
        pytest.skip(f"ComfyUI {comfy.version} builds tiny Flux {model_width(comfy.models, 'flux')} wide: too slow "
                    "for the Triton interpreter's FP8 Linear")
    chain = [linear_patch("fp8", attention_mode="fp16", combined=True)]
    first, _ = _sample(comfy, "flux", chain + [STEP_GRAPH_ON], "flux_linear_first")
    eager, eager_graph = _sample(comfy, "flux", chain + [STEP_GRAPH_ON], "flux_linear_eager")
    print(f"\n[flux + FP8 Linear] eager run 2 vs 1: rel L2 {rel_l2(eager, first):.2e}")
    replayed, graph = _sample(comfy, "flux", chain + [CPU_GRAPHS], "flux_linear_graph")
    print(f"\n[flux + FP8 Linear] step graph: {graph}; latent vs eager runs 2 / 1: rel L2 "
          f"{rel_l2(replayed, eager):.2e} / {rel_l2(replayed, first):.2e}")
    assert graph["reasons"] == {WARMING: 2, RECORDING: 1} and graph["served"] == STEPS - 3, graph
    assert rel_l2(eager, first) == 0.0
    assert rel_l2(replayed, eager) == 0.0


def test_another_nodes_patch_keeps_the_model_eager(comfy):
    """An attn1 patch of another node (transformer_options["patches"]) may change the forward
    between steps: never recorded, with that reason."""
    from test_fused_norms import fused

    chain = [fused(attn1_patch=True), CPU_GRAPHS]
    _, graph = _sample(comfy, "wan21", chain, "wan_attn1_patch")
    assert graph["served"] == 0, graph
    assert list(graph["reasons"]) == ["other nodes patch the forward (transformer_options patches)"], graph
