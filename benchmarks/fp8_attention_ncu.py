"""A target for Nsight Compute: the Gluon FP8 attention kernel alone, launched a few times on
prepared operands, so `ncu` reads its hardware counters (pipe use, issue slots, stall reasons).

    ncu --clock-control none -k regex:_attn_fp8_gluon_fwd --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight ... python3 benchmarks/fp8_attention_ncu.py --shape flux [--config sm90_lean]

Run it at Flux and Wan sizes (`--shape flux`, `--shape wan`). The question it answers: where
a key tile's ~2350 cycles go when the tensor cores need ~1150 and the MUFU
pipe ~1024 for its exponentials (benchmarks/RESULTS.md): which pipes are busy, how full the
issue slots are, and what the consumer warps wait on.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import load_pack  # noqa: E402

pack = load_pack()
full = importlib.import_module(pack.__name__ + ".kernels.attention.fp8_full")
glu = importlib.import_module(pack.__name__ + ".kernels.attention.gluon_hopper")

SHAPES = {"flux": (1, 24, 4608, 128), "wan": (1, 40, 32760, 128), "flux_whole_waves": (1, 33, 4608, 128)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="flux", choices=sorted(SHAPES))
    ap.add_argument("--config", default="sm90_lean")
    ap.add_argument("--launches", type=int, default=5)
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    cfg = glu.GLUON_CONFIGS[args.config]
    q, k, v = full.accuracy_inputs("gauss", shape, torch.bfloat16, "cuda", seed=1)
    qkv = glu.quantize_for_config(q, k, v, shape[3] ** -0.5, cfg)
    for _ in range(args.launches):
        glu.attention_gluon_fp8_quantized(qkv, q.shape, shape[2], q.dtype, q.device, cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
