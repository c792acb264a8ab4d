"""Run our kernels through TRITON_INTERPRET=1 with whatever Triton comes first on sys.path.

Run by version_matrix.py in a subprocess whose PYTHONPATH puts one Triton release first.
Each case goes through the pack's public entry point (kernels.attention, backend="triton";
the FP8 kernel through attention_fp8) on the CPU and is compared with the float32 reference.
Prints one line "RESULT <json>": {"triton", "torch", "numpy", "cases": [{name, kernel, ok,
err (rel. L2), tol, error}]}.

Tolerances (relative L2 against the float32 reference), as in tests/kernels/:
- fp16: 2e-3 (p is rounded to fp16 before P@V); fp32: 1e-5 (the interpreter's fp32 dots are
  exact numpy products);
- FP8 against attention_fp8_emulated (the same quantisation done in torch): 5e-3;
- the fused norms (kernels/fused/norm_rope.py, layer_norm_modulate.py, qk_norm.py), fp16, against their
  references: 1e-3.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it then

ROOT = Path(sys.argv[1])
TOL = {"fp16": 2e-3, "fp32": 1e-5}
FP8_TOL_EMU = 5e-3
FUSED_NORM_TOL = 1e-3  # fp16, rounding where ComfyUI rounds: what is left is fp32 sum order

# name: (B, H, Hkv, Lq, Lk, D, mask, causal). mask: None, "bool" ([B,1,Lq,Lk]), "pad"
# (additive [B,1,1,Lk] padding mask with the last keys at -inf). Lengths are odd so every
# kernel runs full tiles and a partial last tile; Lk > 256 sends unmasked calls to the flash
# kernel, Lk = 77 to the short-key kernel (cross-attention).
CASES = {
    "flash_d64_odd": (1, 2, 2, 33, 301, 64, None, False),
    "flash_gqa_d32": (1, 4, 2, 17, 263, 32, None, False),
    "flash_bool_mask_d40": (2, 2, 2, 37, 45, 40, "bool", False),
    "flash_pad_mask_d64": (1, 2, 2, 21, 50, 64, "pad", False),
    "flash_causal_d64": (1, 2, 2, 40, 40, 64, None, True),
    "flash_causal_gqa_d80": (1, 4, 1, 19, 27, 80, None, True),
    "short_kv_d40_lk77": (2, 2, 2, 40, 77, 40, None, False),
}


def load_pack():
    spec = importlib.util.spec_from_file_location("ta_interp", ROOT / "__init__.py",
                                                  submodule_search_locations=[str(ROOT)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ta_interp"] = mod
    spec.loader.exec_module(mod)
    return importlib.import_module("ta_interp.kernels")


def rand(shape, dtype, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def rel_l2(out, ref):
    if not bool(out.float().isfinite().all()):
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def make_case(B, H, Hkv, Lq, Lk, D, mask, dtype, seed=0):
    import torch
    q, k, v = rand((B, H, Lq, D), dtype, seed), rand((B, Hkv, Lk, D), dtype, seed + 1), rand((B, Hkv, Lk, D), dtype, seed + 2)
    m = None
    if mask == "bool":
        m = rand((B, 1, Lq, Lk), torch.float32, seed + 3) > -0.5
        m[:, :, 0, :] = False  # a fully masked row: zeros, as SDPA gives
    elif mask == "pad":
        m = torch.zeros(B, 1, 1, Lk, dtype=dtype)
        m[..., Lk - 7:] = float("-inf")
    return q, k, v, m


def main():
    t0 = time.time()
    K = load_pack()
    import numpy
    import torch
    import triton
    report = {"triton": triton.__version__, "torch": torch.__version__, "numpy": numpy.__version__,
              "import_seconds": round(time.time() - t0, 2), "cases": []}
    dtypes = {"fp16": torch.float16, "fp32": torch.float32}
    for name, (B, H, Hkv, Lq, Lk, D, mask, causal) in CASES.items():
        for dname, dtype in dtypes.items():
            rec = {"name": f"{name}_{dname}", "tol": TOL[dname]}
            t = time.time()
            try:
                q, k, v, m = make_case(B, H, Hkv, Lq, Lk, D, mask, dtype)
                K.stats.reset()
                out = K.attention(q, k, v, attn_mask=m, is_causal=causal, backend="triton")
                ran = sorted(K.stats.counts())
                err = rel_l2(out, K.attention_ref(q, k, v, m, None, causal))
                rec.update(kernel=",".join(ran), err=err, ok=err <= TOL[dname] and out.dtype == dtype
                           and any(r.startswith("triton_attention") for r in ran))
            except Exception as e:
                rec.update(ok=False, error=_error(e))
            rec["seconds"] = round(time.time() - t, 2)
            report["cases"].append(rec)
    # FP8 Q.K kernel (its interpreter path runs fp16/bf16 inputs; fp32 is not an FP8 input).
    rec = {"name": "fp8_d64_bool_mask_fp16", "tol": FP8_TOL_EMU, "kernel": "triton_fp8"}
    t = time.time()
    try:
        fp8 = importlib.import_module("ta_interp.kernels.attention.fp8")
        q, k, v, m = make_case(1, 2, 2, 37, 45, 64, "bool", torch.float16)
        out = fp8.attention_fp8(q, k, v, attn_mask=m)
        err = rel_l2(out, fp8.attention_fp8_emulated(q, k, v, attn_mask=m))
        rec.update(err=err, ok=err <= FP8_TOL_EMU)
    except Exception as e:
        rec.update(ok=False, error=_error(e))
    rec["seconds"] = round(time.time() - t, 2)
    report["cases"].append(rec)
    # The fused norms (fp16: bf16 casts are emulated under the interpreter, fp16's are not)
    # against their references, which round where ComfyUI's ops round.
    for name, run in (("fused_rms_norm_rope_fp16", _rms_norm_rope_case),
                      ("fused_layer_norm_modulate_fp16", _layer_norm_modulate_case),
                      ("fused_qk_rms_norm_fp16", _qk_rms_norm_case),
                      ("fused_qk_rms_norm_rope_fp16", _qk_rms_norm_rope_case),
                      ("fused_gated_residual_norm_fp16", _gated_residual_norm_case)):
        rec = {"name": name, "tol": FUSED_NORM_TOL, "kernel": name[len("fused_"):-len("_fp16")]}
        t = time.time()
        try:
            out, ref = run(torch)
            err = rel_l2(out, ref)
            rec.update(err=err, ok=err <= FUSED_NORM_TOL and out.dtype == torch.float16)
        except Exception as e:
            rec.update(ok=False, error=_error(e))
        rec["seconds"] = round(time.time() - t, 2)
        report["cases"].append(rec)
    print("RESULT " + json.dumps(report), flush=True)


def _rms_norm_rope_case(torch):
    nr = importlib.import_module("ta_interp.kernels.fused.norm_rope")
    x = rand((2, 13, 192), torch.float16, 5) * 3
    weight = rand((192,), torch.float32, 6).abs().half() + 0.5
    angles = rand((1, 13, 1, 32), torch.float32, 7)
    freqs = torch.stack([angles.cos(), -angles.sin(), angles.sin(), angles.cos()], -1).reshape(1, 13, 1, 32, 2, 2)
    return nr.rms_norm_rope(x, weight, freqs, 1e-6, 64), nr.rms_norm_rope_ref(x, weight, freqs, 1e-6, 64)


def _qk_rms_norm_case(torch):
    qkn = importlib.import_module("ta_interp.kernels.fused.qk_norm")
    q, k, _v = (rand((2, 13, 3 * 3 * 64), torch.float16, 11) * 3).view(2, 13, 3, 3, 64).permute(2, 0, 3, 1, 4)
    wq, wk = rand((64,), torch.float32, 12).abs().half() + 0.5, rand((64,), torch.float32, 13).abs().half() + 0.5
    out, ref = qkn.qk_rms_norm(q, k, wq, wk, 1e-6), qkn.qk_rms_norm_ref(q, k, wq, wk, 1e-6)
    return torch.cat([o.flatten() for o in out]), torch.cat([r.flatten() for r in ref])


def _qk_rms_norm_rope_case(torch):
    qnr = importlib.import_module("ta_interp.kernels.fused.qk_norm_rope")
    q, k, _v = (rand((2, 13, 3 * 3 * 64), torch.float16, 19) * 3).view(2, 13, 3, 3, 64).permute(2, 0, 3, 1, 4)
    wq, wk = rand((64,), torch.float32, 20).abs().half() + 0.5, rand((64,), torch.float32, 21).abs().half() + 0.5
    angles = rand((1, 1, 17, 32), torch.float32, 22)
    pe = torch.stack([angles.cos(), -angles.sin(), angles.sin(), angles.cos()], -1).reshape(1, 1, 17, 32, 2, 2)
    qo = torch.empty(2, 17, 3, 64, dtype=torch.float16).transpose(1, 2)
    ko = torch.empty(2, 17, 3, 64, dtype=torch.float16).transpose(1, 2)
    qnr.qk_rms_norm_rope(q, k, wq, wk, 1e-6, pe, qo, ko, 4)  # rows 4..16 of a 17-token sequence
    ref = qnr.qk_rms_norm_rope_ref(q, k, wq, wk, 1e-6, pe, 4)
    return torch.cat([o[:, :, 4:].flatten() for o in (qo, ko)]), torch.cat([r.flatten() for r in ref])


def _layer_norm_modulate_case(torch):
    lnm = importlib.import_module("ta_interp.kernels.fused.layer_norm_modulate")
    x = rand((2, 13, 200), torch.float16, 8) * 3 + 1
    shift, scale = rand((2, 1, 200), torch.float16, 9) * 0.3, rand((2, 1, 200), torch.float16, 10) * 0.3
    return lnm.layer_norm_modulate(x, shift, scale, 1e-6), lnm.layer_norm_modulate_ref(x, shift, scale, 1e-6)


def _gated_residual_norm_case(torch):
    grn = importlib.import_module("ta_interp.kernels.fused.gated_residual_norm")
    x, y = rand((2, 13, 200), torch.float16, 14) * 3 + 1, rand((2, 13, 200), torch.float16, 15)
    gate = rand((2, 1, 200), torch.float16, 16) * 0.5
    weight, bias = rand((200,), torch.float32, 17).abs().half() + 0.5, rand((200,), torch.float16, 18)
    out = grn.gated_residual_layer_norm(x, y, gate, 1e-6, weight, bias)
    ref = grn.gated_residual_norm_ref(x, y, gate, 1e-6, weight, bias)
    return torch.cat([o.flatten() for o in out]), torch.cat([r.flatten() for r in ref])


def _ours(filename: str) -> bool:
    return filename.startswith(str(ROOT)) and not any(p in filename for p in ("/.cache/", "/.venv"))


def _error(e: BaseException) -> str:
    """The exception, and the innermost frame of our own code it came through."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if _ours(f.filename)]
    cause = e.__cause__ or e.__context__
    while cause is not None:
        frames += [f for f in traceback.extract_tb(cause.__traceback__) if _ours(f.filename)]
        cause = cause.__cause__ or cause.__context__
    where = f" at {Path(frames[-1].filename).relative_to(ROOT)}:{frames[-1].lineno} `{frames[-1].line}`" if frames else ""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300] + where


if __name__ == "__main__":
    main()
