"""Where the Gluon FP8 attention kernel loses speed at Flux's size: the last wave, or each CTA
tile's fixed cost.

    python benchmarks/gluon_waves_bench.py [--out DIR] [--configs sm90_lean,...] [--rep MS]

At Flux (1, 24, 4608, 128) the kernel alone runs ~750 TFLOP/s on an H100 against ~860 at Wan
(1, 40, 32760, 128). Flux has 864 CTA tiles of 36 key tiles each: 6.55 waves on 132 SMs (the
seventh wave 55 % full), Wan 10240 tiles of 256 key tiles (77.6 waves). This times the kernel
alone (quantised operands prepared once) over head counts and lengths that separate the two:
- the same 36 key tiles a CTA tile with whole waves (H = 33 or 66 at L = 4608 on 132 SMs) and
  with Flux's 6.55 (H = 24): the last wave's cost;
- the same head count over longer sequences (more key tiles a CTA tile, more CTA tiles): a
  fixed cost per CTA tile shrinks as 1 / key tiles.
Prints one table row per shape (waves, key tiles a CTA tile, TFLOP/s, ms) and writes
gluon_waves.json under --out (default: $OUT or .).
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

pack = load_pack()
full = importlib.import_module(pack.__name__ + ".kernels.attention.fp8_full")
glu = importlib.import_module(pack.__name__ + ".kernels.attention.gluon_hopper")

# (heads, length): Flux's 24 heads at 4608 and longer; whole-wave head counts at 4608 (33 and 66
# on 132 SMs); Flux's head count with 2 and 4 times the keys.
SHAPES = [(24, 4608), (33, 4608), (66, 4608), (24, 9216), (33, 9216), (24, 18432), (40, 32760)]


def kernel_ms(shape, cfg, rep):
    from triton.testing import do_bench
    q, k, v = full.accuracy_inputs("gauss", shape, torch.bfloat16, "cuda", seed=1)
    qkv = glu.quantize_for_config(q, k, v, shape[3] ** -0.5, cfg)
    fn = lambda: glu.attention_gluon_fp8_quantized(qkv, q.shape, shape[2], q.dtype, q.device, cfg)  # noqa: E731
    return do_bench(fn, warmup=max(25, rep // 4), rep=rep, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--configs", default="sm90_lean")
    ap.add_argument("--rep", type=int, default=100)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name in [c for c in args.configs.split(",") if c]:
        cfg = glu.GLUON_CONFIGS[name]
        for heads, length in SHAPES:
            shape = (1, heads, length, 128)
            tiles = -(-length // glu.BLOCK_M) * heads
            ms = kernel_ms(shape, cfg, args.rep)
            flops = 4.0 * heads * length * length * 128
            rows.append(dict(config=name, heads=heads, length=length, cta_tiles=tiles, waves=tiles / sms,
                             key_tiles=-(-length // cfg["BLOCK_N"]), ms=ms, tflops=flops / ms * 1e-9))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gluon_waves.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), sms=sms,
                                                                     rows=rows), indent=1))
    print(f"\n== kernel alone, {torch.cuda.get_device_name()} ({sms} SMs)")
    print("| config | heads x length | CTA tiles | waves | key tiles a CTA tile | ms | TFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['config']} | {r['heads']} x {r['length']} | {r['cta_tiles']} | {r['waves']:.2f} | "
              f"{r['key_tiles']} | {r['ms']:.3f} | {r['tflops']:.1f} |")


if __name__ == "__main__":
    main()
