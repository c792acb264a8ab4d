"""One command for the GPU machine: correctness, then timing of our attention against every
baseline that can run there; writes JSON and prints the table last.

    PYTHONUNBUFFERED=1 python benchmarks/run.py [--quick] [--sweep] [--dtypes bf16,fp16]

JSON goes to $OUT if set, else benchmarks/results/. Baselines that cannot be imported or
cannot run a shape are reported as missing, with the reason, never silently skipped.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import load_pack  # noqa: E402

import torch  # noqa: E402

pack = load_pack()
import importlib  # noqa: E402
K = importlib.import_module(pack.__name__ + ".kernels")

# name, B, H, Hkv, Lq, Lk, D, mask ("none" | "pad_add")
SHAPES = [
    ("sd15_4096_d40", 2, 8, 8, 4096, 4096, 40, "none"),
    ("sd15_1024_d80", 2, 8, 8, 1024, 1024, 80, "none"),
    ("sd15_256_d160", 2, 8, 8, 256, 256, 160, "none"),
    ("sdxl_4096_d64", 2, 10, 10, 4096, 4096, 64, "none"),
    ("sdxl_1024_d64", 2, 20, 20, 1024, 1024, 64, "none"),
    ("flux_4608_d128", 1, 24, 24, 4608, 4608, 128, "none"),
    ("wan14b_32760_d128", 1, 40, 40, 32760, 32760, 128, "none"),
    ("hunyuan_33390_d128", 1, 24, 24, 33390, 33390, 128, "none"),
    ("cross_4096x77_d64", 2, 10, 10, 4096, 77, 64, "none"),
    ("sd15_cross_4096x77_d40", 2, 8, 8, 4096, 77, 40, "none"),
    ("sdxl_cross_1024x77_d64", 2, 20, 20, 1024, 77, 64, "none"),
    ("wan_cross_32760x512_d128", 1, 40, 40, 32760, 512, 128, "none"),
    ("qwen_4352_pad_d128", 1, 24, 24, 4352, 4352, 128, "pad_add"),
    ("lumina_gqa_4096_d96", 1, 24, 8, 4096, 4096, 96, "none"),
]
QUICK = {"sd15_4096_d40", "sdxl_4096_d64", "flux_4608_d128", "cross_4096x77_d64", "qwen_4352_pad_d128"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GRAPH_IMPLS = ("ours", "sdpa_flash", "sdpa_cudnn")
L2_BYTES = 60 * 2**20


def log(*a):
    print(*a, flush=True)


def make_inputs(shape, dtype, device, seed):
    name, B, H, Hkv, Lq, Lk, D, mask = shape
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, H, Lq, D, device=device, dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, Lk, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, Lk, D, device=device, dtype=dtype, generator=g)
    m = None
    if mask == "pad_add":
        # Qwen-Image style: text padding keys get a large negative additive bias, [B,1,1,Lk].
        m = torch.zeros(B, 1, 1, Lk, device=device, dtype=dtype)
        m[..., Lk - 200:] = float("-inf")
    return q, k, v, m


def ref_rows(q, k, v, m, rows):
    """fp32 reference for a subset of query rows (full K/V), one head group at a time."""
    qs = q[:, :, rows].float()
    H, Hkv = q.shape[1], k.shape[1]
    kf = k.float().repeat_interleave(H // Hkv, 1) if Hkv != H else k.float()
    vf = v.float().repeat_interleave(H // Hkv, 1) if Hkv != H else v.float()
    outs = []
    for h0 in range(0, H, 4):
        s = torch.matmul(qs[:, h0:h0 + 4], kf[:, h0:h0 + 4].transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if m is not None:
            s = s + m.float()
        outs.append(torch.softmax(s, -1) @ vf[:, h0:h0 + 4])
    return torch.cat(outs, 1)


def errors(out_rows, ref):
    o, r = out_rows.float().flatten(), ref.flatten()
    if not torch.isfinite(o).all():
        return {"rel_l2": float("nan"), "cos": float("nan")}
    return {"rel_l2": ((o - r).norm() / r.norm()).item(), "cos": torch.nn.functional.cosine_similarity(o, r, 0).item()}


def baselines(shape, m0=None):
    """name -> (callable(q,k,v,m) or None, reason)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    name, B, H, Hkv, Lq, Lk, D, mask = shape
    gqa = {"enable_gqa": True} if Hkv != H else {}

    def sdpa_with(backend):
        def f(q, k, v, m):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, **gqa)
        return f

    out["sdpa_flash"] = (sdpa_with(SDPBackend.FLASH_ATTENTION), "")
    out["sdpa_cudnn"] = (sdpa_with(SDPBackend.CUDNN_ATTENTION), "")
    try:
        from torch.nn.attention.flex_attention import flex_attention

        # Each shape recompiles flex_attention; past dynamo's recompile limit (8) it silently
        # falls back to an unfused eager path, so start every shape from a clean cache.
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=False)

        # One score_mod per shape (a new closure per call would recompile every call); every
        # input set of a shape carries the same mask values, so the first set's mask serves all.
        mm = None if m0 is None else m0[:, 0, 0].float()

        def score_mod(score, b, h, qi, ki):
            return score + mm[b, ki]

        def f(q, k, v, m):
            if m is None:
                return flex(q, k, v, enable_gqa=bool(gqa))
            return flex(q, k, v, score_mod=score_mod, enable_gqa=bool(gqa))
        out["flex"] = (f, "")
    except Exception as e:
        out["flex"] = (None, f"{type(e).__name__}: {e}")
    try:
        from sageattention import sageattn

        def f(q, k, v, m):
            if m is not None:
                raise RuntimeError("sageattn 1.0.6 takes no mask")
            if Hkv != H:
                k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
            return sageattn(q, k, v, tensor_layout="HND", is_causal=False)
        out["sage1"] = (f, "")
    except Exception as e:
        out["sage1"] = (None, f"{type(e).__name__}: {e}")
    try:
        import comfy_kitchen as ck

        def f(q, k, v, m):
            return ck.int8_attention(q, k, v, attn_mask=m)
        out["ck_int8"] = (f, "") if ck.int8_attention_is_available(q_device()) else (None, "int8_attention_is_available() is False")
    except Exception as e:
        out["ck_int8"] = (None, f"{type(e).__name__}: {e}")
    return out


# Our quantized paths, quantisation of Q/K/V included in their time (what a ComfyUI call costs).
QUANTIZED_IMPLS = {"ours_fp8": "triton_fp8", "ours_int8": "triton_int8"}
# DiT shapes whose accuracy is also judged on inputs with real-model outliers (the quantized paths' bars:
# outliers cos >= 0.9995 and rel. L2 <= 0.03; Gaussian cos >= 0.998 and rel. L2 <= 0.06).
OUTLIER_SHAPES = {"flux_4608_d128", "wan14b_32760_d128", "hunyuan_33390_d128"}
OUTLIER_IMPLS = ("ours", "ours_fp8", "ours_int8", "sdpa_cudnn", "sage1", "ck_int8")


def quantized_impls():
    return {n: (lambda q, k, v, m, b=b: K.attention(q, k, v, attn_mask=m, backend=b), "")
            for n, b in QUANTIZED_IMPLS.items()}


def naive_fp8(q, k, v):
    """Per-tensor e4m3 of Q, K and V (scale = amax / 448), dequantized: what a plain FP8
    attention without smoothing or finer scales computes with."""
    def fake(t):
        s = t.float().abs().amax().clamp_min(1e-12) / 448.0
        return ((t.float() / s).to(torch.float8_e4m3fn).float() * s).to(t.dtype)
    return fake(q), fake(k), fake(v)


def outlier_accuracy(shape, dtype, device, impls):
    """rel. L2 / cosine against float32 on outlier inputs (benchmarks/check_fp8.py's recipe:
    K with a large common offset and 60-100x channels, Q and V outlier channels)."""
    from check_fp8 import make_inputs as outlier_inputs

    name, B, H, Hkv, Lq, Lk, D, mask = shape
    q, k, v = outlier_inputs(B, H, Hkv, Lq, Lk, D, dtype, "outliers")
    rows = torch.randperm(Lq, device=device)[:512]
    ref = ref_rows(q, k, v, None, rows)
    out = {}
    for iname in OUTLIER_IMPLS:
        fn = impls.get(iname, (None, "not run"))[0]
        if fn is None:
            continue
        try:
            out[iname] = errors(fn(q, k, v, None)[:, :, rows], ref)
        except Exception as e:
            out[iname] = {"missing": f"{type(e).__name__}: {str(e)[:120]}"}
    out["naive_fp8"] = errors(ref_rows(*naive_fp8(q, k, v), None, rows), ref)
    for iname, rec in out.items():
        log(f"{name:<22} outliers {iname:<11} " + (f"relL2 {rec['rel_l2']:.5f} cos {rec['cos']:.6f}"
                                                    if "rel_l2" in rec else f"missing: {rec['missing']}"))
    del q, k, v
    torch.cuda.empty_cache()
    return out


def _at():
    from importlib import import_module
    return import_module(K.__name__ + ".attention_triton")


def q_device():
    return torch.device("cuda", torch.cuda.current_device())


def bench(fn, sets, warmup=25, rep=100):
    import triton.testing

    i = [0]

    def call():
        q, k, v, m = sets[i[0] % len(sets)]
        i[0] += 1
        return fn(q, k, v, m)
    return triton.testing.do_bench(call, warmup=warmup, rep=rep, return_mode="median")


def input_sets(shape, dtype, device):
    q, k, v, m = make_inputs(shape, dtype, device, 0)
    nbytes = sum(t.numel() * t.element_size() for t in (q, k, v))
    n = 1 if nbytes > 4 * L2_BYTES else min(8, math.ceil(4 * L2_BYTES / nbytes))
    return [(q, k, v, m)] + [make_inputs(shape, dtype, device, s) for s in range(1, n)]


def _cfgs(tiles, variants, split):
    out = []
    for (bm, bn, w, st) in tiles:
        for var in variants:
            c = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st, SPLIT_D=split, TMA=False, WS=False, LAZY=False)
            c.update(var)
            out.append(c)
    return out


_VARIANTS = [{}, {"TMA": True}, {"WS": True}, {"LAZY": True}, {"LAZY": True, "TMA": True}]
SWEEP = {
    "d64": _cfgs([(128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 4, 3), (128, 64, 4, 4), (128, 128, 8, 2)], _VARIANTS, False),
    "d128": _cfgs([(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 3)], _VARIANTS, True),
    "short": _cfgs([(128, 64, 4, 2), (128, 128, 8, 2), (64, 64, 4, 2), (128, 32, 4, 2), (64, 128, 4, 2)], [{}], True)
    + _cfgs([(128, 64, 4, 2), (64, 64, 4, 2)], [{"TMA": True}], True),
    "d128s": _cfgs([(128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2)], [{}, {"LAZY": True}], True),
    "odd": _cfgs([(128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2)],
                 [{"SPLIT_D": False}, {"SPLIT_D": True}], True)
    + _cfgs([(128, 128, 8, 3), (128, 64, 4, 3)], [{"SPLIT_D": True, "LAZY": True}], True),
}
# Small calls: more, smaller programs (a 256-token d160 call has 64 programs of 64 rows).
SWEEP["small"] = _cfgs([(128, 128, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2),
                        (128, 128, 8, 3), (64, 32, 4, 3), (32, 64, 4, 3), (32, 64, 4, 2), (32, 32, 2, 2),
                        (16, 64, 2, 2), (16, 32, 2, 2), (16, 128, 4, 2), (32, 128, 4, 2)], [{}], False)
SWEEP["d128x"] = _cfgs([(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
                      [{}], False)
# The short-key kernel: rows per tile, warps, stages of the Q-tile loop, programs per SM.
SWEEP["skv"] = [dict(BLOCK_M=bm, num_warps=w, num_stages=st, PROGRAMS_PER_SM=pps)
                for bm, w in ((64, 4), (128, 4), (128, 8)) for st in (2, 3, 4) for pps in (1, 2, 4)]
# Calls over <= 1024 keys (the "m" classes): sweep 1 found 64x64 tiles best; neighbours of it.
SWEEP["med"] = _cfgs([(64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2), (64, 128, 4, 3), (64, 128, 4, 2),
                      (64, 32, 4, 3), (64, 32, 4, 4), (128, 64, 4, 3), (64, 64, 8, 3)], [{}], False)
SWEEP_SHAPES = {"sd15_1024_d80": "med", "sd15_256_d160": "small", "sdxl_1024_d64": "med",
                "cross_4096x77_d64": "skv", "sd15_cross_4096x77_d40": "skv", "sdxl_cross_1024x77_d64": "skv",
                "wan_cross_32760x512_d128": "med"}
# Earlier sweeps (their winners are the shipped sm90 configs; RESULTS.md): --sweep-all adds them.
SWEEP_SHAPES_ALL = {"sdxl_4096_d64": "d64", "flux_4608_d128": "d128", "sd15_4096_d40": "odd",
                    "qwen_4352_pad_d128": "d128s", "lumina_gqa_4096_d96": "odd", **SWEEP_SHAPES}


def sweep(shapes, device, results, table):
    from importlib import import_module
    at = import_module(K.__name__ + ".attention_triton")
    sk = import_module(K.__name__ + ".attention_short_kv")
    info = K.describe(device)
    for shape in shapes:
        if shape[0] not in table:
            continue
        sets = input_sets(shape, torch.bfloat16, device)
        q, k, v, m = sets[0]
        rows = torch.randperm(q.shape[2], device=device)[:256]
        ref = ref_rows(q, k, v, m, rows)
        flops = 4 * shape[1] * shape[2] * shape[4] * shape[5] * shape[6]
        rows_out = []
        for cfg in SWEEP[table[shape[0]]]:
            try:
                if table[shape[0]] == "skv":
                    fn = lambda q, k, v, m, cfg=cfg: sk.attention_short_kv(q, k, v, None, info, False, config=cfg)
                else:
                    fn = lambda q, k, v, m, cfg=cfg: at.attention_triton(q, k, v, m, config=cfg)
                err = errors(fn(q, k, v, m)[:, :, rows], ref)
                ms = bench(fn, sets, warmup=10, rep=40)
                rows_out.append((flops / ms / 1e9, cfg, err["rel_l2"]))
                log(f"  sweep {shape[0]:<22} {flops / ms / 1e9:7.1f} TF/s err {err['rel_l2']:.5f} {cfg}")
            except Exception as e:
                log(f"  sweep {shape[0]:<22} FAILED {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        rows_out.sort(key=lambda r: -r[0])
        results["sweep"][shape[0]] = [{"tflops": r[0], "config": r[1], "rel_l2": r[2]} for r in rows_out]
        if rows_out:
            log(f"BEST {shape[0]}: {rows_out[0][0]:.1f} TF/s {rows_out[0][1]}")
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time candidate configs of our kernel")
    ap.add_argument("--sweep-only", action="store_true")
    ap.add_argument("--sweep-all", action="store_true", help="sweep every tuned shape, not only the small ones")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--only", default="", help="comma list of shape names")
    ap.add_argument("--skip", default="", help="comma list of baselines to skip")
    ap.add_argument("--name", default="bench", help="JSON file name (without .json)")
    ap.add_argument("--no-quantized", action="store_true", help="leave out our FP8 / INT8 paths and the outlier check")
    args = ap.parse_args()

    device = q_device()
    import triton
    props = torch.cuda.get_device_properties(device)
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "rows": [], "sweep": {}, "missing": {},
    }
    for pkg in ("sageattention", "comfy_kitchen"):
        try:
            mod = __import__(pkg)
            results[pkg] = getattr(mod, "__version__", "present")
        except Exception as e:
            results[pkg] = f"missing ({type(e).__name__}: {e})"
    log(json.dumps({k: v for k, v in results.items() if k not in ("rows", "sweep", "missing")}))

    shapes = [s for s in SHAPES if (not args.quick or s[0] in QUICK) and (not args.only or s[0] in args.only.split(","))]
    if args.sweep or args.sweep_only:
        sweep(shapes, device, results, SWEEP_SHAPES_ALL if args.sweep_all else SWEEP_SHAPES)
    skip = set(filter(None, args.skip.split(",")))
    out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)

    if not args.sweep_only:
        for shape in shapes:
            name, B, H, Hkv, Lq, Lk, D, mask = shape
            flops = 4 * B * H * Lq * Lk * D
            for dname in args.dtypes.split(","):
                dtype = DTYPES[dname]
                sets = input_sets(shape, dtype, device)
                q, k, v, m = sets[0]
                rows = torch.randperm(Lq, device=device)[:512]
                ref = ref_rows(q, k, v, m, rows)
                impls = {"ours": (lambda q, k, v, m: K.attention(q, k, v, attn_mask=m, backend="triton"), ""),
                         # the launcher alone, default config: separates Python dispatch cost from kernel time
                         "ours_raw": (lambda q, k, v, m: _at().attention_triton(q, k, v, m), "")}
                if not args.no_quantized:
                    impls.update(quantized_impls())
                impls.update({n: f for n, f in baselines(shape, m).items() if n not in skip})
                row = {"shape": name, "dims": [B, H, Hkv, Lq, Lk, D], "mask": mask, "dtype": dname, "impl": {}}
                for iname, (fn, why) in impls.items():
                    rec = {}
                    if fn is None:
                        rec = {"missing": why}
                    else:
                        try:
                            t0 = time.time()
                            out = fn(q, k, v, m)
                            torch.cuda.synchronize()
                            rec.update(errors(out[:, :, rows], ref))
                            del out
                            rec["first_call_s"] = time.time() - t0
                            ms = bench(fn, sets, rep=100 if flops < 2e12 else 600)
                            rec.update(ms=ms, tflops=flops / ms / 1e9)
                        except Exception as e:
                            rec = {"missing": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
                    row["impl"][iname] = rec
                    log(f"{name:<22} {dname} {iname:<11} " + (
                        f"{rec['tflops']:7.1f} TF/s  {rec['ms']:.3f} ms  relL2 {rec['rel_l2']:.5f} cos {rec['cos']:.6f}"
                        if "tflops" in rec else f"missing: {rec['missing']}"))
                if flops < 5e11:
                    # Small calls are bound by launch overhead on the host; replaying a CUDA
                    # graph shows the kernels' own time. One input set (graphs fix pointers).
                    import triton.testing
                    row["graph"] = {}
                    for gname in GRAPH_IMPLS:
                        fn = impls.get(gname, (None,))[0]
                        if fn is None:
                            continue
                        try:
                            ms = triton.testing.do_bench_cudagraph(lambda: fn(q, k, v, m), rep=50)
                            # Host cost of one eager call: submit 200 without waiting (the GPU
                            # queue holds them), per call.
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            for _ in range(200):
                                fn(q, k, v, m)
                            host_us = (time.perf_counter() - t0) / 200 * 1e6
                            torch.cuda.synchronize()
                            row["graph"][gname] = {"ms": ms, "tflops": flops / ms / 1e9, "host_us": host_us}
                            log(f"{name:<22} {dname} {gname:<11} graph {flops / ms / 1e9:7.1f} TF/s  {ms * 1e3:.1f} us"
                                f"  host {host_us:.1f} us/call")
                        except Exception as e:
                            row["graph"][gname] = {"missing": f"{type(e).__name__}: {str(e)[:120]}"}
                if not args.no_quantized and name in OUTLIER_SHAPES:
                    del sets, q, k, v
                    row["outliers"] = outlier_accuracy(shape, dtype, device, impls)
                    sets = q = k = v = None
                results["rows"].append(row)
                del sets, q, k, v, m
                torch.cuda.empty_cache()
            (out_dir / f"{args.name}.json").write_text(json.dumps(results, indent=1))

    results["counts"] = K.stats.counts()
    path = out_dir / f"{args.name}.json"
    path.write_text(json.dumps(results, indent=1))
    log(f"\nwrote {path}")
    print_table(results)


def print_quantized_table(results):
    """Our FP8 / INT8 paths (quantisation included) beside cuDNN, SageAttention 1.0.6 and
    comfy-kitchen INT8; accuracy on Gaussian and on outlier inputs."""
    names = ["ours", "ours_fp8", "ours_int8", "sdpa_cudnn", "sdpa_flash", "flex", "sage1", "ck_int8"]
    rows = [r for r in results["rows"] if any("tflops" in r["impl"].get(n, {}) for n in QUANTIZED_IMPLS)]
    if not rows:
        return
    log("\nQuantized paths (TFLOP/s incl. quantisation; ratio to SDPA-cuDNN BF16/FP16 of the same dtype)")
    log(f"{'shape':<22} {'dt':<4} " + " ".join(f"{n:>10}" for n in names)
        + f" {'fp8/cud':>7} {'int8/cud':>8} {'fp8/sage':>8}")
    for row in rows:
        tf = {n: row["impl"].get(n, {}).get("tflops") for n in names}
        cells = " ".join(f"{tf[n]:10.1f}" if tf[n] else f"{'-':>10}" for n in names)
        r = lambda a, b, w: f"{tf[a] / tf[b]:{w}.2f}" if tf[a] and tf[b] else f"{'-':>{w}}"
        log(f"{row['shape']:<22} {row['dtype']:<4} {cells} {r('ours_fp8', 'sdpa_cudnn', 7)} "
            f"{r('ours_int8', 'sdpa_cudnn', 8)} {r('ours_fp8', 'sage1', 8)}")
    log("accuracy vs float32 (rel. L2 / cosine): gauss = the timed inputs; outliers = check_fp8's recipe")
    for row in rows:
        for kind, recs in (("gauss", row["impl"]), ("outliers", row.get("outliers") or {})):
            cells = []
            for n in ("ours", "ours_fp8", "ours_int8", "sdpa_cudnn", "sage1", "ck_int8", "naive_fp8"):
                rec = recs.get(n, {})
                if "rel_l2" in rec:
                    cells.append(f"{n} {rec['rel_l2']:.4f}/{rec['cos']:.5f}")
            if cells:
                log(f"  {row['shape']:<22} {row['dtype']:<4} {kind:<8} " + "  ".join(cells))


def print_table(results):
    names = ["ours", "ours_raw", "sdpa_flash", "sdpa_cudnn", "flex", "sage1", "ck_int8"]
    log(f"\n{results['gpu']} cc {results['capability']} torch {results['torch']} triton {results['triton']} {results['date']}")
    log("TFLOP/s (4*B*H*Lq*Lk*D / median time); ratio = ours / baseline; err = ours rel L2 vs fp32 (sdpa_flash's)")
    log(f"{'shape':<22} {'dt':<4} " + " ".join(f"{n:>10}" for n in names) + f" {'/flash':>7} {'/cudnn':>7} {'/flex':>7}  err(ours/flash)")
    for row in results["rows"]:
        imp = row["impl"]
        tf = {n: imp.get(n, {}).get("tflops") for n in names}
        cells = " ".join(f"{tf[n]:10.1f}" if tf[n] else f"{'-':>10}" for n in names)
        ratios = " ".join(f"{tf['ours'] / tf[b]:7.2f}" if tf['ours'] and tf[b] else f"{'-':>7}" for b in ("sdpa_flash", "sdpa_cudnn", "flex"))
        e_o = imp.get("ours", {}).get("rel_l2", float("nan"))
        e_f = imp.get("sdpa_flash", {}).get("rel_l2", float("nan"))
        log(f"{row['shape']:<22} {row['dtype']:<4} {cells} {ratios}  {e_o:.5f}/{e_f:.5f}")
    for row in results["rows"]:
        g = row.get("graph") or {}
        if g:
            log(f"graph {row['shape']:<20} {row['dtype']:<4} " + "  ".join(
                f"{n} {g[n]['tflops']:.1f} TF/s {g[n]['ms'] * 1e3:.1f}us host {g[n]['host_us']:.0f}us"
                if "tflops" in g.get(n, {}) else f"{n} -" for n in GRAPH_IMPLS))
    for name, rows in results.get("sweep", {}).items():
        if rows:
            log(f"sweep best {name}: {rows[0]['tflops']:.1f} TF/s {rows[0]['config']}")
    print_quantized_table(results)


def markdown_table(results) -> str:
    """The measured table as Markdown, for benchmarks/RESULTS.md."""
    names = ["ours", "ours_fp8", "ours_int8", "sdpa_flash", "sdpa_cudnn", "flex", "sage1", "ck_int8"]
    lines = ["| shape | dtype | " + " | ".join(names) + " | ours/flash | ours/cudnn | ours/flex | relL2 ours | relL2 flash |",
             "|" + "---|" * (len(names) + 7)]
    for row in results["rows"]:
        imp = row["impl"]
        tf = {n: imp.get(n, {}).get("tflops") for n in names}
        cell = lambda n: f"{tf[n]:.1f}" if tf[n] else "-"
        ratio = lambda b: f"{tf['ours'] / tf[b]:.2f}" if tf["ours"] and tf[b] else "-"
        err = lambda n: f"{imp.get(n, {}).get('rel_l2', float('nan')):.5f}"
        lines.append(f"| {row['shape']} | {row['dtype']} | " + " | ".join(cell(n) for n in names)
                     + f" | {ratio('sdpa_flash')} | {ratio('sdpa_cudnn')} | {ratio('flex')} | {err('ours')} | {err('sdpa_flash')} |")
    graph_rows = [r for r in results["rows"] if r.get("graph")]
    if graph_rows:
        lines += ["", "CUDA-graph replay (kernel time without host launch overhead), TF/s, and host time per "
                  "eager call (µs):", "",
                  "| shape | dtype | ours | sdpa_flash | sdpa_cudnn | ours/flash | ours/cudnn | host ours | host flash |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in graph_rows:
            g = {n: r["graph"].get(n, {}).get("tflops") for n in GRAPH_IMPLS}
            h = {n: r["graph"].get(n, {}).get("host_us") for n in GRAPH_IMPLS}
            f = lambda x: f"{x:.1f}" if x else "-"
            ratio = lambda b: f"{g['ours'] / g[b]:.2f}" if g["ours"] and g[b] else "-"
            lines.append(f"| {r['shape']} | {r['dtype']} | {f(g['ours'])} | {f(g['sdpa_flash'])} | {f(g['sdpa_cudnn'])} "
                         f"| {ratio('sdpa_flash')} | {ratio('sdpa_cudnn')} | {f(h['ours'])} | {f(h['sdpa_flash'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--markdown":
        print(markdown_table(json.loads(Path(sys.argv[2]).read_text())))
        sys.exit(0)
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
