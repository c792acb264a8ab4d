"""Host (CPU) time per call of the pack's hot paths on a GPU, where a step can be host-bound.

Each path runs on tensors so small that the GPU finishes a call long before the host issues
the next, so wall time / calls is the host's cost of one call (Python + Triton's launch).
Flux 12B makes ~940 Linear calls and ~170 attention calls a step: at 50 us each the host
needs ~50 ms, a third of the H200's 130 ms of kernels.

    python benchmarks/host_overhead.py [--calls 400] [--profile 300] [--out DIR]
    python benchmarks/host_overhead.py --python-only     # any machine, no GPU

--python-only times the patched Linear layer's own Python on the CPU, the kernel replaced by a
stub returning a precomputed output: what the node path adds above kernels.linear on every
served call (its checks, the prepared-weight lookup, the call counters), the part of the GPU
figure this machine can measure.

Prints a table of microseconds per call, then cProfile's top functions for the patched
Linear layer's call (the node path ComfyUI runs) and for the FP8 attention call; writes
host_overhead.json under --out (default $OUT or .). First it checks that kernels.linear.dispatch's
DirectCall (repeating an earlier call's launches) gives the checked path's output bit for bit
on Flux shapes, with bias, GELU epilogue, fp16/fp32 outputs and an unaligned bias; exit
code 1 when one does not.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import load_pack  # noqa: E402

pack = load_pack()
kernels = importlib.import_module(pack.__name__ + ".kernels")
lf = importlib.import_module(pack.__name__ + ".kernels.linear.fp8")
linear_common = importlib.import_module(pack.__name__ + ".runtime.linear_common")
linear_layer = importlib.import_module(pack.__name__ + ".runtime.linear_layer")
linear_state = importlib.import_module(pack.__name__ + ".runtime.linear_state")
settings_mod = importlib.import_module(pack.__name__ + ".runtime.settings")
pa = importlib.import_module(pack.__name__ + ".runtime.attention_patch")
linear_choice = importlib.import_module(pack.__name__ + ".runtime.linear_choice")
call_stats_mod = importlib.import_module(pack.__name__ + ".runtime.call_stats")


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def profile_text(fn, calls, top=25):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


# DirectCall agreement cases: (name, leading dims of x, K, N, bias, activation_from or None,
# out dtype, input dtype). The third call of each signature is served by the DirectCall.
DIRECT_CASES = [
    ("tiny, no bias", (1024,), 128, 128, "none", None, torch.bfloat16, torch.bfloat16),
    ("flux qkv", (1, 4096), 3072, 9216, "plain", None, torch.bfloat16, torch.bfloat16),
    ("flux mlp up + gelu", (1, 4096), 3072, 12288, "plain", 0, torch.bfloat16, torch.bfloat16),
    ("fused tail gelu, fp16", (2, 1000), 256, 512, "plain", 384, torch.float16, torch.float16),
    ("fp32 out", (1500,), 512, 256, "plain", None, torch.float32, torch.bfloat16),
    ("bias not 16-byte aligned", (1100,), 256, 256, "misaligned", None, torch.bfloat16, torch.bfloat16),
    # activation_out (Flux's single blocks): the TMA kernel's tile-aligned copy, and the pointer
    # kernel's (a first column off the tile grid).
    ("flux single linear1 + copy", (1, 4608), 3072, 21504, "plain", 9216, torch.bfloat16, torch.bfloat16, True),
    ("copy from a mid-tile column", (1000,), 512, 640, "plain", 320, torch.bfloat16, torch.bfloat16, True),
]


def direct_call_agreement(gen) -> list[dict]:
    """Every DirectCall output equals the checked path's bit for bit (both run the same compiled
    kernels) and the DirectCall really served (kernels.core.stats' linear_direct_call)."""
    L = importlib.import_module(pack.__name__ + ".kernels.linear.dispatch")
    results = []
    for name, lead, k, n, bias_kind, act_from, out_dtype, in_dtype, *copy in DIRECT_CASES:
        x = torch.randn(*lead, k, device="cuda", generator=gen).to(in_dtype)
        x[..., :3] *= 30.0  # outlier channels
        w = torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5
        bias = None
        if bias_kind != "none":
            raw = torch.randn(n + 1, device="cuda", generator=gen).to(in_dtype)
            bias = raw[1:] if bias_kind == "misaligned" else raw[:n].clone()
        prepared = kernels.prepare_weight(w.to(in_dtype), "fp8_w8a8")
        kw = dict(activation="gelu_tanh", activation_from=act_from) if act_from is not None else {}
        kernels.core.stats.reset()
        outs, copies = [], []
        for _ in range(4):
            if copy:
                copies.append(torch.empty((*lead, n - act_from), dtype=out_dtype, device="cuda"))
                kw["activation_out"] = copies[-1]
            outs.append(kernels.linear(x, prepared, bias, out_dtype=out_dtype, **kw))
        served = kernels.core.stats.counts().get(L.DIRECT_COUNTER, 0)
        act = lf.ACTIVATIONS["gelu_tanh"] if act_from is not None else 0
        checked = lf.run_linear(x.reshape(-1, k), prepared.weight, prepared.scale, bias, 0, out_dtype, act=act,
                                act_from=act_from or 0).view(*lead, n)
        torch.cuda.synchronize()
        same = all(torch.equal(o, checked) for o in outs)
        same = same and all(torch.equal(c, o[..., act_from:]) for c, o in zip(copies, outs))
        ref = x.float() @ w.to(in_dtype).float().T + (bias.float() if bias is not None else 0)
        if act_from is not None:
            ref[..., act_from:] = F.gelu(ref[..., act_from:], approximate="tanh")
        rel = ((outs[-1].float() - ref).norm() / ref.norm()).item()
        results.append(dict(case=name, direct_served=served, bit_equal=same, rel_l2_vs_fp32=rel,
                            ok=bool(same and served == 2 and rel <= 0.035)))
        print(results[-1], flush=True)
    return results


def python_only(rounds: int, calls: int) -> None:
    """The node path's Python per served call, on the CPU with a stub kernel (see the docstring)."""
    # The CPU is "a device our kernels serve" only under Triton's interpreter (no kernel runs here).
    os.environ["TRITON_INTERPRET"] = "1"
    module = torch.nn.Linear(128, 128)
    x = torch.randn(1, 1024, 128)
    with torch.no_grad():
        reference = module(x)

    class Prepared:
        method = "fp8_w8a8"

        def nbytes(self):
            return 0

    def stub_run(x, prepared, bias, out_dtype, **kwargs):
        return reference

    backend = linear_common.LinearBackend(lambda weight, method, scale: Prepared(), stub_run, lambda method, device, dtype: None,
                               ValueError)
    state = linear_state.LinearPatchState(settings_mod.AccelSettings("off", linear_mode="fp8"), linear_common.SkipPatterns.parse(""),
                                min_tokens=1024, backend=backend, label="host-overhead")
    layer = linear_layer.LinearLayer(state, "blocks.0.mlp.0", module, module.forward)
    state.layers.append(layer)
    prepared = Prepared()
    paths = {"stub kernel alone": lambda: stub_run(x, prepared, module.bias, x.dtype),
             "LinearLayer (node path), stub kernel": lambda: layer(x),
             # what a torch.compile'd graph calls per layer: the same path behind one custom op
             "patched_linear op (compiled graph's call), stub": lambda: torch.ops.triton_accel.patched_linear(x, layer.token)}
    with torch.no_grad():
        layer(x)  # prepare + guard (the stub returns ComfyUI's own output: the guard passes)
        served = call_stats_mod.snapshot()["kinds"].get("linear", {}).get("served", 0)
        if served != 1:
            sys.exit(f"the stubbed layer did not serve its first call: {call_stats_mod.snapshot()}")
        results = {name: [] for name in paths}
        for _ in range(rounds):
            for name, fn in paths.items():
                for _ in range(100):
                    fn()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                results[name].append((time.perf_counter() - t0) / calls * 1e6)
    print(f"Python per call on the CPU (us; fastest / median of {rounds} rounds of {calls} calls), "
          f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    for name, us in results.items():
        print(f"{name:45s} {min(us):8.2f} {statistics.median(us):8.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", type=int, default=300)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--python-only", action="store_true", help="the node path's Python on the CPU (stub kernel)")
    args = ap.parse_args()
    if args.python_only:
        return python_only(args.rounds, max(args.calls, 5000))
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    # 1024 tokens (the patch's minimum) x 128 -> 128: microseconds of GPU work per call.
    x = torch.randn(1, 1024, 128, device=dev, generator=gen).to(torch.bfloat16)
    w = (torch.randn(128, 128, device=dev, generator=gen) * 0.1).to(torch.bfloat16)
    b = torch.randn(128, device=dev, generator=gen).to(torch.bfloat16)
    prepared = kernels.prepare_weight(w, "fp8_w8a8")
    fw = lf.Fp8LinearWeight(prepared.weight, prepared.scale)
    xq, xs = lf.quantize_activation(x.view(-1, 128))

    module = torch.nn.Linear(128, 128, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)
        module.bias.copy_(b)
    state = linear_state.LinearPatchState(settings_mod.AccelSettings("off", linear_mode="fp8"), linear_common.SkipPatterns.parse(""),
                                min_tokens=1024, label="host-overhead")
    layer = linear_layer.LinearLayer(state, "blocks.0.mlp.0", module, module.forward)
    fused = linear_layer.LinearLayer(state, "blocks.0.mlp.1", module, module.forward)
    fused.activation = ("gelu_tanh", 0)
    skipped = linear_layer.LinearLayer(state, "blocks.0.mlp.0", module, module.forward)
    skipped.skip_reason = "name matches skip pattern (host_overhead)"
    small = x[:, :512]  # under min_tokens: ComfyUI's Linear serves it
    state.layers += [layer, fused, skipped]
    # A layer auto handed back for good (linear_choice.hand_back): its module's own forward in
    # our patch's place, as after auto measured ComfyUI's Linear faster.
    handed = torch.nn.Linear(128, 128, device=dev, dtype=torch.bfloat16)
    auto_state = linear_state.LinearPatchState(settings_mod.AccelSettings("auto"), linear_common.SkipPatterns.parse(""),
                                     label="host-overhead auto")
    handed_layer = linear_layer.LinearLayer(auto_state, "blocks.0.proj", handed, handed.forward)
    auto_state.layers.append(handed_layer)
    handed.forward = handed_layer
    linear_choice.hand_back(handed_layer)
    with torch.no_grad():
        layer(x), fused(x)  # prepare + guard

    q = torch.randn(1, 24, 256, 128, device=dev, generator=gen).to(torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)

    override = pa.AttentionOverride(settings_mod.AccelSettings("auto"), label="host-overhead")

    def comfy_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                        skip_output_reshape=False, **kwargs):
        return F.scaled_dot_product_attention(q, k, v)

    override(comfy_attention, q, k, v, 24, skip_reshape=True, skip_output_reshape=True)  # auto's timing
    # The same weight with its DirectCall memo pinned to "checked path always": the before/after.
    checked = kernels.prepare_weight(w, "fp8_w8a8")
    kernels.linear(x, checked, b)
    checked._direct.update({key: False for key in checked._direct})
    with torch.no_grad():
        agreement = direct_call_agreement(gen)
        # The node path (the module's Parameter bias, the fused GELU) takes the DirectCall too.
        L = importlib.import_module(pack.__name__ + ".kernels.linear.dispatch")
        kernels.core.stats.reset()
        for _ in range(3):
            layer(x), fused(x)
        node_direct = kernels.core.stats.counts().get(L.DIRECT_COUNTER, 0)
        agreement.append(dict(case="LinearLayer node path (plain, fused GELU), calls 2-4", direct_served=node_direct,
                              ok=node_direct >= 4))
        print(agreement[-1], flush=True)
    paths = {
        "F.linear (cuBLAS)": lambda: F.linear(x, w, b),
        "F.linear + F.gelu": lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
        "quantize_activation (1 Triton launch)": lambda: lf.quantize_activation(x.view(-1, 128)),
        "fp8_gemm (1 Triton launch, TMA)": lambda: lf.fp8_gemm(xq, xs, fw, b, torch.bfloat16),
        "kernels.linear fp8_w8a8": lambda: kernels.linear(x, prepared, b),
        "kernels.linear fp8_w8a8, checked path": lambda: kernels.linear(x, checked, b),
        "kernels.linear fp8_w8a8 + gelu epilogue": lambda: kernels.linear(x, prepared, b, activation="gelu_tanh"),
        "LinearLayer (node path)": lambda: layer(x),
        "LinearLayer with fused GELU": lambda: fused(x),
        # what a torch.compile'd graph calls per layer (the eager path behind one custom op)
        "patched_linear op (compiled graph's call)": lambda: torch.ops.triton_accel.patched_linear(x, layer.token),
        "nn.Linear forward": lambda: module(x),
        "Linear auto handed back (its own forward)": lambda: handed(x),
        "nn.Linear forward, 512 tokens": lambda: module(small),
        "LinearLayer, 512 tokens (handed back)": lambda: layer(small),
        "LinearLayer, skipped by name (handed back)": lambda: skipped(x),
        "SDPA (cuDNN/flash) 24x256x128": lambda: F.scaled_dot_product_attention(q, k, v),
        "kernels.attention fp16 path": lambda: kernels.attention(q, k, v),
        "kernels.attention fp8": lambda: kernels.attention(q, k, v, precision="fp8"),
        "attention override, auto (ComfyUI's call)": lambda: override(comfy_attention, q, k, v, 24, skip_reshape=True,
                                                                      skip_output_reshape=True),
        "ComfyUI's attention function (SDPA)": lambda: comfy_attention(q, k, v, 24, skip_reshape=True,
                                                                    skip_output_reshape=True),
    }
    # The host's speed drifts within a process (the same call measured 1.5x slower minutes
    # later), so every path is timed in each of --rounds rounds, the order rotated per round,
    # and its row gives the fastest round (and the median): paths compare within one round's drift.
    samples: dict[str, list] = {name: [] for name in paths}
    errors: dict[str, str] = {}
    names = list(paths)
    with torch.no_grad():
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                if name in errors:
                    continue
                try:
                    samples[name].append(per_call_us(paths[name], args.calls))
                except Exception as e:
                    errors[name] = f"{type(e).__name__}: {e}"[:300]
    rows = []
    for name in names:
        if name in errors:
            rows.append(dict(path=name, error=errors[name]))
        else:
            rows.append(dict(path=name, us=min(samples[name]), median_us=statistics.median(samples[name]),
                             rounds=[round(v, 1) for v in samples[name]]))
        print(rows[-1], flush=True)
    with torch.no_grad():
        profiles = {}
        for name in ("LinearLayer with fused GELU", "kernels.attention fp8", "attention override, auto (ComfyUI's call)"):
            try:
                profiles[name] = profile_text(paths[name], args.profile)
            except Exception as e:
                profiles[name] = f"{type(e).__name__}: {e}"
    import triton

    call_stats = importlib.import_module(pack.__name__ + ".runtime.call_stats")
    report = dict(call_stats=call_stats.snapshot(), env=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           cpu=os.cpu_count()), rows=rows, profiles=profiles, direct_call_agreement=agreement)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "host_overhead.json").write_text(json.dumps(report, indent=1))
    for name, text in profiles.items():
        print(f"\n==== cProfile, {args.profile} calls: {name}\n{text}")
    print(f"\ncall stats (auto's choice for the override): {json.dumps(report['call_stats'])[:1500]}")
    print(f"\nhost time per call (us; tiny tensors, so the GPU waits on the host): fastest / median of "
          f"{args.rounds} rounds")
    for r in rows:
        print(f"{r['path']:45s} {r['us']:8.1f} {r['median_us']:8.1f}" if "us" in r else f"{r['path']:45s} {r['error']}")
    us = {r["path"]: r["us"] for r in rows if "us" in r}
    over = [("served Linear (node path) over nn.Linear", "LinearLayer (node path)", "nn.Linear forward"),
            ("Linear handed back by auto over nn.Linear", "Linear auto handed back (its own forward)",
             "nn.Linear forward"),
            ("attention override (auto's answer) over ComfyUI's function", "attention override, auto (ComfyUI's call)",
             "ComfyUI's attention function (SDPA)")]
    print("\nhost time over ComfyUI's own call (us, fastest rounds):")
    for label, ours, theirs in over:
        if ours in us and theirs in us:
            print(f"{label:60s} {us[ours] - us[theirs]:8.1f}")
    good = sum(r["ok"] for r in agreement)
    print(f"\nDirectCall agreement (bit-equal to the checked path and copies to their columns, served from "
          f"the 3rd call): "
          f"{good}/{len(agreement)} ok")
    if good != len(agreement):
        sys.exit(1)


if __name__ == "__main__":
    main()
