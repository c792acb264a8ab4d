"""Everything the pack shares, used from many threads at once, as under ComfyUI's MultiGPU work units.

ComfyUI 0.29's "MultiGPU CFG Split" (comfy/multigpu.py) loads one more copy of the model per
extra GPU (`deepclone_multigpu`: a fresh model from the loader, with the patcher's object patches
and callbacks copied over) and runs each GPU's share of the conds in its own thread
(MultiGPUThreadPool). So our attention override, our Linear layers, the route / speed / tuning
caches, the stats counters and the JSON cache files are used by several threads at once.

Each test that covers a race we fixed says so, and fails on the code before the fix:
- a Linear patch copied onto a MultiGPU clone ran the first model's weights
  (test_multigpu_clone_runs_its_own_weights_in_its_own_thread);
- auto's timing held one lock for every device, so cuda:1 waited for all of cuda:0's timings
  (test_speed_choice_times_two_devices_at_once);
- one autotune progress bar for every thread (test_autotune_progress_bar_is_per_thread);
- WeakSets iterated while another thread adds to them (test_live_sets_listed_while_filled).
`sys.setswitchinterval(1e-6)` and barriers make the overlaps happen on every run.

Kernels run on the CPU through TRITON_INTERPRET=1 (tests/conftest.py). Tolerances: attention
float32 through the interpreter vs SDPA: max abs error < 1e-4 (as tests/nodes/test_patch_attention);
Linear fp8_w8a8 vs float32 F.linear on the same weights: rel. L2 < 0.06 (e4m3 weights per channel
and activations per token, ~0.03-0.04 on Gaussian data, as tests/nodes/test_patch_linear); a thread's
result vs the same call made alone: bit-identical (the same kernel on the same inputs).
"""
from __future__ import annotations

import copy
import json
import sys
import threading
import time
import types
import uuid
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from triton_accel import kernels
from triton_accel.kernels.core import json_cache
from triton_accel.runtime import call_stats, speed_choice
from triton_accel.runtime import fused_activations, linear_common, linear_patch, linear_state, progress
from triton_accel.runtime.attention_patch import AttentionOverride
from triton_accel.runtime.settings import AccelSettings
from triton_accel.runtime.speed_choice import ORIGINAL, SpeedChoice

THREADS = 12  # threads of the tests whose calls are host code only
KERNEL_THREADS = 8  # threads of the tests that run interpreted kernels (one grid at a time)
CALLS = 4
KERNEL_CALLS = 2
ATTENTION_ATOL = 1e-4
LINEAR_TOL = 0.06
SETTINGS = AccelSettings("fp16", linear_mode="fp8")  # forced: our kernels on the CPU interpreter
BARRIER_TIMEOUT_S = 20.0


@contextmanager
def _switch_often():
    """Switch threads every microsecond: a check-then-act window of a few bytecodes gets hit."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _run_threads(target, n: int) -> list:
    """target(i) in n threads started together; their results in order, or the first error raised."""
    results, errors = [None] * n, []

    def run(i):
        try:
            with torch.no_grad():  # as in ComfyUI's worker threads (inference mode)
                results[i] = target(i)
        except BaseException as e:  # re-raised in the test's thread below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread did not finish (deadlock?)"
    if errors:
        raise errors[0]
    return results


@pytest.fixture(autouse=True)
def _fresh_counters():
    call_stats.reset()
    kernels.core.stats.reset()


@pytest.fixture(autouse=True)
def _one_interpreted_grid_at_a_time(monkeypatch):
    """Triton's interpreter keeps the running grid in a module global (interpreter_builder), so
    two threads interpreting kernels at once corrupt each other ("x >= grid_dim[0]"): a property
    of the CPU stand-in, not of GPU launches. Only the interpretation of one kernel grid is
    serialised here; everything of ours around it (routing, caches, preparation, the quality
    guard, counters) still runs in all threads at once."""
    from triton.runtime import interpreter

    grid_lock = threading.Lock()
    run_grid = interpreter.GridExecutor.__call__

    def locked(self, *args, **kwargs):
        with grid_lock:
            return run_grid(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", locked)


# ---- fakes: ComfyUI's Linear, attention and the ModelPatcher's MultiGPU clone path -----------

class ComfyLinear(torch.nn.Linear):
    """comfy.ops.disable_weight_init.Linear as far as the patch can tell."""

    comfy_cast_weights = False
    weight_function = ()
    bias_function = ()


class TinyDiT(torch.nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Module()])
        self.blocks[0].qkv = ComfyLinear(dim, 2 * dim)
        self.blocks[0].proj = ComfyLinear(2 * dim, dim)

    def forward(self, x):
        return self.blocks[0].proj(F.gelu(self.blocks[0].qkv(x)))


class BaseModel(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.diffusion_model = TinyDiT()


LAYERS = ("blocks.0.qkv", "blocks.0.proj")


def _resolve(obj, name):
    *path, last = name.split(".")
    for part in path:
        obj = getattr(obj, part)
    return obj, last


class FakePatcher:
    """comfy.model_patcher.ModelPatcher (0.29) as far as our patch and MultiGPU touch it:
    clone() shares the model and copies object patches and callbacks; deepclone_multigpu()
    loads a fresh model from the loader's factory, clones onto it and runs ON_DEEPCLONE_MULTIGPU;
    match_multigpu_clones() re-clones the main patcher onto each clone's model and runs
    ON_MATCH_MULTIGPU_CLONES; patch_model() installs the object patches and runs ON_LOAD."""

    def __init__(self, model, factory, load_device="cpu"):
        self.model = model
        self.factory = factory  # ModelPatcher.cached_patcher_init: the loader, called again
        self.load_device = torch.device(load_device)
        self.object_patches, self.object_patches_backup = {}, {}
        self.model_options = {"transformer_options": {}}
        self.callbacks: dict = {}
        self.patches_uuid = uuid.uuid4()
        self.multigpu: list[FakePatcher] = []

    def clone(self):
        n = FakePatcher(self.model, self.factory, self.load_device)
        n.object_patches = self.object_patches.copy()
        n.object_patches_backup = self.object_patches_backup
        n.model_options = {"transformer_options": dict(self.model_options["transformer_options"])}
        n.callbacks = {k: {k1: list(c1) for k1, c1 in c.items()} for k, c in self.callbacks.items()}
        n.patches_uuid = self.patches_uuid
        n.multigpu = list(self.multigpu)
        return n

    def add_object_patch(self, name, obj):
        self.object_patches[name] = obj

    def get_model_object(self, name):
        if name in self.object_patches:
            return self.object_patches[name]
        owner, last = _resolve(self.model, name)
        return getattr(owner, last)

    def add_callback_with_key(self, call_type, key, callback):
        self.callbacks.setdefault(call_type, {}).setdefault(key, []).append(callback)

    def _callbacks(self, call_type):
        return [cb for cbs in self.callbacks.get(call_type, {}).values() for cb in cbs]

    def deepclone_multigpu(self, new_load_device):
        n = self.clone()
        n.model, n.object_patches_backup, n.multigpu = self.factory(), {}, []
        n.load_device = torch.device(new_load_device)
        for cb in self._callbacks("on_deepclone_multigpu"):
            cb(self, n)
        return n

    def match_multigpu_clones(self):
        matched = []
        for mm in self.multigpu:
            n = self.clone()
            n.load_device, n.model, n.object_patches_backup, n.multigpu = (
                mm.load_device, mm.model, mm.object_patches_backup, [])
            for cb in self._callbacks("on_match_multigpu_clones"):
                cb(self, n)
            matched.append(n)
        self.multigpu = matched

    def patch_model(self):
        for name, obj in self.object_patches.items():
            owner, last = _resolve(self.model, name)
            self.object_patches_backup.setdefault(name, getattr(owner, last))
            setattr(owner, last, obj)
        for cb in self._callbacks("on_load_after"):
            cb(self, None, 0, False, True)
        return self.model


def create_multigpu_deepclones(model: FakePatcher, extra_devices) -> FakePatcher:
    """comfy.multigpu.create_multigpu_deepclones, without the device discovery."""
    model = model.clone()
    for device in extra_devices:
        model.multigpu.append(model.deepclone_multigpu(device))
    model.match_multigpu_clones()
    return model


def comfy_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                    skip_output_reshape=False, **kwargs):
    """ComfyUI's attention_pytorch for [B, L, heads * D] inputs."""
    b, _, dim = q.shape
    d = dim // heads
    q, k, v = (t.view(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, heads * d)


def _loader(seed):
    return lambda: BaseModel(seed)


def _linear_stats() -> dict:
    return call_stats.snapshot()["kinds"].get("linear", {"served": 0, "handed_back": 0})


def _rel_l2(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _unpatched(model: BaseModel, x):
    """The model's own Linear math (F.linear on its weights), whatever forwards are installed."""
    block = model.diffusion_model.blocks[0]
    h = F.gelu(F.linear(x, block.qkv.weight, block.qkv.bias))
    return F.linear(h, block.proj.weight, block.proj.bias)


# ---- the patched layers, many threads at once -----------------------------------------------

def test_patched_attention_and_linear_from_many_threads():
    """KERNEL_THREADS threads x KERNEL_CALLS calls of our attention override and of the patched
    Linear layers at once: every output equals the same call made alone, and every call is
    counted exactly once."""
    main = FakePatcher(BaseModel(0), _loader(0))
    patched = linear_patch.patch_linear_model(main, SETTINGS, skip="", min_tokens=4)
    model = patched.patch_model()
    override = AttentionOverride(SETTINGS, label="Fake #1")
    gen = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(2, 16, 32, generator=gen), torch.randn(2, 16, 64, generator=gen),
               torch.randn(2, 16, 64, generator=gen), torch.randn(2, 16, 64, generator=gen))
              for _ in range(2)]  # two inputs: threads of one input must agree bit for bit
    alone = [(model.diffusion_model(x), override(comfy_attention, q, k, v, 2)) for x, q, k, v in inputs]
    call_stats.reset()
    kernels.core.stats.reset()
    barrier = threading.Barrier(KERNEL_THREADS, timeout=BARRIER_TIMEOUT_S)

    def work(i):
        x, q, k, v = inputs[i % 2]
        barrier.wait()
        return [(model.diffusion_model(x), override(comfy_attention, q, k, v, 2)) for _ in range(KERNEL_CALLS)]

    results = _run_threads(work, KERNEL_THREADS)
    for i, runs in enumerate(results):
        for linear_out, attention_out in runs:
            assert torch.equal(linear_out, alone[i % 2][0])
            assert torch.equal(attention_out, alone[i % 2][1])
    x, q, k, v = inputs[0]
    assert _rel_l2(alone[0][0], _unpatched(model, x)) < LINEAR_TOL
    assert (alone[0][1] - comfy_attention(q, k, v, 2)).abs().max().item() < ATTENTION_ATOL
    snap = call_stats.snapshot()
    assert snap["kinds"]["linear"]["served"] == KERNEL_THREADS * KERNEL_CALLS * len(LAYERS)
    assert snap["kinds"]["linear"]["handed_back"] == 0
    assert snap["kinds"]["attention"]["served"] == KERNEL_THREADS * KERNEL_CALLS
    assert snap["models"]["Fake #1"]["kinds"]["attention"]["served"] == KERNEL_THREADS * KERNEL_CALLS
    counts = kernels.core.stats.counts()
    assert counts.get("triton_linear_fp8_w8a8") == KERNEL_THREADS * KERNEL_CALLS * len(LAYERS)
    assert counts.get("triton_attention") == KERNEL_THREADS * KERNEL_CALLS


def test_multigpu_clone_runs_its_own_weights_in_its_own_thread():
    """The fixed race's worst case: a MultiGPU clone's Linear layers must wrap the clone's own
    modules and prepare its own weights. Before the fix the copied object patches kept the first
    model's layers, so the clone's thread computed with the first model's weights (on two GPUs:
    every call handed back as offloaded, or weights copied over per call).

    The loader gives the clone other weights (seed 1) so that running the wrong copy shows."""
    main = FakePatcher(BaseModel(0), _loader(1))
    patched = linear_patch.patch_linear_model(main, SETTINGS, skip="", min_tokens=4)
    with_clones = create_multigpu_deepclones(patched, ["cpu"])
    (clone,) = with_clones.multigpu
    main_model, clone_model = with_clones.patch_model(), clone.patch_model()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 16, 32, generator=gen) for _ in range(KERNEL_THREADS)]
    barrier = threading.Barrier(KERNEL_THREADS, timeout=BARRIER_TIMEOUT_S)

    def work(i):  # even threads: the first GPU's model; odd: the clone's (MultiGPUThreadPool)
        model = main_model if i % 2 == 0 else clone_model
        barrier.wait()
        return [model.diffusion_model(xs[i]) for _ in range(KERNEL_CALLS)]

    results = _run_threads(work, KERNEL_THREADS)
    for i, runs in enumerate(results):
        own, other = (main_model, clone_model) if i % 2 == 0 else (clone_model, main_model)
        for out in runs:
            assert torch.equal(out, runs[0])
            assert _rel_l2(out, _unpatched(own, xs[i])) < LINEAR_TOL
            assert _rel_l2(out, _unpatched(other, xs[i])) > 0.5
    assert _linear_stats()["served"] == KERNEL_THREADS * KERNEL_CALLS * len(LAYERS)
    state, clone_state = patched.triton_accel_linear, getattr(clone, "triton_accel_linear", None)
    assert clone_state is not None and clone_state is not state
    for name in LAYERS:
        layer = clone.object_patches[f"diffusion_model.{name}.forward"]
        assert layer.state is clone_state and layer.module is clone.model.diffusion_model.get_submodule(name)
        assert layer.previous.__self__ is layer.module  # hands back to the clone's own forward
    # Each copy's prepared weights are its own: no tensor shared between the two states.
    ptrs = [{layer.entries["cpu"].prepared.weight.data_ptr() for layer in s.layers} for s in (state, clone_state)]
    assert len(ptrs[0]) == len(LAYERS) and not ptrs[0] & ptrs[1]


class MlpDiT(torch.nn.Module):
    """Wan's FFN shape: nn.Sequential(Linear, GELU(tanh), Linear), fused (FusedSequential)."""

    def __init__(self, dim=32):
        super().__init__()
        self.ffn = torch.nn.Sequential(ComfyLinear(dim, 2 * dim), torch.nn.GELU(approximate="tanh"),
                                       ComfyLinear(2 * dim, dim))

    def forward(self, x):
        return self.ffn(x)


class MlpModel(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.diffusion_model = MlpDiT()


def test_multigpu_clone_gets_its_own_fused_sequential():
    """The Sequential's patch (one activated op for Linear + GELU under torch.compile) names a
    Linear layer: a MultiGPU clone's must be the clone's own Sequential and layer, else a traced
    clone would run the first model's weights. Eager, each copy runs its own weights."""
    main = FakePatcher(MlpModel(0), lambda: MlpModel(1))
    patched = linear_patch.patch_linear_model(main, SETTINGS, skip="", min_tokens=4)
    key = "diffusion_model.ffn.forward"
    assert isinstance(patched.object_patches[key], fused_activations.FusedSequential)
    with_clones = create_multigpu_deepclones(patched, ["cpu"])
    (clone,) = with_clones.multigpu
    main_model, clone_model = with_clones.patch_model(), clone.patch_model()
    clone_state = clone.triton_accel_linear
    ours, theirs = with_clones.object_patches[key], clone.object_patches[key]
    assert isinstance(theirs, fused_activations.FusedSequential) and theirs is not ours
    assert theirs.module is clone_model.diffusion_model.ffn and ours.module is main_model.diffusion_model.ffn
    assert theirs.layer.state is clone_state and theirs.layer.module is clone_model.diffusion_model.ffn[0]
    assert theirs.previous.__self__ is theirs.module  # the clone's own Sequential.forward
    assert theirs.layer.activation_forward is not None
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        for model in (main_model, clone_model):
            ffn = model.diffusion_model.ffn
            expected = F.linear(F.gelu(F.linear(x, ffn[0].weight, ffn[0].bias), approximate="tanh"),
                                ffn[2].weight, ffn[2].bias)
            assert _rel_l2(model.diffusion_model(x), expected) < LINEAR_TOL


def test_multigpu_clone_state_is_reused_and_released_with_its_model():
    """ComfyUI matches the clones again before every sampling run (match_multigpu_clones): the
    clone's model, its state and its prepared weights are reused, not prepared again; ON_DETACH of
    the clone frees the clone's prepared weights only; the copies never deep-copy prepared weights."""
    prepared = []

    def prepare(weight, method, scale=None):
        prepared.append(weight.data_ptr())
        return kernels.prepare_weight(weight, method, scale)

    backend = linear_common.LinearBackend(prepare, kernels.linear, kernels.linear_refusal, kernels.LinearInputError)
    patched = linear_patch.patch_linear_model(FakePatcher(BaseModel(0), _loader(1)), SETTINGS, skip="", min_tokens=4,
                                    backend=backend)
    first = create_multigpu_deepclones(patched, ["cpu"])
    clone_model = first.multigpu[0].patch_model()
    clone_model.diffusion_model(torch.randn(1, 8, 32))
    assert len(prepared) == len(LAYERS)
    first.match_multigpu_clones()  # the next KSampler run
    again = first.multigpu[0]
    assert again.model is clone_model and again.triton_accel_linear is first.multigpu[0].triton_accel_linear
    again.patch_model().diffusion_model(torch.randn(1, 8, 32))
    assert len(prepared) == len(LAYERS)  # nothing prepared again
    assert copy.deepcopy(again.triton_accel_linear) is again.triton_accel_linear
    clone_state, state = again.triton_accel_linear, patched.triton_accel_linear
    for cb in again._callbacks("on_detach_after"):
        cb(again, True)
    assert clone_state.prepared_bytes() == 0 and all(not layer.entries for layer in clone_state.layers)
    assert state.layers[0].entries == {}  # the first model never ran: nothing of its was touched


# ---- auto's speed choice: two devices time at once, one device never overlaps ----------------

def _candidates(value: float):
    def ours():
        return torch.full((4,), value)

    def original():
        return torch.full((4,), 1.0)
    return {"triton_fp16": ours, ORIGINAL: original}


def test_speed_choice_times_two_devices_at_once(tmp_path):
    """The fixed race: one lock for all of auto's measurements made cuda:1's first call wait
    for every timing on cuda:0. Each device's timer waits until the other device's timer runs:
    with the old lock the barrier times out (BrokenBarrierError)."""
    both_timing = threading.Barrier(2, timeout=5.0)

    def timer(fn, device):
        if fn.__name__ == ORIGINAL:
            both_timing.wait()
        return (1.0 if fn.__name__ == "ours" else 2.0), fn()

    sc = SpeedChoice(tmp_path / "speed.json", timer=timer)
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    with _switch_often():
        choices = _run_threads(lambda i: sc.choose(f"gpu{i}|b1-q4096", _candidates(1.0), devices[i]), 2)
    assert [c[0] for c in choices] == ["triton_fp16", "triton_fp16"]
    assert set(json.loads((tmp_path / "speed.json").read_text())["entries"]) == {"gpu0|b1-q4096", "gpu1|b1-q4096"}


def test_speed_choice_measures_each_key_once_and_never_overlaps_on_one_device(tmp_path):
    """THREADS threads ask for 4 keys on 2 devices at once: each key is timed exactly once, every
    thread gets that key's answer, and two timings never run at once on the same device."""
    lock = threading.Lock()
    running: dict[str, int] = {}
    worst: dict[str, int] = {}
    timed: list[tuple[str, str]] = []

    def timer(fn, device):
        with lock:
            running[str(device)] = running.get(str(device), 0) + 1
            worst[str(device)] = max(worst.get(str(device), 0), running[str(device)])
        threading.Event().wait(0.02)  # a timing takes a while: others pile up meanwhile
        with lock:
            running[str(device)] -= 1
            timed.append((str(device), fn.__name__))
        return (1.0 if fn.__name__ == "ours" else 2.0), fn()

    sc = SpeedChoice(tmp_path / "speed.json", timer=timer)
    barrier = threading.Barrier(THREADS, timeout=BARRIER_TIMEOUT_S)

    def work(i):
        device = torch.device("cuda", i % 2)
        barrier.wait()
        return sc.choose(f"key{i % 4}", _candidates(1.0), device)[0]

    with _switch_often():
        choices = _run_threads(work, THREADS)
    assert choices == ["triton_fp16"] * THREADS
    assert len(timed) == 4 * 2  # 4 keys x (ComfyUI's + ours), each once
    assert worst == {"cuda:0": 1, "cuda:1": 1}


def test_autotune_progress_bar_is_per_thread(monkeypatch):
    """The fixed race: two GPUs autotuning at once under MultiGPU each get their own progress bar.
    With one bar for the process, thread A's steps went to the bar thread B had opened."""
    bars = []

    class ProgressBar:
        def __init__(self, total):
            self.total, self.updates = total, []
            bars.append(self)

        def update_absolute(self, value, total=None):
            self.updates.append((value, total))

    monkeypatch.setitem(sys.modules, "comfy.utils", types.SimpleNamespace(ProgressBar=ProgressBar))
    hook = progress.AutotuneProgress()
    a_opened, b_opened = threading.Event(), threading.Event()

    def tune(i):
        total = 3 if i == 0 else 5
        if i == 1:
            a_opened.wait(5)
        hook(0, total)
        (a_opened if i == 0 else b_opened).set()
        if i == 0:
            b_opened.wait(5)  # B opened its bar after A's: A's next steps must still go to A's bar
        for done in range(1, total + 1):
            hook(done, total)

    _run_threads(tune, 2)
    assert sorted(bar.total for bar in bars) == [3, 5]
    for bar in bars:
        assert {total for _, total in bar.updates} == {bar.total}
        assert [done for done, _ in bar.updates] == list(range(bar.total + 1))


# ---- counters, caches and files ---------------------------------------------------------------

def test_stats_counters_are_exact_after_many_threads():
    labels = _run_threads(lambda i: call_stats.new_model_label("Fake"), THREADS)
    assert len(set(labels)) == THREADS
    calls = 500

    def work(i):
        for _ in range(calls):
            kernels.core.stats.increment("triton_attention")
            call_stats.record("triton", path="triton_fp16", model=labels[i])
            call_stats.record("original", "why", kind="linear", model=labels[i])
            speed_choice.note_model_device(labels[i], f"cuda:{i % 2}")

    with _switch_often():
        _run_threads(work, THREADS)
    assert kernels.core.stats.counts()["triton_attention"] == THREADS * calls
    snap = call_stats.snapshot()
    assert snap["calls"]["triton"] == THREADS * calls
    assert snap["kinds"]["attention"]["served"] == THREADS * calls
    assert snap["kinds"]["linear"] == {"served": 0, "handed_back": THREADS * calls, "paths": {},
                                       "reasons": {"why": THREADS * calls}}
    for i, label in enumerate(labels):
        assert snap["models"][label]["kinds"]["attention"]["served"] == calls
        assert speed_choice.model_devices(label) == {f"cuda:{i % 2}"}


def test_json_cache_concurrent_writers_leave_a_whole_file(tmp_path):
    """THREADS writers (half through one cache object, half through their own objects on the
    same file, as two copies of the pack would) while a reader parses the file: the file always
    parses and in the end holds every entry."""
    path = tmp_path / "cache.json"

    def valid(key, entry):
        return isinstance(entry, dict)

    shared_cache = json_cache.JsonCache("test cache", path, 1, valid)
    done = threading.Event()
    torn = []

    def read():
        while not done.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            try:
                json.loads(text)
            except ValueError as e:
                torn.append(str(e))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    per_thread = 15

    def write(i):
        cache = shared_cache if i % 2 else json_cache.JsonCache("test cache", path, 1, valid)
        for j in range(per_thread):
            cache.put(f"t{i}-{j}", {"n": j})

    try:
        with _switch_often():
            _run_threads(write, THREADS)
    finally:
        done.set()
        reader.join(10)
    assert not torn
    entries = json.loads(path.read_text())["entries"]
    assert set(entries) == {f"t{i}-{j}" for i in range(THREADS) for j in range(per_thread)}
    assert not list(tmp_path.glob(".cache.json.*.tmp"))


def test_registry_and_route_caches_under_concurrent_clears():
    """Attention calls of 4 shapes from KERNEL_THREADS threads while another thread keeps clearing
    every cache of the pack (routes, decisions, registry answers): every call still gives the
    right output, and the registry answers the same implementation throughout."""
    gen = torch.Generator().manual_seed(2)
    shapes = [(1, 2, 16, 16), (1, 2, 32, 16), (2, 1, 16, 32), (1, 4, 8, 16)]
    qkv = [tuple(torch.randn(*s, generator=gen) for _ in range(3)) for s in shapes]
    stop = threading.Event()

    def clear():
        while not stop.is_set():
            kernels.clear_caches()

    clearer = threading.Thread(target=clear, daemon=True)
    clearer.start()

    def work(i):
        q, k, v = qkv[i % len(qkv)]
        outs = [kernels.attention(q, k, v, backend="triton_attention") for _ in range(KERNEL_CALLS)]
        impl = kernels.registry.select("attention", kernels.call_facts(q, k, v, None, False))
        return outs, impl.name

    try:
        with _switch_often():
            results = _run_threads(work, KERNEL_THREADS)
    finally:
        stop.set()
        clearer.join(10)
    for i, (outs, impl_name) in enumerate(results):
        q, k, v = qkv[i % len(qkv)]
        ref = F.scaled_dot_product_attention(q, k, v)
        for out in outs:
            assert (out - ref).abs().max().item() < ATTENTION_ATOL
        assert impl_name == results[0][1]


def _new_linear_state():
    return linear_state.LinearPatchState(SETTINGS, linear_common.SkipPatterns(), backend=linear_common.default_backend())


def _new_json_cache():
    return json_cache.JsonCache("test", "/nonexistent/x.json", 1, lambda key, entry: True)


@pytest.mark.parametrize("make, list_them", [(_new_linear_state, linear_state.fallback_report),
                                             (_new_json_cache, json_cache.clear_memory_copies)],
                         ids=["linear_patch_states", "json_caches"])
def test_live_sets_listed_while_filled(make, list_them):
    """The fixed race: the pack's WeakSets (live Linear patch states, live JSON caches) were
    copied with list() while another thread added to them: "Set changed size during iteration".
    A MultiGPU clone's state is made in a sampling thread while the stats route lists them.
    One 0.3 s round hit it 4 times in 5 on the old code; up to 6 rounds are run."""
    keep = [make() for _ in range(500)]  # a long set: every listing is a long iteration
    errors = []
    for _ in range(6):
        stop = threading.Event()

        def fill(stop=stop):
            end = time.monotonic() + 0.3
            while time.monotonic() < end and not stop.is_set():
                keep.append(make())
            stop.set()

        def list_all(stop=stop):
            try:
                while not stop.is_set():
                    list_them()
            except RuntimeError as e:
                errors.append(e)
                stop.set()

        with _switch_often():
            _run_threads(lambda i: fill() if i == 0 else list_all(), 3)
        if errors:
            break
    assert not errors, errors[0]
