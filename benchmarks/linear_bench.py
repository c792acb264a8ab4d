"""The Linear kernels on a GPU: every kernels.linear method (FP8 W8A8, INT8 W8A8, FP8
weight-only) at Flux / Wan Linear shapes against cuBLAS BF16 and torch._scaled_mm, plus the FP8
W8A8 kernel's correctness checks and tile sweep.

    python benchmarks/linear_bench.py [--out DIR] [--no-sweep] [--shapes flux_qkv,...]
                                      [--methods fp8_w8a8,int8_w8a8,fp8_weight_only]

1. small checks of the FP8 W8A8 kernel (partial tiles, K tail, bias, fp16 / bf16 output,
   pre-quantised FP8 weights, TMA and pointer variants): rel. L2 vs linear_fp8_reference (same
   quantisation) and vs fp32;
2. --sweep (default on): GEMM-only time of each candidate FP8 tile config per shape;
3. per shape (random bf16 data with outlier channels, never zeros): `triton.testing.do_bench`
   medians (it flushes L2 between reps) of our FP8 kernel incl. activation quantisation, its
   GEMM only, its quantisation alone, cuBLAS BF16 F.linear, torch._scaled_mm per-tensor and
   row-wise (each alone and with a separate eager-torch quantisation);
4. per shape, every method through the public API (kernels.prepare_weight + kernels.linear,
   quantisation included) with its rel. L2 vs BF16 on the outlier activations; INT8 without
   the Hadamard rotation (accuracy only: what the rotation buys); torch._int_mm with a separate
   quantisation (cuBLAS INT8); ComfyUI's FP8-weight path (upcast the e4m3 weight x scale_weight
   to BF16 every call, then F.linear) beside our weight-only kernel on the same FP8 weight.
5. --tail (default: TAIL_SHAPES): the split tail (kernels/linear_fp8.tail_split) per shape:
   GEMM alone with every tile whole, with the shipped split and with 2 / 3 / 4 slices forced,
   the whole call (quantisation included) whole and split, cuBLAS BF16 beside; rel. L2 of
   the split output against the whole one; the split counters checked zero afterwards.
Prints the tables last (split-tail table at the very end); writes linear.json under --out
(default: $OUT or .).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import load_pack  # noqa: E402

pack = load_pack()
lf = importlib.import_module(pack.__name__ + ".kernels.linear.fp8")
lref = importlib.import_module(pack.__name__ + ".kernels.linear.ref")
kernels = importlib.import_module(pack.__name__ + ".kernels")
linear_int8 = importlib.import_module(pack.__name__ + ".kernels.linear.int8")

# name -> (M tokens, K in_features, N out_features)
SHAPES = {
    "flux_qkv": (4608, 3072, 9216),
    "flux_mlp_up": (4608, 3072, 12288),
    "flux_mlp_down": (4608, 12288, 3072),
    "wan_proj": (32760, 5120, 5120),
    "wan_ffn_up": (32760, 5120, 13824),
    "wan_ffn_down": (32760, 13824, 5120),
    # Flux's other big ones: the double blocks' attention output projection and the single
    # blocks' fused qkv+MLP-in (3072 -> 21504) and out (15360 -> 3072) at 4608 + 512 tokens.
    "flux_proj": (4608, 3072, 3072),
    "flux_single_in": (5120, 3072, 21504),
    "flux_single_out": (5120, 15360, 3072),
}
# The split tail's shapes: Flux 1024²'s GEMMs whose last wave of 128x256 tiles is partial on
# 132 SMs, as its step runs them (4096 image + 512 text tokens; the single blocks 4608), and
# one Wan GEMM (full waves: no split) as the control.
TAIL_SHAPES = {
    "flux_mlp_down": SHAPES["flux_mlp_down"],
    "flux_single_out_4608": (4608, 15360, 3072),
    "flux_proj": SHAPES["flux_proj"],
    "flux_mlp_up": SHAPES["flux_mlp_up"],
    "txt_qkv": (512, 3072, 9216),
    "txt_proj": (512, 3072, 3072),
    "txt_mlp_up": (512, 3072, 12288),
    "txt_mlp_down": (512, 12288, 3072),
    "wan_proj": SHAPES["wan_proj"],
}
# The sweep: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages, TMA, FLATTEN, EPILOGUE_SUBTILE).
# 128x128 and 64x256 tiles give twice the tiles of 128x256: fewer idle SMs in the last wave
# where 128x256 leaves one (Flux's 4608x3072 outputs: 432 tiles on 132 SMs, 3.3 waves).
SWEEP = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g, num_warps=w, num_stages=s, TMA=tma, FLATTEN=fl,
              EPILOGUE_SUBTILE=sub)
         for bm, bn, bk, g, w, s, tma, fl, sub in (
             (128, 256, 128, 16, 8, 3, True, False, False), (128, 256, 128, 16, 8, 3, True, True, False),
             (128, 256, 128, 16, 8, 4, True, False, True), (128, 256, 128, 16, 8, 4, True, True, True),
             (128, 128, 128, 16, 8, 5, True, False, False), (128, 128, 128, 16, 8, 5, True, True, False),
             (128, 128, 128, 16, 4, 5, True, True, False), (128, 128, 128, 8, 8, 4, True, True, True),
             (64, 256, 128, 16, 4, 4, True, True, False), (256, 128, 128, 16, 8, 3, True, True, False),
             (128, 256, 128, 16, 8, 3, False, False, False))]


def rel_l2(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def activations(m, k, gen, dtype=torch.bfloat16):
    """Gaussian tokens plus 8 channels 20x larger (diffusion transformers' outlier channels)."""
    x = torch.randn(m, k, device="cuda", generator=gen)
    x[:, torch.randperm(k, device="cuda", generator=gen)[:8]] *= 20.0
    return x.to(dtype)


def bench(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def cfg_name(c):
    return (f"{'tma' if c['TMA'] else 'ptr'}_{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}"
            f"_g{c['GROUP_M']}_w{c['num_warps']}_s{c['num_stages']}"
            f"{'_flat' if c.get('FLATTEN') else ''}{'_sub' if c.get('EPILOGUE_SUBTILE') else ''}")


def small_checks(gen):
    """Numerics on the GPU: both GEMM variants, partial tiles, K tail, bias, dtypes, FP8 weights."""
    rows = []
    sm90 = lf.LINEAR_FP8_CONFIGS["sm90"]
    variants = {"tma": sm90, "ptr": dict(sm90, TMA=False), "ptr_bk64": dict(sm90, TMA=False, BLOCK_K=64)}
    for m, k, n in ((1, 3072, 9216), (300, 3072, 3072), (1000, 336, 1040), (4097, 1024, 2048)):
        x = activations(m, k, gen)
        w = torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5
        b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
        fw = lf.quantize_weight(w.to(torch.bfloat16))
        ref32 = lref.linear_reference(x, w.to(torch.bfloat16), b, torch.float32)
        emu = lref.linear_fp8_reference(x, fw, b, torch.float32)
        for vname, cfg in variants.items():
            for out_dtype in (torch.bfloat16, torch.float16):
                try:
                    y = lf.fp8_linear(x, fw, b, out_dtype=out_dtype, config=cfg)
                    rows.append(dict(shape=(m, k, n), variant=vname, out=str(out_dtype),
                                     finite=bool(torch.isfinite(y).all()), rel_emu=rel_l2(y, emu),
                                     rel_fp32=rel_l2(y, ref32)))
                except Exception as e:  # record and go on: one broken variant must not hide the rest
                    rows.append(dict(shape=(m, k, n), variant=vname, out=str(out_dtype),
                                     error=f"{type(e).__name__}: {e}"[:400]))
    # ComfyUI-style FP8 checkpoint: e4m3 weight with a per-tensor scale
    m, k, n = 777, 3072, 3072
    x = activations(m, k, gen)
    w = torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5
    s = w.abs().max() / 448.0
    w8 = (w / s).to(torch.float8_e4m3fn)
    fw = lf.quantize_weight(w8, s)
    y = lf.fp8_linear(x, fw)
    rows.append(dict(shape=(m, k, n), variant="fp8_checkpoint_per_tensor", out="torch.bfloat16",
                     finite=bool(torch.isfinite(y).all()),
                     rel_emu=rel_l2(y, lref.linear_fp8_reference(x, fw, None, torch.float32)),
                     rel_fp32=rel_l2(y, lref.linear_reference(x, w8.float() * s, None, torch.float32))))
    # activation quantisation equals torch's (values; one-pass and two-pass rows)
    for k in (3072, 20480):
        x = activations(64, k, gen)
        q, sc = lf.quantize_activation(x)
        qr, sr = lref.quantize_rows_reference(x)
        rows.append(dict(shape=(64, k, 0), variant="quant_vs_torch", mismatch=int((q.float() != qr.float()).sum()),
                         scale_rel=((sc - sr).abs() / sr).max().item()))
    return rows


def torch_quant_per_tensor(x):
    s = (x.abs().amax().float() / 448.0).clamp_min(1e-12)
    return (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


def torch_quant_rowwise(x):
    s = (x.abs().amax(dim=1, keepdim=True).float() / 448.0).clamp_min(1e-12)
    return (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


def operands(m, k, n, gen):
    """Outlier-channel bf16 activations [m, k], a bf16 weight [n, k] with its FP8 form, a bias."""
    x = activations(m, k, gen)
    w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    return x, w, b, lf.quantize_weight(w)


def run_shape(name, m, k, n, gen, sweep, log, methods=()):
    flops = 2.0 * m * n * k
    x, w, b, fw = operands(m, k, n, gen)
    xq, xs = lf.quantize_activation(x)
    res = dict(shape=name, M=m, K=k, N=n)
    y_bf16 = F.linear(x, w, b)

    sweep_rows = []
    if sweep:
        for c in SWEEP:
            try:
                y = lf.fp8_gemm(xq, xs, fw, b, torch.bfloat16, config=c)
                ms = bench(lambda c=c: lf.fp8_gemm(xq, xs, fw, b, torch.bfloat16, config=c))
                sweep_rows.append(dict(config=cfg_name(c), ms=ms, tflops=flops / ms / 1e9, rel_bf16=rel_l2(y, y_bf16)))
            except Exception as e:
                sweep_rows.append(dict(config=cfg_name(c), error=f"{type(e).__name__}: {e}"[:300]))
            log(f"  sweep {name} {sweep_rows[-1]}")
    res["sweep"] = sweep_rows
    ok = [r for r in sweep_rows if "ms" in r]
    best_cfg = None
    if ok:
        best = min(ok, key=lambda r: r["ms"])
        best_cfg = next(c for c in SWEEP if cfg_name(c) == best["config"])
        res["best_config"] = best["config"]

    def timed(key, fn):
        try:
            res[key] = bench(fn)
        except Exception as e:
            res[key] = None
            res[key + "_error"] = f"{type(e).__name__}: {e}"[:300]
            log(traceback.format_exc()[-1500:])

    timed("ours_full_ms", lambda: lf.fp8_linear(x, fw, b))
    timed("ours_gemm_ms", lambda: lf.fp8_gemm(xq, xs, fw, b, torch.bfloat16))
    timed("ours_quant_ms", lambda: lf.quantize_activation(x))
    if best_cfg is not None:
        timed("ours_full_best_ms", lambda: lf.fp8_linear(x, fw, b, config=best_cfg))
    timed("cublas_bf16_ms", lambda: F.linear(x, w, b))

    w8_t = fw.weight.t()  # [K, N] column-major: what _scaled_mm wants for its second operand
    xq_t, s_t = torch_quant_per_tensor(x)
    ws_t = (fw.scale.max()).reshape(()).float()  # per-tensor weight scale for the per-tensor baseline
    w8_pt = (w.float() / ws_t).clamp(-448, 448).to(torch.float8_e4m3fn).t()
    try:
        y_pt = torch._scaled_mm(xq_t, w8_pt, scale_a=s_t, scale_b=ws_t, bias=b, out_dtype=torch.bfloat16)
        res["scaled_mm_tensor_rel_bf16"] = rel_l2(y_pt, y_bf16)
    except Exception as e:
        res["scaled_mm_tensor_error"] = f"{type(e).__name__}: {e}"[:300]
    timed("scaled_mm_tensor_ms", lambda: torch._scaled_mm(xq_t, w8_pt, scale_a=s_t, scale_b=ws_t, bias=b,
                                                           out_dtype=torch.bfloat16))

    def tensor_full():
        q, s = torch_quant_per_tensor(x)
        return torch._scaled_mm(q, w8_pt, scale_a=s, scale_b=ws_t, bias=b, out_dtype=torch.bfloat16)

    timed("scaled_mm_tensor_quant_ms", tensor_full)
    xq_r, s_r = torch_quant_rowwise(x)
    sb_r = fw.scale.reshape(1, n).float()
    rowwise_bias = b
    try:
        y_rw = torch._scaled_mm(xq_r, w8_t, scale_a=s_r, scale_b=sb_r, bias=b, out_dtype=torch.bfloat16)
    except Exception as e:  # some torch builds refuse a bias with row-wise scales
        res["scaled_mm_rowwise_bias_error"] = f"{type(e).__name__}: {e}"[:300]
        rowwise_bias = None
        y_rw = torch._scaled_mm(xq_r, w8_t, scale_a=s_r, scale_b=sb_r, out_dtype=torch.bfloat16) + b
    res["scaled_mm_rowwise_rel_bf16"] = rel_l2(y_rw, y_bf16)

    def rowwise_full():
        q, s = torch_quant_rowwise(x)
        return torch._scaled_mm(q, w8_t, scale_a=s, scale_b=sb_r, bias=rowwise_bias, out_dtype=torch.bfloat16)

    timed("scaled_mm_rowwise_ms", lambda: torch._scaled_mm(xq_r, w8_t, scale_a=s_r, scale_b=sb_r, bias=rowwise_bias,
                                                           out_dtype=torch.bfloat16))
    timed("scaled_mm_rowwise_quant_ms", rowwise_full)

    timed("ours_full_repeat_ms", lambda: lf.fp8_linear(x, fw, b))  # the spread of one timing
    y = lf.fp8_linear(x, fw, b)
    res["ours_rel_bf16"] = rel_l2(y, y_bf16)
    res["ours_finite"] = bool(torch.isfinite(y).all())
    for key in list(res):
        if key.endswith("_ms") and res[key]:
            res[key.replace("_ms", "_tflops")] = flops / res[key] / 1e9
    if res.get("ours_full_ms"):
        full = res["ours_full_ms"]
        res["x_vs_cublas_bf16"] = res["cublas_bf16_ms"] / full if res.get("cublas_bf16_ms") else None
        res["x_vs_rowwise_quant"] = (res["scaled_mm_rowwise_quant_ms"] / full
                                     if res.get("scaled_mm_rowwise_quant_ms") else None)
        res["x_vs_rowwise_plus_our_quant"] = ((res["scaled_mm_rowwise_ms"] + res["ours_quant_ms"]) / full
                                              if res.get("scaled_mm_rowwise_ms") and res.get("ours_quant_ms") else None)
    if methods:
        res["methods"] = run_methods(name, x, w, b, y_bf16, methods, log)
    return res


# GELU (tanh) epilogue: (shape, first activated column) as the models run them: Flux's double
# blocks' MLP up and Wan's FFN up (nn.Sequential(Linear, GELU)), Flux's single blocks' fused
# projection (GELU on the MLP columns, 9216 on).
GELU_CASES = {"flux_mlp_up": 0, "wan_ffn_up": 0, "flux_single_in": 9216}


def run_gelu(name, m, k, n, first, gen, log):
    """Ours with the GELU in the epilogue vs ours + ComfyUI's GELU pass vs cuBLAS + the GELU
    pass (the GELU on the slice of columns, as the model code runs it: a strided pass where
    the columns are a slice of a fused projection)."""
    x, w, b, fw = operands(m, k, n, gen)
    act = lf.ACTIVATIONS["gelu_tanh"]

    def fused():
        q, s = lf.quantize_activation(x)
        return lf.fp8_gemm(q, s, fw, b, torch.bfloat16, act=act, act_from=first)

    def unfused(y):
        return torch.cat([y[:, :first], F.gelu(y[:, first:], approximate="tanh")], 1) if first else \
            F.gelu(y, approximate="tanh")

    res = dict(shape=name, M=m, K=k, N=n, act_from=first)
    expect = unfused(lf.fp8_linear(x, fw, b).float())
    res["fused_rel_vs_unfused_fp32"] = rel_l2(fused(), expect)
    res["fused_ms"] = bench(fused)
    res["ours_then_gelu_ms"] = bench(lambda: F.gelu(lf.fp8_linear(x, fw, b)[:, first:], approximate="tanh"))
    res["cublas_then_gelu_ms"] = bench(lambda: F.gelu(F.linear(x, w, b)[:, first:], approximate="tanh"))
    res["gelu_pass_ms"] = bench(lambda y=F.linear(x, w, b): F.gelu(y[:, first:], approximate="tanh"))
    res["ours_plain_ms"] = bench(lambda: lf.fp8_linear(x, fw, b))
    if first:
        # Flux's single block: the activated columns go into torch.cat((attn, mlp)) beside the
        # attention output ([M, K]). In place, the cat reads a strided slice (its slow kernel);
        # with the contiguous copy (activation_out) it reads a plain tensor.
        attn = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)

        def fused_copy():
            q, s = lf.quantize_activation(x)
            copy = torch.empty((m, n - first), dtype=torch.bfloat16, device="cuda")
            y = lf.fp8_gemm(q, s, fw, b, torch.bfloat16, act=act, act_from=first, act_out=copy)
            return y, copy

        y, copy = fused_copy()
        res["copy_equals_activated_columns"] = bool(torch.equal(copy, y[:, first:]))
        res["copy_equals_in_place_fused"] = bool(torch.equal(y, fused()))
        res["fused_copy_ms"] = bench(fused_copy)
        res["fused_copy_then_cat_ms"] = bench(lambda: torch.cat((attn, fused_copy()[1]), 1))
        res["fused_in_place_then_cat_ms"] = bench(lambda: torch.cat((attn, fused()[:, first:]), 1))
        res["ours_gelu_pass_then_cat_ms"] = bench(
            lambda: torch.cat((attn, F.gelu(lf.fp8_linear(x, fw, b)[:, first:], approximate="tanh")), 1))
        res["cublas_gelu_pass_then_cat_ms"] = bench(
            lambda: torch.cat((attn, F.gelu(F.linear(x, w, b)[:, first:], approximate="tanh")), 1))
    log(f"  gelu {res}")
    return res


def _int8_rows(t):
    s = (t.abs().amax(dim=1, keepdim=True).float() / 127.0).clamp_min(1e-12)
    return torch.round(t.float() / s).clamp(-127, 127).to(torch.int8), s


def run_methods(name, x, w, b, y_bf16, methods, log):
    """Every kernels.linear method at one shape (public API, quantisation included), and the
    baselines that only make sense beside a method (cuBLAS INT8, ComfyUI's FP8-weight upcast)."""
    m, k = x.shape
    n = w.shape[0]
    flops = 2.0 * m * n * k
    res = {}

    def timed(key, fn):
        try:
            res[key] = bench(fn)
            res[key.replace("_ms", "_tflops")] = flops / res[key] / 1e9
        except Exception as e:
            res[key + "_error"] = f"{type(e).__name__}: {e}"[:300]
            log(traceback.format_exc()[-1500:])

    # ComfyUI's FP8 checkpoints: e4m3 weights with a per-tensor scale_weight.
    s_w = (w.float().abs().max() / 448.0).clamp_min(1e-12)
    w8 = (w.float() / s_w).clamp(-448, 448).to(torch.float8_e4m3fn)
    for method in methods:
        reason = kernels.linear_refusal(method, x.device, x.dtype)
        if reason is not None:
            res[f"{method}_refused"] = reason
            continue
        try:
            t = time.time()
            p = kernels.prepare_weight(w, method)
            torch.cuda.synchronize()
            res[f"{method}_prepare_s"] = time.time() - t
            y = kernels.linear(x, p, b)
            res[f"{method}_rel_bf16"] = rel_l2(y, y_bf16)
            res[f"{method}_finite"] = bool(torch.isfinite(y).all())
            timed(f"{method}_ms", lambda p=p: kernels.linear(x, p, b))
            if method == "int8_w8a8":  # the rotation + quantisation alone (two passes over x)
                timed("int8_quant_ms", lambda p=p: linear_int8.quantize_activation(x, p.rotation))
            if method == "fp8_weight_only":  # the same kernel on the checkpoint's own FP8 weight
                p8 = kernels.prepare_weight(w8, method, weight_scale=s_w)
                res["fp8_weight_only_ckpt_rel_bf16"] = rel_l2(kernels.linear(x, p8, b), y_bf16)
                timed("fp8_weight_only_ckpt_ms", lambda: kernels.linear(x, p8, b))
            del p
        except Exception as e:
            res[f"{method}_error"] = f"{type(e).__name__}: {e}"[:300]
            log(traceback.format_exc()[-1500:])
    try:  # what the rotation buys: plain per-token / per-channel INT8 through the same kernels
        q, s, _ = linear_int8.quantize_weight(w.float(), rotate=False)
        res["int8_plain_rel_bf16"] = rel_l2(linear_int8.run_linear(x, q, s, b, 0, torch.bfloat16), y_bf16)
    except Exception as e:
        res["int8_plain_error"] = f"{type(e).__name__}: {e}"[:300]
    try:  # cuBLAS INT8 (torch._int_mm) with a separate eager quantisation, no rotation
        wq, ws = _int8_rows(w)

        def int_mm_full():
            xq, xs = _int8_rows(x)
            return (torch._int_mm(xq, wq.t()).float() * xs * ws.t() + b.float()).to(torch.bfloat16)

        res["int_mm_quant_rel_bf16"] = rel_l2(int_mm_full(), y_bf16)
        timed("int_mm_quant_ms", int_mm_full)
    except Exception as e:
        res["int_mm_error"] = f"{type(e).__name__}: {e}"[:300]
    # ComfyUI without fp8_e4m3fn_fast: upcast weight x scale_weight to BF16 on every call.
    timed("comfy_fp8_upcast_ms", lambda: F.linear(x, w8.to(torch.bfloat16) * s_w.to(torch.bfloat16), b))
    log(f"  methods {name} {res}")
    return res


def run_tail(name, m, k, n, gen, log):
    """The split tail at one shape: whole tiles, the shipped split, 2-4 slices forced."""
    flops = 2.0 * m * n * k
    x, w, b, fw = operands(m, k, n, gen)
    xq, xs = lf.quantize_activation(x)
    base = dict(lf.LINEAR_FP8_CONFIGS["sm90"])
    whole = dict(base, SPLIT_TAIL=None)
    props = torch.cuda.get_device_properties(0)
    tiles = lf.cdiv(m, base["BLOCK_M"]) * lf.cdiv(n, base["BLOCK_N"])
    plan = lf.tail_split(tiles, props.multi_processor_count, lf.cdiv(k, base["BLOCK_K"]), base["SPLIT_TAIL"],
                         base["BLOCK_M"], base["BLOCK_N"])
    res = dict(shape=name, M=m, K=k, N=n, tiles=tiles, split=plan.split, dp_tiles=plan.dp_tiles)
    y_whole = lf.fp8_gemm(xq, xs, fw, b, torch.bfloat16, config=whole)
    y_split = lf.fp8_gemm(xq, xs, fw, b, torch.bfloat16, config=base)
    y_bf16 = F.linear(x, w, b)
    res["rel_split_vs_whole"] = rel_l2(y_split, y_whole)
    res["rel_split_vs_bf16"] = rel_l2(y_split, y_bf16)
    res["repeat_equal"] = bool(torch.equal(y_split, lf.fp8_gemm(xq, xs, fw, b, torch.bfloat16, config=base)))
    res["gemm_whole_ms"] = bench(lambda: lf.fp8_gemm(xq, xs, fw, b, torch.bfloat16, config=whole))
    res["gemm_split_ms"] = bench(lambda: lf.fp8_gemm(xq, xs, fw, b, torch.bfloat16, config=base))
    for forced in (2, 3, 4):
        cfg = dict(base, TAIL_SPLIT_K=forced)
        res[f"gemm_s{forced}_ms"] = bench(lambda cfg=cfg: lf.fp8_gemm(xq, xs, fw, b, torch.bfloat16, config=cfg))
    res["full_whole_ms"] = bench(lambda: lf.fp8_linear(x, fw, b, config=whole))
    res["full_split_ms"] = bench(lambda: lf.fp8_linear(x, fw, b, config=base))
    res["cublas_ms"] = bench(lambda: F.linear(x, w, b))
    torch.cuda.synchronize()
    tail = importlib.import_module(pack.__name__ + ".kernels.linear.tail_split")
    res["locks_zero"] = all(int(t[0].abs().sum()) == 0 for t in tail._tail_locks.values())
    for key in list(res):
        if key.endswith("_ms"):
            res[key.replace("_ms", "_tflops")] = flops / res[key] / 1e9
    log(f"  tail {res}")
    return res


def tail_table(rows, log):
    log("\nSplit tail (TFLOP/s, do_bench medians; GEMM alone unless 'full' = quantisation + GEMM; "
        "split = the shipped choice, sN = N slices forced)")
    log(" | ".join(("shape", "tiles", "split", "GEMM whole", "GEMM split", "s2", "s3", "s4", "x split/whole",
                    "full whole", "full split", "cuBLAS bf16", "x cuBLAS whole", "x cuBLAS split",
                    "relL2 split/whole", "relL2 vs bf16", "repeat equal", "counters zero")))
    for r in rows:
        log(" | ".join([r["shape"], str(r["tiles"]), str(r["split"]), fmt(r["gemm_whole_tflops"], 0),
                        fmt(r["gemm_split_tflops"], 0), fmt(r["gemm_s2_tflops"], 0), fmt(r["gemm_s3_tflops"], 0),
                        fmt(r["gemm_s4_tflops"], 0), fmt(r["gemm_whole_ms"] / r["gemm_split_ms"], 3),
                        fmt(r["full_whole_tflops"], 0), fmt(r["full_split_tflops"], 0), fmt(r["cublas_tflops"], 0),
                        fmt(r["cublas_ms"] / r["full_whole_ms"]), fmt(r["cublas_ms"] / r["full_split_ms"]),
                        fmt(r["rel_split_vs_whole"], 5), fmt(r["rel_split_vs_bf16"], 4), str(r["repeat_equal"]),
                        str(r["locks_zero"])]))


def fmt(v, p=2):
    return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def methods_table(report, log):
    """Every method per shape: TFLOP/s incl. quantisation, x cuBLAS BF16, rel. L2 vs BF16."""
    log("\nkernels.linear methods (TFLOP/s incl. activation quantisation, bf16 in/out, bias; rel. L2 vs "
        "cuBLAS BF16 on activations with 8 channels x20)")
    hdr = ("shape", "cuBLAS bf16", "smm row+q", "fp8 w8a8", "int8 w8a8", "fp8 w-only", "w-only ckpt",
           "comfy fp8 upcast", "int_mm+q", "x cuBLAS fp8", "x cuBLAS int8", "x cuBLAS w-only", "x smm row+q fp8",
           "int8 quant ms", "relL2 fp8", "relL2 int8", "relL2 int8 plain", "relL2 w-only", "relL2 int_mm")
    log(" | ".join(hdr))
    for r in report["shapes"]:
        mt = r.get("methods") or {}
        base, row = r.get("cublas_bf16_ms"), r.get("scaled_mm_rowwise_quant_ms")

        def ratio(ref, key):
            return ref / mt[key] if ref and mt.get(key) else None

        log(" | ".join([r["shape"], fmt(r.get("cublas_bf16_tflops"), 0), fmt(r.get("scaled_mm_rowwise_quant_tflops"), 0),
                        fmt(mt.get("fp8_w8a8_tflops"), 0), fmt(mt.get("int8_w8a8_tflops"), 0),
                        fmt(mt.get("fp8_weight_only_tflops"), 0), fmt(mt.get("fp8_weight_only_ckpt_tflops"), 0),
                        fmt(mt.get("comfy_fp8_upcast_tflops"), 0), fmt(mt.get("int_mm_quant_tflops"), 0),
                        fmt(ratio(base, "fp8_w8a8_ms")), fmt(ratio(base, "int8_w8a8_ms")),
                        fmt(ratio(base, "fp8_weight_only_ms")), fmt(ratio(row, "fp8_w8a8_ms")),
                        fmt(mt.get("int8_quant_ms"), 3),
                        fmt(mt.get("fp8_w8a8_rel_bf16"), 4), fmt(mt.get("int8_w8a8_rel_bf16"), 4),
                        fmt(mt.get("int8_plain_rel_bf16"), 4), fmt(mt.get("fp8_weight_only_rel_bf16"), 4),
                        fmt(mt.get("int_mm_quant_rel_bf16"), 4)]))
        for key in sorted(mt):
            if key.endswith(("_error", "_refused")):
                log(f"  {r['shape']} {key}: {mt[key]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--gelu", default=",".join(GELU_CASES),
                    help="shapes to time with the GELU epilogue (empty: none)")
    ap.add_argument("--methods", default=",".join(kernels.LINEAR_METHODS),
                    help="kernels.linear methods to time per shape (empty: none)")
    ap.add_argument("--tail", default=",".join(TAIL_SHAPES), help="split-tail shapes (empty: none)")
    args = ap.parse_args()
    t0 = time.time()
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    import triton

    props = torch.cuda.get_device_properties(0)
    env = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
               cuda=torch.version.cuda, default_config=lf.LINEAR_FP8_CONFIGS[lf.config_family(
                   f"sm{props.major}{props.minor}")])
    log(f"env {env}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = dict(env=env, checks=[], shapes=[])
    try:
        report["checks"] = small_checks(gen)
    except Exception:
        log(traceback.format_exc())
    for r in report["checks"]:
        log(f"check {r}")
    for name in args.shapes.split(","):
        m, k, n = SHAPES[name]
        try:
            report["shapes"].append(run_shape(name, m, k, n, gen, not args.no_sweep, log,
                                              [mt for mt in args.methods.split(",") if mt]))
        except Exception:
            log(f"{name} failed:\n{traceback.format_exc()[-2000:]}")
        torch.cuda.empty_cache()
        log(f"  {name} done at {time.time() - t0:.0f}s")
        Path(args.out).mkdir(parents=True, exist_ok=True)  # partial results survive a timeout
        (Path(args.out) / "linear.json").write_text(json.dumps(report, indent=1))
    report["gelu"] = []
    for name in [g for g in args.gelu.split(",") if g]:
        m, k, n = SHAPES[name]
        try:
            report["gelu"].append(run_gelu(name, m, k, n, GELU_CASES[name], gen, log))
        except Exception:
            log(f"gelu {name} failed:\n{traceback.format_exc()[-2000:]}")
        torch.cuda.empty_cache()
    report["tail"] = []
    for name in [t for t in args.tail.split(",") if t]:
        m, k, n = TAIL_SHAPES[name]
        try:
            report["tail"].append(run_tail(name, m, k, n, gen, log))
        except Exception:
            log(f"tail {name} failed:\n{traceback.format_exc()[-2000:]}")
        torch.cuda.empty_cache()
    report["seconds"] = time.time() - t0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "linear.json").write_text(json.dumps(report, indent=1))

    log("\nTFLOP/s (do_bench medians, bf16 in/out, bias; ours = activation quantisation + GEMM)")
    hdr = ("shape", "ours", "ours again", "ours GEMM", "ours best", "quant ms", "cuBLAS bf16", "smm tensor",
           "smm tensor+q", "smm row", "smm row+q", "x cuBLAS", "x row+q", "x row+ourq", "relL2 ours", "relL2 row")
    log(" | ".join(hdr))
    for r in report["shapes"]:
        log(" | ".join([r["shape"], fmt(r.get("ours_full_tflops"), 0), fmt(r.get("ours_full_repeat_tflops"), 0),
                        fmt(r.get("ours_gemm_tflops"), 0),
                        fmt(r.get("ours_full_best_tflops"), 0), fmt(r.get("ours_quant_ms"), 3),
                        fmt(r.get("cublas_bf16_tflops"), 0), fmt(r.get("scaled_mm_tensor_tflops"), 0),
                        fmt(r.get("scaled_mm_tensor_quant_tflops"), 0), fmt(r.get("scaled_mm_rowwise_tflops"), 0),
                        fmt(r.get("scaled_mm_rowwise_quant_tflops"), 0), fmt(r.get("x_vs_cublas_bf16")),
                        fmt(r.get("x_vs_rowwise_quant")), fmt(r.get("x_vs_rowwise_plus_our_quant")),
                        fmt(r.get("ours_rel_bf16"), 4), fmt(r.get("scaled_mm_rowwise_rel_bf16"), 4)]))
    for r in report["shapes"]:
        if r.get("best_config"):
            log(f"best {r['shape']}: {r['best_config']}")
    methods_table(report, log)
    if report["gelu"]:
        log("\nGELU (tanh) epilogue, ms (do_bench medians): ours fused | ours + GELU pass | cuBLAS + GELU pass | "
            "GELU pass alone | ours without GELU | saved vs ours + pass | x vs cuBLAS + pass | rel. L2 fused vs unfused")
        for r in report["gelu"]:
            log(" | ".join([f"{r['shape']} (from col {r['act_from']})", fmt(r["fused_ms"], 3),
                            fmt(r["ours_then_gelu_ms"], 3), fmt(r["cublas_then_gelu_ms"], 3), fmt(r["gelu_pass_ms"], 3),
                            fmt(r["ours_plain_ms"], 3), fmt(r["ours_then_gelu_ms"] - r["fused_ms"], 3),
                            fmt(r["cublas_then_gelu_ms"] / r["fused_ms"]), fmt(r["fused_rel_vs_unfused_fp32"], 5)]))
    if report["tail"]:
        tail_table(report["tail"], log)
    log(f"total {time.time() - t0:.0f}s")
    (Path(args.out) / "linear.log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
