"""One CUDA graph per repeated diffusion-model call: the host work of a step, issued once.

With our kernels in, the Flux 1024² step's GPU work (~97 ms on an H100) is shorter than the
time the host needs to issue it (~600 Python-level launches, 64-180 ms by process: README,
"Known limits"), so the step waited on Python. From the third call with the same signature a
sampler makes, the patched model's forward (our kernels and ComfyUI's ops alike) is recorded
once as a CUDA graph; later calls copy their tensors into the graph's inputs and replay it.

Safety, since a replay runs none of the Python that made the recording:
- Recorded only where nothing else changes the forward between steps: no `patches` /
  `patches_replace` in transformer_options, no other node's model or diffusion-model wrapper
  (TorchCompileModel's included), no ComfyUI hooks (scheduled LoRA weights), the whole model
  on the GPU (no low-VRAM or dynamic-VRAM streaming), no MultiGPU threads, no autograd.
- A call replays only the graph of its own signature: every non-tensor value of the call
  (dict keys, numbers, strings, the identity of other objects) and every tensor's shape,
  dtype, strides and device; its tensors' values are copied in.
- And only while the weights it recorded are the model's: every parameter and buffer is the
  same object at the same address and version, ComfyUI's weight patches are the same
  (patches_uuid), and our Linear layers' prepared FP8 weights are the ones recorded (the graph
  also holds them, so freeing them cannot leave it reading freed memory). Anything else: the
  graphs are dropped and the call runs eagerly.
- The recording's first replay is compared with the eager call on the same inputs; a
  difference beyond VERIFY_REL_L2, a non-finite value, or any error while recording (a
  host synchronisation inside the forward, out of memory) leaves the model eager.
- The graphs (and their memory pool) are dropped when sampling ends.
Measured (H100): Flux 12B 1024² recorded, replayed bit for bit, 0.7-1.2 ms of host
time a step instead of 48-51 (up to 182 on slower hosts). Wan 2.1 is refused at its first
recording: ComfyUI's Wan forward copies a CPU tensor to the GPU on every call.
"""
from __future__ import annotations

import logging
import threading
import weakref

import torch

from ..kernels.core import cache_registry, env_settings
from . import call_stats, call_timing, compiled_ops
from .step_check import StepCheck
from .guards import guard_failure

log = logging.getLogger("triton_accel")

KIND = "step_graph"
KEY = "triton_accel_step_graph"
# Eager calls with one signature before it is recorded: the first ones do one-off work (weights
# quantised and guarded, auto's timing, fused blocks checked, kernels compiled).
CAPTURE_AFTER = 2
MAX_GRAPHS = 2  # one signature per CFG half where cond and uncond run as separate calls
MAX_FAILURES = 2  # recordings that ran out of memory before the model stays eager (other errors: at once)
VERIFY_REL_L2 = 2e-3  # the replay repeats the eager call's kernels: equal bit for bit when deterministic

# What the model's own forward does that a CUDA graph cannot hold (ComfyUI's Wan copies
# torch.arange(...) from the host every call: sinusoidal_embedding_1d). Expected, harmless (the
# step runs eager as without graphs) and the same every time: said once at INFO, with what it
# means; any other recording failure is a WARNING.
CAPTURE_LIMITS = ("Cannot copy between CPU and CUDA tensors during CUDA graph capture",
                  "operation not permitted when stream is capturing", "cudaErrorStreamCaptureUnsupported")
CAPTURE_LIMIT_NOTE = ("the model's forward copies a host tensor or waits on the GPU, which a CUDA graph cannot "
                      "hold; it runs eager, as it would with step graphs off")

REASON_OFF = "step graphs off (TRITON_ACCEL_STEP_GRAPH)"
REASON_NOT_CUDA = "not a CUDA call"
REASON_AUTOGRAD = "autograd"
REASON_PATCHES = "other nodes patch the forward (transformer_options patches)"
REASON_WRAPPERS = "another node wraps the model call"
REASON_HOOKS = "ComfyUI hooks change weights between steps"
REASON_OBJECT_PATCHES = "another node patches the diffusion model's modules (object patches)"
REASON_DYNAMIC = "weights streamed (low VRAM / dynamic VRAM)"
REASON_MULTIGPU = "MultiGPU threads"
REASON_ARGUMENT = "an argument a graph cannot take"
REASON_WARMING = "warming up"
REASON_FAILED = "recording failed"
REASON_FULL = "graph table full"
REASON_CAPTURING = "inside another capture"
REASON_RECORDING = "recorded (this call ran eagerly)"
REASON_MEMORY = "not enough free GPU memory for the recording's activations"


class _NotGraphable(Exception):
    pass


# ---- a call's signature and tensors ---------------------------------------------------------

_VALUE_TYPES = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)


def flatten(obj, tensors: list, device: torch.device):
    """A hashable signature of `obj` (args / kwargs of a model call), appending its tensors to
    `tensors` in a fixed order. Raises _NotGraphable for a tensor off `device` (its values may
    be read on the host, which a replay would not do again) or one whose layout cannot be
    recreated (overlapping strides)."""
    if isinstance(obj, torch.Tensor):
        if obj.device != device:
            raise _NotGraphable(f"a {obj.device} tensor")
        if not _dense(obj):
            raise _NotGraphable("an overlapping-stride tensor")
        tensors.append(obj)
        return ("T", tuple(obj.shape), obj.stride(), obj.dtype, obj.storage_offset() > 0)
    if isinstance(obj, _VALUE_TYPES):
        return (type(obj), obj)
    if isinstance(obj, dict):
        return ("D", tuple((k if isinstance(k, _VALUE_TYPES) else id(k), flatten(v, tensors, device))
                           for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return ("L" if isinstance(obj, list) else "U", tuple(flatten(v, tensors, device) for v in obj))
    try:
        hash(obj)
        if type(obj).__eq__ is not object.__eq__:  # value types (UUIDs, enums...)
            return ("V", type(obj), obj)
    except TypeError:
        pass
    return ("I", type(obj), id(obj))


def rebuild(obj, statics):
    """`obj` with its tensors replaced, in flatten()'s order, by the next ones of `statics`."""
    if isinstance(obj, torch.Tensor):
        return next(statics)
    if isinstance(obj, dict):
        return {k: rebuild(v, statics) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rebuild(v, statics) for v in obj]
    if isinstance(obj, tuple):
        return tuple(rebuild(v, statics) for v in obj)
    return obj


def _dense(t: torch.Tensor) -> bool:
    """No two elements share memory (empty_strided can then make the same layout)."""
    if t.numel() <= 1:
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1)
    extent = 1
    for stride, size in dims:
        if stride < extent:
            return False
        extent = stride * size
    return True


def _outputs(out) -> list | None:
    """The tensors of a model output (a tensor, or a list / tuple of them), else None."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)) and out and all(isinstance(o, torch.Tensor) for o in out):
        return list(out)
    return None


def _cloned(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    return type(out)(o.clone() for o in out)


# ---- the weights a graph recorded -------------------------------------------------------------

def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return -1


def weight_snapshot(module: torch.nn.Module) -> list:
    """(owner dict, name, tensor, address, version) of every parameter and buffer."""
    rows = []
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in table.items():
                if t is not None:
                    rows.append((table, name, t, t.data_ptr(), _version(t)))
    return rows


def weights_unchanged(rows: list) -> bool:
    for table, name, t, ptr, version in rows:
        if table.get(name) is not t or t.data_ptr() != ptr or (version >= 0 and t._version != version):
            return False
    return True


def weights_on(rows: list, device: torch.device) -> bool:
    return all(t.device == device for _, _, t, _, _ in rows)


# ---- recording and replaying (torch.cuda, or a test's stand-in) -----------------------------

class CudaGraphs:
    """torch.cuda's graphs. `capture(fn, pool)` -> (graph, fn's output, pool)."""

    @staticmethod
    def supports(device: torch.device) -> bool:
        return device.type == "cuda" and torch.cuda.is_available()

    @staticmethod
    def capture(fn, pool):
        graph = torch.cuda.CUDAGraph()
        # thread_local: ComfyUI's other threads (previews, the server) may use CUDA meanwhile.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = fn()
        return graph, out, graph.pool()

    @staticmethod
    def replay(graph) -> None:
        graph.replay()

    @staticmethod
    def capturing(device: torch.device) -> bool:
        return torch.cuda.is_current_stream_capturing()

    @staticmethod
    def room(device: torch.device, need: int) -> bool:
        """Whether `need` bytes are free on the device for the graph's own memory pool (which
        cannot use the blocks torch's allocator keeps cached: those are returned first)."""
        if torch.cuda.mem_get_info(device)[0] >= need:
            return True
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0] >= need


class _Graph:
    __slots__ = ("graph", "statics", "out", "weights", "held", "uuid", "linear")

    def __init__(self, graph, statics, out, weights, held, uuid, linear):
        self.graph, self.statics, self.out = graph, statics, out
        self.weights, self.held, self.uuid, self.linear = weights, held, uuid, linear


class StepGraphs:
    """ComfyUI DIFFUSION_MODEL wrapper (and its APPLY_MODEL helper, which sees the BaseModel
    and so ComfyUI's weight patches and hooks). Shared by the clones of the patched model."""

    backend = CudaGraphs

    def __init__(self, label: str | None = None, linear_states: tuple = ()):
        self.label = label
        self.linear_states = tuple(linear_states)
        self.graphs: dict = {}  # signature -> _Graph
        self.seen: dict = {}  # signature -> eager calls made with it
        self.failures = 0
        self.refusal: str | None = None  # why this model stays eager for good
        self.pool = None
        self.check = StepCheck(label)  # eager steps: auto's choices against ComfyUI's, whole steps
        self._base = threading.local()
        self._lock = threading.RLock()

    def __deepcopy__(self, memo):  # clones share it, as they share the diffusion model
        return self

    # -- ComfyUI's entry points
    def apply_model(self, executor, *args, **kwargs):
        """APPLY_MODEL wrapper: remembers the BaseModel for the inner call."""
        if compiled_ops.is_compiling():
            return executor(*args, **kwargs)
        before = getattr(self._base, "model", None)
        self._base.model = getattr(executor, "class_obj", None)
        try:
            return executor(*args, **kwargs)
        finally:
            self._base.model = before

    def outer_sample(self, executor, *args, **kwargs):
        """OUTER_SAMPLE wrapper: the graphs and their memory go when sampling ends."""
        try:
            return executor(*args, **kwargs)
        finally:
            self.drop()

    def __call__(self, executor, *args, **kwargs):
        """DIFFUSION_MODEL wrapper."""
        # First, and nothing else under tracing: TorchCompileModel's dynamo traces the diffusion
        # model's forward, this wrapper included, and our bookkeeping would break its graph.
        if compiled_ops.is_compiling():
            return executor(*args, **kwargs)
        x = args[0] if args else kwargs.get("x")
        if not isinstance(x, torch.Tensor):
            return self._eager(executor, args, kwargs, REASON_ARGUMENT)
        reason = self._refusal(x, args, kwargs)
        # What auto's call timing measures in this step (call_timing): GPU time where the step
        # is on its way to a recording that later steps replay, host and GPU time otherwise.
        mode = call_timing.MODE_GRAPH if reason is None else call_timing.MODE_EAGER
        signature = self._begin_step(args, kwargs, mode)
        with call_timing.step_mode(mode):
            if reason is None:
                return self._graphed(executor, x, args, kwargs)
            # An eager step: auto's choices are checked against ComfyUI's on whole steps.
            return self.check.run(lambda *a, **k: self._eager(executor, a, k, reason), args, kwargs, signature,
                                  self.linear_states, x.device)

    def _begin_step(self, args, kwargs, mode: str) -> tuple:
        """The step's signature (the shapes of its tensor arguments and the mode), and the Linear
        states' per-step hook with it (linear_choice puts handed-back layers back when it changes)."""
        shapes = tuple(a.shape for a in args if isinstance(a, torch.Tensor))
        shapes += tuple((k, v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        signature = (shapes, mode)
        for state in self.linear_states:
            state.begin_step(signature)
        return signature

    def _graphed(self, executor, x, args, kwargs):
        """A call that may be recorded or replayed."""
        tensors: list = []
        try:
            key = (flatten(args, tensors, x.device), flatten(kwargs, tensors, x.device))
        except _NotGraphable as e:
            return self._eager(executor, args, kwargs, f"{REASON_ARGUMENT}: {e}")
        module = getattr(executor, "class_obj", None)
        # The lock guards the tables only, never a model call: a forward may call the model again
        # (nested), and the replay / recording below must not wait on another thread's step.
        with self._lock:
            graph = self.graphs.get(key)
            if graph is not None and not self._still_valid(graph):
                self._drop_locked()
                graph = None
            seen = self.seen.get(key, 0)
            record = (graph is None and seen >= CAPTURE_AFTER and len(self.graphs) < MAX_GRAPHS
                      and isinstance(module, torch.nn.Module))
            if graph is None and not record:
                if len(self.seen) > 4 * MAX_GRAPHS:
                    self.seen.clear()
                self.seen[key] = seen + 1
        if graph is not None:
            return self._replay(graph, tensors)
        if not record:
            return self._eager(executor, args, kwargs, REASON_WARMING if seen < CAPTURE_AFTER else REASON_FULL)
        out = self._eager(executor, args, kwargs, REASON_RECORDING)  # the recording is checked against it
        self._record(executor, args, kwargs, key, tensors, module, out)
        return out

    # -- decisions
    def _refusal(self, x, args, kwargs) -> str | None:
        if not env_settings.step_graph_enabled():
            return REASON_OFF
        if self.refusal is not None:
            return self.refusal
        if not self.backend.supports(x.device):
            return REASON_NOT_CUDA
        if self.backend.capturing(x.device):
            return REASON_CAPTURING
        if torch.is_grad_enabled() and x.requires_grad:
            return REASON_AUTOGRAD
        to = kwargs.get("transformer_options")
        if to is None:
            to = next((a for a in args if isinstance(a, dict) and "wrappers" in a), {})
        return options_refusal(to) or self._model_refusal()

    def _model_refusal(self) -> str | None:
        base = getattr(self._base, "model", None)
        patcher = getattr(base, "current_patcher", None)
        if patcher is not None and getattr(patcher, "current_hooks", None) is not None:
            return REASON_HOOKS
        if getattr(base, "model_lowvram", False):
            return REASON_DYNAMIC
        if patcher is not None and foreign_object_patches(patcher):
            return REASON_OBJECT_PATCHES
        return None

    def _memory_need(self, shape) -> int:
        base = getattr(self._base, "model", None)
        estimate = getattr(base, "memory_required", None)
        if estimate is None:
            return 0
        try:
            return int(estimate(tuple(shape)))
        except Exception:  # a model whose estimate needs its conds: no estimate, no check
            return 0

    def _uuid(self):
        base = getattr(self._base, "model", None)
        return getattr(base, "current_weight_patches_uuid", None)

    def _linear_token(self) -> tuple:
        return tuple(state.changes for state in self.linear_states)

    def _still_valid(self, graph: _Graph) -> bool:
        return (graph.uuid == self._uuid() and graph.linear == self._linear_token()
                and graph.weights[0] == cache_registry.generation() and weights_unchanged(graph.weights[1]))

    # -- running
    def _eager(self, executor, args, kwargs, reason: str):
        if reason is not REASON_OFF:  # off: nothing to report, the counts stay as they were without us
            call_stats.record(call_stats.OUTCOME_HANDED_BACK, reason, kind=KIND, model=self.label)
        return executor(*args, **kwargs)

    def _replay(self, graph: _Graph, tensors: list):
        for static, t in zip(graph.statics, tensors):
            static.copy_(t)
        self.backend.replay(graph.graph)
        call_stats.record(call_stats.OUTCOME_SERVED, path="replay", kind=KIND, model=self.label)
        return _cloned(graph.out)

    def _record(self, executor, args, kwargs, key, tensors, module, out) -> None:
        eager_outs = _outputs(out)
        device = tensors[0].device if tensors else None
        rows = weight_snapshot(module)
        if eager_outs is None or device is None:
            self._fail(REASON_ARGUMENT + ": the model's output is not tensors", final=True)
            return
        if not weights_on(rows, device):
            self._fail(REASON_DYNAMIC, final=True)
            return
        # The recording's activations live in a pool of their own: what ComfyUI reserves for one
        # call of this model (BaseModel.memory_required) must be free besides the eager step's.
        need = self._memory_need(tensors[0].shape)
        if need and not self.backend.room(device, need):
            self._fail(REASON_MEMORY)
            return
        statics = [torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device) for t in tensors]
        for static, t in zip(statics, tensors):
            static.copy_(t)
        it = iter(statics)
        s_args, s_kwargs = rebuild(args, it), rebuild(kwargs, it)
        held = [dict(layer.entries) for state in self.linear_states for layer in state.layers]
        before = compiled_ops.STEP_CAPTURE
        compiled_ops.STEP_CAPTURE = True
        try:
            graph, g_out, pool = self.backend.capture(lambda: executor(*s_args, **s_kwargs), self.pool)
        except Exception as e:  # a host sync in the forward, out of memory, an op that cannot be captured
            # Only running out of memory may pass; anything else the same forward does again.
            limit = any(text in str(e) for text in CAPTURE_LIMITS)
            self._fail(f"{REASON_FAILED}: {type(e).__name__}: {e}"[:300],
                       final=not isinstance(e, torch.cuda.OutOfMemoryError),
                       level=logging.INFO if limit else logging.WARNING, note=CAPTURE_LIMIT_NOTE if limit else None)
            return
        finally:
            compiled_ops.STEP_CAPTURE = before
        self.pool = pool
        g_outs = _outputs(g_out)
        try:
            self.backend.replay(graph)
            if g_outs is None or len(g_outs) != len(eager_outs):
                raise ValueError("the recorded output differs in structure")
            for g, e in zip(g_outs, eager_outs):
                failure = guard_failure(g, e, VERIFY_REL_L2)
                if failure is not None:
                    raise ValueError(f"the replay differs from the eager call: {failure}")
        except Exception as e:
            self._fail(f"{REASON_FAILED}: {e}"[:300], final=True)
            return
        with self._lock:
            self.graphs[key] = _Graph(graph, statics, g_out, (cache_registry.generation(), rows), held,
                                      self._uuid(), self._linear_token())
        log.info("Triton Accel (%s): step recorded as a CUDA graph (%d input tensors; its replay agrees with the "
                 "eager call within rel. L2 %g)", self.label, len(statics), VERIFY_REL_L2)

    def _fail(self, reason: str, final: bool = False, level: int = logging.WARNING, note: str | None = None) -> None:
        with self._lock:
            self.failures += 1
            if final or self.failures >= MAX_FAILURES:
                self.refusal = reason
            self.seen.clear()
        if note:
            log.log(level, "Triton Accel (%s): the step stays eager: %s (%s)", self.label, note, reason)
        else:
            log.log(level, "Triton Accel (%s): the step stays eager: %s", self.label, reason)

    def drop(self) -> None:
        with self._lock:
            self._drop_locked()

    def _drop_locked(self) -> None:
        self.graphs.clear()
        self.seen.clear()
        self.pool = None


_OUR_PACKAGE = __name__.rsplit(".runtime.", 1)[0]  # the pack's package, whatever its folder is called
_object_patch_verdicts: dict = {}  # (id(patcher), id(object_patches), len) -> bool


def foreign_object_patches(patcher) -> bool:
    """Whether another node's object patch replaces something inside the diffusion model (a
    module's forward with its own Python state, such as a step cache, which a replay would not
    run). Ours (our package's classes) and patches outside the diffusion model (ComfyUI's
    model_sampling) are fine. Decided once per patcher and patch table."""
    patches = getattr(patcher, "object_patches", None) or {}
    key = (id(patcher), id(patches), len(patches))
    verdict = _object_patch_verdicts.get(key)
    if verdict is None:
        verdict = any(name.startswith("diffusion_model") and not _ours(obj) for name, obj in patches.items())
        if len(_object_patch_verdicts) > 64:
            _object_patch_verdicts.clear()
        _object_patch_verdicts[key] = verdict
    return verdict


def _ours(obj) -> bool:
    module = getattr(type(obj), "__module__", "") or ""
    return module == _OUR_PACKAGE or module.startswith(_OUR_PACKAGE + ".")


def options_refusal(to: dict) -> str | None:
    """Why transformer_options say the forward may change between steps, or None."""
    if not isinstance(to, dict):
        return None
    if any(to.get(name) for name in ("patches", "patches_replace")):
        return REASON_PATCHES
    if to.get("multigpu_thread_device") is not None:
        return REASON_MULTIGPU
    if to.get("prefetch_dynamic_vbars"):
        return REASON_DYNAMIC
    wrappers = to.get("wrappers") or {}
    for wrapper_type in ("apply_model", "diffusion_model"):
        for key, fns in (wrappers.get(wrapper_type) or {}).items():
            if fns and key not in OUR_WRAPPER_KEYS:
                return f"{REASON_WRAPPERS} ({key})"
    return None


OUR_WRAPPER_KEYS = frozenset({KEY, compiled_ops.WRAPPER_KEY})


def install(patched, label: str | None, linear_state=None) -> StepGraphs | None:
    """Put a StepGraphs on a ModelPatcher clone (replacing one an earlier patch of this clone's
    chain put there, and keeping the Linear states it knew); None where ComfyUI has no wrappers."""
    add = getattr(patched, "add_wrapper_with_key", None)
    if add is None:
        return None
    try:
        from comfy.patcher_extension import WrappersMP

        types = (WrappersMP.DIFFUSION_MODEL, WrappersMP.APPLY_MODEL, WrappersMP.OUTER_SAMPLE)
    except ImportError:  # outside ComfyUI (tests): the names ComfyUI uses
        types = ("diffusion_model", "apply_model", "outer_sample")
    previous = current(patched)
    states = previous.linear_states if previous is not None else ()
    if linear_state is not None:
        states = states + (linear_state,)
    graphs = StepGraphs(label, states)
    remove = getattr(patched, "remove_wrappers_with_key", None)
    for wrapper_type in types:
        if remove is not None:
            remove(wrapper_type, KEY)
    add(types[0], KEY, graphs)
    add(types[1], KEY, graphs.apply_model)
    add(types[2], KEY, graphs.outer_sample)
    finalizer = weakref.finalize(patched, graphs.drop)
    finalizer.atexit = False
    return graphs


def current(patched) -> StepGraphs | None:
    """The StepGraphs on a patched clone, if any."""
    wrappers = getattr(patched, "wrappers", None) or {}
    for fns in (wrappers.get("diffusion_model") or {}).get(KEY, []):
        if isinstance(fns, StepGraphs):
            return fns
    return None
