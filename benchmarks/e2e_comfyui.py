"""End to end in real ComfyUI code: milliseconds per denoising step, one run, every variant.

Builds full-size models of ComfyUI's own classes (SD1.5, SDXL, Flux.1 12B, Qwen-Image 20B,
Wan 2.1 14B: benchmarks/e2e_models.py) with random weights made in place (bf16, on the GPU;
nothing is downloaded), patches them the way the nodes do, and times `BaseModel.apply_model`
(what the sampler calls once per step at cfg 1) with:
  default      ComfyUI's own attention (PyTorch SDPA with its default backend)
  sdpa-flash   the same, SDPA forced to its FlashAttention-2 backend (the RTX default)
  sage         ComfyUI's SageAttention path (sageattention 1.0.6, Triton)
  ours-auto    TritonAccelPatchAttention with settings auto
  ours-triton  TritonAccelPatchAttention with settings fp16 (our kernel forced)
  ours-fp8     TritonAccelPatchAttention with settings fp8 (our FP8 attention forced, sm_89+)
  ours-int8    TritonAccelPatchAttention with settings int8 (our INT8 Q.K attention forced)
  comfy-fp8-fast  ComfyUI's own FP8 Linear (UNETLoader weight_dtype fp8_e4m3fn_fast: FP8
               weights, per-tensor torch._scaled_mm); built as a second model, FP8 weights
  ours-linear  TritonAccelPatchLinear with settings auto (Linear only; attention ComfyUI's)
  ours-linear-fp8  TritonAccelPatchLinear forced fp8 W8A8 (Linear only)
  ours-all     TritonAccelPatch (attention and Linear) with settings auto
  ours-all-fp8 TritonAccelPatch with attention fp8 and Linear fp8 forced
  ours-fp8ckpt TritonAccelPatch (auto) on a model loaded with FP8 weights (weight_dtype
               fp8_e4m3fn, ComfyUI upcasting per call): our Linear uses the FP8 weights as-is
  default-fp8ckpt  ComfyUI's own path on that FP8-weight model (the default of an FP8 checkpoint)
  ours-linear-unfused / ours-all-unfused  ours-linear / ours-all with every GELU left to
               ComfyUI (none in our GEMM epilogue): the fusion's before/after in one run
  ours-linear-nocopy / ours-all-nocopy  ours-linear / ours-all with Flux's single-block GELU
               left to ComfyUI (patch_linear_model copy_activations=False; the default fuses it
               through the GEMM's contiguous copy)
  <variant>+norms, <variant>+qk, <variant>+blocks, <variant>+nonorms  that variant with
               TRITON_ACCEL_FUSED_NORMS=all (Wan blocks, Flux-layer QKNorms and blocks), =qk
               (Wan blocks and Flux-layer QKNorms: an earlier default), =blocks (Wan blocks
               only) or =off (none); none of them: the pack's default (all, docs/settings.md),
               e.g. ours-all+nonorms for the step before the fusion
  <variant>+rope, <variant>+norope  that variant with TRITON_ACCEL_FUSED_ROPE=1 (the default:
               Flux blocks write q and k normalised and rotated in the attention's layout) or 0
               (QK norm kernel, then ComfyUI's concatenation and RoPE)
  <variant>+split, <variant>+nosplit  that variant with TRITON_ACCEL_SPLIT_TAIL=1 (the default:
               the FP8 Linear's last partial wave of tiles cut along K) or 0 (every tile whole)
  <variant>+compile  that variant with ComfyUI's TorchCompileModel (inductor) applied last, as
               a user's graph puts it after the patch nodes ("default+compile" is ComfyUI's
               own compiled model); the first call, which compiles, is left out of the timing
and reports each variant's ms/step, its ratio to the default, the relative L2 difference and
cosine of its output against the default's, the first call's time (auto's timing and the
weight quantisation happen there) and the peak GPU memory.

    python benchmarks/e2e_comfyui.py --comfyui .ext/ComfyUI-0.29.0 [--models flux wan] [--tiny]
        [--dynamic-vram]

--tiny builds one- or two-block models for a CPU smoke run (use TRITON_INTERPRET=1 there).
--check-sensitivity: before the variants, the unpatched model's output change when one
attention's output is scaled by 1.01 (first, middle and last block) and each block's update
over the residual it receives (e2e_models.sensitivity / block_update_ratios): > 0 shows the
blocks are not lost in the residual adds, so the variants' cosines measure every block.
--dynamic-vram runs every variant under ComfyUI 0.29+'s dynamic VRAM, switched on the way
its main.py does (comfy_aimdo.control.init before torch loads, init_devices, CoreModelPatcher =
ModelPatcherDynamic, memory_management.aimdo_enabled): the models' weights live on the CPU and
each Linear layer's weight is cast per call from a virtual VRAM buffer. Needs CUDA and
comfy-aimdo (ComfyUI 0.29's requirements.txt), and says so when either is missing. The rows
then show how many Linear calls our kernels served under it ("fp8_w8a8 (dynamic VRAM)").

Per timed step a row also keeps the host's time to issue it (`step_host_ms`: near the step
time when the step is host-bound) and whether the kernels' direct launch is still on.
Environment: E2E_KPROFILE=<dir> (device time per kernel of one more step), E2E_CPROFILE=<dir>
(cProfile of one more step), E2E_SYNC_DEBUG=1 (torch warns, with a stack, at every host-device
synchronisation inside a timed step). The pack's INFO log (auto's timings) goes to stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.util
import json
import logging
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from e2e_models import FAMILIES, FULL, TINY, build, check_sensitivity, inputs  # noqa: F401  (check_dynamic_vram.py)


def load_pack(name="triton_accel_bench"):
    """The pack as ComfyUI loads it; E2E_PACK_ROOT=<folder> loads another copy of it (an earlier
    release unpacked there, for a before/after on one machine) under the same name."""
    root = Path(os.environ.get("E2E_PACK_ROOT") or ROOT).resolve()
    spec = importlib.util.spec_from_file_location(name, root / "__init__.py", submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def start_aimdo() -> object:
    """comfy_aimdo.control after its init(), as ComfyUI's main.py calls it before torch is
    imported (aimdo takes over the CUDA allocations torch makes). SystemExit when missing."""
    if "torch" in sys.modules:
        raise SystemExit("dynamic VRAM: comfy_aimdo must be started before torch is imported")
    try:
        import comfy_aimdo.control
    except ImportError as e:
        raise SystemExit(f"dynamic VRAM needs comfy-aimdo (ComfyUI 0.29's requirements.txt pins it): {e}") from None
    try:
        started = comfy_aimdo.control.init()
    except Exception as e:
        raise SystemExit(f"dynamic VRAM: comfy_aimdo.control.init() failed: {type(e).__name__}: {e}") from None
    if not started:
        raise SystemExit("dynamic VRAM: comfy_aimdo.control.init() could not load its library (NVIDIA/AMD on "
                         "Linux or Windows only)")
    return comfy_aimdo.control


def enable_dynamic_vram(aimdo_control) -> None:
    """What ComfyUI 0.29's main.py does once comfy is imported: aimdo on every torch device,
    ModelPatcherDynamic as the core patcher, aimdo_enabled. SystemExit when it cannot."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("dynamic VRAM needs a CUDA GPU (comfy-aimdo manages CUDA memory); none is visible")
    import comfy.memory_management
    import comfy.model_management
    import comfy.model_patcher

    if not hasattr(comfy.model_patcher, "ModelPatcherDynamic"):
        raise SystemExit("dynamic VRAM needs ComfyUI 0.29 or later (no ModelPatcherDynamic in this ComfyUI)")
    devices = comfy.model_management.get_all_torch_devices()
    try:
        ok = aimdo_control.init_devices((d.index, 0) for d in devices)
    except TypeError:  # comfy-aimdo 0.4.9's protocol, as main.py handles it
        ok = aimdo_control.init_devices(d.index for d in devices)
    if not ok:
        raise SystemExit("dynamic VRAM: comfy_aimdo.control.init_devices() refused the GPUs")
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    print(f"dynamic VRAM on (comfy-aimdo) for {[str(d) for d in devices]}", flush=True)


def sage_override():
    import comfy.ldm.modules.attention as attention

    sage = attention.REGISTERED_ATTENTION_FUNCTIONS.get("sage")
    if sage is None:
        return None

    def override(func, *args, **kwargs):
        return sage(*args, **kwargs)
    return override


def step_fn(patcher, x, t, context, kwargs):
    import copy
    import torch

    # What comfy.samplers.calc_cond_batch does per step: a copy of the model's
    # transformer_options handed to apply_model.
    def run():
        to = copy.copy(patcher.model_options.get("transformer_options", {}))
        # and what comfy.sampler_helpers.prepare_model_patcher adds: the patcher's wrappers
        # (TorchCompileModel's lives there) and callbacks.
        import comfy.patcher_extension as pe

        to["wrappers"] = pe.merge_nested_dicts(pe.copy_nested_dicts(to.get("wrappers", {})), patcher.wrappers)
        to["callbacks"] = pe.merge_nested_dicts(pe.copy_nested_dicts(to.get("callbacks", {})), patcher.callbacks)
        # ComfyUI's executor runs every node, the sampler included, under inference_mode (where
        # views record no _base: what our fused activations' marks must survive).
        with torch.inference_mode():
            return patcher.model.apply_model(x, t, c_crossattn=context, transformer_options=to, **kwargs)
    return run


# Warm-up calls of a +compile variant: dynamo recompiles ComfyUI's WrapperExecutor.execute on
# each call (it guards on a bound method made per call) until its recompile limit (8) leaves
# that frame eager; the steps timed after are the steady state a user's sampler reaches.
COMPILE_WARMUP = int(os.environ.get("E2E_COMPILE_WARMUP", "9"))


def time_steps(run, steps, device, warmup: int = 1):
    """(median ms per step, last output, first call's ms)."""
    import torch

    t0 = time.perf_counter()
    out = run()  # warm-up: compilation, autotune lookups, auto's one-off timing, weight quantisation
    if device.type == "cuda":
        torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(warmup - 1):
        out = run()
    times, gc_ms, host_ms = [], [], []
    pauses = GcPauses()
    sync_debug = os.environ.get("E2E_SYNC_DEBUG") and device.type == "cuda"
    if sync_debug:  # every host-device synchronisation inside a timed step warns, with its stack
        torch.cuda.set_sync_debug_mode("warn")
    for _ in range(steps):
        with pauses.step():
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t0 = time.perf_counter()
                out = run()
                # The host's time to issue the step: close to the step time when the GPU waits
                # for the host (a host-bound step), well below it when the GPU is the bound.
                host_ms.append((time.perf_counter() - t0) * 1e3)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                out = run()
                times.append((time.perf_counter() - t0) * 1e3)
        gc_ms.append(pauses.last_ms)
    if sync_debug:
        torch.cuda.set_sync_debug_mode(0)
    time_steps.last_host_ms = host_ms
    time_steps.last_times = times  # every timed step, for the JSON (a slow first step shows there)
    time_steps.last_gc_ms = gc_ms  # Python's garbage-collector pauses inside each timed step
    return statistics.median(times), out, first_ms


class GcPauses:
    """Milliseconds the Python garbage collector ran during a step (gc.callbacks): a host-bound
    step (Flux on the H200) waits for them, so a collection shows up in its time."""

    def __init__(self):
        self.last_ms = 0.0
        self._t0 = None

    def _callback(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.last_ms += (time.perf_counter() - self._t0) * 1e3
            self._t0 = None

    def step(self):
        import contextlib
        import gc

        @contextlib.contextmanager
        def timed():
            self.last_ms = 0.0
            gc.callbacks.append(self._callback)
            try:
                yield
            finally:
                gc.callbacks.remove(self._callback)
        return timed()


def profile_step(run, device, folder: Path, label: str) -> None:
    """One more step under cProfile (E2E_CPROFILE=<folder>): where the host time of a step goes,
    for steps that the CPU rather than the GPU bounds (e.g. under dynamic VRAM)."""
    import cProfile
    import io
    import pstats

    import torch

    prof = cProfile.Profile()
    wall = time.perf_counter()
    prof.enable()
    run()
    prof.disable()
    host_ms = (time.perf_counter() - wall) * 1e3
    if device.type == "cuda":
        torch.cuda.synchronize()
    total_ms = (time.perf_counter() - wall) * 1e3
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(35)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(70)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"cprofile_{label}.txt").write_text(f"host {host_ms:.1f} ms of {total_ms:.1f} ms (step incl. sync)\n"
                                                   + text.getvalue())
    print(f"[profile] {label}: host {host_ms:.1f} ms, step {total_ms:.1f} ms", flush=True)


def kernel_profile_step(run, folder: Path, label: str) -> None:
    """One more step under torch.profiler (E2E_KPROFILE=<folder>): device time per kernel,
    grouped by name, largest first: where the GPU time of a step goes."""
    from _profile import device_ms_per_kernel, step_timeline

    rows = sorted(((ms, key) for key, ms in device_ms_per_kernel(run, warmup=False).items()), reverse=True)
    total = sum(ms for ms, _ in rows)
    lines = [f"device total {total:.1f} ms (kernels, one step)", "ms | share | kernel"]
    lines += [f"{ms:.2f} | {100 * ms / total:.1f}% | {key[:160]}" for ms, key in rows[:45]]
    # A second step with host activity too: GPU busy time against the kernels' span (the gaps are
    # waits for the host) and the host calls with the most self time (the profiler's own cost
    # inflates the host side; the busy/span ratio is what to compare between variants).
    tl = step_timeline(run)
    lines += ["", f"timeline: device busy {tl['device_busy_ms']:.1f} ms of a {tl['device_span_ms']:.1f} ms span, "
              f"{tl['kernels']} kernels", "host self ms | calls | op"]
    lines += [f"{ms:.2f} | {n} | {key[:140]}" for ms, n, key in tl["host_self_ms"]]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"kprofile_{label}.txt").write_text("\n".join(lines) + "\n")
    print(f"[kprofile] {label}: device {total:.1f} ms; busy {tl['device_busy_ms']:.1f} of "
          f"{tl['device_span_ms']:.1f} ms span, {tl['kernels']} kernels", flush=True)


# The weights each variant's model is built with (default bf16).
WEIGHTS_OF = {"comfy-fp8-fast": "fp8-fast", "ours-fp8ckpt": "fp8", "default-fp8ckpt": "fp8"}
# variant -> (attention mode or None, Linear mode or None); None: that part is not patched.
OURS = {"ours-auto": ("auto", None), "ours-triton": ("fp16", None), "ours-fp8": ("fp8", None),
        "ours-int8": ("int8", None), "ours-linear": (None, "auto"), "ours-linear-fp8": (None, "fp8"),
        "ours-all": ("auto", "auto"), "ours-all-fp8": ("fp8", "fp8"), "ours-fp8ckpt": ("auto", "auto"),
        "ours-linear-unfused": (None, "auto"), "ours-all-unfused": ("auto", "auto"),
        "ours-linear-nocopy": (None, "auto"), "ours-all-nocopy": ("auto", "auto")}
# Variants whose Linear patch leaves every GELU to ComfyUI (the epilogue fusion's before/after).
UNFUSED = {"ours-linear-unfused", "ours-all-unfused"}
# Variants that leave Flux's single-block GELU (the one fused with a contiguous copy) to ComfyUI.
NOT_COPIED = {"ours-linear-nocopy", "ours-all-nocopy"}


def pack_module(name: str, before: str):
    """The pack's module `name` (runtime.x), or `before` (nodes.y): where it lived before the
    runtime package, so E2E_PACK_ROOT can load an earlier release for a before/after."""
    try:
        return importlib.import_module(f"triton_accel_bench.{name}")
    except ModuleNotFoundError:
        return importlib.import_module(f"triton_accel_bench.{before}")


def patch_ours(base, attention_mode, linear_mode, fuse_activations=True, copy_activations=True):
    """The clone the pack's nodes would hand to the sampler for these settings."""
    AccelSettings = pack_module("runtime.settings", "nodes.settings").AccelSettings

    settings = AccelSettings(attention_mode or "off", linear_mode=linear_mode or "off")
    patched = base
    if attention_mode is not None:
        patched = pack_module("runtime.attention_patch", "nodes.patch_attention").patch_model(patched, settings)
    if linear_mode is not None:
        linear_patch = pack_module("runtime.linear_patch", "nodes.patch_linear")
        patched = linear_patch.patch_linear_model(patched, settings, fuse_activations=fuse_activations,
                                                  copy_activations=copy_activations)
    return patched


def fast_launch_state() -> dict:
    """Whether the kernels' direct launch is still on (a disagreement anywhere turns it off for
    the process, and every later call pays Triton's JIT launch) and how many plans it serves."""
    dl = sys.modules.get("triton_accel_bench.kernels.core.direct_launch") or \
        sys.modules.get("triton_accel_bench.kernels.direct_launch")  # an earlier release's layout
    if dl is None:
        return {}
    return {"enabled": bool(dl.ENABLED), "verified_plans": dl.verified_count()}


COMPILED_SUFFIX = "+compile"


# +norms / +blocks / +nonorms: TRITON_ACCEL_FUSED_NORMS=all / blocks / off (unset otherwise: the pack's default)
NORMS_SUFFIXES = {"norms": "all", "nonorms": "off", "blocks": "blocks", "qk": "qk"}
# +graph: TRITON_ACCEL_STEP_GRAPH=1 (step graphs on, the default); +nograph: 0 (every step eager).
GRAPH_SUFFIXES = {"graph": "1", "nograph": "0"}
# +rope: TRITON_ACCEL_FUSED_ROPE=1 (the default); +norope: 0 (Flux blocks: QK norm, cat, ComfyUI's RoPE).
ROPE_SUFFIXES = {"rope": "1", "norope": "0"}
# +split: TRITON_ACCEL_SPLIT_TAIL=1 (the default); +nosplit: 0 (the FP8 Linear's tiles all whole).
SPLIT_SUFFIXES = {"split": "1", "nosplit": "0"}
# Calls of our variants before the timed steps: a first step quantises, guards and times
# attention, the next ones time the Linear call classes, then auto's step check runs four eager
# steps (ours, ComfyUI's, ours, ComfyUI's) before it settles; with step graphs on, the third
# call is recorded. The timed steps are the state a sampler settles in.
GRAPH_WARMUP = 8


def dynamo_summary() -> dict:
    """What dynamo made of a compiled variant: graphs, graph breaks (by reason), recompiles."""
    from torch._dynamo.utils import counters

    breaks = {reason.split("\n")[0][:120]: n for reason, n in counters["graph_break"].items()}
    return dict(frames=dict(counters["frames"]), unique_graphs=counters["stats"].get("unique_graphs", 0),
                graph_breaks=sum(counters["graph_break"].values()), break_reasons=breaks,
                recompile_limit_hit=counters["unimplemented"].get("recompile_limit reached", 0))


class _AbsentPyAVStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stands in for PyAV ("av") where it is not installed (the GPU machine has no network and
    its wheel, ~40 MB, does not fit the carry beside comfy-kitchen). ComfyUI 0.29's
    comfy_api.latest imports av at module level for its video types; TorchCompileModel, the
    only node that pulls comfy_api.latest in here, never calls into it. Any attribute is a
    fresh empty class, so module-level `from av.x import Y` and subclassing still work, and
    anything that really used av would fail loudly. Dunder names are absent, as on a real module
    without them."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "av" or fullname.startswith("av."):
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = type(sys)(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: self._placeholder(spec.name, attr)
        return module

    @staticmethod
    def _placeholder(module_name, attr):
        if attr.startswith("__"):  # __file__, __spec__ ...: dynamo walks sys.modules and reads them
            raise AttributeError(attr)
        return type(attr, (), {"__module__": module_name})

    def exec_module(self, module):
        pass


def compile_like_the_node(patcher):
    """What ComfyUI's TorchCompileModel node returns for this model (backend inductor)."""
    try:
        import av  # noqa: F401
    except ImportError:
        logging.getLogger("e2e").warning("PyAV (av) not installed: stubbed so comfy_api.latest imports")
        sys.meta_path.append(_AbsentPyAVStub())
    from comfy_extras.nodes_torch_compile import TorchCompileModel

    return TorchCompileModel.execute(patcher, "inductor").result[0]


def split_variant(variant: str) -> tuple[str, bool]:
    """(the variant without suffixes, whether +compile)."""
    parts = variant.split("+")
    rest = [p for p in parts[1:] if p != "compile" and p not in NORMS_SUFFIXES
            and p not in GRAPH_SUFFIXES and p not in ROPE_SUFFIXES and p not in SPLIT_SUFFIXES]
    return "+".join([parts[0], *rest]), "compile" in parts[1:]


def base_variant(variant: str) -> str:
    """The variant without its suffixes."""
    return split_variant(variant)[0]


@contextlib.contextmanager
def env_setting(name: str, value: str | None):
    """Environment variable `name` = value (None: unset) while a variant is patched and run, then
    as it was: the pack reads these per call or at patch time, so variants of one process do not
    leak into each other."""
    before = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if before is not None:
            os.environ[name] = before


def fused_norms(value: str | None):
    """TRITON_ACCEL_FUSED_NORMS (read at patch time)."""
    return env_setting("TRITON_ACCEL_FUSED_NORMS", value)


def step_graph_setting(value: str | None):
    """TRITON_ACCEL_STEP_GRAPH (None: unset, the default: on; read per call)."""
    return env_setting("TRITON_ACCEL_STEP_GRAPH", value)


def run_variant(name, variant, base, x, t, context, kwargs, steps, device, ref, dynamic_vram=False):
    base_name, compiled = split_variant(variant)
    norms = next((NORMS_SUFFIXES[p] for p in variant.split("+")[1:] if p in NORMS_SUFFIXES), None)
    graph = next((GRAPH_SUFFIXES[p] for p in variant.split("+")[1:] if p in GRAPH_SUFFIXES), None)
    rope = next((ROPE_SUFFIXES[p] for p in variant.split("+")[1:] if p in ROPE_SUFFIXES), None)
    split = next((SPLIT_SUFFIXES[p] for p in variant.split("+")[1:] if p in SPLIT_SUFFIXES), None)
    with fused_norms(norms), step_graph_setting(graph), \
            env_setting("TRITON_ACCEL_FUSED_ROPE", rope), env_setting("TRITON_ACCEL_SPLIT_TAIL", split):
        row = run_variant_uncompiled(name, base_name, base, x, t, context, kwargs, steps, device, ref,
                                     dynamic_vram, compiled=compiled, tag=variant)
    row["variant"] = variant
    return row


def run_variant_uncompiled(name, variant, base, x, t, context, kwargs, steps, device, ref, dynamic_vram=False,
                           compiled=False, tag=None):
    """`tag`: the variant with its suffixes, naming its profile files (the default: `variant`)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    call_stats = pack_module("runtime.call_stats", "nodes.call_stats")

    ctx = contextlib.nullcontext()
    patcher = base
    if variant == "sdpa-flash":
        if device.type != "cuda":
            return dict(model=name, variant=variant, error="needs CUDA")
        ctx = sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    elif variant == "sage":
        override = sage_override()
        if override is None:
            return dict(model=name, variant=variant, error="sageattention not importable")
        patcher = base.clone()
        patcher.model_options["transformer_options"]["optimized_attention_override"] = override
    elif variant in OURS:
        try:
            patcher = patch_ours(base, *OURS[variant], fuse_activations=variant not in UNFUSED,
                                 copy_activations=variant not in NOT_COPIED)
        except Exception as e:
            return dict(model=name, variant=variant, error=f"patch failed: {type(e).__name__}: {e}"[:300])
    elif variant not in ("default", "default-fp8ckpt", "comfy-fp8-fast"):
        return dict(model=name, variant=variant, error="unknown variant")
    if compiled:
        try:
            patcher = compile_like_the_node(patcher)
        except Exception as e:
            return dict(model=name, variant=variant, error=f"TorchCompileModel failed: {type(e).__name__}: {e}"[:300])
        import torch._dynamo.utils

        torch._dynamo.utils.counters.clear()
    call_stats.reset()
    kernel_stats = sys.modules["triton_accel_bench.kernels"].stats
    kernel_stats.reset()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    import comfy.model_management

    try:
        # What the sampler does before its steps: load the clone, which applies its object
        # patches (the Linear patch lives there; the attention override travels in
        # transformer_options). Unloaded after, so the next variant starts from the plain model.
        comfy.model_management.load_models_gpu([patcher], force_full_load=True)
        with ctx:
            ms, out, first_ms = time_steps(step_fn(patcher, x, t, context, kwargs), steps, device,
                                           warmup=COMPILE_WARMUP if compiled else
                                           GRAPH_WARMUP if variant in OURS and not compiled else 1)
            if os.environ.get("E2E_KPROFILE") and device.type == "cuda":
                kernel_profile_step(step_fn(patcher, x, t, context, kwargs), Path(os.environ["E2E_KPROFILE"]),
                                    f"{name}_{tag or variant}{'_dynamic' if dynamic_vram else ''}")
            if os.environ.get("E2E_CPROFILE"):
                profile_step(step_fn(patcher, x, t, context, kwargs), device, Path(os.environ["E2E_CPROFILE"]),
                             f"{name}_{tag or variant}{'_dynamic' if dynamic_vram else ''}")
        # Everything on the GPU, the VBAR's resident weights included (aimdo allocates those
        # outside torch's allocator, so max_memory_allocated does not see them).
        free, total = torch.cuda.mem_get_info() if device.type == "cuda" else (0, 0)
        device_used = (total - free) / 2**30 if device.type == "cuda" else float("nan")
    except Exception as e:  # one broken variant must not lose the others' numbers
        print(f"[{name}] {variant}: FAILED {e}", flush=True)
        traceback.print_exc()
        return dict(model=name, variant=variant, error=f"{type(e).__name__}: {e}"[:300])
    finally:
        comfy.model_management.unload_all_models()
        if compiled:  # the next variant compiles its own forwards, within dynamo's recompile limit
            torch._dynamo.reset()
    out = out.float()
    base_out = out if ref is None else ref
    diff = ((out - base_out).norm() / base_out.norm()).item()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), base_out.flatten(), dim=0).item()
    snap = call_stats.snapshot()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    linear = snap.get("kinds", {}).get("linear", {})
    if dynamic_vram and variant in OURS and OURS[variant][1] is not None and not linear.get("served"):
        print(f"[{name}] {variant}: WARNING no Linear call served under dynamic VRAM: {linear.get('reasons')}",
              flush=True)
    row = dict(model=name, variant=variant, ms_per_step=ms, rel_l2_vs_default=diff, cosine_vs_default=cos,
               first_call_ms=first_ms, step_ms=list(getattr(time_steps, "last_times", [])),
               step_gc_ms=[round(g, 2) for g in getattr(time_steps, "last_gc_ms", [])],
               step_host_ms=[round(h, 1) for h in getattr(time_steps, "last_host_ms", [])],
               fast_launch=fast_launch_state(), peak_gib=peak,
               device_used_gib=device_used, finite=bool(torch.isfinite(out).all()),
               calls={kind: f"{c['served']} ours/{c['handed_back']} back" for kind, c in snap.get("kinds", {}).items()},
               paths=snap["paths"], linear_paths=snap.get("kinds", {}).get("linear", {}).get("paths", {}),
               linear_reasons=snap.get("kinds", {}).get("linear", {}).get("reasons", {}),
               kernel_calls=dict(kernel_stats.counts()), out=out)
    if compiled:
        row["dynamo"] = dynamo_summary()
    print(f"[{name}] {variant}{COMPILED_SUFFIX if compiled else ''}: {ms:.1f} ms/step (first call {first_ms:.0f} ms), rel L2 {diff:.2e}, "
          f"cos {cos:.6f}, peak {peak:.1f} GiB (device {device_used:.1f} GiB in use), calls {row['calls']} "
          f"{row['linear_paths']}; steps {[round(t, 1) for t in row['step_ms']]} ms, host {row['step_host_ms']} ms, "
          f"gc {row['step_gc_ms']} ms, direct launch {row['fast_launch']}"
          + (f", dynamo {row['dynamo']}" if compiled else ""), flush=True)
    del patcher
    return row


def run_benchmark_node(name, base, x, context, kwargs, out_dir):
    """The TritonAccelBenchmark node on this model, as a ComfyUI graph would run it (one sampling
    step through comfy.sample), its result written to out_dir/benchmark_node_<name>/."""
    import folder_paths

    from triton_accel_bench.nodes.benchmark_node import benchmark
    from triton_accel_bench.runtime.settings import AccelSettings

    folder_paths.set_user_directory(str(out_dir / f"benchmark_node_{name}"))
    extra = {}
    if "y" in kwargs:
        extra = {"pooled_output": kwargs["y"], "guidance": 3.5}
    positive = [[context, extra]]
    t0 = time.perf_counter()
    try:
        text, _image, _result, png = benchmark(base, positive, {"samples": x.cpu()}, AccelSettings("auto"), repeats=10)
    except Exception as e:
        print(f"[{name}] benchmark node: FAILED {type(e).__name__}: {e}", flush=True)
        return
    print(f"[{name}] benchmark node ({time.perf_counter() - t0:.0f} s, chart {'yes' if png else 'no'}):\n{text}",
          flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH", str(ROOT / ".ext" / "ComfyUI-0.29.0")))
    ap.add_argument("--models", nargs="+", default=["flux", "wan"], choices=FAMILIES)
    ap.add_argument("--variants", nargs="+", default=["default", "sdpa-flash", "sage", "ours-auto", "ours-triton", "ours-fp8",
                                                      "comfy-fp8-fast", "ours-linear", "ours-all"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--check-sensitivity", action="store_true",
                    help="print (and keep in the JSON's meta) the unpatched model's output change for a 1%% change "
                         "of one attention's output, and each block's update over its residual")
    ap.add_argument("--benchmark-node", action="store_true",
                    help="also run the TritonAccelBenchmark node (settings auto) on each bf16 model; its JSON and "
                         "chart go to OUT/benchmark_node_<model>/")
    ap.add_argument("--dynamic-vram", action="store_true",
                    help="run under ComfyUI 0.29+'s dynamic VRAM (comfy-aimdo, ModelPatcherDynamic; weights on the "
                         "CPU, streamed per call), as ComfyUI starts by default on NVIDIA; needs CUDA and comfy-aimdo")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "benchmarks" / "results")))
    ap.add_argument("--fresh-process", action="store_true",
                    help="run each (model, variant) in its own process, in the order given (repeat variants for "
                         "an ABBA order): a host-bound step's time then does not depend on what ran before it "
                         "in the process; the first default's output is the reference of the later ones")
    ap.add_argument("--ref-file", help=argparse.SUPPRESS)  # --fresh-process: the reference output, shared
    args = ap.parse_args()
    if args.fresh_process:
        return fresh_process_main(args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("triton_accel").setLevel(logging.INFO)

    sys.path.insert(0, args.comfyui)
    aimdo = start_aimdo() if args.dynamic_vram else None
    import torch

    import comfy.cli_args

    if not torch.cuda.is_available():
        comfy.cli_args.args.cpu = True  # model_management asks CUDA for its device at import
    if args.dynamic_vram:
        enable_dynamic_vram(aimdo)
    pack = load_pack()

    os.environ.setdefault("TRITON_ACCEL_CACHE_DIR", str(Path(args.out) / "cache"))
    # With an index: comfy-aimdo's VBAR (dynamic VRAM) takes load_device.index.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    specs = TINY if args.tiny else FULL
    results, sensitivities = [], {}
    for name in args.models:
        spec = specs[name]
        x = t = context = kwargs = None
        ref = None
        if args.ref_file and os.path.exists(args.ref_file):
            ref = torch.load(args.ref_file).to(device)
        # Variants grouped by the weights they need: one full-size model in memory at a time.
        for weights in ("bf16", "fp8-fast", "fp8"):
            todo = [v for v in args.variants if WEIGHTS_OF.get(base_variant(v), "bf16") == weights]
            if not todo:
                continue
            t_build = time.perf_counter()
            base = build(spec, dtype, device, weights, args.dynamic_vram)
            x, t, context, kwargs = inputs(spec, dtype, device)
            print(f"[{name}] built ({weights}) in {time.perf_counter() - t_build:.1f} s", flush=True)
            if args.check_sensitivity and name not in sensitivities:
                sensitivities[name] = check_sensitivity(name, spec, base, step_fn(base, x, t, context, kwargs))
            for variant in todo:
                row = run_variant(name, variant, base, x, t, context, kwargs, args.steps, device, ref,
                                  args.dynamic_vram)
                results.append(row)
                if ref is None and "out" in row:
                    ref = row["out"]
                    if args.ref_file:
                        torch.save(ref.cpu(), args.ref_file)
                row.pop("out", None)
            if args.benchmark_node and weights == "bf16":
                run_benchmark_node(name, base, x, context, kwargs, Path(args.out))
            del base
            if device.type == "cuda":
                torch.cuda.empty_cache()

    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                triton=pack.kernels.triton_version(), dtype=str(dtype), steps=args.steps, tiny=args.tiny,
                dynamic_vram=args.dynamic_vram, comfy_kitchen=comfy_kitchen_backends(),
                pack=os.environ.get("E2E_PACK_ROOT") or "this checkout")
    if sensitivities:
        meta["sensitivity"] = sensitivities
    write_report(args, meta, results)



def comfy_kitchen_backends() -> str:
    """Which comfy-kitchen ComfyUI runs with (its CUDA backend makes the default's RoPE one kernel)."""
    ck = sys.modules.get("comfy_kitchen")
    if ck is None:
        return "not imported"
    try:
        names = [name for name, info in ck.list_backends().items()
                 if info.get("available") and not info.get("disabled")]
    except Exception:
        names = []
    try:
        from importlib.metadata import version

        ck_version = version("comfy_kitchen")
    except Exception:
        ck_version = getattr(ck, "__version__", "?")
    return f"{ck_version} ({', '.join(names) or 'backends unknown'})"


def fresh_process_main(args) -> None:
    """--fresh-process: each (model, variant) in a child process of this script, one after the
    other, their rows gathered into one report; ratios use the median of the default's runs."""
    import subprocess
    import tempfile

    results, meta = [], {}
    tmp = Path(tempfile.mkdtemp(prefix="e2e_fresh_"))
    passthrough = ["--comfyui", args.comfyui, "--steps", str(args.steps)] + (["--tiny"] if args.tiny else []) \
        + (["--dynamic-vram"] if args.dynamic_vram else [])
    for name in args.models:
        ref_file = tmp / f"ref_{name}.pt"
        order = list(args.variants)
        if "default" in order and order[0] != "default":  # the reference first
            order.insert(0, "default")
        for i, variant in enumerate(order):
            out = tmp / f"{name}_{i}_{variant}"
            cmd = [sys.executable, __file__, *passthrough, "--models", name, "--variants", variant, "--out", str(out),
                   "--ref-file", str(ref_file)]
            print(f"[fresh process] {name} {variant} ({i + 1}/{len(order)})", flush=True)
            rc = subprocess.run(cmd).returncode
            report = out / ("e2e_comfyui_dynamic_vram.json" if args.dynamic_vram else "e2e_comfyui.json")
            if rc != 0 or not report.exists():
                results.append(dict(model=name, variant=variant, error=f"child process exited with {rc}"))
                continue
            child = json.loads(report.read_text())
            meta = child["meta"]
            for row in child["results"]:
                row["run"] = i
                results.append(row)
    meta = dict(meta, fresh_process=True)
    write_report(args, meta, results)


def write_report(args, meta: dict, results: list) -> None:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / ("e2e_comfyui_dynamic_vram.json" if args.dynamic_vram else "e2e_comfyui.json")).write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    print(f"\n{meta}")
    print(f"{'model':6} {'variant':15} {'ms/step':>9} {'vs default':>10} {'rel L2':>9} {'cosine':>9} "
          f"{'first ms':>9} {'peak GiB':>8}  calls")
    for name in args.models:
        defaults = [r["ms_per_step"] for r in results if r["model"] == name and r["variant"] == "default"
                    and "ms_per_step" in r]
        default = statistics.median(defaults) if defaults else None
        compiled = [r["ms_per_step"] for r in results if r["model"] == name
                    and r["variant"] == "default" + COMPILED_SUFFIX and "ms_per_step" in r]
        compiled_default = statistics.median(compiled) if compiled else None
        for r in (r for r in results if r["model"] == name):
            if "error" in r:
                print(f"{name:6} {r['variant']:15} {'-':>9} {'-':>10} {'-':>9}  {r['error']}")
                continue
            ratio = default / r["ms_per_step"] if default else float("nan")
            # compiled variants also against ComfyUI's own compiled model
            vs_compiled = (f" ({compiled_default / r['ms_per_step']:.3f}x default{COMPILED_SUFFIX})"
                           if compiled_default and r["variant"].endswith(COMPILED_SUFFIX) else "")
            print(f"{name:6} {r['variant']:15} {r['ms_per_step']:9.1f} {ratio:9.3f}x {r['rel_l2_vs_default']:9.2e}"
                  f" {r['cosine_vs_default']:9.6f} {r['first_call_ms']:9.0f} {r['peak_gib']:8.1f}  {r['calls']} "
                  f"{r.get('kernel_calls', {})}{vs_compiled}")
    # A variant run more than once (an ABBA order): the median of its runs' ms/step.
    for name in args.models:
        by_variant: dict[str, list] = {}
        for r in results:
            if r["model"] == name and "ms_per_step" in r:
                by_variant.setdefault(r["variant"], []).append(r["ms_per_step"])
        if any(len(v) > 1 for v in by_variant.values()):
            default = statistics.median(by_variant.get("default", [float("nan")]))
            print(f"\n{name}: median ms/step over runs (vs default's median)")
            for variant, ms in by_variant.items():
                med = statistics.median(ms)
                print(f"{name:6} {variant:15} {med:9.1f} {default / med:9.3f}x  runs {[round(m, 1) for m in ms]}")


if __name__ == "__main__":
    main()
