"""TRITON_ACCEL_FUSED_NORMS in a real ComfyUI: Wan's attention blocks with the fused LayerNorm +
modulation and q/k RMSNorm + RoPE (runtime/fused_norms.py), and the QKNorms of Flux's layers,
on the CPU under the interpreter, where ComfyUI runs the tiny models in fp32.

Tolerance against the same chain without the fused norms: rel. L2 of the sampled latent
< 1e-5. Both sides run the same Linear / attention; the fused kernels differ from torch's
LayerNorm / RMSNorm only in the order of their fp32 row sums (~1e-7 per value), while a 1 %
attention error moves this latent by 2.4e-3 (test_attention_patch.py's calibration).
"""

import pytest

from it_workflows import (MAX_INTERPRETED_WIDTH, fused_norms, linear_patch, model_width, patch, read_latent, rel_l2,
                          sampling_workflow)

FAMILY = "wan21"
FUSED_TOL = 1e-5
EXACT_TOL = 1e-6
STEPS_BLOCK_CALLS = 2  # 2 Euler steps, cfg 1 (one model call a step), one block


def with_guard_run(count: int) -> int:
    """Calls inside the block when the first-call guard runs the block a second time (ComfyUI's
    forward and ours): the tiny Wan has one block, so that is one step's calls more."""
    return count * (STEPS_BLOCK_CALLS + 1) // STEPS_BLOCK_CALLS


def fused(node="TritonAccelPatchAttention", attention="fp16", linear=None, attn1_patch=False, norms="all",
          rope=True):
    settings = {"mode": attention, "device": "auto"}
    if linear is not None:
        settings["linear"] = linear
    return ("TritonAccelTestFusedNorms", {"node": node, "attn1_patch": attn1_patch, "fused_norms": norms,
                                          "fused_rope": rope, "settings": ("settings", settings)})


def _sample(comfy, chain, tag):
    prompt, save, _ = sampling_workflow(FAMILY, model_chain=chain, tag=tag, models=comfy.models)
    comfy.reset_stats()
    entry = comfy.run(prompt)
    return read_latent(comfy, entry, save), comfy.stats()


def _kind(stats, kind):
    return stats.get("kinds", {}).get(kind, {"served": 0, "handed_back": 0, "reasons": {}, "paths": {}})


def test_fused_norms_match_the_unfused_patch(comfy):
    plain, plain_stats = _sample(comfy, [fused(norms="off")], "plain")
    assert _kind(plain_stats, "norms")["served"] == 0
    latent, stats = _sample(comfy, [fused()], "fused")
    norms = _kind(stats, "norms")
    err = rel_l2(latent, plain)
    print(f"\nfused norms vs unfused: rel L2 {err:.3e}; norms {norms}; attention {stats.get('calls')}")
    assert norms["served"] == STEPS_BLOCK_CALLS and norms["handed_back"] == 0, norms
    assert norms["paths"] == {"fused_norms": STEPS_BLOCK_CALLS}, norms
    # the attention calls inside the fused blocks still reach our attention kernel
    served = plain_stats["calls"].get("triton", 0)
    assert served > 0 and stats["calls"].get("triton", 0) == with_guard_run(served), (stats, plain_stats)
    assert err < FUSED_TOL, err


def test_the_patch_node_fuses_wan_blocks_by_default(comfy):
    """No setting: the plain patch node fuses Wan's blocks (TRITON_ACCEL_FUSED_NORMS unset in
    the server), with the latent of the explicitly fused run."""
    fused_latent, _ = _sample(comfy, [fused(norms="all")], "all")
    latent, stats = _sample(comfy, [patch("fp16")], "default")
    norms = _kind(stats, "norms")
    assert norms["paths"] == {"fused_norms": STEPS_BLOCK_CALLS} and norms["handed_back"] == 0, norms
    assert rel_l2(latent, fused_latent) < EXACT_TOL


def test_fused_norms_with_the_linear_patch(comfy):
    ref, ref_stats = _sample(comfy, [fused_norms(linear_patch("fp8", attention_mode="fp16", combined=True), "off")],
                             "linear")
    assert _kind(ref_stats, "norms")["served"] == 0
    latent, stats = _sample(comfy, [fused("TritonAccelPatch", linear="fp8")], "fused_linear")
    norms, linear = _kind(stats, "norms"), _kind(stats, "linear")
    err = rel_l2(latent, ref)
    print(f"\nfused norms + Linear vs Linear alone: rel L2 {err:.3e}; norms {norms}; linear served "
          f"{linear['served']} (alone {_kind(ref_stats, 'linear')['served']})")
    assert norms["served"] == STEPS_BLOCK_CALLS and norms["handed_back"] == 0, norms
    alone = _kind(ref_stats, "linear")["served"]
    assert alone > 0 and linear["served"] == with_guard_run(alone), (linear, _kind(ref_stats, "linear"))
    assert err < FUSED_TOL, err


def test_blocks_with_attn1_patches_go_to_comfyui(comfy):
    """Another node's attn1 patch is applied inside WanSelfAttention: the fused block must hand
    the call back rather than skip it."""
    ref, _ = _sample(comfy, [fused(attention="off", attn1_patch=True)], "patched_off")
    latent, stats = _sample(comfy, [fused(attn1_patch=True)], "patched_fused")
    norms = _kind(stats, "norms")
    print(f"\nattn1 patch: norms {norms}")
    assert norms["served"] == 0 and norms["handed_back"] == STEPS_BLOCK_CALLS, norms
    assert list(norms["reasons"]) == ["attn1/attn2 patches of another node"], norms
    assert rel_l2(latent, ref) < 1e-4  # fp16 mode: our attention kernel (fp32 on the CPU) vs ComfyUI's


def test_attention_off_patches_no_block(comfy):
    ref, _ = _sample(comfy, [], "ref")
    latent, stats = _sample(comfy, [fused(attention="off")], "off")
    assert _kind(stats, "norms")["served"] == _kind(stats, "norms")["handed_back"] == 0
    assert rel_l2(latent, ref) < EXACT_TOL


def _sample_family(comfy, family, chain, tag):
    prompt, save, _ = sampling_workflow(family, model_chain=chain, tag=tag, models=comfy.models)
    comfy.reset_stats()
    entry = comfy.run(prompt)
    return read_latent(comfy, entry, save), comfy.stats()


@pytest.mark.parametrize("family", ["flux", "hunyuan_video"])
def test_flux_qk_norms_and_blocks_fused(comfy, family):
    """Every QKNorm and every Double/SingleStreamBlock of comfy/ldm/flux/layers.py (Flux's and
    HunyuanVideo's) served by the fused passes by default (the plain patch node, settings unset),
    the latent unchanged within fp32 sum order against TRITON_ACCEL_FUSED_NORMS=blocks (no Wan
    block in these models: nothing fused); =qk fuses the QKNorms only. By default the blocks
    normalise and rotate q and k themselves (TRITON_ACCEL_FUSED_ROPE): their QKNorm modules run
    only inside ComfyUI's forward on each block kind's checked call; with the rope fusion off
    the fused blocks call their QKNorms, which our QK norm serves."""
    plain, plain_stats = _sample_family(comfy, family, [fused(norms="blocks")], "plain")  # blocks: nothing here
    assert _kind(plain_stats, "norms")["served"] == 0, _kind(plain_stats, "norms")
    qk, qk_stats = _sample_family(comfy, family, [fused(norms="qk")], "qk")
    latent, stats = _sample_family(comfy, family, [patch("fp16")], "default")
    norope, norope_stats = _sample_family(comfy, family, [fused(norms="all", rope=False)], "norope")
    norms, qk_norms, norope_norms = _kind(stats, "norms"), _kind(qk_stats, "norms"), _kind(norope_stats, "norms")
    err, qk_err, norope_err = rel_l2(latent, plain), rel_l2(qk, plain), rel_l2(norope, plain)
    print(f"\n[{family}] fused QK norms + blocks vs unfused: rel L2 {err:.3e}; norms {norms}; "
          f"QK norms only: rel L2 {qk_err:.3e}, {qk_norms}; rope fusion off: rel L2 {norope_err:.3e}, {norope_norms}")
    assert list(qk_norms["paths"]) == ["fused_qk_norm"] and qk_norms["handed_back"] == 0, qk_norms
    assert qk_norms["served"] % STEPS_BLOCK_CALLS == 0, qk_norms  # every QKNorm, every step
    for n in (norms, norope_norms):
        assert set(n["paths"]) == {"fused_qk_norm", "fused_flux_block"} and n["handed_back"] == 0, n
        assert n["paths"]["fused_flux_block"] % STEPS_BLOCK_CALLS == 0, n
    # rope fusion off: each block's QKNorm(s) called inside the fused block, and the first block
    # of each kind runs twice on its checked call (ours, then ComfyUI's forward)
    assert norope_norms["paths"]["fused_qk_norm"] > qk_norms["served"], (norope_norms, qk_norms)
    # rope fusion on: the QKNorms of the checked calls' ComfyUI forward only
    assert 0 < norms["paths"]["fused_qk_norm"] < qk_norms["served"], (norms, qk_norms)
    assert err < FUSED_TOL and qk_err < FUSED_TOL and norope_err < FUSED_TOL, (err, qk_err, norope_err)


def test_flux_blocks_with_the_fp8_linear(comfy):
    """Flux's fused blocks under the combined patch with the FP8 Linear (its interpreter path on
    the CPU): the same Linear calls served as with the blocks left to ComfyUI (=qk), the latent
    within the fused passes' tolerance of that run; the norm passes' e4m3 rows are read by the
    Linears after them from their third call on (DirectCall, CUDA only), so not here."""
    if model_width(comfy.models, "flux") > MAX_INTERPRETED_WIDTH:
        pytest.skip(f"ComfyUI {comfy.version} builds tiny Flux {model_width(comfy.models, 'flux')} wide: too slow "
                    "for the Triton interpreter's FP8 Linear")
    chain = linear_patch("fp8", attention_mode="fp16", combined=True)
    ref, ref_stats = _sample_family(comfy, "flux", [fused_norms(chain, "qk")], "flux_linear_qk")
    latent, stats = _sample_family(comfy, "flux", [fused_norms(chain, "all")], "flux_linear_all")
    norms, linear, ref_linear = _kind(stats, "norms"), _kind(stats, "linear"), _kind(ref_stats, "linear")
    err = rel_l2(latent, ref)
    print(f"\nFlux fused blocks + FP8 Linear vs QK norms only: rel L2 {err:.3e}; norms {norms}; linear "
          f"{linear['served']} served / {linear['handed_back']} back (qk: {ref_linear['served']} / "
          f"{ref_linear['handed_back']})")
    assert norms["paths"].get("fused_flux_block", 0) > 0 and norms["handed_back"] == 0, norms
    assert ref_linear["served"] > 0 and linear["served"] >= ref_linear["served"], (linear, ref_linear)
    assert err < FUSED_TOL, err


def test_torch_compile_traces_comfyuis_forward(comfy):
    """Under ComfyUI's TorchCompileModel the patched blocks trace ComfyUI's own forward
    (inductor fuses those ops itself): nothing counted as ours or handed back, attention still
    ours, the latent as the compiled unfused patch gives it."""
    compiled = ("TorchCompileModel", {"backend": "inductor"})
    plain, plain_stats = _sample(comfy, [fused(norms="off"), compiled], "plain_compiled")
    latent, stats = _sample(comfy, [fused(), compiled], "fused_compiled")
    norms = _kind(stats, "norms")
    err = rel_l2(latent, plain)
    print(f"\ncompiled: fused-norms model vs plain: rel L2 {err:.3e}; norms {norms}; attention {stats.get('calls')}")
    assert norms["served"] == norms["handed_back"] == 0, norms
    assert stats["calls"].get("triton", 0) == plain_stats["calls"].get("triton", 0) > 0, (stats, plain_stats)
    assert err < FUSED_TOL, err
