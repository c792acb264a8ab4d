"""The Gluon warp-specialised attention kernels on an sm_90 GPU: FP8
(kernels/attention/gluon_hopper.py) and BF16/FP16 (kernels/attention/gluon_hopper_bf16.py).

    python benchmarks/gluon_attention_bench.py [--out DIR] [--shapes flux,wan,hunyuan,sd3]
                                                [--configs sm90_lean,sm90_lean@n0] [--rep MS]
                                                [--bf16-shapes flux,wan,hunyuan,hd256,gqa] [--lite]

1. the installed Triton's Gluon facts (version, what gluon_refusal says, warp_specialize's
   parameters, the TMA copy's name);
2. accuracy vs float32 at small odd shapes and on a slice of heads at each model shape, on
   attention_fp8_full.accuracy_inputs' "gauss" and "outlier" inputs, for every Gluon config
   and for attention_fp8_full (output poisoned with NaN first: unwritten rows show);
3. do_bench medians: Gluon FP8 with quantisation, Gluon kernel alone, attention_fp8_full with
   quantisation, our BF16 flash kernel (kernels.attention backend="triton"), SDPA cuDNN and
   SDPA flash (BF16).
4. the BF16 Gluon kernel (--bf16-shapes): accuracy vs float32 (bf16 and fp16, odd lengths,
   GQA, head dims 40/64/128/256, a [B, L, H, D]-permuted layout) beside SDPA cuDNN's, then
   do_bench (eager and CUDA-graph) against SDPA cuDNN / flash and our plain-Triton kernel at
   Flux, Wan, HunyuanVideo, head dim 256 (1,12,4096,256) and GQA 32/8 (1,32,4608,128).
--lite times every FP8 config with and without its
quantisation (eager and graph-replayed) but leaves host time, the profiler breakdown,
attention_fp8_full and our plain BF16 row to the first config (a sweep of candidate configs in one
short device call). A --configs name may end in "@n<N>": that config with N outlier channels
instead of N_OUTLIER ("sm90_lean@n0": no side operands).
Prints a table last and writes gluon_attention.json under --out (default: $OUT or .).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _accuracy import metrics, reference  # noqa: E402
from _load import load_pack  # noqa: E402

pack = load_pack()
full = importlib.import_module(pack.__name__ + ".kernels.attention.fp8_full")
glu = importlib.import_module(pack.__name__ + ".kernels.attention.gluon_hopper")
glb = importlib.import_module(pack.__name__ + ".kernels.attention.gluon_hopper_bf16")
attn = importlib.import_module(pack.__name__ + ".kernels.attention.dispatch")

SHAPES = {"flux": (1, 24, 4608, 128), "wan": (1, 40, 32760, 128), "hunyuan": (1, 24, 33390, 128),
          "sd3": (2, 24, 4429, 64)}
# (3, 24, 1100, 64): 648 CTA tiles of 9 key tiles, several per SM for a persistent config (odd ring
# offsets from its second tile on).
SMALL = [(1, 2, 1000, 128), (2, 3, 77, 64), (1, 2, 200, 128), (1, 2, 300, 40), (1, 1, 4097, 128), (1, 2, 50, 128),
         (3, 24, 1100, 64)]
# name -> (B, H, L, D, H_kv) for the BF16 rows.
BF16_SHAPES = {"flux": (1, 24, 4608, 128, 24), "wan": (1, 40, 32760, 128, 40), "hunyuan": (1, 24, 33390, 128, 24),
               "hd256": (1, 12, 4096, 256, 12), "gqa": (1, 32, 4608, 128, 8), "sd3": (2, 24, 4429, 64, 24)}
# (B, H, Lq, Lk, D, H_kv, layout): odd lengths, GQA, padded head dims, permuted storage.
BF16_SMALL = [(1, 2, 1000, 1000, 128, 2, "bhld"), (2, 3, 77, 77, 64, 3, "bhld"), (1, 2, 300, 200, 40, 2, "bhld"),
              (1, 2, 333, 4097, 256, 2, "bhld"), (1, 8, 500, 700, 128, 2, "bhld"), (2, 4, 129, 65, 128, 4, "blhd"),
              (1, 1, 1, 1, 128, 1, "bhld"), (1, 4, 1024, 77, 80, 4, "blhd")]
TARGET = dict(outlier=(0.9995, 0.03), gauss=(0.998, 0.06))  # (cosine >=, rel L2 <=)


def gluon_facts():
    import triton
    facts = dict(triton=triton.__version__, torch=torch.__version__, refusal=glu.gluon_refusal("cuda"),
                 gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()))
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import tma
        facts["warp_specialize"] = list(inspect.signature(gl.warp_specialize).parameters)
        facts["tma"] = [n for n in ("async_load", "async_copy_global_to_shared") if hasattr(tma, n)]
    except Exception as e:
        facts["gluon_error"] = f"{type(e).__name__}: {e}"[:300]
    return facts


def fp8_config(name):
    """(config, n_outlier) of a --configs entry: a GLUON_CONFIGS name, "@n<N>" appended for
    N outlier channels instead of N_OUTLIER ("sm90_lean@n0": no side operands, which shows
    what the outlier channels' extra k-step and their quantisation cost)."""
    base, sep, n = name.partition("@n")
    return glu.GLUON_CONFIGS[base], (int(n) if sep else glu.N_OUTLIER)


def runners(configs, lite=False):
    """name -> fn(q, k, v): every FP8 path whose accuracy is checked."""
    out = {f"gluon_{c}": (lambda cfg, n: lambda q, k, v: glu.attention_gluon_fp8(q, k, v, config=cfg, n_outlier=n))(
        *fp8_config(c)) for c in configs}
    if not lite:
        out["fp8_full"] = lambda q, k, v: full.attention_fp8_full(q, k, v)
    return out


def accuracy(shape, fns, heads=None):
    """Metrics on the first `heads` heads; "same_as_first": every head's output bit-equal to
    the first path's (a persistent config must compute exactly what its plain twin does)."""
    rows = {}
    for kind in ("gauss", "outlier"):
        q, k, v = full.accuracy_inputs(kind, shape, torch.bfloat16, "cuda", seed=3)
        ref = reference(q[:, :heads], k[:, :heads], v[:, :heads])
        first = None
        for name, fn in fns.items():
            try:
                o = fn(q, k, v)
                rows[f"{name}/{kind}"] = metrics(o[:, :heads], ref)
                if first is None:
                    first = o
                else:
                    rows[f"{name}/{kind}"]["same_as_first"] = bool(torch.equal(o, first))
            except Exception as e:
                rows[f"{name}/{kind}"] = dict(error=f"{type(e).__name__}: {e}"[:300])
    return rows


def bench(fn, rep):
    from triton.testing import do_bench
    return do_bench(fn, warmup=max(25, rep // 4), rep=rep, return_mode="median")


def speed(shape, configs, rep, lite=False):
    """lite: graph replay, host time and the profiler breakdown for the first config only."""
    from torch.nn.attention import SDPBackend
    q, k, v = full.accuracy_inputs("gauss", shape, torch.bfloat16, "cuda", seed=1)
    scale = shape[3] ** -0.5
    ms, breakdown = {}, {}
    for i, c in enumerate(configs):
        cfg, n_out = fp8_config(c)
        try:
            ms[f"gluon_{c}"] = bench(lambda: glu.attention_gluon_fp8(q, k, v, config=cfg, n_outlier=n_out), rep)
            qkv = glu.quantize_for_config(q, k, v, scale * 1.0, cfg, n_out)
            ms[f"gluon_{c}_kernel"] = bench(
                lambda: glu.attention_gluon_fp8_quantized(qkv, q.shape, shape[2], q.dtype, q.device, cfg), rep)
            # CUDA-graph replay: the same work without the host's launch cost (3 quantisation
            # launches, 5 tensor descriptors and the Gluon launch per call), as a step graph
            # replays it in ComfyUI.
            ms[f"gluon_{c}_graph"] = graph_ms(lambda: glu.attention_gluon_fp8(q, k, v, config=cfg, n_outlier=n_out))
            if lite and i > 0:
                continue
            ms[f"gluon_{c}_host_us"] = host_us(lambda: glu.attention_gluon_fp8(q, k, v, config=cfg, n_outlier=n_out))
            try:
                breakdown[c] = kernel_breakdown(lambda: glu.attention_gluon_fp8(q, k, v, config=cfg,
                                                                                n_outlier=n_out))
            except Exception as e:
                breakdown[c] = dict(error=f"{type(e).__name__}: {e}"[:300])
        except Exception as e:
            ms[f"gluon_{c}_error"] = f"{type(e).__name__}: {e}"[:300]
    calls = {} if lite else dict(fp8_full=lambda: full.attention_fp8_full(q, k, v),
                                 ours_bf16=lambda: attn.attention(q, k, v, backend="triton"))
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        calls[name] = (lambda b: lambda: _sdpa(q, k, v, b))(backend)
    for name, fn in calls.items():
        try:
            ms[name] = bench(fn, rep)
        except Exception as e:
            ms[name + "_error"] = f"{type(e).__name__}: {e}"[:300]
    flops = 4 * shape[0] * shape[1] * shape[2] * shape[2] * shape[3]
    return dict(ms=ms, breakdown=breakdown, tflops={n: flops / t / 1e9 for n, t in ms.items()
                                                    if isinstance(t, float) and not n.endswith("_us")})


def host_us(fn, calls=20):
    """CPU time per call with the GPU queue not full (launch cost: argument checks, tensor
    descriptors, allocations, launches): the eager floor of a short call."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def kernel_breakdown(fn, calls=20):
    """Device microseconds per call of each kernel fn launches (torch.profiler), and the span
    from the first kernel's start to the last one's end per call: what the quantiser's launches
    cost beside the attention kernel, gaps included."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    per_kernel = {}
    for e in kernels:
        per_kernel[e.name[:60]] = per_kernel.get(e.name[:60], 0.0) + e.device_time / calls
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / calls
    return dict(per_kernel_us=per_kernel, span_us_per_call=span)


def graph_ms(fn):
    from triton.testing import do_bench_cudagraph
    with torch.cuda.stream(torch.cuda.Stream()):
        return do_bench_cudagraph(fn, rep=100, return_mode="median")


def _sdpa(q, k, v, backend):
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel(backend):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def bf16_inputs(B, H, Lq, Lk, D, Hk, layout, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def make(heads, length):
        if layout == "blhd":  # how ComfyUI hands heads over: a permuted [B, L, H, D] tensor
            return torch.randn(B, length, heads, D, generator=gen, device="cuda").to(dtype).transpose(1, 2)
        return torch.randn(B, heads, length, D, generator=gen, device="cuda").to(dtype)

    return make(H, Lq), make(Hk, Lk), make(Hk, Lk)


def bf16_reference(q, k, v):
    g = q.shape[1] // k.shape[1]
    return reference(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))


def _sdpa_gqa(q, k, v, backend):
    """SDPA on GQA inputs: enable_gqa where the backend takes it, else K/V expanded first."""
    if k.shape[1] == q.shape[1]:
        return _sdpa(q, k, v, backend)
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel(backend):
        try:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        except RuntimeError:
            g = q.shape[1] // k.shape[1]
            return torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))


def bf16_accuracy():
    from torch.nn.attention import SDPBackend
    rows = {}
    for case in BF16_SMALL:
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v = bf16_inputs(*case, dtype=dtype, seed=5)
            ref = bf16_reference(q, k, v)
            name = f"{case}/{str(dtype)[6:]}"
            try:
                o = glb.attention_gluon_bf16(q, k, v)
                rows[name] = dict(gluon=metrics(o, ref), layout_kept=o.stride() == q.stride(), cudnn=None)
            except Exception as e:
                rows[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
                continue
            try:  # cuDNN's own error beside ours, where it serves the call (not Lk = 1, not d40/d256)
                rows[name]["cudnn"] = metrics(_sdpa_gqa(q, k, v, SDPBackend.CUDNN_ATTENTION), ref)
            except RuntimeError:
                pass
    return rows


def bf16_speed(name, rep):
    from torch.nn.attention import SDPBackend
    B, H, L, D, Hk = BF16_SHAPES[name]
    q, k, v = bf16_inputs(B, H, L, L, D, Hk, "bhld", torch.bfloat16, seed=1)
    ref = bf16_reference(q[:, :2], k[:, :max(1, 2 * Hk // H)], v[:, :max(1, 2 * Hk // H)])
    acc = {}
    calls = {"gluon_bf16": lambda: glb.attention_gluon_bf16(q, k, v),
             "ours_bf16": lambda: attn.attention(q, k, v, backend="triton"),
             "cudnn": lambda: _sdpa_gqa(q, k, v, SDPBackend.CUDNN_ATTENTION),
             "flash": lambda: _sdpa_gqa(q, k, v, SDPBackend.FLASH_ATTENTION)}
    ms = {}
    for n, fn in calls.items():
        try:
            acc[n] = metrics(fn()[:, :2], ref)
            ms[n] = bench(fn, rep)
            if n in ("gluon_bf16", "cudnn"):
                ms[n + "_graph"] = graph_ms(fn)
                ms[n + "_host_us"] = host_us(fn)
        except Exception as e:
            ms[n + "_error"] = f"{type(e).__name__}: {e}"[:300]
    flops = 4 * B * H * L * L * D
    return dict(ms=ms, accuracy=acc, tflops={n: flops / t / 1e9 for n, t in ms.items()
                                                  if isinstance(t, float) and not n.endswith("_us")})


def print_table(result):
    print("\n== accuracy (cos / rel L2 vs float32; targets outlier >= 0.9995 / <= 0.03, gauss >= 0.998 / <= 0.06)")
    for shape, rows in result["accuracy"].items():
        for name, m in rows.items():
            text = m.get("error") or f"{m['cos']:.5f} / {m['rel_l2']:.4f}"
            if "same_as_first" in m:
                text += "   bit-equal to the first" if m["same_as_first"] else "   DIFFERS from the first"
            print(f"{shape:>22} {name:<34} {text}")
    for case, row in result.get("bf16_accuracy", {}).items():
        text = row.get("error") or "gluon {cos:.6f} / {rel_l2:.4f}".format(**row["gluon"]) + (
            "   cudnn {cos:.6f} / {rel_l2:.4f}".format(**row["cudnn"]) if row.get("cudnn") else "") + "".join(
            f"   {n} " + (m.get("error") or "{cos:.6f} / {rel_l2:.4f}".format(**m))[:80]
            for n, m in row.items() if n.startswith("sm90_"))
        print(f"bf16 {case:<44} {text}")
    print("\n== TFLOP/s (median do_bench; ratio to SDPA cuDNN)")
    for shape, sp in list(result["speed"].items()) + [("bf16 " + n, sp) for n, sp in result["bf16_speed"].items()]:
        cudnn = sp["tflops"].get("cudnn")
        for name, tf in sp["tflops"].items():
            ratio = f"{tf / cudnn:.2f}x" if cudnn else "-"
            print(f"{shape:>22} {name:<28} {tf:7.1f}  {ratio}")
        for name, err in sp["ms"].items():
            if name.endswith("_error"):
                print(f"{shape:>22} {name:<28} {err[:150]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default="flux,wan,hunyuan,sd3")
    ap.add_argument("--configs", default=",".join(glu.GLUON_CONFIGS))
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--acc-heads", type=int, default=2)
    ap.add_argument("--bf16-shapes", default="flux,wan,hunyuan,hd256,gqa")
    ap.add_argument("--small", type=int, default=1, help="0: skip the FP8 small-shape accuracy cases")
    ap.add_argument("--lite", action="store_true", help="graph/host/profile for the first FP8 config only")
    args = ap.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    t0 = time.time()
    result = dict(facts=gluon_facts(), accuracy={}, speed={}, bf16_accuracy={}, bf16_speed={})
    print(json.dumps(result["facts"]), flush=True)
    fns = runners(configs, args.lite)
    for shape in SMALL if args.small else []:
        result["accuracy"][str(shape)] = accuracy(shape, fns)
        print(shape, json.dumps(result["accuracy"][str(shape)]), flush=True)
    for name in [s for s in args.shapes.split(",") if s]:
        shape = SHAPES[name]
        result["accuracy"][name] = accuracy(shape, fns, heads=args.acc_heads)
        result["speed"][name] = speed(shape, configs, args.rep, args.lite)
        print(name, f"{time.time() - t0:.0f}s", json.dumps(result["speed"][name]["tflops"]), flush=True)
        save(result, args.out)  # after every shape: a run cut short still leaves its figures
        torch.cuda.empty_cache()
    bf16_names = [s for s in args.bf16_shapes.split(",") if s]
    if bf16_names:
        result["bf16_accuracy"] = bf16_accuracy()
        print("bf16 accuracy", json.dumps(result["bf16_accuracy"]), flush=True)
    for name in bf16_names:
        result["bf16_speed"][name] = bf16_speed(name, args.rep)
        print("bf16", name, f"{time.time() - t0:.0f}s", json.dumps(result["bf16_speed"][name]), flush=True)
        save(result, args.out)
        torch.cuda.empty_cache()
    save(result, args.out)
    print_table(result)


def save(result, out):
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "gluon_attention.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
