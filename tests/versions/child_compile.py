"""Compile every shipped kernel for every target with whatever Triton comes first on sys.path.

Run by version_matrix.py in a subprocess whose PYTHONPATH puts one Triton release first and
whose environment has TRITON_INTERPRET unset (under the interpreter @triton.jit gives
objects triton.compile cannot build). Prints one line "RESULT <json>":
{"triton": version, "features": {name: present}, "refused": {target: the registry's rule},
"cases": [{target, kernel, case, ok, elf, shared, error, seconds}]}. Uses the kernel files'
own compile_spec()/compile_specs() and default_config(), as tests/compile/ does.

The compile API moved between releases: Triton 3.3+ takes ASTSource(fn, signature with
"constexpr" entries, constexprs by name, attrs {(index,): [["tt.divisibility", 16]]}), which
is what our compile_spec() functions return; Triton 3.2 takes the signature of the runtime
arguments only, constants by name (None and 1-valued arguments among them) and an
AttrsDescriptor. _source() converts.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys
import time
import types
from pathlib import Path

ROOT = Path(sys.argv[1])
ONLY_TARGETS = set(sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else None

# target -> (backend, arch, warp size, arch family of the flash kernel's tuning table)
TARGETS = {
    "sm75": ("cuda", 75, 32, "sm75"),
    "sm80": ("cuda", 80, 32, "sm80"),
    "sm86": ("cuda", 86, 32, "sm86"),
    "sm89": ("cuda", 89, 32, "sm89"),
    "sm90": ("cuda", 90, 32, "sm90"),
    "sm120": ("cuda", 120, 32, "sm120"),
    "gfx942": ("hip", "gfx942", 64, "gfx942"),
    "gfx1100": ("hip", "gfx1100", 32, "gfx1100"),
}

# Flash kernel cases: (dtype, head dim, kv len, mask kind, causal). Every target builds the
# hot path (no mask, d64) and the short-key kernel; sm86 (consumer Ampere/Ada tiles) and sm90
# (Hopper tiles) also build an additive padding mask broadcast over rows (Qwen-Image, bf16,
# d128) and a padded head dim (SD1.5's 40) with a full boolean mask and the causal flag; sm80
# one fp32 case (ieee dots). Each compile costs 3-20 s of CPU, so the classes the compile
# tests (tests/compile/) cover for the newest Triton are sampled here, not repeated.
FLASH_CASES = [("fp16", 64, 4096, 0, False)]
EXTRA_FLASH = {"sm86": [("bf16", 128, 4096, 2, False), ("fp16", 40, 4096, 1, True)],
               "sm90": [("bf16", 128, 4096, 2, False), ("fp16", 40, 4096, 1, True)],
               "sm80": [("fp32", 64, 4096, 0, False)]}
# FP8 cases (dtype, head dim, mask kind, causal): compiled on sm89+, refused below.
FP8_CASES = {"sm89": ("fp16", 64, 1, False), "sm90": ("bf16", 128, 1, True), "sm120": ("bf16", 128, 2, False)}
FP8_REFUSAL_TARGETS = ("sm75", "sm80", "sm86")
FUSED_NORM_TARGETS = ("sm86", "gfx1100")


def load_pack():
    spec = importlib.util.spec_from_file_location("ta_versions", ROOT / "__init__.py",
                                                  submodule_search_locations=[str(ROOT)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ta_versions"] = mod
    spec.loader.exec_module(mod)
    return lambda name: importlib.import_module("ta_versions.kernels." + name)


def features(tl):
    """What this Triton's public API offers (gpu_rules.FEATURE_MIN_TRITON is checked against it)."""
    out = {"warp_specialize": "warp_specialize" in inspect.signature(tl.range.__init__).parameters,
           "device_tensor_descriptor": hasattr(tl, "make_tensor_descriptor")}
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
        out["host_tensor_descriptor"] = True
    except Exception:
        out["host_tensor_descriptor"] = False
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl  # noqa: F401
        out["gluon"] = hasattr(gluon, "jit")
    except Exception:
        out["gluon"] = False
    return out


def _source(ASTSource, fn, sig, constexprs, attrs, legacy):
    if not legacy:
        return ASTSource(fn, sig, constexprs, attrs)
    from triton.backends.compiler import AttrsDescriptor
    names = list(sig)
    signature = {}
    hints = {}
    for p in fn.params:
        if p.is_constexpr:
            continue
        value = constexprs.get(p.name, "runtime")
        signature[p.name] = sig[p.name] if sig[p.name] != "constexpr" else ("*i8" if value is None else "i32")
        if value == 1 and not isinstance(value, bool):
            hints[p.num] = 1  # Triton 3.2 folds 1-valued integer arguments ("tt.equal_to")
    for (idx,), props in attrs.items():
        if ["tt.divisibility", 16] in [list(x) for x in props]:
            hints[fn.arg_names.index(names[idx])] = 16
    return ASTSource(fn, signature, dict(constexprs), AttrsDescriptor.from_hints(hints))


def _error_line(e: BaseException) -> str:
    """One line that says why. Triton's CompilationError reads "at L:C:", the source line, a
    caret, then its cause; a call into another @jit function nests them, so the innermost
    one names the construct that failed."""
    def is_compilation_error(x):
        return any(c.__name__ == "CompilationError" for c in type(x).__mro__)

    while is_compilation_error(e):
        cause = e.__cause__ or e.__context__
        if cause is None or not is_compilation_error(cause):
            break
        e = cause
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if is_compilation_error(e):
        cause = e.__cause__ or e.__context__
        why = f"{type(cause).__name__}: {str(cause).splitlines()[0]}" if cause and str(cause) else lines[-1]
        return f"{type(e).__name__} {lines[0] if lines else ''} {why}"[:400]
    pick = next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else "")
    return f"{type(e).__name__}: {pick}"[:400]


def fp_fusion_pin(kernel, triton, ASTSource, GPUTarget, legacy) -> dict:
    """Whether the launch options keep FP fusion on where Triton's default has it off.

    One row kernel (LayerNorm + modulation: (x - mean) * rstd * (1 + scale) + shift) compiled
    for sm_86 with TRITON_DEFAULT_FP_FUSION=0, what Triton 3.10 makes the default, without and
    with kernel_common.LAUNCH_OPTIONS: the compiled enable_fp_fusion flag and the PTX's
    fma.rn.f32 count of each. On releases that warn about that default (3.9), also whether
    parsing each option set warns (the pinned set first: the warning fires once a process)."""
    launch = kernel("core.kernel_common").LAUNCH_OPTIONS
    fn, sig, constexprs, attrs, opts = kernel("fused.layer_norm_modulate").compile_specs(dtype="bf16", channels=5120)[0]
    target = GPUTarget("cuda", 86, 32)
    out = {}
    saved = os.environ.get("TRITON_DEFAULT_FP_FUSION")
    try:
        os.environ["TRITON_DEFAULT_FP_FUSION"] = "0"
        for name, extra in (("unpinned", {}), ("pinned", launch)):
            k = triton.compile(_source(ASTSource, fn, sig, constexprs, attrs, legacy), target=target,
                               options=dict(num_warps=opts["num_warps"], num_stages=opts["num_stages"], **extra))
            out[name] = {"flag": bool(getattr(k.metadata, "enable_fp_fusion", False)),
                         "fma": k.asm["ptx"].count("fma.rn.f32")}
        try:
            from triton._utils import FP_FUSION_DEFAULT_WARNING as message  # 3.9+
        except ImportError:  # older releases: no triton._utils, or no such warning in it
            message = None
        if message is not None:
            import warnings
            from triton.compiler.compiler import make_backend
            del os.environ["TRITON_DEFAULT_FP_FUSION"]
            backend = make_backend(target)
            for name, extra in (("pinned", launch), ("unpinned", {})):
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    backend.parse_options(dict(num_warps=4, **extra))
                out[name]["warned"] = any(str(w.message) == message for w in seen)
    finally:
        if saved is None:
            os.environ.pop("TRITON_DEFAULT_FP_FUSION", None)
        else:
            os.environ["TRITON_DEFAULT_FP_FUSION"] = saved
    return out


def main():
    t_import = time.time()
    kernel = load_pack()
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    legacy = tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 3)
    at, sk, fp8 = kernel("attention.flash"), kernel("attention.short_kv"), kernel("attention.fp8")
    fp8q = kernel("attention.fp8_quant")
    # (module, compile_specs kwargs): the row kernels at Wan 14B's width, the QK norm at Flux's head dim
    norm_kernels = ((kernel("fused.norm_rope"), {"channels": 5120}), (kernel("fused.layer_norm_modulate"), {"channels": 5120}),
                    (kernel("fused.qk_norm"), {"head_dim": 128}), (kernel("fused.gated_residual_norm"), {"channels": 5120}),
                    (kernel("fused.qk_norm_rope"), {"head_dim": 128}))
    gpu_rules = kernel("core.gpu_rules")
    report = {"triton": triton.__version__, "triton_file": triton.__file__, "features": features(tl),
              "import_seconds": round(time.time() - t_import, 2), "refused": {}, "cases": []}

    def build(target_name, kname, case, spec, cfg, target):
        fn, sig, constexprs, attrs = spec
        backend = target.backend
        rec = {"target": target_name, "kernel": kname, "case": case,
               "config": {k: v for k, v in cfg.items() if k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}}
        t = time.time()
        try:
            k = triton.compile(_source(ASTSource, fn, sig, constexprs, attrs, legacy), target=target,
                               options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
            binary = k.asm.get("cubin") if backend == "cuda" else k.asm.get("hsaco")
            rec.update(ok=True, elf=bool(binary) and binary[:4] == b"\x7fELF", shared=k.metadata.shared)
        except Exception as e:
            rec.update(ok=False, error=_error_line(e))
        rec["seconds"] = round(time.time() - t, 2)
        report["cases"].append(rec)

    for name, (backend, arch, warp, key) in TARGETS.items():
        if ONLY_TARGETS and name not in ONLY_TARGETS:
            continue
        target = GPUTarget(backend, arch, warp)
        hip = backend == "hip"
        info = types.SimpleNamespace(arch=key, type="cuda", vendor="amd" if hip else "nvidia")
        # A target the registry refuses on this Triton (Turing after 3.2, Blackwell before 3.3)
        # never runs our kernels: record the rule and build nothing (Triton 3.2 aborts the
        # process on sm_120: "computeCapability not supported").
        rule = gpu_rules.nvidia_gpu_blocker("", divmod(arch, 10), triton.__version__) if not hip else None
        if rule is not None:
            report["refused"][name] = {"code": rule.code, "reason": rule.reason}
            continue
        for dtype, d, lk, mask, causal in FLASH_CASES + EXTRA_FLASH.get(name, []):
            cfg = at.default_config(info, d, lk, False)  # what the launcher picks on this GPU
            if dtype == "fp32":  # the launcher's fp32 clamp: fp32 tiles take twice the shared memory
                cfg = dict(cfg, BLOCK_N=min(cfg["BLOCK_N"], 64), num_stages=min(cfg["num_stages"], 2))
            spec = at.compile_spec(dtype, d, cfg, mask_kind=mask, is_causal=causal, hip=hip,
                                   mask_row_bcast=mask == 2)
            build(name, "flash", f"{dtype}_d{d}_mask{mask}{'_causal' if causal else ''}", spec, cfg, target)
        # The short-key kernel (cross-attention to 77 text tokens), where its arch enables it.
        sk_family = sk.config_family(info, False)
        if sk.SHORT_KV_BYTES.get(sk_family, 0):
            cfg = sk.SHORT_KV_CONFIGS[sk_family]
            build(name, "short_kv", "fp16_d64_lk77", sk.compile_spec("fp16", 64, 77, cfg, hip=hip), cfg, target)
        if name in FP8_CASES or name in FP8_REFUSAL_TARGETS:
            dtype, d, mask, causal = FP8_CASES.get(name, ("fp16", 64, 0, False))
            cfg = fp8.default_config(info, d, False)
            specs = fp8.compile_specs(dtype, d, cfg, mask, causal)
            if name in FP8_REFUSAL_TARGETS:
                specs = specs[-1:]  # the attention kernel's fp8 dot is what the target lacks
            for spec in specs:
                kname = spec[0].__name__ if hasattr(spec[0], "__name__") else spec[0].fn.__name__
                is_attn = "attn" in kname
                opts = dict(num_warps=cfg["num_warps"] if is_attn else 4, num_stages=cfg["num_stages"] if is_attn else 3)
                build(name, "fp8" + ("" if is_attn else "_quant"), f"{dtype}_d{d}_mask{mask}{'_causal' if causal else ''}",
                      spec, opts, target)
        # The full-FP8 attention's quantisers (statistics with a software-pipelined row loop,
        # finalize, quantise, V-mean fix): Hopper's and Ada's tiles, as quantize_qkv launches them.
        if name in ("sm89", "sm90"):
            for kname, fn, sig, constexprs, attrs, warps in fp8q.compile_specs("bf16", 128, 128, 128):
                build(name, "fp8_full_quant", kname, (fn, sig, constexprs, attrs),
                      dict(num_warps=warps, num_stages=3), target)
        # The fused norms (RMSNorm + RoPE, LayerNorm + modulation, QK norm):
        # row kernels without dots, one NVIDIA and one AMD target per release.
        if name in FUSED_NORM_TARGETS:
            for module, kwargs in norm_kernels:
                for fn, sig, constexprs, attrs, opts in module.compile_specs(dtype="bf16", **kwargs):
                    build(name, "fused_norms", fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__,
                          (fn, sig, constexprs, attrs), opts, target)
            # Flux's blocks: the gated residual whose product is rounded on its bits first.
            for module, kwargs in ((kernel("fused.layer_norm_modulate"), {"channels": 3072, "residual": True, "gate": True}),
                                   (kernel("fused.gated_residual_norm"), {"channels": 3072, "norm": False})):
                for fn, sig, constexprs, attrs, opts in module.compile_specs(dtype="bf16", round_product=True, **kwargs):
                    build(name, "fused_norms_flux", fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__,
                          (fn, sig, constexprs, attrs), opts, target)
        # The norm kernels with the FP8 Linear's e4m3 rows (sm_89+, where that Linear runs).
        if name in ("sm89", "sm90"):
            for module, kwargs in ((kernel("fused.layer_norm_modulate"), {"residual": True}), (kernel("fused.gated_residual_norm"), {})):
                for fn, sig, constexprs, attrs, opts in module.compile_specs(dtype="bf16", fp8_rows=True, **kwargs):
                    build(name, "fused_norms_fp8_rows", fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__,
                          (fn, sig, constexprs, attrs), opts, target)
            # Flux's single block: linear2's concatenated input with its e4m3 rows.
            for fn, sig, constexprs, attrs, opts in kernel("linear.cat_fp8_rows").compile_specs(dtype="bf16"):
                build(name, "fused_norms_fp8_rows", fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__,
                      (fn, sig, constexprs, attrs), opts, target)
    try:
        report["fp_fusion"] = fp_fusion_pin(kernel, triton, ASTSource, GPUTarget, legacy)
    except Exception as e:
        report["fp_fusion"] = {"error": _error_line(e)}
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    main()
