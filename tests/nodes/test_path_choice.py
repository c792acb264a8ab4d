"""The path each device gets, over a table of real cards x Triton versions (kernels/core/gpu_rules.py,
what the Settings node decides with)."""
import pytest

from triton_accel.kernels.core.gpu_rules import (
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
    ("amd-auto", AMD, "auto", PATH_PYTORCH, ["not run on AMD hardware", "gfx1100"], False),
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
    from triton_accel.kernels.core import gpu_rules

    assert select_path(nvidia("sm_61")).code == gpu_rules.GPU_TOO_OLD
    assert select_path(nvidia("sm_75", "3.3.1")).code == gpu_rules.TURING_DROPPED
    assert select_path(nvidia("sm_120", "3.2.0")).code == gpu_rules.BLACKWELL_TRITON
    assert select_path(CPU).code == gpu_rules.NO_GPU
    assert select_path(AMD).code == gpu_rules.AMD_NOT_VALIDATED
    assert select_path(nvidia("sm_89", None)).code == gpu_rules.TRITON_MISSING


# ---- AMD per gfx family, Intel XPU, CPU without the interpreter (issue 14) ----------------------

ALL_PATHS = frozenset({PATH_TRITON_FP16, PATH_TRITON_FP8, "triton_int8"})
AMD_CARDS = {"gfx942": "AMD Instinct MI300X", "gfx950": "AMD Instinct MI355X", "gfx1100": "AMD Radeon RX 7900 XTX",
             "gfx1201": "AMD Radeon RX 9070 XT", "gfx1030": "AMD Radeon RX 6800 XT"}


def amd(arch, triton="3.9.0"):
    name = AMD_CARDS[arch.split(":")[0]]
    return DeviceFacts(device="cuda:0", vendor="amd", name=name, arch=arch, triton_version=triton,
                       implemented=ALL_PATHS)


# (arch, mode) -> (path, rule code or "", overridden, words the reason must contain)
AMD_TABLE = {
    ("gfx942", "auto"): (PATH_PYTORCH, "AMD_NOT_VALIDATED", False, ["MI300X", "gfx942", "not run on AMD hardware"]),
    ("gfx1201", "auto"): (PATH_PYTORCH, "AMD_NOT_VALIDATED", False, ["gfx1201", "fp16"]),
    ("gfx942", "fp16"): (PATH_TRITON_FP16, "", False, ["CDNA3", "not run on AMD hardware"]),
    ("gfx1100", "fp16"): (PATH_TRITON_FP16, "", False, ["RDNA3"]),
    ("gfx1201", "fp16"): (PATH_TRITON_FP16, "", False, ["RDNA4"]),
    # FP8 only where the matrix cores take OCP e4m3 (our quantisers' format)
    ("gfx942", "fp8"): (PATH_TRITON_FP16, "AMD_FP8_FNUZ", True, ["fp8 asked, but", "fnuz", "float8_e4m3fn"]),
    ("gfx1100", "fp8"): (PATH_TRITON_FP16, "NO_FP8_TENSOR_CORES", True, ["fp8 asked, but", "RDNA3 has no FP8"]),
    ("gfx1201", "fp8"): ("triton_fp8", "", False, ["OCP e4m3", "gfx1201"]),
    ("gfx950", "fp8"): ("triton_fp8", "", False, ["OCP e4m3", "gfx950"]),
    # INT8 dots on every family we serve (i8 MFMA, iu8 WMMA)
    ("gfx942", "int8"): ("triton_int8", "", False, ["int8 forced", "gfx942"]),
    ("gfx1100", "int8"): ("triton_int8", "", False, ["int8 forced"]),
    ("gfx1201", "int8"): ("triton_int8", "", False, ["int8 forced"]),
    # ROCm reports the arch with its target features; an arch outside the tested families: PyTorch
    ("gfx942:sramecc+:xnack-", "fp8"): (PATH_TRITON_FP16, "AMD_FP8_FNUZ", True, ["fnuz"]),
    ("gfx1030", "auto"): (PATH_PYTORCH, "AMD_ARCH_UNTESTED", False, ["gfx1030", "compile-tested"]),
    ("gfx1030", "fp16"): (PATH_PYTORCH, "AMD_ARCH_UNTESTED", True, ["fp16 asked", "gfx1030"]),
}


@pytest.mark.parametrize("arch, mode", list(AMD_TABLE), ids=[f"{a}-{m}" for a, m in AMD_TABLE])
def test_amd_path_per_gfx_family(arch, mode):
    path, code, overridden, words = AMD_TABLE[(arch, mode)]
    d = select_path(amd(arch), mode)
    assert (d.path, d.code, d.overridden) == (path, code, overridden), d
    assert not d.measure, "auto never times our kernels on AMD"
    for word in words:
        assert word in d.reason, (word, d.reason)
    assert "\n" not in d.reason


def test_amd_fp8_needs_a_triton_that_compiles_e4m3_for_the_target():
    """gfx12 gets e4m3 from Triton 3.4, gfx950 from 3.3 (gpu_rules.AMD_FP8_MIN_TRITON, checked
    against the releases' HIP backends in tests/compile/test_compile_amd.py)."""
    from triton_accel.kernels.core.gpu_rules import AMD_FP8_TRITON, select_linear_method

    old = select_path(amd("gfx1201", "3.3.1"), "fp8")
    assert (old.path, old.code, old.overridden) == (PATH_TRITON_FP16, AMD_FP8_TRITON, True), old
    assert "Triton 3.4" in old.reason and "3.3.1" in old.reason
    assert select_linear_method(amd("gfx1201", "3.3.1"), "fp8").code == AMD_FP8_TRITON
    assert select_path(amd("gfx1201", "3.4.0"), "fp8").path == "triton_fp8"
    assert select_path(amd("gfx950", "3.3.1"), "fp8").path == "triton_fp8"


# (arch, Linear mode) -> (method, overridden, words)
AMD_LINEAR = {
    ("gfx942", "auto"): (PATH_PYTORCH, False, ["not run on AMD hardware"]),
    ("gfx942", "int8"): ("int8_w8a8", False, ["int8 forced", "CDNA3"]),
    ("gfx942", "fp8"): (PATH_PYTORCH, True, ["fp8 asked, but", "fnuz"]),
    ("gfx942", "fp8_weight_only"): ("fp8_weight_only", False, ["forced"]),
    ("gfx1100", "fp8"): (PATH_PYTORCH, True, ["RDNA3 has no FP8"]),
    ("gfx1100", "int8"): ("int8_w8a8", False, ["RDNA3"]),
    ("gfx1201", "fp8"): ("fp8_w8a8", False, ["FP8 W8A8", "RDNA4"]),
    ("gfx950", "fp8"): ("fp8_w8a8", False, ["CDNA4"]),
    ("gfx1030", "int8"): (PATH_PYTORCH, True, ["int8 asked, but", "gfx1030"]),
}


@pytest.mark.parametrize("arch, mode", list(AMD_LINEAR), ids=[f"{a}-{m}" for a, m in AMD_LINEAR])
def test_amd_linear_method_per_gfx_family(arch, mode):
    from triton_accel.kernels.core.gpu_rules import select_linear_method

    method, overridden, words = AMD_LINEAR[(arch, mode)]
    d = select_linear_method(amd(arch), mode)
    assert (d.path, d.overridden) == (method, overridden), d
    for word in words:
        assert word in d.reason, (word, d.reason)


def _fake_device(monkeypatch, info):
    from triton_accel.kernels.core import device as device_mod

    monkeypatch.setattr(device_mod, "describe", lambda device=None: info)


@pytest.mark.parametrize("arch, fp8_ok, int8_ok", [("gfx942", False, True), ("gfx950", True, True),
                                                   ("gfx1100", False, True), ("gfx1201", True, True),
                                                   ("gfx1030", False, False)])
def test_amd_kernel_refusals_agree_with_the_rules(monkeypatch, arch, fp8_ok, int8_ok):
    """What the kernels themselves refuse on an AMD GPU (fp8_device_refusal, the INT8 attention's
    device_refusal, the registry's FP8 constraints, the Linear constraints) is what select_path
    and select_linear_method decide: a forced path the rules pick is never refused per call."""
    import torch

    from triton_accel import kernels as K
    import importlib

    from triton_accel.kernels.attention import int8 as attention_int8

    from triton_accel.kernels.core import gpu_rules
    from triton_accel.kernels.core.kernel_common import fp8_device_refusal
    from triton_accel.kernels.core.registry import Call

    linear_mod = importlib.import_module("triton_accel.kernels.linear.dispatch")  # the package exports a function of that name

    info = K.core.device.DeviceInfo("cuda", "amd", AMD_CARDS[arch], (9, 4), arch)
    _fake_device(monkeypatch, info)
    gpu = torch.device("cuda", 0)
    assert (fp8_device_refusal(gpu, "FP8 attention") is None) == fp8_ok
    assert (attention_int8.device_refusal(gpu, "fp16") is None) == int8_ok
    assert attention_int8.device_refusal(gpu, "fp8") is not None  # FP16-accumulating FP8 P.V: no AMD form
    call = Call(device=info, dtype=torch.bfloat16, head_dim=128, head_dim_v=128, q_heads=2, kv_heads=2,
                mask="none", is_causal=False)
    fp8_impl = K.registry.get("attention", "triton_fp8")
    assert (fp8_impl.constraints.check(call) is None) == fp8_ok, fp8_impl.constraints.check(call)
    assert (select_path(amd(arch), "fp8").path == "triton_fp8") == fp8_ok
    assert (select_path(amd(arch), "int8").path == "triton_int8") == int8_ok
    for method, ok in (("fp8_w8a8", fp8_ok), ("int8_w8a8", int8_ok)):
        assert (linear_mod.linear_refusal(method, "cuda:0") is None) == ok, linear_mod.linear_refusal(method, "cuda:0")
        mode = "fp8" if method == "fp8_w8a8" else "int8"
        assert (gpu_rules.select_linear_method(amd(arch), mode).path == method) == ok


def test_intel_xpu_gets_pytorch_with_a_one_line_reason(monkeypatch):
    """An Intel GPU as the Settings node probes it (a fake XPU device: torch's CPU build still
    makes xpu devices): PyTorch attention and Linear, one line saying so, and no Triton test
    kernel launched on it."""
    import torch

    from triton_accel.kernels.core import gpu_rules, selfcheck
    from triton_accel.runtime import device_probe

    def no_launch(device):
        raise AssertionError(f"selfcheck launched a Triton kernel on {device}")

    monkeypatch.setattr(selfcheck, "triton_works", no_launch)
    monkeypatch.setattr(torch.xpu, "get_device_name", lambda index=0: "Intel(R) Arc(TM) A770 Graphics", raising=False)
    device_probe._cache.clear()
    try:
        facts = device_probe.probe(torch.device("xpu", 0))
    finally:
        device_probe._cache.clear()
    assert (facts.vendor, facts.name) == ("intel", "Intel(R) Arc(TM) A770 Graphics")
    for decision in (select_path(facts, "auto"), select_path(facts, "fp16"), gpu_rules.select_linear_method(facts)):
        assert decision.path == PATH_PYTORCH and decision.code == gpu_rules.INTEL, decision
        assert "Intel" in decision.reason and "\n" not in decision.reason


CPU_CHILD = r"""
import importlib.util, json, os, sys
import torch
root = sys.argv[1]
assert "TRITON_INTERPRET" not in os.environ
spec = importlib.util.spec_from_file_location("triton_accel", os.path.join(root, "__init__.py"),
                                              submodule_search_locations=[root])
pack = importlib.util.module_from_spec(spec); sys.modules["triton_accel"] = pack; spec.loader.exec_module(pack)
from triton_accel import kernels as K
from triton_accel.kernels.core import gpu_rules, stats
from triton_accel.runtime import device_probe
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 64, 32, dtype=torch.float16) for _ in range(3))
stats.reset()
out = K.attention(q, k, v)  # auto: what a model's attention call on the CPU gets
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
facts = device_probe.probe(torch.device("cpu"))
print("RESULT " + json.dumps(dict(
    counts=stats.counts(), equal=bool(torch.equal(out, ref)), interpreter=K.interpreter_enabled(),
    attention=[(d.path, d.code) for d in (gpu_rules.select_path(facts, m) for m in ("auto", "fp16", "fp8"))],
    linear=[(d.path, d.code) for d in (gpu_rules.select_linear_method(facts, m) for m in ("auto", "int8"))])))
"""


def test_cpu_without_the_interpreter_goes_to_sdpa():
    """Outside the tests (TRITON_INTERPRET unset, which tests/conftest.py sets here, so a fresh
    process): a CPU attention call runs PyTorch SDPA, never the Triton interpreter, and the rules
    give PyTorch for every mode, attention and Linear."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", CPU_CHILD, str(root)], capture_output=True, text=True, env=env,
                       timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    r = json.loads(lines[-1][7:])
    assert r["interpreter"] is False
    assert r["counts"] == {"torch_sdpa": 1}, r["counts"]
    assert r["equal"], "the CPU call did not return SDPA's output"
    assert r["attention"] == [[PATH_PYTORCH, "NO_GPU"]] * 3, r["attention"]
    assert r["linear"] == [[PATH_PYTORCH, "NO_GPU"]] * 2, r["linear"]
