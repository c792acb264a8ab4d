"""The path each device gets, over a table of real cards x Triton versions (kernels/gpu_rules.py,
what the Settings node decides with)."""
import pytest

from triton_accel.kernels.gpu_rules import (
    PATH_PYTORCH, PATH_TRITON_FP16, PATH_TRITON_FP8, Facts as DeviceFacts, select_path,
)

BOTH = frozenset({PATH_TRITON_FP16, PATH_TRITON_FP8})

CARDS = {
    "sm_61": ("NVIDIA GeForce GTX 1080 Ti", (6, 1)),
    "sm_75": ("NVIDIA GeForce RTX 2080 Ti", (7, 5)),
    "sm_80": ("NVIDIA A100-SXM4-80GB", (8, 0)),
    "sm_86": ("NVIDIA GeForce RTX 3090", (8, 6)),
    "sm_89": ("NVIDIA GeForce RTX 4090", (8, 9)),
    "sm_90": ("NVIDIA H200", (9, 0)),
    "sm_100": ("NVIDIA B200", (10, 0)),
    "sm_120": ("NVIDIA GeForce RTX 5090", (12, 0)),
}


def nvidia(card, triton="3.6.0", **kw):
    name, cap = CARDS[card]
    return DeviceFacts(device="cuda:0", vendor="nvidia", name=name, capability=cap,
                       arch=card, triton_version=triton, **kw)


AMD = DeviceFacts(device="cuda:0", vendor="amd", name="AMD Radeon RX 7900 XTX", arch="gfx1100", triton_version="3.6.0")
CPU = DeviceFacts(device="cpu", vendor="cpu", name="cpu", triton_version="3.6.0")
INTEL = DeviceFacts(device="xpu:0", vendor="intel", name="Intel Arc A770", triton_version="3.6.0")

# (facts, mode) -> (path, words the reason must contain, measure)
TABLE = [
    ("sm_61-any", nvidia("sm_61"), "auto", PATH_PYTORCH, ["sm_61", "sm_75"], False),
    ("sm_61-forced", nvidia("sm_61"), "fp16", PATH_PYTORCH, ["sm_61"], False),
    ("sm_75-triton-3.2", nvidia("sm_75", "3.2.0"), "auto", PATH_TRITON_FP16, ["sm_75", "FP16/BF16"], True),
    ("sm_75-triton-3.3", nvidia("sm_75", "3.3.1"), "auto", PATH_PYTORCH, ["Turing", "3.3"], False),
    ("sm_75-triton-3.6-forced", nvidia("sm_75", "3.6.0"), "fp16", PATH_PYTORCH, ["Turing"], False),
    ("sm_80", nvidia("sm_80"), "auto", PATH_TRITON_FP16, ["sm_80"], True),
    ("sm_86", nvidia("sm_86", "3.5.1"), "auto", PATH_TRITON_FP16, ["RTX 3090", "sm_86"], True),
    ("sm_86-fp8-asked", nvidia("sm_86"), "fp8", PATH_TRITON_FP16, ["no FP8 tensor cores", "sm_89"], False),
    ("sm_89-auto-fp8-unavailable", nvidia("sm_89"), "auto", PATH_TRITON_FP16, ["FP16/BF16", "timed"], True),
    ("sm_89-fp8-asked-unavailable", nvidia("sm_89"), "fp8", PATH_TRITON_FP16, ["FP8 kernel cannot run here"], False),
    ("sm_89-auto-fp8-kernel", nvidia("sm_89", implemented=BOTH), "auto", PATH_TRITON_FP8, ["FP8", "timed"], True),
    ("sm_86-auto-both-kernels", nvidia("sm_86", implemented=BOTH), "auto", PATH_TRITON_FP16, ["sm_86"], True),
    ("sm_90", nvidia("sm_90"), "auto", PATH_TRITON_FP16, ["H200", "sm_90"], True),
    ("sm_90-fp16", nvidia("sm_90"), "fp16", PATH_TRITON_FP16, ["forced"], False),
    ("sm_100", nvidia("sm_100"), "auto", PATH_TRITON_FP16, ["sm_100"], True),
    ("sm_120-triton-3.6", nvidia("sm_120", "3.6.0"), "auto", PATH_TRITON_FP16, ["sm_120"], True),
    ("sm_120-triton-3.2", nvidia("sm_120", "3.2.0"), "auto", PATH_PYTORCH, ["Blackwell", "3.3"], False),
    # Datacenter Blackwell has the same Triton floor (install.py and the nodes once disagreed here).
    ("sm_100-triton-3.2", nvidia("sm_100", "3.2.0", implemented=BOTH), "auto", PATH_PYTORCH, ["Blackwell", "3.3"], False),
    ("sm_120-torch-2.6", nvidia("sm_120", torch_version="2.6.0", torch_cuda="12.4"), "auto", PATH_PYTORCH,
     ["Blackwell", "CUDA 12.8"], False),
    ("sm_120-torch-2.7-cu126", nvidia("sm_120", torch_version="2.7.1", torch_cuda="12.6"), "auto", PATH_PYTORCH,
     ["CUDA 12.8"], False),
    ("sm_120-torch-2.7-cu128", nvidia("sm_120", torch_version="2.7.1", torch_cuda="12.8"), "auto",
     PATH_TRITON_FP16, ["sm_120"], True),
    ("no-triton", nvidia("sm_89", None), "auto", PATH_PYTORCH, ["not installed", "install.py"], False),
    ("broken-triton", nvidia("sm_89", "3.5.0", triton_error="Triton failed to run a test kernel: DLL load failed"),
     "auto", PATH_PYTORCH, ["DLL load failed"], False),
    ("off", nvidia("sm_90"), "off", PATH_PYTORCH, ["off"], False),
    ("amd-auto", AMD, "auto", PATH_PYTORCH, ["not validated on AMD", "gfx1100"], False),
    ("amd-forced", AMD, "fp16", PATH_TRITON_FP16, ["gfx1100"], False),
    ("intel", INTEL, "auto", PATH_PYTORCH, ["Intel"], False),
    ("cpu-auto", CPU, "auto", PATH_PYTORCH, ["no GPU"], False),
    ("cpu-forced-no-interpreter", CPU, "fp16", PATH_PYTORCH, ["no GPU"], False),
    ("cpu-auto-interpreter", DeviceFacts(device="cpu", vendor="cpu", triton_version="3.6.0", interpreter=True),
     "auto", PATH_PYTORCH, ["no GPU"], False),
    ("cpu-forced-interpreter", DeviceFacts(device="cpu", vendor="cpu", triton_version="3.6.0", interpreter=True),
     "fp16", PATH_TRITON_FP16, ["TRITON_INTERPRET"], False),
]


@pytest.mark.parametrize("facts, mode, path, words, measure", [pytest.param(*row[1:], id=row[0]) for row in TABLE])
def test_path_choice(facts, mode, path, words, measure):
    decision = select_path(facts, mode)
    assert decision.path == path, decision.reason
    for word in words:
        assert word in decision.reason, decision.reason
    assert decision.measure == measure


def test_two_gpus_of_one_rig_get_their_own_paths():
    rtx3090 = nvidia("sm_86")
    rtx4090 = DeviceFacts(device="cuda:1", vendor="nvidia", name=CARDS["sm_89"][0], capability=(8, 9),
                          triton_version="3.6.0", implemented=frozenset({PATH_TRITON_FP16, PATH_TRITON_FP8}))
    assert select_path(rtx3090).path == PATH_TRITON_FP16
    assert select_path(rtx4090).path == PATH_TRITON_FP8


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown mode"):
        select_path(CPU, "turbo")


def test_candidates_fall_back_from_quantised_to_fp16():
    fp8 = nvidia("sm_89", implemented=frozenset({PATH_TRITON_FP16, PATH_TRITON_FP8}))
    assert select_path(fp8, "auto").candidates == (PATH_TRITON_FP8, PATH_TRITON_FP16)
    assert select_path(fp8, "fp8").candidates == (PATH_TRITON_FP8, PATH_TRITON_FP16)
    assert select_path(fp8, "fp16").candidates == (PATH_TRITON_FP16,)
    assert select_path(nvidia("sm_61"), "auto").candidates == ()


@pytest.mark.parametrize("facts, mode, overridden", [
    pytest.param(nvidia("sm_86"), "fp8", True, id="fp8-on-ampere"),
    pytest.param(nvidia("sm_61"), "fp16", True, id="fp16-on-pascal"),
    pytest.param(nvidia("sm_89", implemented=BOTH), "fp8", False, id="fp8-on-ada"),
    pytest.param(nvidia("sm_61"), "auto", False, id="auto-never-overrides"),
])
def test_forced_mode_says_it_was_overridden(facts, mode, overridden):
    decision = select_path(facts, mode)
    assert decision.overridden == overridden
    if overridden:
        assert f"{mode} asked" in decision.reason, decision.reason


def test_blocked_decisions_carry_the_rule_code():
    from triton_accel.kernels import gpu_rules

    assert select_path(nvidia("sm_61")).code == gpu_rules.GPU_TOO_OLD
    assert select_path(nvidia("sm_75", "3.3.1")).code == gpu_rules.TURING_DROPPED
    assert select_path(nvidia("sm_120", "3.2.0")).code == gpu_rules.BLACKWELL_TRITON
    assert select_path(CPU).code == gpu_rules.NO_GPU
    assert select_path(AMD).code == gpu_rules.AMD_NOT_VALIDATED
    assert select_path(nvidia("sm_89", None)).code == gpu_rules.TRITON_MISSING
