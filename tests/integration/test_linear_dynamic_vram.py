"""Our Linear's dynamic-VRAM route against ComfyUI 0.29's own cast code, on the CPU.

comfy-aimdo (the VBAR) needs CUDA, so cast_bias_weight's VBAR branch cannot run here as it is:
it is taken for a CUDA input only, and its first half (cast_modules_with_vbar) faults VBAR
pages in. Its second half, comfy.ops.resolve_cast_module_with_vbar, is plain torch and is where
everything the patch relies on happens: the weight handed over in the dtype asked for (FP8 stays
FP8), the LoRA applied by the layer's LowVramPatch (what ModelPatcherDynamic.load attaches for a
ModelPatcher.add_patches entry), the _function lists. So a subprocess in ComfyUI's folder
replaces comfy.ops.cast_bias_weight with a restatement of its VBAR branch on the CPU
(`vbar_cast_on_cpu`: the weight and bias gathered into a buffer as cast_modules_with_vbar
leaves them, then the real resolve function), in its two regimes: no VBAR room (a transient
buffer every call, signature None) and resident (a per-layer slot standing for the VBAR page:
filled, LoRA applied and written back by the first cast, handed over as it is after),
and drives real comfy.ops Linear layers (disable_weight_init with bf16 weights, manual_cast
with float8_e4m3fn weights) through our layer with the real ComfyWeightCast adapter (only its
`streams` test, CUDA-only, is widened to the CPU) and the kernels under the interpreter.
ComfyUI's own forward, through the same cast, is the reference.

Tolerance: rel. L2 of one layer's output against ComfyUI's: < 0.06 (FP8 W8A8, see
tests/nodes/test_patch_linear_dynamic_vram.py); a LoRA must move ComfyUI's output by > 0.2.
Skipped without COMFYUI_PATH and on ComfyUI without dynamic VRAM (before 0.29).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOL = 0.06
LORA_MIN_EFFECT = 0.2


def _env() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    extra = os.environ.get("COMFYUI_EXTRA_PYTHONPATH")
    if extra:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, env.get("PYTHONPATH", "")) if p)
    return env


@pytest.fixture(scope="module")
def result():
    comfy_path = Path(os.environ["COMFYUI_PATH"])
    if "def resolve_cast_module_with_vbar" not in (comfy_path / "comfy" / "ops.py").read_text():
        pytest.skip("this ComfyUI has no dynamic VRAM (resolve_cast_module_with_vbar: ComfyUI 0.29+)")
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    proc = subprocess.run([python, str(Path(__file__).resolve()), "--in-process", str(REPO)], cwd=comfy_path,
                          env=_env(), capture_output=True, text=True, timeout=600, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"in-process run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n" \
                                           f"{proc.stderr[-6000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    print(f"\n[dynamic VRAM, CPU] {json.dumps(out)}")
    return out


LAYERS = [f"{regime}:{name}" for regime in ("no_room", "resident") for name in ("fp8_lora", "fp8", "bf16_lora")]


@pytest.mark.parametrize("layer", LAYERS)
def test_served_through_comfyuis_cast_and_agrees(result, layer):
    r = result[layer]
    assert r["served"] == 2 and r["handed_back"] == 0, r
    assert r["paths"] == {"fp8_w8a8 (dynamic VRAM)": 2}, r
    assert r["rel_l2"] < TOL, r
    assert r["uncasts"] == r["casts"], r


@pytest.mark.parametrize("regime", ["no_room", "resident"])
def test_fp8_weight_reaches_the_kernel_as_fp8(result, regime):
    r = result[f"{regime}:fp8"]
    assert r["kernel_weight_dtypes"] == ["torch.float8_e4m3fn"] * 2 and r["kernel_weight_shared"] == [True, True], r


@pytest.mark.parametrize("layer", [f"{regime}:{name}" for regime in ("no_room", "resident")
                                   for name in ("fp8_lora", "bf16_lora")])
def test_lora_reaches_our_kernel(result, layer):
    r = result[layer]
    assert r["lora_effect"] > LORA_MIN_EFFECT, r  # ComfyUI's own output moved by the LoRA ...
    assert r["rel_l2"] < TOL, r  # ... and ours followed it


def test_fp8_lora_is_written_back_then_used_as_fp8(result):
    # No VBAR room: the LoRA'd weight comes back in the input's dtype on every call (quantised
    # per call). Resident: the first cast applies the LoRA, hands it over in the input's dtype
    # and writes a stochastically rounded FP8 copy into the slot, which ComfyUI's forward (the
    # guard's reference) then reads: its output differs from the exact one by more than the
    # guard's 0.05, so the guard runs ours again, on the slot's FP8 weight as it is, and agrees;
    # the next call uses the slot too.
    assert result["no_room:fp8_lora"]["kernel_weight_dtypes"] == ["torch.bfloat16"] * 2
    r = result["resident:fp8_lora"]
    assert r["kernel_weight_dtypes"] == ["torch.bfloat16"] + ["torch.float8_e4m3fn"] * 2, r
    assert r["kernel_weight_shared"] == [False, True, True], r


def _in_process(repo: str) -> dict:
    """Runs inside ComfyUI's folder; returns what the tests check."""
    import importlib.util
    import types

    sys.path.insert(0, os.getcwd())
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    import comfy.memory_management
    import comfy.model_management
    import comfy.model_patcher
    import comfy.ops
    import torch

    spec = importlib.util.spec_from_file_location("triton_accel_it_dyn", Path(repo) / "__init__.py",
                                                  submodule_search_locations=[repo])
    pack = importlib.util.module_from_spec(spec)
    sys.modules["triton_accel_it_dyn"] = pack
    spec.loader.exec_module(pack)
    modules = {name: sys.modules[f"triton_accel_it_dyn.runtime.{name}"]
               for name in ("linear_common", "linear_layer", "linear_state")}
    # The Linear engine's names _run_layers uses, from the modules that hold them.
    pl = types.SimpleNamespace(LinearBackend=modules["linear_common"].LinearBackend,
                               SkipPatterns=modules["linear_common"].SkipPatterns,
                               LinearPatchState=modules["linear_state"].LinearPatchState,
                               LinearLayer=modules["linear_layer"].LinearLayer)
    dynamic_vram = sys.modules["triton_accel_it_dyn.runtime.dynamic_vram"]
    call_stats = sys.modules["triton_accel_it_dyn.runtime.call_stats"]
    settings = sys.modules["triton_accel_it_dyn.runtime.settings"].AccelSettings("off", linear_mode="fp8")
    kernels = pack.kernels
    from triton_accel_it_dyn.kernels.linear.dispatch import prepare_weight_per_call

    counts = {"casts": 0, "uncasts": 0}
    real_uncast = comfy.ops.uncast_bias_weight
    regime = {"name": "no_room"}

    def vbar_cast_on_cpu(s, input=None, dtype=None, device=None, bias_dtype=None, offloadable=False,
                         compute_dtype=None, want_requant=False):
        # cast_bias_weight's defaults, then its VBAR branch (cast_modules_with_vbar's outcome,
        # resolve_cast_module_with_vbar itself, the clean-up).
        dtype = dtype or input.dtype
        bias_dtype = bias_dtype or dtype
        device = device or input.device
        params = [s.weight, s.bias]
        resident = regime["name"] == "resident"
        signature = "page" if resident else None
        if resident and getattr(s, "_v_signature", None) == signature:
            s._prefetch = dict(signature=signature, resident=True)
        else:
            if resident:  # the VBAR page: kept with the layer, filled from the weights once
                buffer = s._page = torch.empty((comfy.memory_management.vram_aligned_size(params),), dtype=torch.uint8)
            else:  # no VBAR room: a transient cast buffer per call
                buffer = torch.empty((comfy.memory_management.vram_aligned_size(params),), dtype=torch.uint8)
            comfy.model_management.cast_to_gathered(params, buffer)
            s._prefetch = dict(signature=signature, resident=False, xfer_dest=buffer, cast_dest=None, needs_cast=False,
                               cast_geometry=comfy.memory_management.tensors_to_geometries(params))
        weight, bias = comfy.ops.resolve_cast_module_with_vbar(s, dtype, device, bias_dtype, compute_dtype,
                                                               want_requant)
        del s._prefetch
        counts["casts"] += 1
        handle = (None, None, None)
        return (weight, bias, handle) if offloadable else (weight, bias)

    def counted_uncast(*args):
        counts["uncasts"] += 1
        return real_uncast(*args)

    comfy.ops.cast_bias_weight = vbar_cast_on_cpu
    comfy.ops.uncast_bias_weight = counted_uncast

    class CpuStreams(dynamic_vram.ComfyWeightCast):
        def streams(self, module, x):
            return hasattr(module, "_v")

    out = {}
    for regime["name"] in ("no_room", "resident"):
        out.update(_run_layers(regime["name"], pl, call_stats, settings, kernels, prepare_weight_per_call, counts,
                               CpuStreams))
    return out


def _run_layers(regime, pl, call_stats, settings, kernels, prepare_weight_per_call, counts, cast_class) -> dict:
    import comfy.model_patcher
    import comfy.ops
    import torch

    gen = torch.Generator().manual_seed(0)
    root = torch.nn.Module()
    root.diffusion_model = torch.nn.Module()
    layers = {"fp8": comfy.ops.manual_cast.Linear(64, 48, dtype=torch.float8_e4m3fn),
              "fp8_lora": comfy.ops.manual_cast.Linear(64, 48, dtype=torch.float8_e4m3fn),
              "bf16_lora": comfy.ops.disable_weight_init.Linear(64, 48, dtype=torch.bfloat16)}
    for name, m in layers.items():
        w = torch.randn(48, 64, generator=gen) * 0.125
        m.weight = torch.nn.Parameter(w.to(m.weight.dtype), requires_grad=False)
        m.bias = torch.nn.Parameter((torch.randn(48, generator=gen) * 0.1).to(m.weight.dtype), requires_grad=False)
        m.comfy_cast_weights, m.seed_key, m._v = True, name, object()
        m.weight_lowvram_function = m.bias_lowvram_function = None
        root.diffusion_model.add_module(name, m)
    patcher = comfy.model_patcher.ModelPatcher(root, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    for name in ("fp8_lora", "bf16_lora"):
        key = f"diffusion_model.{name}.weight"
        diff = torch.randn(48, 64, generator=gen) * 0.06
        assert patcher.add_patches({key: (diff,)}, 1.0) == [key]
        # What ModelPatcherDynamic.load attaches for a patched key.
        layers[name].weight_lowvram_function = comfy.model_patcher.LowVramPatch(key, patcher.patches)

    seen = []

    def prepare_per_call(weight, method, scale):
        prepared = prepare_weight_per_call(weight, method, scale)
        seen.append((str(weight.dtype), prepared.weight.data_ptr() == weight.data_ptr()))
        return prepared

    backend = pl.LinearBackend(kernels.prepare_weight, kernels.linear, kernels.linear_refusal,
                               kernels.LinearInputError, prepare_per_call)
    x = torch.randn(2, 32, 64, generator=gen).to(torch.bfloat16)
    out = {}
    for name, m in layers.items():
        state = pl.LinearPatchState(settings, pl.SkipPatterns(), 1, backend, label=f"dyn {name}",
                                    weight_cast=cast_class())
        layer = pl.LinearLayer(state, name, m, m.forward)
        state.layers.append(layer)
        call_stats.reset()
        seen.clear()
        counts.update(casts=0, uncasts=0)
        ours = [layer(x) for _ in range(2)][-1].float()
        stats = call_stats.snapshot()["kinds"]["linear"]
        casts = dict(counts)
        reference = m.forward(x).float()
        without_lora = torch.nn.functional.linear(x, m.weight.to(x.dtype), m.bias.to(x.dtype)).float()
        out[f"{regime}:{name}"] = dict(
            served=stats["served"], handed_back=stats["handed_back"], paths=dict(stats["paths"]),
            reasons=dict(stats["reasons"]), rel_l2=((ours - reference).norm() / reference.norm()).item(),
            lora_effect=((reference - without_lora).norm() / without_lora.norm()).item(),
            kernel_weight_dtypes=[d for d, _ in seen], kernel_weight_shared=[shared for _, shared in seen], **casts)
    return out


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--in-process":
    print("RESULT " + json.dumps(_in_process(sys.argv[2])), flush=True)
