"""install.py and the Settings node must never disagree on which attention path a machine gets.

Both ask kernels/core/gpu_rules.py: the Settings node through select_path(), install.py through
nvidia_gpu_blocker() in its GPU check and select_path() for the expected path. This walks the
whole grid (every NVIDIA capability from sm_61 to sm_120, AMD, Intel, CPU x Triton none / 3.2 /
3.3 / 3.5 / 3.6 / 3.9 x torch 2.6 ... 2.13 with the CUDA builds they ship, plus a cu126 torch
2.7) and checks, for every point, that install.py's plan (built from made-up facts, as
tests/install does) and select_path() give the same path, and the same code and reason for
every GPU blocker.

install.py's "Triton version" for a grid point is the Triton the pack will import after its
run: the installed one when it matches torch's pin, else the version it installs. For
"none" that is torch's pin (the version install.py asks pip for), so "none" is compared with
select_path on that version; select_path on a missing Triton says TRITON_MISSING, which
install.py answers by installing it (checked separately).
"""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_install():
    name = "triton_accel_install"  # the name tests/install uses: one copy per test process
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "install.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


inst = _load_install()
rules = inst.gpu_rules  # kernels/core/gpu_rules.py, the file nodes/ and kernels/ import as a package module

NVIDIA = {
    "sm61": ("NVIDIA GeForce GTX 1080", (6, 1)),
    "sm70": ("Tesla V100-SXM2-32GB", (7, 0)),
    "sm75": ("NVIDIA GeForce RTX 2080", (7, 5)),
    "sm80": ("NVIDIA A100-SXM4-80GB", (8, 0)),
    "sm86": ("NVIDIA GeForce RTX 3090", (8, 6)),
    "sm87": ("Orin", (8, 7)),
    "sm89": ("NVIDIA GeForce RTX 4090", (8, 9)),
    "sm90": ("NVIDIA H100 80GB HBM3", (9, 0)),
    "sm100": ("NVIDIA B200", (10, 0)),
    "sm120": ("NVIDIA GeForce RTX 5090", (12, 0)),
}
# AMD GPUs: (name, gfx arch as ROCm reports it, capability torch reports) per family gpu_rules
# knows (CDNA3 with its target features, CDNA4, RDNA3, RDNA4) and one it does not (RDNA2).
AMD = {
    "amd": ("AMD Instinct MI300X", "gfx942:sramecc+:xnack-", [9, 4]),
    "amd_gfx950": ("AMD Instinct MI355X", "gfx950", [9, 5]),
    "amd_gfx1100": ("AMD Radeon RX 7900 XTX", "gfx1100", [11, 0]),
    "amd_gfx1201": ("AMD Radeon RX 9070 XT", "gfx1201", [12, 0]),
    "amd_gfx1030": ("AMD Radeon RX 6800 XT", "gfx1030", [10, 3]),
}
OTHER = tuple(AMD) + ("intel", "cpu")
INTEL_NAME = "Intel(R) Arc(TM) A770 Graphics"
TRITONS = (None, "3.2.0", "3.3.0", "3.5.0", "3.6.0", "3.9.0")
# (torch, CUDA of its default build); torch 2.7 also ships cu126 (too old for Blackwell).
TORCHES = (("2.6.0", "12.4"), ("2.7.0", "12.6"), ("2.7.0", "12.8"), ("2.8.0", "12.8"), ("2.9.1", "12.8"),
           ("2.10.0", "12.8"), ("2.11.0", "12.8"), ("2.12.0", "12.8"), ("2.13.0", "12.8"))
# The Triton each torch pins (its Requires-Dist on Linux; triton-windows pairs the same way).
TORCH_PIN = {6: "3.2.0", 7: "3.3.0", 8: "3.4.0", 9: "3.5.0", 10: "3.6.0", 11: "3.7.0", 12: "3.8.0", 13: "3.9.0"}
PACK = "/home/me/ComfyUI/custom_nodes/comfyui-triton-accel"
# A complete build ships every Triton path (FP8, INT8, FP16/BF16); install.py assumes that.
SHIPPED = rules.TRITON_PATHS


def _pin(torch, triton):
    return triton or TORCH_PIN[int(torch.split(".")[1])]


def linux_facts(device, torch, cuda, triton):
    """What install.py's probe reports on Linux for this grid point."""
    pin = _pin(torch, triton)
    facts = dict(os="linux", python="/venv/bin/python", python_dir="/venv/bin", python_kind="venv",
                 python_version=(3, 12, 3), numpy_version="2.2.6", triton_cache_dir="/home/me/.triton/cache",
                 pack_dir=PACK)
    if device in NVIDIA:
        name, cap = NVIDIA[device]
        facts.update(torch_version=f"{torch}+cu{cuda.replace('.', '')}", torch_cuda=cuda, cuda_available=True,
                     gpus=[{"name": name, "capability": list(cap)}],
                     torch_requires=[f'triton=={pin}; platform_system == "Linux"'],
                     installed={"triton": triton} if triton else {})
    elif device in AMD:
        name, arch, cap = AMD[device]
        facts.update(torch_version=f"{torch}+rocm6.4", torch_hip="6.4.43482", cuda_available=True,
                     gpus=[{"name": name, "capability": cap, "arch": arch}],
                     torch_requires=[f'pytorch-triton-rocm=={pin}; platform_system == "Linux"'],
                     installed={"pytorch-triton-rocm": triton} if triton else {})
    else:
        # CPU and XPU builds of torch name no triton: install.py installs plain triton, version
        # chosen by pip. Its probe asks torch.cuda only, so an Intel GPU looks like no GPU at all.
        facts.update(torch_version=f"{torch}+{'xpu' if device == 'intel' else 'cpu'}",
                     installed={"triton": triton} if triton else {})
    return inst.Facts(**facts)


def windows_facts(device, torch, cuda, triton):
    """A working ComfyUI portable (VC++ runtime, headers, driver) with this GPU; `triton` is the
    installed triton-windows, which torch pins (install.py follows torch's pin over its table)."""
    name, cap = NVIDIA[device]
    return inst.Facts(
        os="windows", python=r"C:\p\python_embeded\python.exe", python_dir=r"C:\p\python_embeded",
        python_kind="embedded", python_version=(3, 12, 10), torch_version=f"{torch}+cu{cuda.replace('.', '')}",
        torch_cuda=cuda, cuda_available=True, cuda_driver="13.0", gpus=[{"name": name, "capability": list(cap)}],
        torch_requires=[f'triton-windows=={triton}; platform_system == "Windows"'] if triton else [],
        installed={"triton-windows": triton} if triton else {}, numpy_version="2.2.6",
        vcrt_dir=r"C:\Windows\System32", vcrt_system={d: [14, 44, 35211, 0] for d in inst.VCRT_DLLS},
        include_dir=r"C:\p\python_embeded\Include", include_minor=12,
        python_lib=r"C:\p\python_embeded\libs\python312.lib", python_lib_dirs=[r"C:\p\python_embeded"],
        headers_target=r"C:\p\python_embeded", long_paths_enabled=True, triton_cache_dir=r"C:\Users\me\.triton\cache",
        pack_dir=r"C:\p\ComfyUI\custom_nodes\comfyui-triton-accel")


def rules_facts(device, torch, cuda, triton_version):
    """What the Settings node probes on the same machine (gpu_rules.Facts)."""
    common = dict(triton_version=triton_version, implemented=SHIPPED)
    if device in NVIDIA:
        name, cap = NVIDIA[device]
        return rules.Facts(device="cuda:0", vendor="nvidia", name=name, capability=cap,
                           torch_version=f"{torch}+cu{cuda.replace('.', '')}", torch_cuda=cuda, **common)
    if device in AMD:
        name, arch, _cap = AMD[device]
        return rules.Facts(device="cuda:0", vendor="amd", name=name, arch=arch.split(":")[0],
                           torch_version=f"{torch}+rocm6.4", **common)
    if device == "intel":
        return rules.Facts(device="xpu:0", vendor="intel", name=INTEL_NAME, torch_version=f"{torch}+xpu", **common)
    return rules.Facts(device="cpu", vendor="cpu", torch_version=f"{torch}+cpu", **common)


def expected_version(platform, device, torch, triton):
    """The Triton the pack imports after install.py ran, when install.py can know it."""
    if triton:
        return triton
    if platform == "windows":
        return "3.%d" % (int(torch.split(".")[1]) - 4)  # install.py's triton-windows table
    if device in NVIDIA or device in AMD:
        return _pin(torch, triton)
    return None  # CPU / XPU torch pins no triton: pip picks it


def disagreement(platform, device, torch, cuda, triton):
    """'' when install.py and select_path agree on this grid point, else what differs."""
    facts = (windows_facts if platform == "windows" else linux_facts)(device, torch, cuda, triton)
    p = inst.plan(facts)
    version = expected_version(platform, device, torch, triton)
    if version is None:
        # No version to ask with: the CPU / Intel answer must not depend on one at all.
        answers = {(d.path, d.code, d.reason) for d in
                   (rules.select_path(rules_facts(device, torch, cuda, v), "auto") for v in TRITONS[1:])}
        if len(answers) != 1:
            return f"select_path depends on the Triton version here: {answers}"
        version = TRITONS[-1]
    d = rules.select_path(rules_facts(device, torch, cuda, version), "auto")
    got = [(b.code, b.reason) for b in p.blockers]
    if p.path != d.path:
        return f"path: install.py {p.path} ({p.path_reason}), select_path {d.path} ({d.reason})"
    if device == "intel":
        # install.py's probe only asks torch.cuda, so it cannot tell an Intel GPU from none: it
        # says NO_GPU where the Settings node says INTEL_UNSUPPORTED. Both keep PyTorch.
        return "" if [c for c, _ in got] == [rules.NO_GPU] and d.code == rules.INTEL else f"intel: {got} vs {d}"
    rule = rules.device_blocker(rules_facts(device, torch, cuda, version))
    if rule is not None:  # a GPU blocker (or no GPU): same code, and the Rule's reason word for word
        want = [(rule.code, rule.reason)]
        ok = got == want and p.path_reason == rule.reason and d.code == rule.code and rule.reason in d.reason
        return "" if ok else f"blocker: install.py {got} / {p.path_reason!r}, gpu_rules {want} / {d.reason!r}"
    if d.path == rules.PATH_PYTORCH:  # AMD: not validated, auto keeps PyTorch with select_path's reason
        ok = got == [(d.code, d.reason)] and p.path_reason == d.reason
        return "" if ok else f"pytorch: install.py {got}, select_path {d.code} {d.reason!r}"
    ok = (not got and not p.triton_blocked and p.path_reason == d.reason
          and p.expected_paths == rules.expected_paths(d))
    return "" if ok else f"triton path: install.py {got} {p.path_reason!r} {p.expected_paths!r}, select_path {d}"


GRID = [("linux", dev, t) for dev in list(NVIDIA) + list(OTHER) for t in TRITONS]
GRID += [("windows", dev, t) for dev in NVIDIA for t in TRITONS]


@pytest.mark.parametrize("platform, device, triton", GRID,
                         ids=[f"{p}-{d}-triton{t or 'none'}" for p, d, t in GRID])
def test_install_and_settings_agree(platform, device, triton):
    wrong = {f"torch {torch} CUDA {cuda}": why for torch, cuda in TORCHES
             if (why := disagreement(platform, device, torch, cuda, triton))}
    assert not wrong, wrong


@pytest.mark.parametrize("device", list(NVIDIA) + list(OTHER))
def test_missing_triton_is_what_install_py_fixes(device):
    """select_path on a machine without Triton says TRITON_MISSING; install.py's plan for it
    installs the package (or, for ROCm's PyTorch-index-only package, prints the command)."""
    for torch, cuda in TORCHES:
        d = rules.select_path(rules_facts(device, torch, cuda, None), "auto")
        assert (d.path, d.code) == (rules.PATH_PYTORCH, rules.TRITON_MISSING)
        p = inst.plan(linux_facts(device, torch, cuda, None))
        codes = [x.code for x in p.findings]
        if device in AMD:
            assert "TRITON_FROM_PYTORCH_INDEX" in codes, codes
        else:
            assert "TRITON_MISSING" in codes, codes
            assert any(a.argv and a.argv[-1].startswith("triton") for a in p.actions), p.actions


def test_the_grid_covers_every_outcome():
    """The grid is only worth something if it reaches each path and each GPU rule."""
    paths, codes = set(), set()
    for platform, device, triton in GRID:
        for torch, cuda in TORCHES:
            facts = (windows_facts if platform == "windows" else linux_facts)(device, torch, cuda, triton)
            p = inst.plan(facts)
            paths.add(p.path)
            codes |= {b.code for b in p.blockers}
    assert paths == {rules.PATH_TRITON_FP8, rules.PATH_TRITON_INT8, rules.PATH_PYTORCH}
    assert {rules.GPU_TOO_OLD, rules.TURING_DROPPED, rules.BLACKWELL_TORCH, rules.BLACKWELL_TRITON, rules.NO_GPU,
            rules.AMD_NOT_VALIDATED, rules.AMD_ARCH_UNTESTED} <= codes


def test_rules_module_is_the_packs_file():
    assert Path(rules.__file__).resolve() == ROOT / "kernels" / "core" / "gpu_rules.py"


# What auto times per architecture, the way install.py announces it: the candidates
# in order, for the Triton the pack imports after install.py ran.
AUTO_CANDIDATES = {
    "sm75": (rules.PATH_TRITON_INT8, rules.PATH_TRITON_FP16),  # Triton 3.2 only (3.3 dropped Turing)
    "sm80": (rules.PATH_TRITON_INT8, rules.PATH_TRITON_FP16),
    "sm86": (rules.PATH_TRITON_INT8, rules.PATH_TRITON_FP16),
    "sm87": (rules.PATH_TRITON_INT8, rules.PATH_TRITON_FP16),
    "sm89": (rules.PATH_TRITON_FP8, rules.PATH_TRITON_INT8, rules.PATH_TRITON_FP16),
    "sm90": (rules.PATH_TRITON_FP8, rules.PATH_TRITON_FP16),
    "sm100": (rules.PATH_TRITON_FP8, rules.PATH_TRITON_FP16),
    "sm120": (rules.PATH_TRITON_FP8, rules.PATH_TRITON_INT8, rules.PATH_TRITON_FP16),
}


@pytest.mark.parametrize("device", list(AUTO_CANDIDATES))
def test_install_announces_the_quantized_candidates_auto_times(device):
    triton = "3.2.0" if device == "sm75" else "3.6.0"
    torch, cuda = ("2.6.0", "12.4") if device == "sm75" else ("2.10.0", "12.8")
    p = inst.plan(linux_facts(device, torch, cuda, triton))
    d = rules.select_path(rules_facts(device, torch, cuda, triton), "auto")
    assert d.candidates == AUTO_CANDIDATES[device] and d.measure
    assert p.path == d.path == AUTO_CANDIDATES[device][0]
    for path in AUTO_CANDIDATES[device]:
        assert rules.PATH_LABEL[path] in p.expected_paths, p.expected_paths


@pytest.mark.parametrize("device", ["sm89", "sm90", "sm120"])
@pytest.mark.parametrize("kernels", [frozenset(), frozenset({rules.FP8_KERNEL_GLUON}),
                                     frozenset({rules.FP8_KERNEL_INT8_FP8PV}), rules.OPTIONAL_FP8_KERNELS],
                         ids=["none", "gluon", "int8_fp8pv", "both"])
def test_optional_fp8_kernels_change_only_the_precision_words(device, kernels):
    """install.py cannot know which optional FP8 kernel runs (fp8_kernels=None); the Settings node
    probes it. The path and candidates (what install.py announces) must not depend on it."""
    known = rules_facts(device, "2.10.0", "12.8", "3.6.0")
    probed = rules.Facts(**{**known.__dict__, "fp8_kernels": kernels})
    a, b = rules.select_path(known, "auto"), rules.select_path(probed, "auto")
    assert (a.path, a.candidates, a.measure, a.code) == (b.path, b.candidates, b.measure, b.code)
    assert rules.expected_paths(a) == rules.expected_paths(b)


def test_install_assumes_every_triton_path_gpu_rules_names():
    facts = inst.device_facts(linux_facts("sm89", "2.10.0", "12.8", "3.6.0"),
                              {"name": "NVIDIA GeForce RTX 4090", "capability": [8, 9]}, "3.6.0")
    assert facts.implemented == frozenset(rules.PATHS) - {rules.PATH_PYTORCH}
