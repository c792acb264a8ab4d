"""kernels/core/tuning.py's autotuning progress: the hook nodes/ installs (ComfyUI's progress bar) is
told (done, total) once before and after every candidate config, failed ones included, and the
log says what is tuned and what won. No dtype: configs are JSON, timings are faked (no GPU).

Named cases: every config runs; one config fails to compile (still counted); a hook that raises
(the tuning goes on); no hook installed.
"""
import logging

import pytest

from triton_accel.kernels.core import tuning
from triton_accel.kernels.core.device import DeviceInfo

INFO = DeviceInfo("cuda", "nvidia", "NVIDIA H200", (9, 0), "sm90")
DEFAULT = {"BLOCK_M": 64, "num_warps": 4}
CONFIGS = [{"BLOCK_M": 64, "num_warps": 4}, {"BLOCK_M": 128, "num_warps": 8}, {"BLOCK_M": 256, "num_warps": 8}]
FAKE_MS = {64: 0.50, 128: 0.25, 256: 0.75}


@pytest.fixture
def autotuning(tmp_path, monkeypatch):
    """Autotuning on, an empty cache, do_bench replaced by fixed times per BLOCK_M."""
    triton_testing = pytest.importorskip("triton.testing")
    monkeypatch.setenv("TRITON_ACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_ACCEL_AUTOTUNE", "1")
    state = {"config": None}

    def run(cfg):
        if cfg.get("fails"):
            raise RuntimeError("out of shared memory")
        state["config"] = cfg

    def fake_do_bench(fn, **kwargs):
        fn()
        return FAKE_MS[state["config"]["BLOCK_M"]]

    monkeypatch.setattr(triton_testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(tuning, "_progress_hook", None)  # the nodes' hook comes back after the test
    tuning.clear_memory()
    yield run
    tuning.clear_memory()


CASES = {
    "all_run": CONFIGS,
    "one_fails_to_compile": CONFIGS[:1] + [{"BLOCK_M": 512, "fails": True}] + CONFIGS[1:],
}


@pytest.mark.parametrize("case", list(CASES))
def test_hook_sees_every_config_and_the_log_names_the_winner(autotuning, case, caplog):
    configs = CASES[case]
    seen = []
    tuning.set_progress_hook(lambda done, total: seen.append((done, total)))
    with caplog.at_level(logging.INFO, logger="triton_accel.kernels.core.tuning"):
        best = tuning.choose("attention", INFO, ("bfloat16", 128), DEFAULT, lambda: configs, autotuning)
    assert best == {"BLOCK_M": 128, "num_warps": 8}
    n = len(configs)
    assert seen == [(i, n) for i in range(n + 1)]
    messages = [r.getMessage() for r in caplog.records]
    assert f"autotuning attention at bfloat16-128: {n} configs (first call only; TRITON_ACCEL_AUTOTUNE=1)" in messages
    assert any(m.startswith("autotuned attention at bfloat16-128: chose {'BLOCK_M': 128, 'num_warps': 8} (0.250 ms)")
               for m in messages), messages
    # the second call is a cache hit: no timing, no progress
    seen.clear()
    assert tuning.choose("attention", INFO, ("bfloat16", 128), DEFAULT, lambda: configs, autotuning) == best
    assert seen == []


def test_a_broken_hook_does_not_stop_tuning(autotuning):
    def broken(done, total):
        raise ValueError("progress display gone")
    tuning.set_progress_hook(broken)
    assert tuning.choose("attention", INFO, ("float16", 64), DEFAULT, lambda: CONFIGS, autotuning)["BLOCK_M"] == 128


def test_no_hook_installed(autotuning):
    tuning.set_progress_hook(None)
    assert tuning.autotune(CONFIGS, autotuning)[0]["BLOCK_M"] == 128
