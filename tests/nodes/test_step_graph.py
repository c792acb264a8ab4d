"""runtime/step_graph.py: when a patched model's step is recorded, replayed, or left eager.

The CPU has no CUDA graphs: FakeGraphs stands in for torch.cuda's, with a graph's contract
(the recording reads only the static input tensors and writes the output tensors it returned
then; a replay refills those). What these tests pin is the wrapper's bookkeeping: signatures,
the weights a recording depends on, refusals with their reasons, the verification of the
first replay, and that the graphs go when sampling ends. The real recording of Flux and Wan
steps runs on the GPU in benchmarks/e2e_comfyui.py (variants with +graph / +nograph).
"""
from __future__ import annotations

import logging
import uuid

import pytest
import torch

from triton_accel.kernels.core import cache_registry
from triton_accel.runtime import call_stats, compiled_ops, step_graph
from triton_accel.runtime.step_graph import StepGraphs


class FakeGraph:
    def __init__(self, fn, out):
        self.fn, self.out = fn, out


class FakeGraphs:
    """CUDA graphs' contract on the CPU: replay() recomputes the recorded call from the static
    inputs into the recorded output tensors. `corrupt` makes replays differ (a bad recording);
    `fail` makes capture raise (a host sync inside the forward)."""

    captures = 0
    replays = 0
    corrupt = 0.0
    fail: Exception | None = None
    capture_flags: list = []

    @staticmethod
    def supports(device):
        return True

    @staticmethod
    def capturing(device):
        return False

    room_for = None  # bytes free on the "device" (None: any amount)

    @classmethod
    def room(cls, device, need):
        return cls.room_for is None or need <= cls.room_for

    @classmethod
    def capture(cls, fn, pool):
        cls.capture_flags.append(compiled_ops.STEP_CAPTURE)
        if cls.fail is not None:
            raise cls.fail
        cls.captures += 1
        out = fn()
        return FakeGraph(fn, out), out, pool or "pool"

    @classmethod
    def replay(cls, graph):
        cls.replays += 1
        fresh = graph.fn()
        graph.out.copy_(fresh + cls.corrupt)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.calls = 0  # Python-side work: eager calls only (a replay runs none)

    def forward(self, x, timestep, context=None, transformer_options=None):
        self.calls += 1
        return self.lin(x) * timestep.view(-1, 1, 1) + context.mean()


class Executor:
    """What ComfyUI's WrapperExecutor gives a wrapper: callable, with class_obj."""

    def __init__(self, module):
        self.class_obj = module

    def __call__(self, *args, **kwargs):
        return self.class_obj(*args, **kwargs)


class Base:
    """The BaseModel attributes the APPLY_MODEL side reads."""

    def __init__(self, need=0):
        self.current_weight_patches_uuid = None
        self.model_lowvram = False
        self.current_patcher = None
        self.need = need

    def memory_required(self, input_shape):
        return self.need


@pytest.fixture(autouse=True)
def fake_backend(monkeypatch):
    monkeypatch.setattr(StepGraphs, "backend", FakeGraphs)
    monkeypatch.setattr(FakeGraphs, "captures", 0)
    monkeypatch.setattr(FakeGraphs, "replays", 0)
    monkeypatch.setattr(FakeGraphs, "corrupt", 0.0)
    monkeypatch.setattr(FakeGraphs, "fail", None)
    monkeypatch.setattr(FakeGraphs, "capture_flags", [])
    monkeypatch.setattr(FakeGraphs, "room_for", None)
    monkeypatch.setenv("TRITON_ACCEL_STEP_GRAPH", "1")
    call_stats.reset()
    yield


def inputs(seed=0, tokens=5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, tokens, 8, generator=g), torch.rand(2, generator=g) + 0.5,
            {"context": torch.randn(2, 3, 8, generator=g), "transformer_options": {"cond_or_uncond": [0, 1]}})


class Outer:
    """The APPLY_MODEL executor: its class_obj is the BaseModel."""

    def __init__(self, base, inner):
        self.class_obj, self.inner = base, inner

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def call(graphs, model, x, t, kwargs, base=None):
    executor = Executor(model)
    if base is None:
        return graphs(executor, x, t, **kwargs)
    return graphs.apply_model(Outer(base, lambda *a, **k: graphs(executor, *a, **k)), x, t, **kwargs)


def reference(model, x, t, kwargs):
    with torch.no_grad():
        return model.lin(x) * t.view(-1, 1, 1) + kwargs["context"].mean()


def step_counts():
    kinds = call_stats.snapshot()["kinds"].get(step_graph.KIND, {})
    return kinds.get("served", 0), kinds.get("reasons", {})


@torch.no_grad()
def test_recorded_after_two_eager_calls_then_replayed_with_each_calls_values():
    model, graphs = Model(), StepGraphs("M #1")
    for i in range(6):
        x, t, kwargs = inputs(seed=i)
        out = call(graphs, model, x, t, kwargs)
        torch.testing.assert_close(out, reference(model, x, t, kwargs))
    # calls 1-2 eager (warming), call 3 eager + recorded, calls 4-6 replayed
    assert FakeGraphs.captures == 1
    # 3 eager calls, the recording, its verifying replay and 3 replays (the fake re-runs forward)
    assert model.calls == 3 + 1 + 1 + 3
    served, reasons = step_counts()
    assert served == 3
    assert reasons == {step_graph.REASON_WARMING: 2, step_graph.REASON_RECORDING: 1}
    assert FakeGraphs.capture_flags == [True]  # our layers serve the recording
    assert compiled_ops.STEP_CAPTURE is False


@torch.no_grad()
def test_replayed_output_is_a_copy_the_next_replay_does_not_overwrite():
    model, graphs = Model(), StepGraphs()
    for i in range(3):
        call(graphs, model, *inputs(seed=i))
    a = call(graphs, model, *inputs(seed=10))
    a_copy = a.clone()
    call(graphs, model, *inputs(seed=11))
    assert torch.equal(a, a_copy)


@torch.no_grad()
def test_a_new_signature_warms_up_again_and_table_is_bounded():
    model, graphs = Model(), StepGraphs()
    for tokens in (5, 6, 7):  # three signatures (shapes differ)
        for i in range(4):
            call(graphs, model, *inputs(seed=i, tokens=tokens))
    assert FakeGraphs.captures == step_graph.MAX_GRAPHS
    _, reasons = step_counts()
    assert reasons[step_graph.REASON_FULL] >= 1


@torch.no_grad()
def test_non_tensor_values_are_part_of_the_signature():
    model, graphs = Model(), StepGraphs()
    for i in range(3):
        call(graphs, model, *inputs(seed=i))
    x, t, kwargs = inputs(seed=5)
    kwargs["transformer_options"] = {"cond_or_uncond": [1, 0]}  # another Python value: no replay
    out = call(graphs, model, x, t, kwargs)
    torch.testing.assert_close(out, reference(model, x, t, kwargs))
    assert step_counts()[0] == 0


@pytest.mark.parametrize("change", ["in_place", "replaced", "uuid", "linear_state", "cache_clear"])
@torch.no_grad()
def test_changed_weights_drop_the_graph(change):
    model, base = Model(), Base()
    state = type("State", (), {"changes": 0, "layers": [], "begin_step": lambda self, signature: None})()
    graphs = StepGraphs(linear_states=(state,))
    for i in range(4):
        call(graphs, model, *inputs(seed=i), base=base)
    assert step_counts()[0] == 1
    if change == "in_place":
        model.lin.weight.add_(1.0)
    elif change == "replaced":
        model.lin.weight = torch.nn.Parameter(model.lin.weight + 1.0)
    elif change == "uuid":
        base.current_weight_patches_uuid = uuid.uuid4()
    elif change == "linear_state":
        state.changes += 1
    else:
        cache_registry.clear_all()
    x, t, kwargs = inputs(seed=9)
    out = call(graphs, model, x, t, kwargs, base=base)
    torch.testing.assert_close(out, reference(model, x, t, kwargs))  # the new weights, eagerly
    assert step_counts()[0] == 1
    assert graphs.graphs == {}
    for i in range(3):  # warms up and records again with the new weights
        x, t, kwargs = inputs(seed=20 + i)
        out = call(graphs, model, x, t, kwargs, base=base)
        torch.testing.assert_close(out, reference(model, x, t, kwargs))
    assert FakeGraphs.captures == 2 and step_counts()[0] == 2


@pytest.mark.parametrize("case, reason", [
    ("patches", step_graph.REASON_PATCHES),
    ("patches_replace", step_graph.REASON_PATCHES),
    ("wrapper", step_graph.REASON_WRAPPERS + " (torch_compile)"),
    ("dynamic", step_graph.REASON_DYNAMIC),
    ("multigpu", step_graph.REASON_MULTIGPU),
    ("hooks", step_graph.REASON_HOOKS),
    ("lowvram", step_graph.REASON_DYNAMIC),
])
@torch.no_grad()
def test_refused_where_the_forward_may_change_between_steps(case, reason, monkeypatch):
    model, base, graphs = Model(), Base(), StepGraphs()
    ours = {step_graph.KEY: [graphs], compiled_ops.WRAPPER_KEY: [object()]}
    for i in range(5):
        x, t, kwargs = inputs(seed=i)
        to = kwargs["transformer_options"]
        to["wrappers"] = {"diffusion_model": dict(ours), "apply_model": {compiled_ops.WRAPPER_KEY: [object()]}}
        if case in ("patches", "patches_replace"):
            to[case] = {"attn1_patch": [lambda *a: a]}
        elif case == "wrapper":
            to["wrappers"]["apply_model"]["torch_compile"] = [object()]
        elif case == "dynamic":
            to["prefetch_dynamic_vbars"] = True
        elif case == "multigpu":
            to["multigpu_thread_device"] = torch.device("cpu")
        elif case == "hooks":
            base.current_patcher = type("P", (), {"current_hooks": object()})()
        elif case == "lowvram":
            base.model_lowvram = True
        out = call(graphs, model, x, t, kwargs, base=base)
        torch.testing.assert_close(out, reference(model, x, t, kwargs))
    assert FakeGraphs.captures == 0
    assert step_counts() == (0, {reason: 5})


@torch.no_grad()
def test_our_own_wrappers_do_not_refuse():
    model, graphs = Model(), StepGraphs()
    active, outer = object(), object()  # long-lived, as ComfyUI's wrapper objects are
    for i in range(4):
        x, t, kwargs = inputs(seed=i)
        kwargs["transformer_options"]["wrappers"] = {
            "diffusion_model": {step_graph.KEY: [graphs]}, "apply_model": {compiled_ops.WRAPPER_KEY: [active]},
            "outer_sample": {"someone_else": [outer]}}  # outside the model call: allowed
        call(graphs, model, x, t, kwargs)
    assert step_counts()[0] == 1


@torch.no_grad()
def test_a_replay_that_disagrees_leaves_the_model_eager():
    FakeGraphs.corrupt = 1.0
    model, graphs = Model(), StepGraphs()
    for i in range(6):
        x, t, kwargs = inputs(seed=i)
        out = call(graphs, model, x, t, kwargs)
        torch.testing.assert_close(out, reference(model, x, t, kwargs))
    assert step_counts()[0] == 0
    assert graphs.refusal.startswith(step_graph.REASON_FAILED) and "rel. L2" in graphs.refusal
    assert FakeGraphs.captures == 1  # never again


@pytest.mark.parametrize("error, attempts", [
    (RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture"), 1),  # Wan 2.1 on the GPU
    (torch.cuda.OutOfMemoryError("CUDA out of memory"), step_graph.MAX_FAILURES),
])
@torch.no_grad()
def test_a_recording_that_raises_leaves_the_model_eager(error, attempts):
    """What the same forward does again (a host copy or sync inside it) is given up at once; out
    of memory may pass, so it is tried again up to MAX_FAILURES recordings."""
    FakeGraphs.fail = error
    model, graphs = Model(), StepGraphs()
    for i in range(12):
        x, t, kwargs = inputs(seed=i)
        out = call(graphs, model, x, t, kwargs)
        torch.testing.assert_close(out, reference(model, x, t, kwargs))
    assert len(FakeGraphs.capture_flags) == attempts
    assert str(error)[:20] in graphs.refusal
    assert compiled_ops.STEP_CAPTURE is False


@pytest.mark.parametrize("error, level", [
    (RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is "
                  "pinned. Please use tensor.pin_memory()"), logging.INFO),  # ComfyUI's Wan, every run
    (RuntimeError("CUDA error: operation not permitted when stream is capturing"), logging.INFO),  # a host sync
    (RuntimeError("an op with no CUDA graph support"), logging.WARNING),
    (torch.cuda.OutOfMemoryError("CUDA out of memory"), logging.WARNING),
])
@torch.no_grad()
def test_a_forward_that_no_graph_can_hold_is_said_once_at_info(caplog, error, level):
    """A model whose own forward copies from the host (Wan) is expected to stay eager: one INFO
    line saying what that means, no WARNING a user would read as a fault; any other recording
    failure stays a WARNING (out of memory once per attempt)."""
    FakeGraphs.fail = error
    model, graphs = Model(), StepGraphs()
    with caplog.at_level(logging.INFO, logger="triton_accel"):
        for i in range(12):
            x, t, kwargs = inputs(seed=i)
            call(graphs, model, x, t, kwargs)
    lines = [r for r in caplog.records if "stays eager" in r.getMessage()]
    assert lines and {r.levelno for r in lines} == {level}
    assert len(lines) == (1 if level == logging.INFO else len(FakeGraphs.capture_flags))
    if level == logging.INFO:
        assert step_graph.CAPTURE_LIMIT_NOTE in lines[0].getMessage()
        assert str(error)[:40] in lines[0].getMessage()  # the error itself is still there


class Patcher:
    def __init__(self, object_patches):
        self.object_patches = object_patches
        self.current_hooks = None


@pytest.mark.parametrize("patches, refused", [
    ({}, False),
    ({"model_sampling": object()}, False),  # ComfyUI's ModelSamplingFlux / SD3 nodes: outside the model call
    ({"diffusion_model.blocks.0.forward": lambda *a: a}, True),  # another node's (step cache...) forward
])
@torch.no_grad()
def test_other_nodes_object_patches_inside_the_diffusion_model_keep_it_eager(patches, refused):
    from triton_accel.runtime import fused_activations

    ours = fused_activations.FusedActivation("act", None, None)
    model, base = Model(), Base()
    base.current_patcher = Patcher({"diffusion_model.final.forward": ours, **patches})
    graphs = StepGraphs()
    for i in range(4):
        call(graphs, model, *inputs(seed=i), base=base)
    served, reasons = step_counts()
    if refused:
        assert served == 0 and reasons == {step_graph.REASON_OBJECT_PATCHES: 4}
    else:
        assert served == 1


@torch.no_grad()
def test_tensors_off_the_device_and_non_tensor_outputs_stay_eager():
    model, graphs = Model(), StepGraphs()
    for i in range(4):
        x, t, kwargs = inputs(seed=i)
        kwargs["transformer_options"]["sigmas"] = torch.ones(1, device="meta")
        call(graphs, model, x, t, kwargs)
    _, reasons = step_counts()
    assert list(reasons) == [f"{step_graph.REASON_ARGUMENT}: a meta tensor"]

    class DictOut(Model):
        def forward(self, *a, **k):
            return {"out": super().forward(*a, **k)}

    model, graphs = DictOut(), StepGraphs()
    for i in range(5):
        call(graphs, model, *inputs(seed=i))
    assert FakeGraphs.captures == 0 and graphs.refusal.startswith(step_graph.REASON_ARGUMENT)


@torch.no_grad()
def test_strided_inputs_keep_their_layout_and_overlapping_ones_are_refused():
    model, graphs = Model(), StepGraphs()
    for i in range(4):
        x, t, kwargs = inputs(seed=i)
        x = x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
        out = call(graphs, model, x, t, kwargs)
        torch.testing.assert_close(out, reference(model, x, t, kwargs))
    assert step_counts()[0] == 1
    assert graphs.graphs and next(iter(graphs.graphs.values())).statics[0].stride() == x.stride()
    assert not step_graph._dense(torch.zeros(4, 1).expand(4, 3))
    assert step_graph._dense(torch.zeros(4, 3)[:, :2])


@torch.no_grad()
def test_sampling_end_drops_the_graphs():
    model, graphs = Model(), StepGraphs()

    def sample():
        for i in range(4):
            call(graphs, model, *inputs(seed=i))
        assert graphs.graphs
        return "latent"

    assert graphs.outer_sample(lambda: sample()) == "latent"
    assert graphs.graphs == {} and graphs.pool is None


def test_flatten_signature_and_rebuild_round_trip():
    tensors: list = []
    u = uuid.uuid4()
    obj = {"a": [1, 2.5, "s", None], "b": (torch.zeros(2, 3),), "u": u, "f": len}
    key = step_graph.flatten(obj, tensors, torch.device("cpu"))
    assert hash(key) is not None and len(tensors) == 1
    tensors2: list = []
    assert step_graph.flatten({"a": [1, 2.5, "s", None], "b": (torch.ones(2, 3),), "u": u, "f": len},
                              tensors2, torch.device("cpu")) == key  # values of tensors are not in it
    assert step_graph.flatten(dict(obj, u=uuid.uuid4()), [], torch.device("cpu")) != key
    new = torch.ones(2, 3)
    rebuilt = step_graph.rebuild(obj, iter([new]))
    assert rebuilt["b"][0] is new and rebuilt["a"] == obj["a"] and rebuilt is not obj


class WrapperPatcher:
    """ModelPatcher's wrapper table (add / remove with key), for install()."""

    def __init__(self):
        self.wrappers = {}

    def add_wrapper_with_key(self, wrapper_type, key, fn):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(fn)

    def remove_wrappers_with_key(self, wrapper_type, key):
        self.wrappers.get(wrapper_type, {}).pop(key, None)


def test_install_replaces_its_wrappers_and_keeps_the_linear_states_of_the_chain():
    patcher = WrapperPatcher()
    first = step_graph.install(patcher, "M #1")
    state = object()
    second = step_graph.install(patcher, "M #1", state)
    assert second is not first and second.linear_states == (state,)
    assert step_graph.current(patcher) is second
    for wrapper_type in ("diffusion_model", "apply_model", "outer_sample"):
        assert len(patcher.wrappers[wrapper_type][step_graph.KEY]) == 1
    assert step_graph.install(object(), "x") is None  # no wrapper API: nothing to do


@torch.no_grad()
def test_on_unless_turned_off(monkeypatch):
    monkeypatch.setenv("TRITON_ACCEL_STEP_GRAPH", "0")
    model, graphs = Model(), StepGraphs()
    for i in range(4):
        call(graphs, model, *inputs(seed=i))
    assert FakeGraphs.captures == 0 and step_counts() == (0, {})  # off: not counted at all
    monkeypatch.delenv("TRITON_ACCEL_STEP_GRAPH")
    call(graphs, model, *inputs(seed=9))
    assert step_counts() == (0, {step_graph.REASON_WARMING: 1})


@torch.no_grad()
def test_no_recording_without_room_for_its_activations():
    """The recording's pool needs what ComfyUI reserves for one call (BaseModel.memory_required)
    besides the eager step's memory: without it the model stays eager, counted with the reason."""
    FakeGraphs.room_for = 1000
    model = Model()
    graphs = StepGraphs()
    for i in range(8):
        call(graphs, model, *inputs(seed=i), base=Base(need=4000))
    _, reasons = step_counts()
    assert FakeGraphs.captures == 0 and graphs.refusal == step_graph.REASON_MEMORY
    graphs = StepGraphs()
    for i in range(4):
        call(graphs, model, *inputs(seed=i), base=Base(need=800))
    assert FakeGraphs.captures == 1


def test_transparent_to_torch_compile():
    """TorchCompileModel traces the diffusion model's forward, this wrapper included: under
    tracing it must be only the call through (fullgraph: no graph break), and count nothing."""
    model, graphs = Model(), StepGraphs()

    def forward(x, t, context):
        return graphs(Executor(model), x, t, context=context, transformer_options={"cond_or_uncond": [0]})

    compiled = torch.compile(forward, backend="eager", fullgraph=True)
    x, t, kwargs = inputs()
    with torch.no_grad():
        for _ in range(4):
            out = compiled(x, t, kwargs["context"])
        torch.testing.assert_close(out, reference(model, x, t, kwargs))
    assert FakeGraphs.captures == 0 and step_counts() == (0, {})


def test_real_backend_refuses_cpu_calls():
    assert not step_graph.CudaGraphs.supports(torch.device("cpu"))
