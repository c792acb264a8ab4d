"""Where the full-FP8 attention's quantisation time goes, on the GPU.

    python benchmarks/fp8_quant_bench.py [--out DIR] [--shapes flux,wan,hunyuan] [--iters N] [--sweep]

Per shape (random bf16 inputs with outlier channels, never zeros):
1. device time of each kernel of kernels.attention.fp8_quant.quantize_qkv (stats, finalize,
   quantise, V-mean fix) from torch.profiler over --iters calls, with the bytes each one must move and
   the bandwidth that gives, beside a plain device copy of Q (read + write) as the ceiling;
2. do_bench medians of quantize_qkv (with and without the outlier side operands, and with
   the older launch shapes: S37_TUNING), of the Gluon FP8 kernel alone on its output, and of
   the whole call (quantisation + kernel; again with S37_TUNING), with TFLOP/s and the share of
   the call the quantisation takes;
3. SDPA cuDNN on the same bf16 inputs, for the ratio;
4. --sweep: the kernels' device times for each launch shape in SWEEP (QUANT_TUNING overrides).
Prints the table last; writes fp8_quant.json under --out (default: $OUT or .).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import load_pack  # noqa: E402
from _profile import device_ms_per_kernel  # noqa: E402

pack = load_pack()
quant = importlib.import_module(pack.__name__ + ".kernels.attention.fp8_quant")
glu = importlib.import_module(pack.__name__ + ".kernels.attention.gluon_hopper")

SHAPES = {"flux": (1, 24, 4608, 128), "wan": (1, 40, 32760, 128), "hunyuan": (1, 24, 33390, 128)}
# --sweep: quantize_qkv launch shapes (QUANT_TUNING keys) timed per kernel.
# The older launch shapes: every row of Q and K in the statistics, 512-row chunks, 8 warps
# for 128 x 128 tiles (the last SWEEP entry; the "older" columns of the table).
S37_TUNING = dict(QK_STRIDE=1, STATS_ROWS=512, QUANT_WARPS=8)
# Also: V's mean without its rounding correction (V_MEAN_FIX=0) beside the default (the
# correction is the "fix" kernel alone: the quantising kernel is the same either way).
SWEEP = [dict(), dict(V_MEAN_FIX=0), S37_TUNING]
STAGES = (("stats", "fp8_stats_kernel"), ("finalize", "_fp8_finalize_kernel"), ("quant", "_fp8_quant_kernel"),
          ("fix", "_v_mean_fix_kernel"))


def inputs(shape, gen):
    """Gaussian Q/K/V with what real DiT activations have: a per-channel offset on K and a few
    channels of Q and V 10x larger."""
    b, h, l, d = shape
    q = torch.randn(shape, device="cuda", generator=gen)
    k = torch.randn(shape, device="cuda", generator=gen) + 3.0 * torch.randn(1, h, 1, d, device="cuda", generator=gen)
    v = torch.randn(shape, device="cuda", generator=gen)
    ch = torch.randperm(d, device="cuda", generator=gen)[:4]
    q[..., ch] *= 10.0
    v[..., ch] *= 10.0
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def bench(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def run_shape(name, shape, gen, iters, log, do_sweep=False):
    b, h, l, d = shape
    q, k, v = inputs(shape, gen)
    flops = 4.0 * b * h * l * l * d
    elt = q.element_size()
    n_el = b * h * l * d
    res = dict(shape=name, dims=shape)
    scale = d ** -0.5
    cfg = glu.default_config(q.device)
    bn = cfg["BLOCK_N"]

    # Bytes each stage must move at least (the side operands' gathers come from cache lines the
    # same program reads anyway; not counted).
    stride = quant.qk_stride(l, l, quant.QUANT_TUNING)  # Q and K rows the statistics read: 1 in stride
    res["qk_stride"] = stride
    res["bytes"] = dict(stats=n_el * elt * (1 + 2 / stride), quant=3 * n_el * elt + 3 * n_el, copy_q=2 * n_el * elt)
    res["copy_q_ms"] = bench(lambda: q.clone())
    res["copy_q_TBps"] = res["bytes"]["copy_q"] / res["copy_q_ms"] / 1e9
    times = device_ms_per_kernel(lambda: quant.quantize_qkv(q, k, v, scale, glu.BLOCK_M, bn), iters)
    res["kernels_ms"] = times
    for stage, key in STAGES:
        ms = sum(t for kname, t in times.items() if key in kname)
        res[f"{stage}_ms"] = ms
        if stage in res["bytes"] and ms:
            res[f"{stage}_TBps"] = res["bytes"][stage] / ms / 1e9
    sweep = []
    for tune in SWEEP if do_sweep else ():
        try:
            t = device_ms_per_kernel(lambda tune=tune: quant.quantize_qkv(q, k, v, scale, glu.BLOCK_M, bn, tuning=tune), iters)
            row = dict(tuning=tune, **{f"{stage}_ms": sum(x for n, x in t.items() if key in n) for stage, key in STAGES})
            row["device_ms"] = sum(row[f"{stage}_ms"] for stage, _ in STAGES)
        except Exception as e:  # one bad launch shape must not hide the others
            row = dict(tuning=tune, error=f"{type(e).__name__}: {e}"[:300])
        sweep.append(row)
        log(f"  sweep {name} {row}")
    res["sweep"] = sweep
    res["quantize_ms"] = bench(lambda: quant.quantize_qkv(q, k, v, scale, glu.BLOCK_M, bn))
    res["quantize_no_side_ms"] = bench(lambda: quant.quantize_qkv(q, k, v, scale, glu.BLOCK_M, bn, n_outlier=0))
    qkv = glu.quantize_for_config(q, k, v, scale, cfg)
    res["kernel_ms"] = bench(lambda: glu.attention_gluon_fp8_quantized(qkv, q.shape, l, q.dtype, q.device, cfg))
    res["full_ms"] = bench(lambda: glu.attention_gluon_fp8(q, k, v))
    # The same two timings with the older quantisation (every row of Q and K in the
    # statistics, 512-row chunks, 8 warps for 128 x 128 tiles), in the same process.
    saved = dict(quant.QUANT_TUNING)
    try:
        quant.QUANT_TUNING.update(S37_TUNING)
        res["quantize_s37_ms"] = bench(lambda: quant.quantize_qkv(q, k, v, scale, glu.BLOCK_M, bn))
        res["full_s37_ms"] = bench(lambda: glu.attention_gluon_fp8(q, k, v))
    finally:
        quant.QUANT_TUNING.clear()
        quant.QUANT_TUNING.update(saved)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        res["cudnn_ms"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    for key in ("kernel", "full", "full_s37", "cudnn"):
        res[f"{key}_tflops"] = flops / res[f"{key}_ms"] / 1e9
    res["full_vs_cudnn"] = res["cudnn_ms"] / res["full_ms"]
    res["quant_share"] = 1.0 - res["kernel_ms"] / res["full_ms"]
    log(json.dumps(res, default=str))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="time each SWEEP launch shape's kernels")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    def log(s):
        print(s, flush=True)

    reason = glu.gluon_refusal(torch.device("cuda"))
    if reason:
        log(f"Gluon FP8 refused here: {reason}")
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [run_shape(n, SHAPES[n], gen, args.iters, log, args.sweep) for n in args.shapes.split(",")]
    (out_dir / "fp8_quant.json").write_text(json.dumps(rows, indent=1, default=str))
    if any(r["sweep"] for r in rows):
        log("\n| shape | tuning | stats ms | finalize ms | quant ms | fix ms | device ms |")
        log("|---|---|---|---|---|---|---|")
        for r in rows:
            for w in r["sweep"]:
                log(f"| {r['shape']} | {w['tuning']} | " + (w.get("error") or " | ".join(
                    f"{w[k]:.3f}" for k in ("stats_ms", "finalize_ms", "quant_ms", "fix_ms", "device_ms"))) + " |")
    log("\n| shape | copy Q TB/s | QK stride | stats ms (TB/s) | finalize ms | quant ms (TB/s) | fix ms | quantize_qkv ms (no side; "
        "older) | kernel ms (TF/s) | full ms (TF/s) | full, older quantisation | cuDNN TF/s | full / cuDNN | quant share |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['shape']} | {r['copy_q_TBps']:.2f} | {r['qk_stride']} | {r['stats_ms']:.3f} ({r.get('stats_TBps', 0):.2f}) "
            f"| {r['finalize_ms']:.3f} | {r['quant_ms']:.3f} ({r.get('quant_TBps', 0):.2f}) | {r['fix_ms']:.3f} "
            f"| {r['quantize_ms']:.3f} ({r['quantize_no_side_ms']:.3f}; {r['quantize_s37_ms']:.3f}) "
            f"| {r['kernel_ms']:.3f} ({r['kernel_tflops']:.0f}) | {r['full_ms']:.3f} ({r['full_tflops']:.0f}) "
            f"| {r['full_s37_ms']:.3f} ({r['full_s37_tflops']:.0f}) | {r['cudnn_tflops']:.0f} "
            f"| {r['full_vs_cudnn']:.3f}x | {100 * r['quant_share']:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
