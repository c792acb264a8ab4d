"""Issue 11 in the nodes: which quantized paths each GPU gets (gpu_rules.select_path), auto's
guard that keeps a quantized path only where it is faster AND agrees with ComfyUI's attention,
and speed_summary(), what the Settings node and the status panel show of auto's measurements.

No dtype axis in the rule tests (they decide from facts, not tensors). The guard tests feed
float32 outputs with a stated distance from ComfyUI's: the bars under test are
guards.QUANTIZED_BAR (rel. L2 <= 0.05, worst-head cosine >= 0.998) and LOSSLESS_BAR
(rel. L2 <= 2e-2).
"""
from __future__ import annotations

import json
import logging

import pytest
import torch

from triton_accel.kernels.core import gpu_rules
from triton_accel.kernels.core.gpu_rules import (PATH_PYTORCH, PATH_TRITON_FP8, PATH_TRITON_FP16, PATH_TRITON_INT8,
                                            Facts, select_path)
from triton_accel.runtime import guards
from triton_accel.runtime import speed_choice
from triton_accel.runtime.attention_patch import AttentionOverride, head_slices, speed_key
from triton_accel.runtime.settings import AccelSettings
from triton_accel.runtime.speed_choice import ORIGINAL, SpeedChoice

ALL = gpu_rules.TRITON_PATHS
CARDS = {
    "sm_75": ("NVIDIA GeForce RTX 2080 Ti", (7, 5)), "sm_80": ("NVIDIA A100-SXM4-80GB", (8, 0)),
    "sm_86": ("NVIDIA GeForce RTX 3090", (8, 6)), "sm_87": ("Orin", (8, 7)),
    "sm_89": ("NVIDIA GeForce RTX 4090", (8, 9)), "sm_90": ("NVIDIA H200", (9, 0)),
    "sm_100": ("NVIDIA B200", (10, 0)), "sm_120": ("NVIDIA GeForce RTX 5090", (12, 0)),
}


def nvidia(card, triton="3.6.0", implemented=ALL, **kw):
    name, cap = CARDS[card]
    return Facts(device="cuda:0", vendor="nvidia", name=name, capability=cap, triton_version=triton,
                 torch_version="2.10.0", torch_cuda="12.8", implemented=implemented, **kw)


FP8, INT8, FP16 = PATH_TRITON_FP8, PATH_TRITON_INT8, PATH_TRITON_FP16
# card, Triton -> auto's candidates in order (issue 11's per-architecture recipe)
AUTO = [
    ("sm_90", "3.6.0", (FP8, FP16)), ("sm_100", "3.6.0", (FP8, FP16)),
    ("sm_89", "3.6.0", (FP8, INT8, FP16)), ("sm_120", "3.6.0", (FP8, INT8, FP16)),
    ("sm_80", "3.6.0", (INT8, FP16)), ("sm_86", "3.6.0", (INT8, FP16)), ("sm_87", "3.6.0", (INT8, FP16)),
    ("sm_75", "3.2.0", (INT8, FP16)), ("sm_75", "3.3.1", ()),
]


@pytest.mark.parametrize("card, triton, candidates", AUTO, ids=[f"{c}-triton{t}" for c, t, _ in AUTO])
def test_auto_candidates_per_architecture(card, triton, candidates):
    d = select_path(nvidia(card, triton), "auto")
    assert d.candidates == candidates, d.reason
    assert d.path == (candidates[0] if candidates else PATH_PYTORCH)
    assert d.measure == bool(candidates) and not d.overridden
    if INT8 in candidates:
        assert "Triton INT8 (INT8 Q.K, FP16 P.V)" in d.reason, d.reason
    if FP8 in candidates:
        assert "Triton FP8 (" in d.reason, d.reason


def test_auto_drops_paths_the_build_cannot_run():
    only_fp16 = frozenset({FP16})
    assert select_path(nvidia("sm_86", implemented=only_fp16)).candidates == (FP16,)
    assert select_path(nvidia("sm_89", implemented=frozenset({FP16, INT8}))).candidates == (INT8, FP16)


# Which FP8 kernel the reason names, once the Settings node has probed the optional ones.
PRECISION = [
    ("sm_90", frozenset({gpu_rules.FP8_KERNEL_GLUON}), "FP8 Q.K and P.V, warp-specialised Gluon kernel"),
    ("sm_90", frozenset(), "Triton FP8 (FP8 Q.K and P.V)"),
    ("sm_89", frozenset({gpu_rules.FP8_KERNEL_INT8_FP8PV}), "INT8 Q.K, FP8 P.V with FP16 accumulation"),
    ("sm_120", frozenset({gpu_rules.FP8_KERNEL_INT8_FP8PV}), "INT8 Q.K, FP8 P.V with FP16 accumulation"),
    ("sm_89", frozenset({gpu_rules.FP8_KERNEL_GLUON}), "Triton FP8 (FP8 Q.K and P.V)"),  # Gluon: sm_90 only
    ("sm_100", gpu_rules.OPTIONAL_FP8_KERNELS, "Triton FP8 (FP8 Q.K and P.V)"),
]


@pytest.mark.parametrize("card, kernels, words", PRECISION, ids=[f"{c}-{sorted(k)}" for c, k, _ in PRECISION])
def test_reason_names_the_precision_that_runs(card, kernels, words):
    d = select_path(nvidia(card, fp8_kernels=kernels), "auto")
    assert words in d.reason and "where available" not in d.reason, d.reason


def test_unknown_fp8_kernels_name_both_possibilities():
    # install.py cannot probe them: the reason says what runs where it can.
    reason = select_path(nvidia("sm_89"), "auto").reason
    assert "INT8 Q.K, FP8 P.V with FP16 accumulation where available, else FP8 Q.K and P.V" in reason, reason


@pytest.mark.parametrize("card, kernels, order", [
    ("sm_90", gpu_rules.OPTIONAL_FP8_KERNELS, ("fp8_gluon", "fp8_full", "fp8_qk")),
    ("sm_89", gpu_rules.OPTIONAL_FP8_KERNELS, ("int8_fp8pv", "fp8_full", "fp8_qk")),
    ("sm_120", frozenset(), ("fp8_full", "fp8_qk")),
    ("sm_100", gpu_rules.OPTIONAL_FP8_KERNELS, ("fp8_full", "fp8_qk")),
])
def test_fp8_kernel_order(card, kernels, order):
    assert gpu_rules.fp8_kernel_order(CARDS[card][1], kernels) == order


# (facts, mode) -> (path, words); every one overridden and saying "<mode> asked, but".
FORCED_OVERRIDDEN = {
    "int8-turing-triton-3.3": (nvidia("sm_75", "3.3.1"), "int8", PATH_PYTORCH, ["Turing", "3.3"]),
    "fp8-turing-triton-3.3": (nvidia("sm_75", "3.3.1"), "fp8", PATH_PYTORCH, ["Turing"]),
    "fp8-amd-rdna3": (Facts(device="cuda:0", vendor="amd", name="AMD Radeon RX 7900 XTX", arch="gfx1100",
                            triton_version="3.6.0", implemented=ALL), "fp8", FP16, ["RDNA3 has no FP8", "gfx1100"]),
    "int8-not-shipped": (nvidia("sm_86", implemented=frozenset({FP16})), "int8", FP16, ["INT8 kernel cannot run"]),
    "fp8-ampere": (nvidia("sm_86"), "fp8", FP16, ["no FP8 tensor cores"]),
    "int8-cpu-interpreter": (Facts(device="cpu", vendor="cpu", triton_version="3.6.0", interpreter=True,
                                   implemented=ALL), "int8", FP16, ["interpreter"]),
}


@pytest.mark.parametrize("case", list(FORCED_OVERRIDDEN))
def test_forced_quantized_mode_that_cannot_run_says_so(case):
    facts, mode, path, words = FORCED_OVERRIDDEN[case]
    d = select_path(facts, mode)
    assert d.path == path and d.overridden, d
    assert d.reason.startswith(f"{mode} asked, but"), d.reason
    for word in words:
        assert word in d.reason, d.reason


@pytest.mark.parametrize("card", ["sm_75", "sm_86", "sm_89", "sm_90"])
def test_forced_int8_runs_where_it_can_with_fp16_behind_it(card):
    d = select_path(nvidia(card, "3.2.0" if card == "sm_75" else "3.6.0"), "int8")
    assert (d.path, d.candidates, d.overridden, d.measure) == (INT8, (INT8, FP16), False, False)
    assert "int8 forced" in d.reason and "INT8 Q.K, FP16 P.V" in d.reason


def test_saved_workflow_modes_still_load():
    assert {"auto", "fp8", "fp16", "off"} < set(gpu_rules.MODES) and "int8" in gpu_rules.MODES
    AccelSettings("int8")  # the Settings node's dropdown value is accepted


# ---- auto's guard ---------------------------------------------------------------------------

REF = torch.randn(2, 40, 4, 16, generator=torch.Generator().manual_seed(0))  # [B, H, L, D]


def _off_by(rel: float, seed: int = 1, heads=None) -> torch.Tensor:
    """REF plus noise of norm rel * ||REF|| (on `heads` only, scaled to that slice, when given)."""
    noise = torch.randn(REF.shape, generator=torch.Generator().manual_seed(seed))
    if heads is None:
        return REF + noise * (rel * REF.norm() / noise.norm())
    out = REF.clone()
    for h in heads:
        n = noise[:, h]
        out[:, h] += n * (rel * REF[:, h].norm() / n.norm())
    return out


def _timer(ms):
    def timer(fn, device):
        return ms[fn.__name__], fn()
    return timer


def _choose(tmp_path, outputs: dict, ms: dict, groups=None):
    candidates = {}
    for name, out in outputs.items():
        def fn(out=out):
            return out
        fn.__name__ = name
        candidates[name] = fn
    original = candidates[ORIGINAL] = (lambda: REF)
    original.__name__ = ORIGINAL
    sc = SpeedChoice(tmp_path / "speed.json", timer=_timer({**ms, ORIGINAL: 2.0}))
    return sc.choose("key", candidates, torch.device("cpu"), groups=groups)[0], sc


PER_HEAD = lambda t: t.reshape(2 * 40, -1)  # noqa: E731  [B, H, L, D] -> (batch, head) slices


@pytest.mark.parametrize("path", [FP8, INT8])
def test_faster_quantized_path_that_disagrees_is_rejected(tmp_path, path):
    # 0.055: the full-FP8 kernel's figure on Gaussian-noise inputs; it must not pass.
    choice, _ = _choose(tmp_path, {path: _off_by(0.055)}, {path: 0.5}, PER_HEAD)
    assert choice == ORIGINAL


@pytest.mark.parametrize("path", [FP8, INT8])
def test_faster_quantized_path_that_agrees_is_kept(tmp_path, path):
    # 0.01: full FP8 on outlier-structured (real-activation-like) inputs.
    choice, sc = _choose(tmp_path, {path: _off_by(0.01)}, {path: 0.5}, PER_HEAD)
    assert choice == path
    timing = json.loads((tmp_path / "speed.json").read_text())["entries"]["key"]["timings"][path]
    assert timing["agrees"] and timing["rel_l2"] == pytest.approx(0.01, rel=1e-3) and timing["min_cosine"] > 0.998


def test_slower_quantized_path_is_not_kept_even_when_it_agrees(tmp_path):
    assert _choose(tmp_path, {FP8: _off_by(0.01)}, {FP8: 2.5}, PER_HEAD)[0] == ORIGINAL


def test_one_broken_head_fails_the_cosine_bar_the_total_would_pass(tmp_path):
    broken = _off_by(0.2, heads=[7])
    rel = ((broken - REF).norm() / REF.norm()).item()
    assert rel < guards.QUANTIZED_BAR.max_rel_l2  # the whole-output figure alone would accept it
    assert _choose(tmp_path, {FP8: broken}, {FP8: 0.5}, groups=None)[0] == FP8
    assert _choose(tmp_path / "per-head", {FP8: broken}, {FP8: 0.5}, groups=PER_HEAD)[0] == ORIGINAL


def test_each_path_is_judged_by_its_own_bar(tmp_path):
    # 0.03 is quantisation noise for FP8 but a bug for the lossless kernel.
    choice, _ = _choose(tmp_path, {FP16: _off_by(0.03, seed=2), FP8: _off_by(0.03, seed=3)},
                        {FP16: 0.4, FP8: 0.6}, PER_HEAD)
    assert choice == FP8
    assert guards.agreement_bar(FP16).max_rel_l2 == 2e-2


def test_nan_output_is_rejected(tmp_path):
    bad = REF.clone()
    bad[0, 0, 0, 0] = float("nan")
    assert _choose(tmp_path, {FP8: bad}, {FP8: 0.1}, PER_HEAD)[0] == ORIGINAL


def test_zero_heads_on_both_sides_agree():
    ref = REF.clone()
    ref[:, 3] = 0  # a fully masked head: zeros from every path
    assert guards.agreement(ref.clone(), ref, PER_HEAD)["min_cosine"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("skip_output_reshape", [False, True])
def test_head_slices_follow_comfyui_output_layout(skip_output_reshape):
    b, h, n, d = 2, 3, 5, 4
    bhld = torch.arange(b * h * n * d, dtype=torch.float32).reshape(b, h, n, d)
    out = bhld if skip_output_reshape else bhld.transpose(1, 2).reshape(b, n, h * d)
    slices = head_slices({"batch": b, "heads": h, "skip_output_reshape": skip_output_reshape})(out)
    assert torch.equal(slices, bhld.reshape(b * h, n * d))


def test_quantized_candidate_falls_back_to_fp16_with_the_reason():
    """A call the FP8 path cannot serve (float32) leaves FP16/BF16 as the only candidate."""
    override = AttentionOverride(AccelSettings("fp8"))
    decision = gpu_rules.Decision(FP8, "test", candidates=(FP8, FP16))
    q, k, v = (torch.randn(1, 2, 40, 64) for _ in range(3))
    usable, refusals = override._usable_paths(decision, q, k, v, None, False)
    assert usable == [FP16] and any("dtype torch.float32" in r for r in refusals), refusals
    q, k, v = (t.half() for t in (q, k, v))
    usable, refusals = override._usable_paths(decision, q, k, v, None, True)  # low_precision_attention=False
    assert usable == [FP16] and refusals == [f"{FP8}: full precision requested"]


# ---- what is recorded and logged ------------------------------------------------------------

def test_speed_summary_rows(tmp_path):
    sc = SpeedChoice(tmp_path / "speed.json", timer=_timer({ORIGINAL: 3.0, FP8: 1.5, FP16: 2.5}))
    about = {"device": "cuda:1", "gpu": "NVIDIA H200", "arch": "sm_90", "shape_class": "b1-h24/24-q8192-k8192-d128"}
    cands = {ORIGINAL: lambda: REF, FP8: lambda: _off_by(0.01), FP16: lambda: REF}
    for name, fn in cands.items():
        fn.__name__ = name
    sc.choose("NVIDIA H200|sm_90|x|b1-h24/24-q8192-k8192-d128", cands, torch.device("cpu"), PER_HEAD, about)
    # An entry written before `about` was stored: read from its key.
    sc._cache.put("NVIDIA A100|sm_80|torch 2.9|triton 3.5|pack 0.1|triton_fp16|b2-h10/10-q4096-k4096-d64",
                  {"choice": ORIGINAL, "timings": {ORIGINAL: {"ms": 1.0}, FP16: {"ms": 1.2, "rel_l2": 0.001}}})
    rows = speed_choice.speed_summary(sc)
    new = next(r for r in rows if r["gpu"] == "NVIDIA H200")
    assert new["device"] == "cuda:1" and new["shape_class"] == about["shape_class"] and new["choice"] == FP8
    assert new["timings_ms"] == {ORIGINAL: 3.0, FP8: 1.5, FP16: 2.5} and new["speedup_vs_original"] == 2.0
    assert new["agreement"][FP8]["agrees"] is True
    old = next(r for r in rows if r["gpu"] == "NVIDIA A100")
    assert (old["arch"], old["shape_class"], old["speedup_vs_original"]) == ("sm_80", "b2-h10/10-q4096-k4096-d64", 1.0)
    # Another process reads the same rows from the file.
    assert speed_choice.speed_summary(SpeedChoice(tmp_path / "speed.json")) == rows


def test_speed_key_fields():
    """The shape class stays the key's last field (speed_summary reads old entries from it)."""
    facts = nvidia("sm_90", arch="sm_90")
    key = speed_key(facts, [ORIGINAL, FP8, FP16], "b1-h40/40-q32760-k32760-d128")
    fields = key.split("|")
    assert fields[:2] == ["NVIDIA H200", "sm_90"] and fields[-1] == "b1-h40/40-q32760-k32760-d128"
    assert fields[5] == f"{ORIGINAL}+{FP8}+{FP16}" and len(fields) == 8
    assert fields[6] == "eager"  # the step mode: an eager call is timed with its host time


def test_one_info_line_before_and_one_after_timing_then_silence(tmp_path, caplog):
    sc = SpeedChoice(tmp_path / "speed.json", timer=_timer({ORIGINAL: 2.0, FP8: 1.0}))
    cands = {ORIGINAL: lambda: REF, FP8: lambda: _off_by(0.2)}
    for name, fn in cands.items():
        fn.__name__ = name
    about = {"shape_class": "b2-h40/40-q4-k4-d16-float32-none"}
    with caplog.at_level(logging.INFO, logger="triton_accel.nodes.speed_choice"):
        for _ in range(3):
            sc.choose("k", cands, torch.device("cpu"), PER_HEAD, about)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0] == (f"Triton Accel: timing {FP8} against ComfyUI's attention at "
                        "b2-h40/40-q4-k4-d16-float32-none (first call only)")
    assert "-> original" in lines[1] and "disagrees" in lines[1], lines[1]
    assert all(r.levelno == logging.INFO for r in caplog.records)  # a quantized path disagreeing is no warning
