"""The attention override, driven the way ComfyUI's wrap_attn drives it, on the CPU.

TRITON_INTERPRET=1 (tests/conftest.py) lets the forced fp16 path run our Triton kernel on
CPU tensors. `comfy_attention_pytorch` below restates ComfyUI's attention_pytorch contract
(layouts, mask promotion, output reshape) as the "original function".
Tolerance: float32 inputs, interpreter vs SDPA in float32: max abs error < 1e-4.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from triton_accel import kernels
from triton_accel.runtime import call_stats
from triton_accel.runtime.attention_patch import AttentionOverride, adapt_call, Unsupported, patch_model
from triton_accel.runtime.settings import AccelSettings

ATOL = 1e-4


def comfy_attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                            skip_output_reshape=False, **kwargs):
    calls = comfy_attention_pytorch.calls
    calls.append(kwargs)
    if skip_reshape:
        b, _, _, dim_head = q.shape
    else:
        b, _, dim_head = q.shape
        dim_head //= heads
        kv_heads = k.shape[-1] // dim_head
        q = q.view(b, -1, heads, dim_head).transpose(1, 2)
        k = k.view(b, -1, kv_heads, dim_head).transpose(1, 2)
        v = v.view(b, -1, kv_heads, dim_head).transpose(1, 2)
    if mask is not None:
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
    extra = {key: kwargs[key] for key in ("scale", "enable_gqa") if key in kwargs}
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)
    if not skip_output_reshape:
        out = out.transpose(1, 2).reshape(b, -1, heads * dim_head)
    return out


comfy_attention_pytorch.calls = []


@pytest.fixture(autouse=True)
def _fresh_counters():
    call_stats.reset()
    kernels.core.stats.reset()
    comfy_attention_pytorch.calls.clear()


def _rand(*shape):
    return torch.randn(*shape, dtype=torch.float32)


def _run(override, *args, **kwargs):
    kwargs.setdefault("transformer_options", {})
    kwargs["_inside_attn_wrapper"] = True
    return override(comfy_attention_pytorch, *args, **kwargs)


FORCED = AccelSettings("fp16")

# name, args builder -> (args, kwargs); each is a call shape a real model family sends.
CASES = {
    "sd15-self-heads-positional": lambda: ((_rand(2, 64, 8 * 40), _rand(2, 64, 8 * 40), _rand(2, 64, 8 * 40), 8), {}),
    "sd15-cross-77": lambda: ((_rand(2, 64, 8 * 40), _rand(2, 77, 8 * 40), _rand(2, 77, 8 * 40), 8), {"attn_precision": None}),
    "wan-heads-keyword": lambda: ((_rand(1, 48, 2 * 128), _rand(1, 48, 2 * 128), _rand(1, 48, 2 * 128)), {"heads": 2}),
    "flux-skip-reshape": lambda: ((_rand(1, 2, 40, 128), _rand(1, 2, 40, 128), _rand(1, 2, 40, 128), 2),
                                  {"skip_reshape": True, "mask": None}),
    "skip-output-reshape": lambda: ((_rand(1, 30, 3 * 64), _rand(1, 30, 3 * 64), _rand(1, 30, 3 * 64), 3),
                                    {"skip_output_reshape": True}),
    "qwen-additive-mask-2d-batch": lambda: ((_rand(2, 33, 2 * 64), _rand(2, 40, 2 * 64), _rand(2, 40, 2 * 64), 2),
                                            {"mask": torch.where(torch.rand(2, 1, 40) > 0.3, 0.0, -1e4)}),
    "hunyuan-bool-mask": lambda: ((_rand(1, 2, 24, 64), _rand(1, 2, 24, 64), _rand(1, 2, 24, 64), 2),
                                  {"skip_reshape": True, "mask": torch.rand(1, 1, 24, 24) > 0.2}),
    "mask-2d": lambda: ((_rand(1, 16, 64), _rand(1, 20, 64), _rand(1, 20, 64), 1),
                        {"mask": torch.randn(16, 20)}),
    "lumina-gqa": lambda: ((_rand(1, 20, 6 * 96), _rand(1, 20, 2 * 96), _rand(1, 20, 2 * 96), 6), {"enable_gqa": True}),
    "scale": lambda: ((_rand(1, 10, 2 * 32), _rand(1, 10, 2 * 32), _rand(1, 10, 2 * 32), 2), {"scale": 0.3}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forced_triton_serves_real_call_shapes(case):
    args, kwargs = CASES[case]()
    expected = comfy_attention_pytorch(*args, **dict(kwargs))
    comfy_attention_pytorch.calls.clear()
    out = _run(AttentionOverride(FORCED), *args, **dict(kwargs))
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=1e-3)
    # The fast path really ran: our kernel counted, the original function never called.
    assert call_stats.snapshot()["calls"] == {"triton": 1}
    assert comfy_attention_pytorch.calls == []
    assert sum(kernels.core.stats.counts().values()) >= 1


UNSUPPORTED = {
    "full-precision-fp32": (lambda: ((_rand(1, 8, 64), _rand(1, 8, 64), _rand(1, 8, 64), 1),
                                     {"low_precision_attention": False}), "low_precision_attention"),
    "unknown-keyword": (lambda: ((_rand(1, 8, 64), _rand(1, 8, 64), _rand(1, 8, 64), 1), {"attn_bias_mode": "x"}),
                        "unknown keyword"),
    "float64": (lambda: ((torch.randn(1, 8, 64, dtype=torch.float64),) * 3 + (1,), {}), "dtype"),
    "head-dim-512": (lambda: ((_rand(1, 8, 512), _rand(1, 8, 512), _rand(1, 8, 512), 1), {}), "head dim"),
    "heads-differ-without-gqa": (lambda: ((_rand(1, 2, 8, 32), _rand(1, 1, 8, 32), _rand(1, 1, 8, 32), 2),
                                          {"skip_reshape": True, "enable_gqa": False}), "heads differ"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_calls_reach_the_original_function_unchanged(case):
    build, reason_word = UNSUPPORTED[case]
    args, kwargs = build()
    sent = dict(kwargs)
    try:
        _run(AttentionOverride(FORCED), *args, **kwargs)
    except RuntimeError:
        pass  # SDPA itself may refuse (heads differ); what matters is who was called, and how
    stats = call_stats.snapshot()
    assert stats["calls"] == {"original": 1}
    assert any(reason_word in r for r in stats["reasons"]), stats
    assert len(comfy_attention_pytorch.calls) == 1
    passed = comfy_attention_pytorch.calls[0]
    for key, value in sent.items():
        if key not in ("mask", "skip_reshape", "attn_precision", "skip_output_reshape", "heads"):
            assert passed[key] is value
    assert passed["_inside_attn_wrapper"] is True


def test_cpu_auto_and_off_hand_every_call_back():
    args, kwargs = CASES["sd15-self-heads-positional"]()
    for mode in ("auto", "off"):
        call_stats.reset()
        _run(AttentionOverride(AccelSettings(mode)), *args, **dict(kwargs))
        assert call_stats.snapshot()["calls"] == {"original": 1}


def test_previous_override_is_wrapped_not_erased():
    seen = []

    def previous(func, *args, **kwargs):
        seen.append(kwargs.get("low_precision_attention"))
        return func(*args, **kwargs)

    override = AttentionOverride(FORCED, previous=previous)
    args, kwargs = UNSUPPORTED["full-precision-fp32"][0]()
    _run(override, *args, **kwargs)
    assert seen == [False]  # the call we cannot serve went through the earlier override
    args, kwargs = CASES["sd15-self-heads-positional"]()
    _run(override, *args, **kwargs)
    assert seen == [False]  # the call we serve did not


class FakePatcher:
    """The part of ComfyUI's ModelPatcher the node touches: clone() deep-copies model_options."""

    def __init__(self, model_options=None):
        self.model_options = model_options or {"transformer_options": {}}

    def clone(self):
        return FakePatcher(copy.deepcopy(self.model_options))


def test_patch_model_clones_and_leaves_the_original_untouched():
    original = FakePatcher()
    patched = patch_model(original, FORCED)
    assert "optimized_attention_override" not in original.model_options["transformer_options"]
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    assert isinstance(override, AttentionOverride) and override.settings is FORCED
    # Clones of the patched model (samplers clone freely) keep the same override and settings.
    again = patched.clone().model_options["transformer_options"]["optimized_attention_override"]
    assert again is override


def test_patch_model_stacks_on_an_existing_override():
    def other(func, *a, **kw):
        return func(*a, **kw)

    base = FakePatcher({"transformer_options": {"optimized_attention_override": other}})
    patched = patch_model(base)
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    assert override.previous is other
    assert override.settings.mode == "auto"


def test_adapt_call_reads_views_without_copies():
    qkv = _rand(2, 16, 3 * 4 * 32)
    q, k, v = qkv.chunk(3, dim=-1)
    call = adapt_call((q, k, v, 4), {})
    assert call["q"].shape == (2, 4, 16, 32)
    assert call["q"].data_ptr() == q.data_ptr() and not call["q"].is_contiguous()


def test_adapt_call_refuses_heads_that_do_not_divide():
    with pytest.raises(Unsupported, match="multiple of heads"):
        adapt_call((_rand(1, 4, 30), _rand(1, 4, 30), _rand(1, 4, 30), 4), {})


def test_forced_fp8_runs_the_fp8_kernel_and_fp32_calls_take_fp16():
    from triton_accel.kernels.core.gpu_rules import PATH_TRITON_FP8, PATH_TRITON_FP16, Decision

    class FP8Settings(AccelSettings):
        def decision_for(self, device):
            return Decision(PATH_TRITON_FP8, "test", candidates=(PATH_TRITON_FP8, PATH_TRITON_FP16))

    override = AttentionOverride(FP8Settings("fp8"))
    q, k, v = (torch.randn(1, 24, 2 * 64, dtype=torch.float16) for _ in range(3))
    out = _run(override, q, k, v, 2)
    expected = comfy_attention_pytorch(q.float(), k.float(), v.float(), 2)
    rel = ((out.float() - expected).norm() / expected.norm()).item()
    assert rel < 6e-2  # e4m3 Q.K on Gaussian inputs (the kernel's own tests bound it tighter)
    assert call_stats.snapshot()["paths"] == {PATH_TRITON_FP8: 1}
    # fp32 inputs: the FP8 kernel refuses them, the FP16/BF16 kernel serves them.
    _run(override, *(t.float() for t in (q, k, v)), 2)
    assert call_stats.snapshot()["paths"] == {PATH_TRITON_FP8: 1, PATH_TRITON_FP16: 1}
    # A full-precision request never goes to the lossy path.
    _run(override, q, k, v, 2, low_precision_attention=False)
    assert call_stats.snapshot()["paths"] == {PATH_TRITON_FP8: 1, PATH_TRITON_FP16: 2}


def test_settings_node_reports_on_the_node_and_survives_a_bad_device():
    from triton_accel.nodes.settings_node import TritonAccelSettings

    node = TritonAccelSettings()
    result = node.configure("fp16", "cpu")
    assert isinstance(result["result"][0], AccelSettings)
    assert "TRITON_INTERPRET" in result["ui"]["text"][0]
    bad = node.configure("auto", "gpu0")
    assert "Could not probe device 'gpu0'" in bad["ui"]["text"][0]
    assert bad["result"][0].mode == "auto"


# ---- torch.compile (ComfyUI's TorchCompileModel) -----------------------------------------------

def _recording_backend(graphs: list):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend


def _ops(graphs) -> int:
    return sum(1 for gm in graphs for node in gm.graph.nodes if "patched_attention" in str(node.target))


def _compiled(override, graphs, backend="record"):
    """A compiled caller that hands the call to the override as ComfyUI's wrap_attn does;
    fullgraph=True: any graph break fails the test."""
    def model(*args, **kwargs):
        return _run(override, *args, **kwargs)
    torch.compiler.reset()
    return torch.compile(model, fullgraph=True, backend=_recording_backend(graphs) if backend == "record" else backend)


@pytest.mark.parametrize("backend", ["record", "eager", "aot_eager"])
@pytest.mark.parametrize("case", ["flux-skip-reshape", "wan-heads-keyword", "skip-output-reshape",
                                  "qwen-additive-mask-2d-batch", "hunyuan-bool-mask", "lumina-gqa", "scale"])
def test_torch_compile_records_one_op_that_serves_at_run_time(case, backend):
    """The trace records one patched_attention op; at run time the forced kernel serves it, as
    without compile, and the output equals ComfyUI's function's."""
    args, kwargs = CASES[case]()
    expected = comfy_attention_pytorch(*args, **dict(kwargs))
    comfy_attention_pytorch.calls.clear()
    graphs = []
    out = _compiled(AttentionOverride(FORCED), graphs, backend)(*args, **dict(kwargs))
    if backend == "record":
        assert _ops(graphs) == 1
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=1e-3)
    assert call_stats.snapshot()["calls"] == {"triton": 1}
    assert comfy_attention_pytorch.calls == []


def test_torch_compile_run_time_hands_back_to_the_traced_function():
    """CPU auto hands the call back at run time: the op finds ComfyUI's function again by its
    module and name and calls it with the call restated in [B, H, L, D] form."""
    args, kwargs = CASES["qwen-additive-mask-2d-batch"]()
    expected = comfy_attention_pytorch(*args, **dict(kwargs))
    comfy_attention_pytorch.calls.clear()
    graphs = []
    out = _compiled(AttentionOverride(AccelSettings("auto")), graphs)(*args, **dict(kwargs))
    assert _ops(graphs) == 1
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert call_stats.snapshot()["calls"] == {"original": 1}
    assert len(comfy_attention_pytorch.calls) == 1 and comfy_attention_pytorch.calls[0]["_inside_attn_wrapper"]


def test_torch_compile_traces_calls_the_op_cannot_restate_as_they_are():
    graphs = []
    args, kwargs = UNSUPPORTED["float64"][0]()
    _compiled(AttentionOverride(FORCED), graphs)(*args, **kwargs)
    assert _ops(graphs) == 0 and len(comfy_attention_pytorch.calls) == 1
    graphs.clear()
    args, kwargs = CASES["scale"]()

    override = AttentionOverride(FORCED)

    def model(q, k, v, heads):  # a closure as the function: not reachable by name at run time
        return override(lambda *a, **kw: comfy_attention_pytorch(*a, **kw), q, k, v, heads,
                        transformer_options={}, **kwargs)
    torch.compiler.reset()
    torch.compile(model, fullgraph=True, backend=_recording_backend(graphs))(*args)
    assert _ops(graphs) == 0


def test_compiled_op_names_a_freed_override_with_a_reason():
    from triton_accel.runtime import compiled_ops

    override = AttentionOverride(FORCED)
    token = override.token
    assert compiled_ops.lookup(token, "attention override") is override
    del override
    import gc
    gc.collect()
    with pytest.raises(RuntimeError, match="no longer exists"):
        compiled_ops.lookup(token, "attention override")


def test_a_second_patched_model_retraces_under_comfyuis_guard_filter():
    """ComfyUI's TorchCompileModel drops every guard on transformer_options (where the override
    lives), and dynamo caches graphs per code object: without the active-model wrapper a second
    patched model ran the first one's graph, i.e. the first override (or, once that model was
    freed, "whose patch no longer exists"). With it, each model's calls run its own override."""
    import gc

    from triton_accel.runtime import compiled_ops

    def skip_transformer_options(entries):  # comfy_extras/nodes_torch_compile.py's filter
        return [("transformer_options" not in e.name) for e in entries]

    def model(q, k, v, transformer_options):
        return transformer_options["optimized_attention_override"](
            comfy_attention_pytorch, q, k, v, heads=2, transformer_options=transformer_options,
            _inside_attn_wrapper=True)

    torch.compiler.reset()
    compiled = torch.compile(model, backend="eager", options={"guard_filter_fn": skip_transformer_options})
    args, _ = CASES["wan-heads-keyword"]()
    served = []
    for settings in (FORCED, AccelSettings("auto"), FORCED):  # three patched models, one after the other
        override = AttentionOverride(settings)
        wrapper = compiled_ops.ActiveModelWrapper(override.token)
        call_stats.reset()
        wrapper(compiled, *args, {"optimized_attention_override": override})
        served.append(call_stats.snapshot()["calls"])
        assert compiled_ops.ACTIVE_ATTENTION == 0  # restored after the call
        del override, wrapper
        gc.collect()  # the previous model is gone, as when ComfyUI unloads it
    assert served == [{"triton": 1}, {"original": 1}, {"triton": 1}], served


def test_patch_model_puts_the_active_model_wrapper_on_the_clone():
    from triton_accel.runtime import compiled_ops
    from triton_accel.runtime.attention_patch import OVERRIDE_KEY, patch_model

    class Patcher:
        def __init__(self):
            self.model_options = {"transformer_options": {}}
            self.wrappers = {}

        def clone(self):
            n = Patcher()
            n.model_options = {"transformer_options": dict(self.model_options["transformer_options"])}
            n.wrappers = {k: {kk: list(vv) for kk, vv in v.items()} for k, v in self.wrappers.items()}
            return n

        def add_wrapper_with_key(self, wrapper_type, key, wrapper):
            self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

        def remove_wrappers_with_key(self, wrapper_type, key):
            self.wrappers.get(wrapper_type, {}).pop(key, None)

    once = patch_model(Patcher(), FORCED)
    twice = patch_model(once, FORCED)
    for patched in (once, twice):
        (wrapper,) = patched.wrappers["apply_model"][compiled_ops.WRAPPER_KEY]
        assert wrapper.token == patched.model_options["transformer_options"][OVERRIDE_KEY].token


def test_torch_compile_traces_calls_autograd_records_as_they_are():
    args, kwargs = CASES["scale"]()
    q = args[0].clone().requires_grad_(True)
    graphs = []
    with torch.enable_grad():
        _compiled(AttentionOverride(FORCED), graphs)(q, *args[1:], **kwargs).sum().backward()
    assert _ops(graphs) == 0 and q.grad is not None
