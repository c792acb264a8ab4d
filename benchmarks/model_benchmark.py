"""TritonAccelBenchmark from the command line: the attention and Linear shapes of a model
family (or shapes a node run recorded), PyTorch against our kernels, PNG + JSON, table last.

    PYTHONUNBUFFERED=1 python benchmarks/model_benchmark.py --model flux --model wan [--out DIR]
    python benchmarks/model_benchmark.py --shapes-json user/triton_accel/benchmark_last.json
    TRITON_INTERPRET=1 python benchmarks/model_benchmark.py --model sd15 --device cpu --tiny --mode fp16

Needs torch and Triton (and matplotlib for a bar chart, else Pillow draws a table; with
neither only the JSON and the text are written); no ComfyUI. The baseline is PyTorch SDPA at
its default backend (what ComfyUI's attention_pytorch runs on NVIDIA GPUs) and torch's Linear.
Timing, accuracy and the chart are the node's own code (runtime/benchmark_core.py,
runtime/benchmark_chart.py). Output goes to --out, else $OUT, else benchmarks/results/.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import load_pack  # noqa: E402

import torch  # noqa: E402

pack = load_pack()
core = importlib.import_module(pack.__name__ + ".runtime.benchmark_core")
chart = importlib.import_module(pack.__name__ + ".runtime.benchmark_chart")
bench_node = importlib.import_module(pack.__name__ + ".nodes.benchmark_node")
settings_mod = importlib.import_module(pack.__name__ + ".runtime.settings")

A, L = core.AttentionShape, core.LinearShape


def _attn(b, h, lq, lk, d, dtype, count):
    return A(b, h, h, lq, lk, d, d, dtype), count


def _block_linears(rows, width, ctx_rows, ctx_dim, dtype, blocks):
    """One SD-style transformer block: self q/k/v/out + cross q/out (rows x C -> C), cross k/v
    from the text (ctx_rows x ctx_dim -> C), GEGLU FF (C -> 8C, 4C -> C)."""
    return [(L(rows, width, width, dtype), 6 * blocks), (L(ctx_rows, ctx_dim, width, dtype, bias=False), 2 * blocks),
            (L(rows, width, 8 * width, dtype), blocks), (L(rows, 4 * width, width, dtype), blocks)]


def family_shapes(name: str, dtype: str) -> tuple[list, list, str]:
    """(attention [(shape, count)], Linear [(shape, count)], description) per forward."""
    if name == "flux":
        # Flux.1 12B at 1024x1024: 4096 image + 512 text tokens, 24 heads of 128, 19 double + 38
        # single blocks; each block's Linear layers counted once at the joint 4608 rows.
        attn = [_attn(1, 24, 4608, 4608, 128, dtype, 57)]
        lin = [(L(4608, 3072, 9216, dtype), 57), (L(4608, 3072, 12288, dtype), 57),
               (L(4608, 12288, 3072, dtype), 57), (L(4608, 3072, 3072, dtype), 57)]
        return attn, lin, "Flux.1 12B, 1024x1024 (57 blocks; double-block streams counted as joint rows)"
    if name == "wan":
        # Wan 2.1 14B at 832x480x81: 32760 tokens, 40 heads of 128, 40 blocks; cross-attention
        # to 512 text tokens; self q/k/v/o + cross q/o are 5120 -> 5120, FFN 5120 -> 13824 -> 5120.
        attn = [_attn(1, 40, 32760, 32760, 128, dtype, 40), _attn(1, 40, 32760, 512, 128, dtype, 40)]
        lin = [(L(32760, 5120, 5120, dtype), 240), (L(32760, 5120, 13824, dtype), 40),
               (L(32760, 13824, 5120, dtype), 40), (L(512, 5120, 5120, dtype), 80)]
        return attn, lin, "Wan 2.1 14B, 832x480x81 frames (40 blocks)"
    if name == "sd15":
        # SD1.5 at 512x512, batch 2 (cond + uncond): 16 transformer blocks, 8 heads; 77 text tokens.
        levels = [(4096, 320, 5), (1024, 640, 5), (256, 1280, 5), (64, 1280, 1)]
        attn, lin = [], []
        for tokens, width, blocks in levels:
            attn += [_attn(2, 8, tokens, tokens, width // 8, dtype, blocks),
                     _attn(2, 8, tokens, 77, width // 8, dtype, blocks)]
            lin += _block_linears(2 * tokens, width, 2 * 77, 768, dtype, blocks)
        return attn, lin, "SD1.5, 512x512, batch 2 (16 transformer blocks)"
    if name == "sdxl":
        # SDXL at 1024x1024, batch 2: 10 blocks at 4096 tokens (640 wide), 60 at 1024 (1280 wide),
        # heads of 64; 77 text tokens of 2048.
        attn, lin = [], []
        for tokens, width, blocks in [(4096, 640, 10), (1024, 1280, 60)]:
            attn += [_attn(2, width // 64, tokens, tokens, 64, dtype, blocks),
                     _attn(2, width // 64, tokens, 77, 64, dtype, blocks)]
            lin += _block_linears(2 * tokens, width, 2 * 77, 2048, dtype, blocks)
        return attn, lin, "SDXL, 1024x1024, batch 2 (70 transformer blocks)"
    raise ValueError(f"unknown model family {name!r}")


FAMILIES = ("flux", "wan", "sd15", "sdxl")


def _cut(n: int, factor: int, floor: int, multiple: int = 1) -> int:
    return max(floor, (n // factor) // multiple * multiple)


def shrink(shapes: list, kind: str) -> list:
    """--tiny: the same calls with token counts / 256 (>= 16) and features / 32 (multiples of 16),
    for a CPU smoke run through the Triton interpreter (numbers then say nothing about speed)."""
    out = []
    for shape, count in shapes:
        if kind == "attention":
            shape = A(**{**shape.__dict__, "q_len": _cut(shape.q_len, 256, 16), "kv_len": _cut(shape.kv_len, 256, 16),
                         "batch": 1, "heads": min(shape.heads, 2), "kv_heads": min(shape.kv_heads, 2)})
        else:
            shape = L(**{**shape.__dict__, "rows": _cut(shape.rows, 256, 16),
                         "in_features": _cut(shape.in_features, 32, 16, 16),
                         "out_features": _cut(shape.out_features, 32, 16, 16)})
        out.append((shape, count))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", choices=FAMILIES, default=[], help="model family (repeatable)")
    ap.add_argument("--shapes-json", help="shapes recorded by the node (benchmark_last.json) or a shapes() dump")
    ap.add_argument("--out", help="output folder (default $OUT, else benchmarks/results)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--mode", default="auto", help="attention mode of the Settings node (auto/fp8/fp16/off...)")
    ap.add_argument("--linear-mode", default="auto", help="Linear mode (auto/fp8/int8/fp8_weight_only/off)")
    ap.add_argument("--repeats", type=int, default=20, help="timed runs per shape and implementation")
    ap.add_argument("--tiny", action="store_true", help="shrink every shape (CPU smoke run)")
    ap.add_argument("--list-shapes", action="store_true", help="print the shapes as JSON and time nothing")
    args = ap.parse_args(argv)
    if not args.model and not args.shapes_json:
        ap.error("give --model (flux, wan, sd15, sdxl) and/or --shapes-json")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)

    dtype = {"bf16": "bfloat16", "fp16": "float16"}[args.dtype]
    attention, linear, sources = [], [], []
    for name in args.model:
        a, lin, what = family_shapes(name, dtype)
        attention += a
        linear += lin
        sources.append(what)
    if args.shapes_json:
        a, lin = core.shapes_from_json(json.loads(Path(args.shapes_json).read_text()))
        attention += a
        linear += lin
        sources.append(f"shapes from {args.shapes_json}")
    if args.tiny:
        attention, linear = shrink(attention, "attention"), shrink(linear, "linear")
        sources.append("--tiny (shapes shrunk)")

    if args.list_shapes:
        print(json.dumps({"source": sources, "attention": [dict(s.__dict__, count=n) for s, n in attention],
                          "linear": [dict(s.__dict__, count=n) for s, n in linear]}, indent=1))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    settings = settings_mod.AccelSettings(args.mode, args.linear_mode)
    chosen = bench_node.chosen_paths(settings, device, weight_is_fp8=False)

    def progress(done, total, what):
        print(f"[{done}/{total}] {what}", flush=True)

    result = core.run_benchmark(attention, linear, device, **chosen, repeats=args.repeats, progress=progress,
                                source="; ".join(sources))
    result["chart"] = chart.chart_backend()
    out_dir = Path(args.out or os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "model_benchmark_{}_{}".format("-".join(args.model) or "recorded",
                                          datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    image = chart.draw_chart(result)
    if image is not None:
        (out_dir / f"{stem}.png").write_bytes(chart.png_bytes(image))
        print(f"chart ({result['chart']}): {out_dir / (stem + '.png')}")
    else:
        print("no chart: neither matplotlib nor Pillow is importable here (the JSON has every number)")
    print(f"JSON: {out_dir / (stem + '.json')}\n")
    print(core.report_text(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
