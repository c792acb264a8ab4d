"""Issue 2 (foundation): the pack loads into a real ComfyUI under a dashed folder name, its
nodes are listed, and a workflow runs end to end."""
import torch

from it_workflows import read_latent, sampling_workflow

PACK_NODES = ("TritonAccelSettings", "TritonAccelPatchAttention")


def test_server_starts_and_pack_imports(comfy):
    stats = comfy.get_json("/system_stats")
    assert "system" in stats
    log = comfy.log()
    bad = [ln for ln in log.splitlines()
           if ("IMPORT FAILED" in ln and "comfyui-triton-accel" in ln)
           or "Triton Accel: the nodes could not be loaded" in ln]
    assert not bad, "the pack failed to import:\n" + "\n".join(bad)


def test_object_info_lists_pack_nodes(comfy):
    info = comfy.object_info()
    missing = [n for n in PACK_NODES if n not in info]
    assert not missing, f"not in /object_info: {missing}; Triton-ish nodes present: " \
                        f"{sorted(k for k in info if 'riton' in k)}"
    for name in PACK_NODES:
        assert info[name]["category"] == "Triton Accel", (name, info[name]["category"])
        # the per-node route answers too
        assert name in comfy.object_info(name)


def test_flux_workflow_end_to_end(comfy):
    """UNETLoader -> TritonAccelPatchAttention (default settings) -> KSampler -> SaveLatent."""
    prompt, save, _ = sampling_workflow("flux", model_chain=[("TritonAccelPatchAttention", {})], tag="e2e",
                                       models=comfy.models)
    entry = comfy.run(prompt)
    latent = read_latent(comfy, entry, save)
    assert latent.shape == (1, 16, 8, 8)
    assert torch.isfinite(latent).all()
    assert latent.abs().max() > 0


def test_harness_reports_rejected_prompt(comfy):
    """The harness raises with ComfyUI's node errors when a prompt is rejected."""
    import pytest

    with pytest.raises(Exception) as info:
        comfy.run({"1": {"class_type": "UNETLoader",
                         "inputs": {"unet_name": "no_such_model.safetensors", "weight_dtype": "default"}},
                   "2": {"class_type": "TritonAccelPatchAttention", "inputs": {"model": ["1", 0]}},
                   "3": {"class_type": "TritonAccelTestAttentionProbe",
                         "inputs": {"model": ["2", 0], "case": "fp32_plain", "seed": 0}}})
    text = str(info.value)
    assert "rejected" in text or "node errors" in text, text
    assert "no_such_model.safetensors" in text, text
