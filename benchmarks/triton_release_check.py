"""Every kernel family on a GPU under whichever Triton comes first on sys.path: accuracy against
float32 and speed, to compare Triton releases on one card (the device machine has one release
installed; benchmarks/carry_triton.sh packs another to carry) and to measure what FP fusion
left to Triton's default would cost.

    python benchmarks/triton_release_check.py --tag 3.6 [--unpinned] [--out DIR]
    python benchmarks/triton_release_check.py --compare DIR/release_3.6.json DIR/release_3.9.json ...

Per run, through the public API (what the nodes call), random data with outlier channels:
1. attention at Flux (1,24,4608,128) and Wan 2.1 (1,40,32760,128), bf16, for the FP16/BF16
   (`backend="triton"`), FP8 and INT8 paths and SDPA-cuDNN beside them: rel. L2 and cosine of
   the first head against a float32 reference, do_bench median ms, which kernel served;
2. attention at small odd shapes (lengths off the tiles, GQA, head dims 40/64/80/256, a
   [B, L, H, D] view) for the same paths: rel. L2 against float32, checked against a
   tolerance per path;
3. every kernels.linear method at a Flux and a Wan Linear shape: rel. L2 against BF16
   F.linear, ms, cuBLAS BF16 beside;
4. the fused row kernels (LayerNorm + modulation, gated residual + LayerNorm, QK RMSNorm, the
   FP8 rows of Flux's concatenated input) at Wan / Flux sizes: rel. L2 against their float
   references, ms.
--unpinned empties kernel_common.LAUNCH_OPTIONS and sets TRITON_DEFAULT_FP_FUSION=0 before
anything compiles: the kernels as launches that leave FP fusion to the default would build
them under Triton 3.10 (no FMA contraction, ptxas --fmad=false). Writes release_<tag>.json;
prints its table last. Exit code 1 when an accuracy check fails.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Attention shapes (B, H, L, D) timed and checked on their first head.
BIG = {"flux": (1, 24, 4608, 128), "wan": (1, 40, 32760, 128)}
# (name, B, H, H_kv, Lq, Lk, D, layout)
SMALL = [("odd_d64", 1, 3, 3, 1000, 777, 64, "bhld"), ("gqa_d128", 1, 8, 2, 500, 700, 128, "bhld"),
         ("d40_view", 2, 4, 4, 1024, 1031, 40, "blhd"), ("d256", 1, 2, 2, 333, 4097, 256, "bhld"),
         ("cross_77", 2, 10, 10, 4096, 77, 64, "bhld")]
# rel. L2 against float32 per path on Gaussian inputs: BF16 rounding of P and the output for
# the 16-bit path (SDPA itself: ~2.3e-3), the quantized paths' Gaussian bar for the quantized ones.
SMALL_TOL = {"bf16": 8e-3, "fp8": 0.06, "int8": 0.06}
# The quantized paths' bars (cos >=, rel. L2 <=) per input kind (INT8 at the outlier
# inputs: 0.031-0.033 measured); the 16-bit path is held to its small-shape
# tolerance on both.
BIG_TOL = {"outlier": {"bf16": (0.9999, 8e-3), "fp8": (0.9995, 0.03), "int8": (0.9995, 0.035)},
           "gauss": {"bf16": (0.9999, 8e-3), "fp8": (0.998, 0.06), "int8": (0.998, 0.06)}}
# (name, M, K, N): Flux's fused QKV projection of its image tokens, Wan's attention output.
LINEAR = [("flux_qkv", 4608, 3072, 9216), ("wan_o", 32760, 5120, 5120)]
# rel. L2 against BF16 F.linear on outlier activations (e4m3 / int8 rounding of both operands).
LINEAR_TOL = {"fp8_w8a8": 0.05, "int8_w8a8": 0.05, "fp8_weight_only": 0.05}
ROW_TOL = 1e-2  # rel. L2 of the row kernels against their float references (bf16 outputs)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default=None, help="name of this run (default: the Triton version)")
    ap.add_argument("--unpinned", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--sections", default="attention,small,linear,rows",
                    help="which of attention (model shapes), small (odd shapes), linear, rows to run")
    ap.add_argument("--compare", nargs="+", help="print the side-by-side table of these JSON files")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="the whole script on the CPU under the interpreter at tiny sizes (checks the script)")
    return ap.parse_args()


ARGS = parse()
if ARGS.unpinned:
    os.environ["TRITON_DEFAULT_FP_FUSION"] = "0"
if ARGS.cpu_dry_run:
    os.environ["TRITON_INTERPRET"] = "1"
    BIG = {"flux": (1, 2, 200, 128)}
    SMALL = [("odd_d64", 1, 2, 2, 70, 45, 64, "bhld"), ("gqa_d128", 1, 4, 2, 33, 50, 128, "bhld"),
             ("d40_view", 1, 2, 2, 40, 31, 40, "blhd")]
    LINEAR = [("tiny", 37, 96, 80)]
    ROWS = dict(tokens=24, channels=256, heads=2, flux_tokens=24, cat=(64, 256))
else:
    ROWS = dict(tokens=32760, channels=5120, heads=24, flux_tokens=4608, cat=(3072, 12288))
DEVICE = "cpu" if ARGS.cpu_dry_run else "cuda"

import torch  # noqa: E402

sys.path.insert(0, str(HERE))
from _accuracy import metrics, reference  # noqa: E402


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def bench(fn):
    if ARGS.cpu_dry_run:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=max(25, ARGS.rep // 4), rep=ARGS.rep, return_mode="median")


def guarded(fn):
    try:
        return fn()
    except Exception as e:
        return dict(error=f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300])


def run():
    from _load import load_pack
    pack = load_pack()
    K = importlib.import_module(pack.__name__ + ".kernels")
    kc = importlib.import_module(pack.__name__ + ".kernels.core.kernel_common")
    full = importlib.import_module(pack.__name__ + ".kernels.attention.fp8_full")
    if ARGS.unpinned:
        kc.LAUNCH_OPTIONS.clear()  # every launch site spreads this dict: now they pass nothing
    import triton
    result = dict(tag=ARGS.tag or triton.__version__, triton=triton.__version__, triton_file=triton.__file__,
                  torch=torch.__version__, gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", unpinned=ARGS.unpinned,
                  launch_options=dict(kc.LAUNCH_OPTIONS),
                  fp_fusion_env=os.environ.get("TRITON_DEFAULT_FP_FUSION"), rows=[], failures=[])
    rows = result["rows"]

    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)

    def row(section, case, path, **kw):
        rows.append(dict(section=section, case=case, path=path, **kw))
        print(json.dumps(rows[-1]), flush=True)
        # Rewritten after every row: a run cut short by the call's time limit keeps what it measured.
        (out / f"release_{result['tag']}.json").write_text(json.dumps(result, indent=1))

    paths = {"bf16": dict(backend="triton"), "fp8": dict(precision="fp8"), "int8": dict(precision="int8")}

    def served(path, q, k, v):
        K.stats.reset()
        out = K.attention(q, k, v, **paths[path])
        sync()
        return out, ",".join(sorted(n for n, c in K.stats.counts().items() if c))

    sections = set(ARGS.sections.split(","))
    # 1. model shapes
    for name, shape in (BIG if "attention" in sections else {}).items():
        flops = 4 * shape[0] * shape[1] * shape[2] ** 2 * shape[3]
        for kind in ("outlier", "gauss"):
            q, k, v = full.accuracy_inputs(kind, shape, torch.bfloat16, DEVICE, seed=3)
            ref = reference(q[:, :1], k[:, :1], v[:, :1])
            for path in paths:
                def one(path=path):
                    out, kernel = served(path, q, k, v)
                    m = metrics(out[:, :1], ref)
                    cos_min, rel_max = BIG_TOL[kind][path]
                    ok = m["cos"] >= cos_min and m["rel_l2"] <= rel_max
                    ms = bench(lambda: K.attention(q, k, v, **paths[path])) if kind == "outlier" else None
                    return dict(kernel=kernel, ok=bool(ok), ms=ms, tflops=flops / ms / 1e9 if ms else None, **m)
                r = guarded(one)
                row("attention", f"{name}/{kind}", path, **r)
                if not r.get("ok"):
                    result["failures"].append(f"attention {name}/{kind} {path}: {r}")
            if kind == "outlier":
                from torch.nn.attention import SDPBackend, sdpa_kernel

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
                        m = metrics(f()[:, :1], ref)
                        ms = bench(f)
                    return dict(ms=ms, tflops=flops / ms / 1e9, ok=True, **m)
                row("attention", f"{name}/{kind}", "sdpa_cudnn", **guarded(cudnn))
            del q, k, v, ref
            sync()

    # 2. small odd shapes
    for name, B, H, Hk, Lq, Lk, D, layout in (SMALL if "small" in sections else []):
        gen = torch.Generator(device=DEVICE).manual_seed(Lq + Lk + D)

        def make(h, n):
            if layout == "blhd":
                return torch.randn(B, n, h * D, device=DEVICE, generator=gen).to(torch.bfloat16).view(
                    B, n, h, D).transpose(1, 2)
            return torch.randn(B, h, n, D, device=DEVICE, generator=gen).to(torch.bfloat16)
        q, k, v = make(H, Lq), make(Hk, Lk), make(Hk, Lk)
        ref = reference(q, k, v)
        for path in paths:
            def one(path=path):
                out, kernel = served(path, q, k, v)
                m = metrics(out, ref)
                return dict(kernel=kernel, ok=bool(m["rel_l2"] <= SMALL_TOL[path]), **m)
            r = guarded(one)
            if "error" in r and "BackendUnavailable" in r["error"]:
                r["ok"] = True  # refused with its reason (e.g. a head dim the quantized path does not take)
            row("attention_small", name, path, **r)
            if not r.get("ok"):
                result["failures"].append(f"attention_small {name} {path}: {r}")

    # 3. Linear
    for name, M, Kd, N in (LINEAR if "linear" in sections else []):
        gen = torch.Generator(device=DEVICE).manual_seed(M + N)
        x = torch.randn(M, Kd, device=DEVICE, generator=gen)
        x[:, torch.randperm(Kd, device=DEVICE, generator=gen)[:8]] *= 30.0
        x = x.to(torch.bfloat16)
        w = (torch.randn(N, Kd, device=DEVICE, generator=gen) * Kd ** -0.5).to(torch.bfloat16)
        b = torch.randn(N, device=DEVICE, generator=gen).to(torch.bfloat16)
        y_bf16 = torch.nn.functional.linear(x, w, b)
        flops = 2 * M * Kd * N
        ms = bench(lambda: torch.nn.functional.linear(x, w, b))
        row("linear", name, "cublas_bf16", ms=ms, tflops=flops / ms / 1e9, ok=True)
        for method in K.LINEAR_METHODS:
            def one(method=method):
                prepared = K.prepare_weight(w, method)
                y = K.linear(x, prepared, b)
                m = metrics(y, y_bf16)
                ms = bench(lambda: K.linear(x, prepared, b))
                return dict(ok=bool(m["rel_l2"] <= LINEAR_TOL[method]), ms=ms, tflops=flops / ms / 1e9, **m)
            r = guarded(one)
            row("linear", name, method, **r)
            if not r.get("ok"):
                result["failures"].append(f"linear {name} {method}: {r}")
        sync()

    # 4. row kernels
    lnm = importlib.import_module(pack.__name__ + ".kernels.fused.layer_norm_modulate")
    grn = importlib.import_module(pack.__name__ + ".kernels.fused.gated_residual_norm")
    qkn = importlib.import_module(pack.__name__ + ".kernels.fused.qk_norm")
    cat = importlib.import_module(pack.__name__ + ".kernels.linear.cat_fp8_rows")
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    c = ROWS["channels"]
    x = (torch.randn(1, ROWS["tokens"], c, device=DEVICE, generator=gen) * 3).to(torch.bfloat16)
    y = torch.randn_like(x)
    shift, scale, gate = (torch.randn(1, 1, c, device=DEVICE, generator=gen).to(torch.bfloat16) for _ in range(3))
    q, kk = (torch.randn(1, ROWS["heads"], ROWS["flux_tokens"], 128, device=DEVICE, generator=gen).to(torch.bfloat16)
             for _ in range(2))
    wq = torch.rand(128, device=DEVICE, generator=gen).to(torch.bfloat16) + 0.5
    a, bb = (torch.randn(ROWS["flux_tokens"], n, device=DEVICE, generator=gen).to(torch.bfloat16) for n in ROWS["cat"])
    cases = {
        "layer_norm_modulate_wan": (lambda: lnm.layer_norm_modulate(x, shift, scale, 1e-6),
                                    lambda: lnm.layer_norm_modulate_ref(x, shift, scale, 1e-6)),
        "gated_residual_layer_norm_wan": (lambda: grn.gated_residual_layer_norm(x, y, gate, 1e-6)[1],
                                          lambda: grn.gated_residual_norm_ref(x, y, gate, 1e-6)[1]),
        "qk_rms_norm_flux": (lambda: torch.cat(qkn.qk_rms_norm(q, kk, wq, wq, 1e-6)),
                             lambda: torch.cat(qkn.qk_rms_norm_ref(q, kk, wq, wq, 1e-6))),
        # The e4m3 rows dequantised, against the concatenation they encode.
        "cat_fp8_rows_flux": (lambda: (lambda r: r[1][0].float() * r[1][1].view(-1, 1))(cat.cat_fp8_rows(a, bb)),
                              lambda: torch.cat([a, bb], dim=1).float()),
    }
    for name, (fn, ref_fn) in (cases.items() if "rows" in sections else ()):
        def one(fn=fn, ref_fn=ref_fn, name=name):
            m = metrics(fn(), ref_fn())
            tol = 0.05 if name.startswith("cat_fp8") else ROW_TOL  # e4m3 rows: 3 mantissa bits
            return dict(ok=bool(m["rel_l2"] <= tol), ms=bench(fn), **m)
        r = guarded(one)
        row("rows", name, "ours", **r)
        if not r.get("ok"):
            result["failures"].append(f"rows {name}: {r}")
    return result


def table(results):
    """Side-by-side: one line per (section, case, path), ms and rel. L2 of each run, and each
    run's ms against the first's."""
    keys = []
    for res in results:
        for r in res["rows"]:
            key = (r["section"], r["case"], r["path"])
            if key not in keys:
                keys.append(key)
    index = [{(r["section"], r["case"], r["path"]): r for r in res["rows"]} for res in results]
    head = " | ".join([f"{res['tag']} ms | rel L2" for res in results]
                      + [f"{res['tag']} / {results[0]['tag']}" for res in results[1:]])
    lines = [f"| section | case | path | {head} |", "|" + "---|" * (3 + 2 * len(results) + len(results) - 1)]
    for key in keys:
        cells, ms = [], []
        for idx in index:
            r = idx.get(key, {})
            t = r.get("ms")
            ms.append(t)
            err = r.get("error")
            cells += ["err" if err else (f"{t:.3f}" if t else "-"),
                      "-" if err or r.get("rel_l2") is None else f"{r['rel_l2']:.4f}" + ("" if r.get("ok", True) else " FAIL")]
        rat = [f"{m / ms[0]:.3f}" if m and ms[0] else "-" for m in ms[1:]]
        lines.append(f"| {' | '.join(key + tuple(cells) + tuple(rat))} |")
    for res in results:
        lines.append(f"\n{res['tag']}: Triton {res['triton']} ({res['triton_file']}), torch {res['torch']}, "
                     f"{res['gpu']}, launch options {res['launch_options']}, TRITON_DEFAULT_FP_FUSION="
                     f"{res['fp_fusion_env']}; accuracy failures: {len(res['failures'])}")
        lines += [f"  FAIL {f}" for f in res["failures"]]
    return "\n".join(lines)


def main():
    if ARGS.compare:
        print(table([json.loads(Path(p).read_text()) for p in ARGS.compare]))
        return 0
    t0 = time.time()
    result = run()
    result["seconds"] = round(time.time() - t0, 1)
    (Path(ARGS.out) / f"release_{result['tag']}.json").write_text(json.dumps(result, indent=1))
    print(table([result]))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
