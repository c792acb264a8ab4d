"""One Wan-2.1-shaped attention layer, sequence-parallel over torch.distributed.

    torchrun --nproc_per_node=N benchmarks/sequence_parallel_wan.py [--shape wan|tiny]
        [--impl ulysses|ring|both] [--precision fp16|fp8] [--iters 10] [--out FILE.json]
    python benchmarks/sequence_parallel_wan.py ...      (one process: world size 1)

NCCL on CUDA (one GPU per rank: cuda:LOCAL_RANK), gloo otherwise (CPU: the kernels then run
under the Triton interpreter, TRITON_INTERPRET=1 is set here; only --shape tiny is sensible).
--shape wan is (1, 40, 32760, 128) bf16 (Wan 2.1 14B 480p x 81 frames self-attention);
tiny is (1, 4, 128, 32). Every rank builds the same full q, k, v from one seed and keeps its
sequence shard (the length must divide by the world size).

Reported on rank 0:
- agreement of the gathered sequence-parallel output with single-GPU kernels.attention at
  the same precision (rel. L2, cosine), and, for fp8, with the single-GPU fp16/bf16 kernel;
- times (median ms): single-GPU attention (triton.testing.do_bench on CUDA, rank 0 alone);
  each sequence-parallel call (fixed iteration count, every rank, CUDA events after a barrier:
  do_bench picks its own repetition count per rank, which would deadlock collectives; the
  slowest rank's median); for ring also the same W blocks of attention and LSE merges without
  any transfer (compute only) and the W-1 K/V ring transfers alone (communication only), so
  hidden = (compute + communication - total) / communication says how much of the transfer
  the overlap hid (1.0: all of it; 0 or below: none); for ulysses the four all-to-alls alone.
Writes the numbers as JSON to --out (default: sequence_parallel_<shape>_<precision>_w<N>.json
under $OUT or .).
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the pack imports triton

import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import load_pack  # noqa: E402

pack = load_pack()
kernels = importlib.import_module(pack.__name__ + ".kernels")
sp = importlib.import_module(pack.__name__ + ".kernels.attention.sequence_parallel")

SHAPES = {"wan": (1, 40, 32760, 128), "tiny": (1, 4, 128, 32)}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="wan")
    p.add_argument("--impl", choices=["ulysses", "ring", "both"], default="both")
    p.add_argument("--precision", choices=["fp16", "fp8"], default="fp16")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default: 10 on CUDA, 2 on CPU)")
    p.add_argument("--out", default=None)
    return p.parse_args()


def init_distributed():
    """(world, rank, device): torchrun's environment, or a one-process group without it."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=10),
                            **({"device_id": device} if cuda else {}))
    return dist.get_world_size(), dist.get_rank(), device


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_collective(fn, iters: int, device) -> float:
    """Median ms of fn() over `iters` runs, the same count on every rank (2 warm-up runs), each
    run started together after a barrier; the slowest rank's median."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    worst = torch.tensor([statistics.median(times)], dtype=torch.float64,
                         device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def time_single(fn, device, iters: int) -> float:
    """Median ms of a call with no collectives (rank 0 alone): do_bench on CUDA."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=100, rep=500, return_mode="median")
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def ring_parts(q, k, v, world, rank, attn_kw):
    """The ring's compute alone (the same W blocks and merges on local K/V, no transfer) and
    its communication alone (the W-1 exchanges, no attention)."""
    def compute_only():
        acc = acc_lse = None
        for _ in range(world):
            out, lse = kernels.attention(q, k, v, return_lse=True, **attn_kw)
            acc, acc_lse = (out.float(), lse) if acc is None else sp._merge_into(acc, acc_lse, out, lse)
        return acc

    def comm_only():
        kk, vv = k.contiguous(), v.contiguous()
        for _ in range(world - 1):
            k_next, v_next, reqs = sp._ring_exchange(kk, vv, world, rank, None)
            for r in reqs:
                r.wait()
            kk, vv = k_next, v_next
        return kk

    return compute_only, comm_only


def ulysses_comm_only(q, k, v, world):
    def run():
        parts = [sp._seq_to_heads(t, world, None, "auto") for t in (q, k, v)]
        return sp._heads_to_seq(parts[0], world, None, "auto")
    return run


def agreement(out, ref) -> dict:
    o, r = out.float().flatten(), ref.float().flatten()
    return {"rel_l2": ((o - r).norm() / r.norm().clamp_min(1e-30)).item(),
            "cosine": torch.nn.functional.cosine_similarity(o, r, dim=0).item(),
            "finite": bool(torch.isfinite(o).all())}


def gather_sequence(shard, world):
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard.contiguous())
    return torch.cat(parts, dim=2)


def run_impl(name, shards, world, rank, device, attn_kw, iters, reference, results):
    fn = sp.ulysses_attention if name == "ulysses" else sp.ring_attention
    q, k, v = shards
    out = fn(q, k, v, **attn_kw)
    full_out = gather_sequence(out, world)
    row = {"total_ms": time_collective(lambda: fn(q, k, v, check_shapes=False, **attn_kw), iters, device)}
    if name == "ring" and world > 1:
        compute_only, comm_only = ring_parts(q, k, v, world, rank, attn_kw)
        row["compute_only_ms"] = time_collective(compute_only, iters, device)
        row["comm_only_ms"] = time_collective(comm_only, iters, device)
        hidden = (row["compute_only_ms"] + row["comm_only_ms"] - row["total_ms"]) / max(row["comm_only_ms"], 1e-9)
        row["comm_hidden_fraction"] = round(hidden, 3)
        # Where the transfer is a sliver of the call (CPU runs), timing noise swamps the fraction.
        row["comm_share_of_total"] = round(row["comm_only_ms"] / row["total_ms"], 4)
    if name == "ulysses" and world > 1:
        row["all_to_all_only_ms"] = time_collective(ulysses_comm_only(q, k, v, world), iters, device)
    if rank == 0:
        for ref_name, ref in reference.items():
            row[f"vs_{ref_name}"] = agreement(full_out, ref)
    results[name] = row
    del full_out


def main():
    args = parse_args()
    world, rank, device = init_distributed()
    B, H, L, D = SHAPES[args.shape]
    if L % world:
        raise SystemExit(f"sequence length {L} does not divide by the world size {world}")
    iters = args.iters or (10 if device.type == "cuda" else 2)
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    q_full, k_full, v_full = (torch.randn(B, H, L, D, generator=gen, device=device, dtype=dtype) for _ in range(3))
    mine = slice(rank * (L // world), (rank + 1) * (L // world))
    shards = [t[:, :, mine].contiguous() for t in (q_full, k_full, v_full)]
    attn_kw = {"precision": args.precision}

    results = {"shape": [B, H, L, D], "dtype": str(dtype), "precision": args.precision, "world": world,
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "backend": dist.get_backend(), "torch": torch.__version__, "pack_triton": kernels.triton_version()}
    reference = {}
    if rank == 0:
        single = lambda: kernels.attention(q_full, k_full, v_full, **attn_kw)  # noqa: E731
        reference[f"single_{args.precision}"] = single()
        if args.precision == "fp8":
            reference["single_fp16"] = kernels.attention(q_full, k_full, v_full, precision="fp16")
        results["single_ms"] = time_single(single, device, iters)
    dist.barrier()
    for name in (["ulysses", "ring"] if args.impl == "both" else [args.impl]):
        run_impl(name, shards, world, rank, device, attn_kw, iters, reference, results)
    if rank == 0:
        for name in ("ulysses", "ring"):
            if name in results:
                results[name]["speedup_vs_single"] = round(results["single_ms"] / results[name]["total_ms"], 3)
        out = Path(args.out or Path(os.environ.get("OUT", ".")) /
                   f"sequence_parallel_{args.shape}_{args.precision}_w{world}.json")
        out.write_text(json.dumps(results, indent=1))
        print(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
