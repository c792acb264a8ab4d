"""FP8 W8A8 Linear (kernels/linear_fp8.py) on a GPU: correctness, a tile sweep, and speed
against cuBLAS BF16 and torch._scaled_mm at Flux / Wan Linear shapes.

    python benchmarks/linear_bench.py [--out DIR] [--no-sweep] [--shapes flux_qkv,...]

1. small checks (partial tiles, K tail, bias, fp16 / bf16 output, pre-quantised FP8 weights,
   TMA and pointer variants): rel. L2 vs linear_fp8_reference (same quantisation) and vs fp32;
2. --sweep (default on): GEMM-only time of each candidate tile config per shape;
3. per shape (random bf16 data with outlier channels, never zeros): `triton.testing.do_bench`
   medians (it flushes L2 between reps) of ours incl. activation quantisation, ours GEMM only,
   our quantisation alone, cuBLAS BF16 F.linear, torch._scaled_mm per-tensor and row-wise (each
   alone and with a separate eager-torch quantisation); TFLOP/s, ratios, rel. L2 vs BF16.
Prints the table last; writes linear_fp8.json under --out (default: $OUT or .).
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
lf = importlib.import_module(pack.__name__ + ".kernels.linear_fp8")
lref = importlib.import_module(pack.__name__ + ".kernels.linear_ref")

# name -> (M tokens, K in_features, N out_features)
SHAPES = {
    "flux_qkv": (4608, 3072, 9216),
    "flux_mlp_up": (4608, 3072, 12288),
    "flux_mlp_down": (4608, 12288, 3072),
    "wan_proj": (32760, 5120, 5120),
    "wan_ffn_up": (32760, 5120, 13824),
    "wan_ffn_down": (32760, 13824, 5120),
}
SWEEP = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g, num_warps=w, num_stages=s, TMA=tma)
         for bm, bn, bk, g, w, s, tma in (
             (128, 256, 128, 8, 8, 3, True), (128, 256, 64, 8, 8, 5, True), (128, 256, 64, 8, 8, 4, True),
             (128, 128, 128, 8, 4, 4, True), (128, 128, 128, 8, 8, 5, True), (256, 128, 128, 8, 8, 3, True),
             (128, 256, 128, 16, 8, 3, True), (128, 256, 128, 32, 8, 3, True), (128, 128, 128, 16, 8, 5, True),
             (128, 256, 128, 16, 8, 3, False), (128, 128, 128, 8, 8, 4, False))]


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
            f"_g{c['GROUP_M']}_w{c['num_warps']}_s{c['num_stages']}")


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


def run_shape(name, m, k, n, gen, sweep, log):
    flops = 2.0 * m * n * k
    x = activations(m, k, gen)
    w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    fw = lf.quantize_weight(w)
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
    return res


def fmt(v, p=2):
    return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--shapes", default=",".join(SHAPES))
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
            report["shapes"].append(run_shape(name, m, k, n, gen, not args.no_sweep, log))
        except Exception:
            log(f"{name} failed:\n{traceback.format_exc()[-2000:]}")
        torch.cuda.empty_cache()
        log(f"  {name} done at {time.time() - t0:.0f}s")
        Path(args.out).mkdir(parents=True, exist_ok=True)  # partial results survive a timeout
        (Path(args.out) / "linear_fp8.json").write_text(json.dumps(report, indent=1))
    report["seconds"] = time.time() - t0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "linear_fp8.json").write_text(json.dumps(report, indent=1))

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
    log(f"total {time.time() - t0:.0f}s")
    (Path(args.out) / "linear_fp8.log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
