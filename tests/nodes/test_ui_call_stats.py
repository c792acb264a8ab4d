"""call_stats: the original totals stay as they were; per kind and per patched model on top."""
import pytest
from triton_accel.runtime import call_stats


@pytest.fixture(autouse=True)
def _fresh():
    call_stats.reset()
    yield
    call_stats.reset()


def test_labels_are_class_name_and_counter():
    first = call_stats.new_model_label("Flux")
    second = call_stats.new_model_label("Flux")
    other = call_stats.new_model_label("WAN21")
    assert first.startswith("Flux #") and second.startswith("Flux #") and other.startswith("WAN21 #")
    assert int(second.split("#")[1]) == int(first.split("#")[1]) + 1
    assert {first, second, other} <= set(call_stats.snapshot()["models"])


def test_original_keys_unchanged_and_attention_only():
    label = call_stats.new_model_label("SDXL")
    call_stats.record("triton", path="triton_fp16", model=label)
    call_stats.record("original", "dtype torch.float64", model=label)
    call_stats.record("original", "too few tokens", kind="linear", model=label)
    call_stats.record("triton", path="fp8_w8a8", kind="linear", model=label)
    snap = call_stats.snapshot()
    # What /triton_accel/stats returned before: attention calls only, same keys and spellings.
    assert snap["calls"] == {"triton": 1, "original": 1}
    assert snap["reasons"] == {"dtype torch.float64": 1}
    assert snap["paths"] == {"triton_fp16": 1}
    assert snap["version"] == call_stats.STATS_VERSION == 2
    assert snap["kinds"]["linear"] == {"served": 1, "handed_back": 1, "paths": {"fp8_w8a8": 1},
                                       "reasons": {"too few tokens": 1}}
    model = snap["models"][label]
    assert model["model_class"] == "SDXL"
    assert model["kinds"]["attention"]["served"] == 1 and model["kinds"]["attention"]["handed_back"] == 1
    assert model["kinds"]["linear"]["reasons"] == {"too few tokens": 1}


@pytest.mark.parametrize("model", [None, "Unknown #7"], ids=["no-label", "label-never-issued"])
def test_record_without_an_issued_label(model):
    call_stats.record("triton", path="triton_fp16", model=model)
    snap = call_stats.snapshot()
    assert snap["calls"] == {"triton": 1}
    if model is None:
        assert all(m["kinds"] == {} for m in snap["models"].values())  # counted in the totals only
    else:
        assert snap["models"][model]["model_class"] == "Unknown"


def test_positional_record_still_works():
    call_stats.record("original", "reason text", None)
    assert call_stats.snapshot()["reasons"] == {"reason text": 1}


def test_reset_zeroes_counts_keeps_labels():
    label = call_stats.new_model_label("Flux")
    call_stats.record("triton", path="triton_fp16", model=label)
    call_stats.reset()
    snap = call_stats.snapshot()
    assert snap["calls"] == {} and snap["kinds"] == {}
    assert snap["models"][label] == {"model_class": "Flux", "kinds": {}}


def test_model_table_is_bounded():
    labels = [call_stats.new_model_label("Flux") for _ in range(call_stats.MAX_MODELS + 5)]
    models = call_stats.snapshot()["models"]
    assert len(models) == call_stats.MAX_MODELS
    assert labels[0] not in models and labels[-1] in models


def test_user_facing_label_is_not_original():
    assert call_stats.HANDED_BACK_LABEL == "handed back to ComfyUI"
