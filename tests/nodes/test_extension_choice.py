"""Other packs' attention in the nodes: forced as "ext:<name>", timed by auto, handed back on failure,
listed by the status route, and reached through the hooks of packs loaded before ours.

Inputs are float32 on the CPU (ComfyUI's dtype there). Tolerances: a forced SDPA extension
against ComfyUI's attention (the test's SDPA-based stand-in): atol 1e-5 (both are PyTorch SDPA
on the same float32 values, differing only by the [B, L, H*D] <-> [B, H, L, D] views); a call
handed back must equal ComfyUI's output exactly (atol 0), since ComfyUI's function computed it.
auto's bars are speed_choice's: LOSSLESS_BAR (rel. L2 <= 2e-2) for an extension registered
lossless, QUANTIZED_BAR (rel. L2 <= 0.05, worst-head cosine >= 0.998) for a lossy one.
"""
from __future__ import annotations

import logging
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from triton_accel import kernels
from triton_accel.kernels.core import extensions
from triton_accel.runtime import attention_patch, guards
from triton_accel.runtime import call_stats, extension_hooks, attention_patch as patch_attention, settings, speed_choice
from triton_accel.nodes import status
from triton_accel.runtime.attention_patch import AttentionOverride
from triton_accel.runtime.settings import AccelSettings
from triton_accel.nodes.settings_node import TritonAccelSettings
from triton_accel.runtime.speed_choice import ORIGINAL, SpeedChoice

CPU = {"device_types": ["cpu"]}


def comfy_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                    **kwargs):
    """ComfyUI's attention_pytorch, reduced: [B, L, H*D] in and out."""
    comfy_attention.calls += 1
    b, _, inner = q.shape
    d = inner // heads
    q, k, v = (t.view(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(b, -1, heads * d)


comfy_attention.calls = 0


def sdpa(q, k, v, attn_mask=None, scale=None, is_causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal)


def counting(fn):
    def wrapped(q, k, v, attn_mask=None, scale=None, is_causal=False):
        wrapped.calls += 1
        return fn(q, k, v, attn_mask, scale, is_causal)
    wrapped.calls = 0
    return wrapped


@pytest.fixture(autouse=True)
def _clean():
    call_stats.reset()
    comfy_attention.calls = 0
    yield
    for entry in extensions.list_extensions():
        extensions.unregister(entry["name"])
    extensions.reset_counts()
    kernels.clear_caches()


def _call(override, seed=0, lq=24, heads=2, d=64, dtype=torch.float32, **kwargs):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, lq, heads * d, generator=g).to(dtype) for _ in range(3))
    out = override(comfy_attention, q, k, v, heads, transformer_options={}, _inside_attn_wrapper=True, **kwargs)
    return out, comfy_attention(q, k, v, heads)


def _reasons() -> dict:
    return call_stats.snapshot()["reasons"]


# ---- forced: mode "ext:<name>" on the Settings node ------------------------------------------

def test_forced_extension_serves_the_call():
    fn = counting(sdpa)
    path = extensions.register_attention("forced", fn, constraints=CPU, label="SDPA ext")
    settings_ = AccelSettings(path)
    decision = settings_.decision_for(torch.device("cpu"))
    assert decision.path == path and decision.reason.startswith(f"{path} forced: SDPA ext from"), decision.reason
    out, ref = _call(AttentionOverride(settings_, label="Test #1"))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert fn.calls == 1
    snap = call_stats.snapshot()
    assert snap["calls"] == {"triton": 1} and snap["paths"] == {path: 1}
    assert snap["models"]["Test #1"]["kinds"]["attention"]["paths"] == {path: 1}


BROKEN = {
    "raises": (lambda q, k, v, **kw: (_ for _ in ()).throw(ValueError("kernel exploded")), "raised ValueError"),
    "wrong-shape": (lambda q, k, v, **kw: sdpa(q, k, v)[:, :1], "returned shape"),
    "wrong-dtype": (lambda q, k, v, **kw: sdpa(q, k, v).half(), "returned dtype torch.float16"),
    "nan": (lambda q, k, v, **kw: sdpa(q, k, v) * math.nan, "NaN or Inf"),
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_failing_forced_extension_is_handed_back_with_the_reason(kind, caplog):
    fn, words = BROKEN[kind]
    path = extensions.register_attention("broken", fn, constraints=CPU)
    override = AttentionOverride(AccelSettings(path))
    with caplog.at_level(logging.WARNING, logger="triton_accel"):
        out, ref = _call(override)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    (reason, count), = _reasons().items()
    assert reason.startswith(f"{path} failed: ") and words in reason and count == 1, reason
    assert any(words in r.getMessage() for r in caplog.records)
    out, ref = _call(override)  # the same signature: straight back, counted again
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert sum(_reasons().values()) == 2 and call_stats.snapshot()["calls"] == {"original": 2}


def test_forced_extension_not_installed_says_so_and_comfyui_runs():
    settings_ = AccelSettings("ext:not-installed")
    decision = settings_.decision_for(torch.device("cpu"))
    assert decision.path == "pytorch" and decision.overridden
    assert decision.reason.startswith("ext:not-installed asked, but no extension of that name is registered")
    out, ref = _call(AttentionOverride(settings_))
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert list(_reasons()) == [decision.reason]


def test_forced_extension_on_a_device_it_refuses():
    path = extensions.register_attention("gpu-only", sdpa, constraints={"device_types": ["cuda"]})
    decision = AccelSettings(path).decision_for(torch.device("cpu"))
    assert decision.path == "pytorch" and "device type 'cpu' not supported" in decision.reason


def test_forced_extension_refusing_a_call_hands_it_back():
    path = extensions.register_attention("small-heads", sdpa, constraints={**CPU, "head_dims": (1, 32)})
    out, ref = _call(AttentionOverride(AccelSettings(path)), d=64)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert list(_reasons()) == [f"{path}: head dim 64 outside 1..32"]


def test_settings_node_lists_extensions_and_keeps_saved_values_valid():
    assert TritonAccelSettings.INPUT_TYPES()["required"]["mode"][0] == list(settings.MODES)
    path = extensions.register_attention("listed", sdpa, constraints=CPU, label="Listed")
    mode = TritonAccelSettings.INPUT_TYPES()["required"]["mode"]
    assert mode[0] == [*settings.MODES, path]
    assert mode[1]["triton_accel_labels"][path].startswith(f"{path} (Listed, from ")
    # A workflow saved with an extension whose pack is not installed here still validates.
    assert TritonAccelSettings.VALIDATE_INPUTS(mode="ext:from-another-machine") is True
    assert TritonAccelSettings.VALIDATE_INPUTS(mode="fp16") is True
    assert "not one of" in TritonAccelSettings.VALIDATE_INPUTS(mode="fp9")
    with pytest.raises(ValueError, match="ext:<name>"):
        AccelSettings("fp9")
    text = TritonAccelSettings().configure("ext:from-another-machine", device="cpu")["ui"]["text"][0]
    assert "ext:from-another-machine asked, but no extension" in text


# ---- auto: timed against ComfyUI's attention where auto times ------------------------------

def _auto(monkeypatch, tmp_path, ms: dict):
    """auto on a device where it times (patched for the CPU), with a timer that reports `ms`
    per candidate in the order choose() runs them: ComfyUI's attention, then each path."""
    order = []

    def timer(fn, device):
        out = fn()
        order.append(out)
        name = list(ms)[len(order) - 1]
        return ms[name], out

    chooser = SpeedChoice(tmp_path / "speed.json", timer=timer)
    monkeypatch.setattr(patch_attention, "timed_on", lambda device: True)
    monkeypatch.setattr(patch_attention, "_speed", lambda: chooser)
    return AttentionOverride(AccelSettings("auto"), label="Auto #1"), chooser


def _off_by(rel):
    """An extension whose output is `rel` (relative L2) away from SDPA's, spread over every head."""
    def fn(q, k, v, attn_mask=None, scale=None, is_causal=False):
        out = sdpa(q, k, v, attn_mask, scale, is_causal)
        noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        return out + noise * (rel * out.norm() / noise.norm())
    return fn


AUTO_CASES = {
    # name: (lossy, rel. L2 off ComfyUI's, ms of the extension vs 2.0 for ComfyUI's, kept?)
    "faster-exact": (False, 0.0, 1.0, True),
    "slower-exact": (False, 0.0, 3.0, False),
    "faster-lossless-but-off": (False, 0.03, 1.0, False),
    "faster-lossy-within-its-bar": (True, 0.03, 1.0, True),
    "faster-lossy-beyond-its-bar": (True, 0.08, 1.0, False),
}


@pytest.mark.parametrize("case", list(AUTO_CASES))
def test_auto_keeps_an_extension_only_when_faster_and_agreeing(monkeypatch, tmp_path, case):
    lossy, rel, ms, kept = AUTO_CASES[case]
    path = extensions.register_attention("timed", _off_by(rel), constraints=CPU, lossy=lossy)
    override, chooser = _auto(monkeypatch, tmp_path, {ORIGINAL: 2.0, path: ms})
    out, ref = _call(override)
    (key, entry), = chooser.snapshot().items()
    assert entry["choice"] == (path if kept else ORIGINAL), entry
    assert key.split("|")[-3] == path  # the candidates: the extension alone (auto on the CPU has no Triton path)
    assert call_stats.snapshot()["calls"] == ({"triton": 1} if kept else {"original": 1})
    expected_rel = ((out - ref).norm() / ref.norm()).item()
    assert expected_rel == pytest.approx(rel, abs=1e-6) if kept else expected_rel == 0
    # The next call of the shape class uses the remembered answer without timing again.
    _call(override, seed=1)
    assert len(chooser.snapshot()) == 1


def test_auto_with_a_failing_extension_hands_back_then_stops_offering_it(monkeypatch, tmp_path):
    fn = counting(lambda q, k, v, attn_mask=None, scale=None, is_causal=False: (_ for _ in ()).throw(
        RuntimeError("no kernel image")))
    path = extensions.register_attention("failing", fn, constraints=CPU)
    override, chooser = _auto(monkeypatch, tmp_path, {ORIGINAL: 2.0, path: 1.0})
    out, ref = _call(override)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert any(r.startswith(f"{path} failed: raised RuntimeError") for r in _reasons())
    out, ref = _call(override)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert fn.calls == 1, "the failure is remembered per signature"
    assert call_stats.snapshot()["calls"] == {"original": 2} and chooser.snapshot() == {}


def test_auto_never_offers_extensions_on_devices_where_it_does_not_time(tmp_path):
    fn = counting(sdpa)
    extensions.register_attention("untimed", fn, constraints=CPU)
    out, ref = _call(AttentionOverride(AccelSettings("auto")))  # the CPU: auto does not time there
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert fn.calls == 0 and call_stats.snapshot()["calls"] == {"original": 1}


def test_lossy_extensions_skip_full_precision_calls(monkeypatch, tmp_path):
    path = extensions.register_attention("lossy", sdpa, constraints=CPU, lossy=True)
    override, _ = _auto(monkeypatch, tmp_path, {ORIGINAL: 2.0, path: 1.0})
    _call(override, dtype=torch.float16, low_precision_attention=False)  # float32 would be refused before
    assert list(_reasons()) == [f"{path}: full precision requested"]


def test_agreement_bar_follows_the_lossy_flag():
    lossless = extensions.register_attention("lossless", sdpa, constraints=CPU)
    lossy = extensions.register_attention("quantized", sdpa, constraints=CPU, lossy=True)
    assert guards.agreement_bar(lossless) is guards.LOSSLESS_BAR
    assert guards.agreement_bar(lossy) is guards.QUANTIZED_BAR
    assert guards.agreement_bar("ext:unknown") is guards.LOSSLESS_BAR


# ---- status ---------------------------------------------------------------------------------

def test_status_lists_extensions_per_device(monkeypatch, tmp_path):
    path = extensions.register_attention("shown", sdpa, constraints={**CPU, "head_dims": (8, 128)}, priority=7,
                                         label="Shown", pack="example_pack")
    extensions.register_attention("gpu", sdpa, constraints={"device_types": ["cuda"]}, pack="example_pack")
    override, chooser = _auto(monkeypatch, tmp_path, {ORIGINAL: 2.0, path: 1.0, "ext:gpu": 0.1})
    _call(override)
    rows = speed_choice.speed_summary(chooser)
    payload = status.extensions_status([torch.device("cpu")], rows)
    shown = next(e for e in payload if e["path"] == path)
    assert shown["pack"] == "example_pack" and shown["priority"] == 7 and shown["label"] == "Shown"
    assert shown["constraints"]["head_dims"] == [8, 128] and shown["served"] >= 1
    assert shown["devices"] == [{"device": "cpu", "eligible": True, "refusal": None, "forced": False,
                                 "auto_times_here": False, "measured_shape_classes": 1, "kept_shape_classes": 1,
                                 "chosen": True}]
    gpu = next(e for e in payload if e["path"] == "ext:gpu")
    assert gpu["devices"][0]["eligible"] is False and "device type 'cpu'" in gpu["devices"][0]["refusal"]
    assert [e["path"] for e in status.status_payload()["extensions"]] == [path, "ext:gpu"]


# ---- the hooks: packs loaded before ours -----------------------------------------------------

def test_pending_hooks_of_earlier_packs_are_called_once(monkeypatch, tmp_path, caplog):
    custom_nodes = tmp_path / "custom_nodes"
    calls = []
    modules = {}
    for name, hook in (("early_pack", lambda api: calls.append(api.register_attention("early", sdpa, constraints=CPU,
                                                                                       pack="early_pack"))),
                       ("broken_pack", lambda api: (_ for _ in ()).throw(RuntimeError("bad hook"))),
                       ("other_module", None)):
        (custom_nodes / name).mkdir(parents=True)
        module = types.ModuleType(name)
        module.__file__ = str(custom_nodes / name / "__init__.py")
        if hook is not None:
            module.register_triton_accel = hook
        modules[name] = module
        monkeypatch.setitem(sys.modules, f"{custom_nodes}/{name}", module)
    outside = types.ModuleType("outside")
    outside.__file__ = str(tmp_path / "outside.py")
    outside.register_triton_accel = lambda api: calls.append("outside")
    monkeypatch.setitem(sys.modules, "outside", outside)
    monkeypatch.setattr(extension_hooks, "_custom_node_dirs", lambda: [str(custom_nodes.resolve())])
    monkeypatch.setattr(extension_hooks, "_hooks_called", set())
    with caplog.at_level(logging.ERROR, logger="triton_accel"):
        assert extension_hooks.call_pending_hooks("ours") == ["early_pack"]
    assert calls == ["ext:early"] and any("bad hook" in (r.exc_text or "") or "broken_pack" in r.getMessage()
                                          for r in caplog.records)
    assert extension_hooks.call_pending_hooks("ours") == [] and calls == ["ext:early"]


def test_publish_takes_the_public_name_only_when_free(monkeypatch):
    monkeypatch.delitem(sys.modules, "triton_accel_not_yet", raising=False)
    monkeypatch.setattr(extension_hooks, "PUBLIC_NAME", "triton_accel_not_yet")
    assert extension_hooks.publish("some/pack") is True
    assert sys.modules["triton_accel_not_yet"] is extensions
    import triton_accel_not_yet

    assert triton_accel_not_yet.register_attention is extensions.register_attention
    monkeypatch.setitem(sys.modules, "triton_accel_not_yet", types.ModuleType("someone_else"))
    assert extension_hooks.publish("some/pack") is False
    # Under the tests the package itself is "triton_accel" and forwards the API names.
    monkeypatch.setattr(extension_hooks, "PUBLIC_NAME", "triton_accel")
    assert extension_hooks.publish("triton_accel") is True


def test_auto_inside_a_cuda_graph_capture_uses_what_it_measured_before_or_comfyuis(monkeypatch, tmp_path):
    """No timing inside a CUDA graph capture (TorchCompileModel's cudagraphs backend): a shape
    class measured before runs its choice, one not measured yet goes to ComfyUI's attention."""
    from triton_accel.runtime import compiled_ops

    path = extensions.register_attention("captured", _off_by(0.0), constraints=CPU)
    override, chooser = _auto(monkeypatch, tmp_path, {ORIGINAL: 2.0, path: 1.0})
    monkeypatch.setattr(compiled_ops, "capturing", lambda t: True)
    out, ref = _call(override)
    assert torch.equal(out, ref) and chooser.snapshot() == {}
    assert _reasons() == {attention_patch.AUTO_CAPTURING: 1}
    monkeypatch.setattr(compiled_ops, "capturing", lambda t: False)
    _call(override, seed=1)  # measured outside a capture: the extension kept
    call_stats.reset()
    monkeypatch.setattr(compiled_ops, "capturing", lambda t: True)
    _call(override, seed=2)
    assert call_stats.snapshot()["calls"] == {"triton": 1} and len(chooser.snapshot()) == 1


@pytest.mark.parametrize("faster", [False, True])
def test_a_decided_signature_skips_the_adapter_and_the_speed_cache(monkeypatch, tmp_path, faster, pack_frames):
    """Once auto decided a call signature, ComfyUI's calls go straight to its function (only
    the override's own frames, the compile check and the signature on the way) and ours straight
    to the path."""
    path = extensions.register_attention("decided", sdpa, constraints=CPU)
    override, chooser = _auto(monkeypatch, tmp_path, {ORIGINAL: 2.0, path: 1.0 if faster else 3.0})
    _call(override)  # timed
    lookups = []
    monkeypatch.setattr(chooser, "known", lambda key: lookups.append(key))
    frames = [name.split(":")[1] for name in pack_frames(lambda: _call(override, seed=1))]
    assert lookups == []
    if faster:
        assert "adapt_call" in frames and "_usable_paths" not in frames, frames
    else:
        assert set(frames) <= {"__call__", "_is_compiling", "_eager", "call_signature", "generation"}, frames
