"""The patches' objects as torch.compile sees them (ComfyUI's TorchCompileModel).

Dynamo traces a compiled model's forwards, our patches included. Tracing a patch's eager path
would freeze its first answer into the graph (weights prepared, auto's timing and every guard
happen on a first call, which a trace never really makes) and break the graph at its locks and
exceptions. So a traced call records one opaque custom op that names the patch object by an
integer token; at run time the op runs that object's eager path on real tensors.

The token -> object table is process-wide (kernels.core.stats.shared(): the ops are registered by
the first copy of the pack imported and serve every copy's objects) and weak, so a compiled
graph never keeps a model alive; a graph that outlives its model raises with the reason.
"""
from __future__ import annotations

import itertools
import logging
import weakref

from ..kernels.core import stats

log = logging.getLogger("triton_accel")


def _table():
    state = stats.shared()
    if getattr(state, "compiled_objects", None) is None:  # lookup() runs per compiled call: no lock once made
        with state.lock:
            if getattr(state, "compiled_objects", None) is None:
                state.compiled_tokens = itertools.count(1)
                state.compiled_objects = weakref.WeakValueDictionary()
    return state


def register(obj) -> int:
    """A token naming `obj` in compiled graphs, for as long as obj lives."""
    state = _table()
    with state.lock:
        token = next(state.compiled_tokens)
        state.compiled_objects[token] = obj
    return token


def lookup(token: int, what: str):
    obj = _table().compiled_objects.get(int(token))
    if obj is None:
        raise RuntimeError(f"Triton Accel: a compiled graph names {what} {token}, whose patch no longer exists "
                           "(its model was freed); recompile the model")
    return obj


# ---- which patched model is running (what a compiled graph must be specialised on) -----------
#
# ComfyUI's TorchCompileModel compiles with a guard filter that drops every guard on
# transformer_options, where the attention override lives. Dynamo caches graphs per code object
# (WanModel.forward...), so a second patched model of the same class (new settings, a new
# patch node) passed every remaining guard and ran the first model's graph: its baked override
# token, or a dead one ("whose patch no longer exists"). The patch's APPLY_MODEL wrapper sets
# ACTIVE_ATTENTION to the running model's override token around each model call (outside the
# compiled code), and every traced override call branches on it (traced_token), which makes
# dynamo guard on its value: another model re-traces with its own token.
ACTIVE_ATTENTION = 0
WRAPPER_KEY = "triton_accel_active_model"


def traced_token(token: int) -> int:
    """`token`, read under tracing so the graph is guarded on the running model (above)."""
    if ACTIVE_ATTENTION != token:  # the branch is what makes dynamo guard on the global
        return token
    return token


class ActiveModelWrapper:
    """ComfyUI APPLY_MODEL wrapper: ACTIVE_ATTENTION = `token` while the model runs."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, executor, *args, **kwargs):
        global ACTIVE_ATTENTION
        before, ACTIVE_ATTENTION = ACTIVE_ATTENTION, self.token
        try:
            return executor(*args, **kwargs)
        finally:
            ACTIVE_ATTENTION = before


def add_active_model_wrapper(patched, token: int) -> bool:
    """Put ActiveModelWrapper(token) on a ModelPatcher clone (replacing one an earlier patch of
    this clone's chain put there); False where ComfyUI has no model wrappers."""
    add = getattr(patched, "add_wrapper_with_key", None)
    if add is None:
        return False
    try:
        from comfy.patcher_extension import WrappersMP

        wrapper_type = WrappersMP.APPLY_MODEL
    except ImportError:  # outside ComfyUI (tests): the name ComfyUI uses
        wrapper_type = "apply_model"
    remove = getattr(patched, "remove_wrappers_with_key", None)
    if remove is not None:
        remove(wrapper_type, WRAPPER_KEY)
    add(wrapper_type, WRAPPER_KEY, ActiveModelWrapper(token))
    return True


# True while step_graph records a model call: that recording is replayed only while the weights
# and our prepared entries it read are unchanged (step_graph checks them per call), so our
# layers may serve it as they serve an eager call.
STEP_CAPTURE = False


def capturing(t) -> bool:
    """Whether a CUDA graph is being captured on t's device's current stream by someone else
    (TorchCompileModel's cudagraphs backend, or a node capturing by hand): a replay runs the
    recorded kernels on the recorded buffers, and none of our Python (weight-version checks,
    auto's timing) runs again. False inside step_graph's own recording (STEP_CAPTURE)."""
    import torch

    return t.is_cuda and not STEP_CAPTURE and torch.cuda.is_current_stream_capturing()


def is_compiling() -> bool:
    """Whether dynamo is tracing the running code."""
    import torch

    try:
        return torch.compiler.is_compiling()
    except AttributeError:
        return False


def define(name: str, schema: str, impl, fake) -> None:
    """Register the op triton_accel::<name><schema> running `impl`, with `fake` for tracing
    (nothing when another copy of the pack registered it: its op reads the same token table).

    torch.library's low-level registration, not torch.library.custom_op: a compiled graph calls
    the op once per patched Linear / attention call (~600 a Flux step), and custom_op's wrapper
    (autograd dispatch, a dynamo-disable frame, alias checks) costs ~30 us a call on the CPU
    against ~2 us (benchmarks/host_overhead.py --python-only). What it added is not needed here:
    a trace records these ops only with gradients off (the patches trace ComfyUI's function
    otherwise), their outputs are fresh tensors, and dynamo does not trace into a compiled graph's
    callees (tests/nodes: fullgraph, backends record / eager / aot_eager, the op body run on real
    tensors only; tests/integration: inductor through ComfyUI's TorchCompileModel)."""
    import torch

    if op_registered(name):
        return
    state = _table()
    lib = torch.library.Library("triton_accel", "FRAGMENT")
    lib.define(name + schema)
    lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"triton_accel::{name}", fake, lib=lib)
    with state.lock:  # a Library removes its registrations when it is garbage-collected
        libraries = getattr(state, "compiled_libraries", None)
        if libraries is None:
            libraries = state.compiled_libraries = []
        libraries.append(lib)


def registration_error(register, what: str) -> str | None:
    """Run `register` (a module's op definition); on failure (a torch whose library API refuses
    ours) the pack still loads: a warning, and the error text that makes the patches trace
    ComfyUI's `what` instead of our op. None when registered."""
    try:
        register()
    except Exception as e:
        log.warning("Triton Accel: torch.compile'd models will run ComfyUI's %s (our op could not be registered: "
                    "%s: %s)", what, type(e).__name__, e)
        return f"{type(e).__name__}: {e}"
    return None


def op_registered(name: str) -> bool:
    import torch

    try:
        getattr(torch.ops.triton_accel, name)
    except (AttributeError, RuntimeError):
        return False
    return True
