"""call_stats: the original totals stay as they were; per kind and per patched model on top."""
import pytest
from triton_accel.runtime import call_stats


@pytest.fixture(autouse=True)
def _fresh():
    call_stats.reset()
    yield
    call_stats.reset()


def test_new_labels_are_family_and_never_repeat():
    first = call_stats.new_model_label("Flux")
    second = call_stats.new_model_label("Flux")
    other = call_stats.new_model_label("Wan 2.1")
    assert first.split(" #")[0] == second.split(" #")[0] == "Flux" and other.split(" #")[0] == "Wan 2.1"
    assert first != second
    assert {first, second, other} <= set(call_stats.snapshot()["models"])


def _comfy_model(config_class: str, base_class: str = "BaseModel"):
    """What ComfyUI's ModelPatcher carries: .model (comfy.model_base.<base_class>) whose
    .model_config is an instance of comfy.supported_models.<config_class>."""
    inner = type(base_class, (), {})()
    if config_class:
        inner.model_config = type(config_class, (), {})()
    return type("ModelPatcher", (), {"model": inner})()


@pytest.mark.parametrize("config_class,base_class,family", [
    ("SD15", "BaseModel", "SD1.5"), ("SDXL", "SDXL", "SDXL"), ("Flux", "Flux", "Flux"),
    ("WAN21_T2V", "WAN21", "Wan 2.1"), ("WAN21_I2V", "WAN21", "Wan 2.1"), ("WAN22_T2V", "WAN22", "Wan 2.2"),
    ("QwenImage", "QwenImage", "Qwen-Image"), ("HunyuanVideoI2V", "HunyuanVideo", "HunyuanVideo"),
    ("Lumina2", "Lumina2", "Lumina 2"), ("SomeNewModel", "BaseModel", "SomeNewModel"),
    ("", "WAN21", "Wan 2.1"), ("", "BaseModel", "Model"),
], ids=lambda v: v or "none")
def test_labels_name_the_family(config_class, base_class, family):
    model = _comfy_model(config_class, base_class)
    assert call_stats.model_family(model) == family
    assert call_stats.model_label(model).split(" #")[0] == family


@pytest.mark.parametrize("model", [None, object(), 3, "text"], ids=["none", "object", "int", "str"])
def test_family_of_anything_never_raises(model):
    assert isinstance(call_stats.model_family(model), str) and call_stats.model_family(model)


def test_label_stays_for_one_loaded_model_across_runs_and_clones():
    model = _comfy_model("StableRunsModel")
    clone = type("ModelPatcher", (), {"model": model.model})()  # ModelPatcher.clone shares .model
    labels = {call_stats.model_label(model) for _ in range(5)} | {call_stats.model_label(clone)}
    assert labels == {"StableRunsModel"}
    assert [k for k in call_stats.snapshot()["models"] if k.startswith("StableRunsModel")] == ["StableRunsModel"]


def test_two_loaded_models_of_one_family_get_two_labels_and_a_freed_one_is_reused():
    import gc

    family = "TwoLoadedModel"  # a family no other test loads
    first, second = _comfy_model(family), _comfy_model(family)
    assert (call_stats.model_label(first), call_stats.model_label(second)) == (family, f"{family} #2")
    call_stats.record("triton", path="triton_fp16", model=family)
    del first
    gc.collect()
    third = _comfy_model(family)
    assert call_stats.model_label(third) == family  # not #3: numbers do not grow run after run
    assert call_stats.snapshot()["models"][family]["kinds"] == {}  # the new model starts at 0


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
