"""Full-FP8 attention (kernels/attention/fp8_full.py) on a GPU: accuracy and speed.

    python benchmarks/fp8_attention_bench.py [--out DIR] [--sweep] [--shapes flux,wan,hunyuan]

1. small shapes (odd lengths, head dims 40/64/128): accuracy vs float32, both input kinds;
2. --sweep: tile configs at the Flux shape (quant+attention and attention alone);
3. per model shape: accuracy on a slice of heads vs a float32 reference computed in query
   chunks (the full score matrix of one Wan head is 4.3 GB), for ours (with and without the
   outlier side operand) and naive per-tensor FP8; timings (do_bench medians) of ours
   (quant+attention, attention alone, quantisation alone), SDPA cuDNN and SDPA flash (BF16).
Prints a table and writes fp8_full.json under --out (default: $OUT or .).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import load_pack  # noqa: E402
from _profile import device_ms_per_kernel  # noqa: E402

pack = load_pack()
import importlib  # noqa: E402

full = importlib.import_module(pack.__name__ + ".kernels.attention.fp8_full")
quant = importlib.import_module(pack.__name__ + ".kernels.attention.fp8_quant")

SHAPES = {"flux": (1, 24, 4608, 128), "wan": (1, 40, 32760, 128), "hunyuan": (1, 24, 33390, 128)}
SWEEP = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, TWO_LEVEL=two) for bm, bn, w, s, two in (
    (128, 128, 8, 3, True), (128, 128, 8, 4, True), (128, 64, 8, 3, True), (64, 64, 4, 3, True),
    (128, 128, 8, 3, False))]
TARGET = dict(outlier=(0.9995, 0.03), gauss=(0.998, 0.06))  # (cosine >=, rel L2 <=)


def metrics(out, ref):
    o, r = out.float().flatten(), ref.float().flatten()
    if not torch.isfinite(o).all():
        return dict(cos=float("nan"), rel_l2=float("nan"))
    return dict(cos=torch.nn.functional.cosine_similarity(o, r, dim=0).item(),
                rel_l2=((o - r).norm() / r.norm()).item())


def chunked_attention(q, k, v, scale, p_fp8=False, chunk=4096):
    """fp32 attention in query chunks ([H, L, D] inputs); p_fp8 rounds P*448 to e4m3 (the
    naive baseline's P)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    kt = k.float().transpose(-1, -2)
    vf = v.float()
    for i in range(0, q.shape[-2], chunk):
        s = torch.matmul(q[..., i:i + chunk, :].float(), kt) * scale
        p = torch.softmax(s, dim=-1)
        del s
        if p_fp8:
            p = (p * 448.0).to(torch.float8_e4m3fn).float() / 448.0
        out[..., i:i + chunk, :] = torch.matmul(p, vf)
        del p
    return out


def per_tensor_fp8(x):
    s = x.float().abs().amax().clamp_min(1e-30) / 448.0
    return ((x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s)


def bench(fn, rep):
    from triton.testing import do_bench
    return do_bench(fn, warmup=max(25, rep // 4), rep=rep, return_mode="median")


def small_checks():
    rows = []
    for shape in ((1, 2, 1000, 128), (2, 3, 333, 64), (1, 2, 77, 40), (1, 1, 4100, 128)):
        for kind in ("gauss", "outlier"):
            q, k, v = full.accuracy_inputs(kind, shape, torch.bfloat16, "cuda", seed=3)
            ref = full.attention_fp8_full_ref(q, k, v)
            out = full.attention_fp8_full(q, k, v)
            m = metrics(out, ref)
            rows.append(dict(shape=shape, kind=kind, **m))
            print(f"small {shape} {kind:8s} cos {m['cos']:.6f} rel {m['rel_l2']:.4f}", flush=True)
    return rows


def time_config(q, k, v, cfg, rep, n_outlier=quant.N_OUTLIER):
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D)
    qkv = quant.quantize_qkv(q, k, v, scale, cfg["BLOCK_M"], cfg["BLOCK_N"], n_outlier)
    t_attn = bench(lambda: full.attention_fp8_full_quantized(qkv, q.shape, k.shape[2], q.dtype, q.device, cfg), rep)
    t_quant = bench(lambda: quant.quantize_qkv(q, k, v, scale, cfg["BLOCK_M"], cfg["BLOCK_N"], n_outlier), rep)
    t_all = bench(lambda: full.attention_fp8_full(q, k, v, config=cfg, n_outlier=n_outlier), rep)
    return dict(attn_ms=t_attn, quant_ms=t_quant, total_ms=t_all)


def sweep(shape, rep):
    q, k, v = full.accuracy_inputs("gauss", shape, torch.bfloat16, "cuda", seed=1)
    flops = 4 * shape[0] * shape[1] * shape[2] * shape[2] * shape[3]
    rows = []
    for cfg in SWEEP:
        try:
            t = time_config(q, k, v, cfg, rep)
            row = dict(config=cfg, **t, tflops_attn=flops / t["attn_ms"] / 1e9, tflops_total=flops / t["total_ms"] / 1e9)
        except Exception as e:  # a config that does not compile or fit: record and go on
            row = dict(config=cfg, error=f"{type(e).__name__}: {e}"[:300])
        rows.append(row)
        print("sweep", json.dumps(row), flush=True)
    ok = [r for r in rows if "error" not in r and r["config"]["TWO_LEVEL"]]  # sm_90 keeps two levels
    return rows, min(ok, key=lambda r: r["total_ms"])["config"] if ok else None


def accuracy_at(shape, cfg, heads):
    """Accuracy on the first `heads` heads of the full-size call (the kernel runs them all)."""
    B, H, L, D = shape
    scale = 1.0 / math.sqrt(D)
    res = {}
    for kind in ("gauss", "outlier"):
        q, k, v = full.accuracy_inputs(kind, shape, torch.bfloat16, "cuda", seed=7)
        ref = chunked_attention(q[0, :heads], k[0, :heads], v[0, :heads], scale)
        ours = full.attention_fp8_full(q, k, v, config=cfg)[0, :heads]
        ours0 = full.attention_fp8_full(q, k, v, config=cfg, n_outlier=0)[0, :heads]
        ours1 = full.attention_fp8_full(q, k, v, config=dict(cfg, TWO_LEVEL=not cfg.get("TWO_LEVEL", True)))[0, :heads]
        qn, kn, vn = (per_tensor_fp8(t) for t in (q, k, v))  # scales over the whole tensor
        naive = chunked_attention(qn[0, :heads], kn[0, :heads], vn[0, :heads], scale, p_fp8=True)
        del qn, kn, vn
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            cudnn = torch.nn.functional.scaled_dot_product_attention(q, k, v)[0, :heads]
        res[kind] = dict(ours=metrics(ours, ref), ours_no_outlier_side=metrics(ours0, ref),
                         ours_other_accumulation=metrics(ours1, ref),
                         naive_per_tensor=metrics(naive, ref), cudnn_bf16=metrics(cudnn, ref))
        print(f"acc {shape} {kind}: " + json.dumps(res[kind]), flush=True)
        del q, k, v, ref
    return res


def quant_breakdown(q, k, v, cfg, iters=10):
    """GPU time per quantisation kernel (torch.profiler), mean over iters calls, in ms."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    times = device_ms_per_kernel(lambda: quant.quantize_qkv(q, k, v, scale, cfg["BLOCK_M"], cfg["BLOCK_N"]), iters)
    return {name: ms for name, ms in times.items() if "_fp8_" in name}


def graph_ms(fn):
    """Median of CUDA-graph replays: GPU time without Python launch overhead."""
    from triton.testing import do_bench_cudagraph
    try:
        return do_bench_cudagraph(fn, rep=200, return_mode="median")
    except Exception as e:  # capture can fail on some stacks: say so, keep the run going
        print(f"graph timing failed: {type(e).__name__}: {e}"[:300], flush=True)
        return None


def speed_at(shape, cfg, rep):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = full.accuracy_inputs("gauss", shape, torch.bfloat16, "cuda", seed=1)
    flops = 4 * shape[0] * shape[1] * shape[2] * shape[2] * shape[3]
    out = dict(time_config(q, k, v, cfg, rep))
    t0 = time_config(q, k, v, cfg, rep, n_outlier=0)
    out.update(attn_ms_no_side=t0["attn_ms"], total_ms_no_side=t0["total_ms"])
    out["total_graph_ms"] = graph_ms(lambda: full.attention_fp8_full(q, k, v, config=cfg))
    try:
        out["quant_kernels_ms"] = quant_breakdown(q, k, v, cfg)
    except Exception as e:
        out["quant_kernels_ms"] = {"error": f"{type(e).__name__}: {e}"[:200]}
    print("quant kernels", json.dumps(out["quant_kernels_ms"]), flush=True)
    for name, backend in (("cudnn_ms", SDPBackend.CUDNN_ATTENTION), ("flash_ms", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                out[name] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), rep)
        except Exception as e:
            out[name] = None
            out[name + "_error"] = f"{type(e).__name__}: {e}"[:200]
    for key in list(out):
        if isinstance(out[key], float):
            out["tflops_" + key] = flops / out[key] / 1e9
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", default=None, help="shape name to sweep SWEEP's configs at (flux, wan)")
    ap.add_argument("--shapes", default="flux,wan,hunyuan")
    ap.add_argument("--heads", type=int, default=2, help="heads compared with the fp32 reference")
    ap.add_argument("--config", default=None, help="BM,BN,warps,stages (skips the sweep's choice)")
    args = ap.parse_args()
    import triton
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references must be fp32
    t_start = time.time()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), targets=TARGET)
    print(json.dumps(result), flush=True)
    result["small"] = small_checks()
    cfg = dict(full.FP8_FULL_CONFIGS["sm90"])
    if args.config:
        bm, bn, w, s = (int(x) for x in args.config.split(","))
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
    elif args.sweep:
        result["sweep"], best = sweep(SHAPES[args.sweep], rep=200 if args.sweep == "flux" else 400)
        cfg = best or cfg
    result["config"] = cfg
    result["shapes"] = {}
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        rep = 200 if shape[2] < 10000 else 600
        row = dict(shape=shape, speed=speed_at(shape, cfg, rep), accuracy=accuracy_at(shape, cfg, args.heads))
        result["shapes"][name] = row
        print(f"{name}: " + json.dumps(row["speed"]), flush=True)
        torch.cuda.empty_cache()
    result["seconds"] = time.time() - t_start
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fp8_full.json").write_text(json.dumps(result, indent=1))
    print_table(result)


def print_table(result):
    print(f"\nconfig {result['config']}  ({result['device']}, torch {result['torch']}, triton {result['triton']})")
    print(f"{'shape':8s} {'what':28s} {'ms':>8s} {'TFLOP/s':>8s} {'x cuDNN':>8s}")
    for name, row in result["shapes"].items():
        sp = row["speed"]
        for label, key in (("ours quant+attn", "total_ms"), ("ours quant+attn, CUDA graph", "total_graph_ms"),
                           ("ours attn only", "attn_ms"),
                           ("ours quant only", "quant_ms"), ("ours quant+attn, no side", "total_ms_no_side"),
                           ("ours attn only, no side", "attn_ms_no_side"),
                           ("SDPA cuDNN bf16", "cudnn_ms"), ("SDPA flash bf16", "flash_ms")):
            ms = sp.get(key)
            if not isinstance(ms, float):
                continue
            tf = sp.get("tflops_" + key)
            ratio = sp["cudnn_ms"] / ms if sp.get("cudnn_ms") else float("nan")
            print(f"{name:8s} {label:28s} {ms:8.3f} {tf if tf and key != 'quant_ms' else float('nan'):8.1f} {ratio:8.3f}")
        for kind, acc in row["accuracy"].items():
            for who, m in acc.items():
                print(f"{name:8s} {kind:8s} {who:22s} cos {m['cos']:.6f} rel L2 {m['rel_l2']:.4f}")


if __name__ == "__main__":
    main()
