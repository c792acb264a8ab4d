"""The processes test_sequence_parallel.py spawns (one per rank, gloo on CPU).

torch.multiprocessing.spawn pickles its entry point by module name, and pytest's importlib
import mode gives test modules no importable name: the entry lives here, imported through
sys.path by the test. Each rank loads the pack by path as conftest does (TRITON_INTERPRET=1
comes from the parent's environment, so the kernels run under the interpreter), runs the
cases it is given, and writes its output shards to <result_dir>/rank<r>.pt and what ran (or
the ValueError it raised) to rank<r>.json; the test compares them with single-process
attention, computed once in the parent. An exception fails the spawn, which the test reports.
"""
from __future__ import annotations

import datetime
import importlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACK_NAME = "triton_accel"


def load_kernels():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    if PACK_NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACK_NAME, ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACK_NAME] = module
        spec.loader.exec_module(module)
    return (importlib.import_module(f"{PACK_NAME}.kernels"),
            importlib.import_module(f"{PACK_NAME}.kernels.attention.sequence_parallel"))


def full_inputs(case, torch):
    """The whole sequence's q, k, v (same seed on every rank, so every rank can slice its shard)."""
    world = case["world"]
    B, H, HK, L, D = case["B"], case["H"], case["HK"], case["L"] * world, case["D"]
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dtype = getattr(torch, case.get("dtype", "float32"))
    q = torch.randn(B, H, L, D, generator=gen).to(dtype)
    k = torch.randn(B, HK, L, D, generator=gen).to(dtype)
    v = torch.randn(B, HK, L, D, generator=gen).to(dtype)
    return q, k, v


def run_case(case, rank, world, K, SP, torch):
    """This rank's output shard of `case` and the counters of what ran, or the ValueError's text."""
    q, k, v = full_inputs(case, torch)
    L = case["L"]
    mine = slice(rank * L, (rank + 1) * L)
    shard = [t[:, :, mine] for t in (q, k, v)]
    if case.get("uneven") and rank == 0:
        shard = [torch.cat([t, t[:, :, :16]], dim=2) for t in shard]
    kw = {n: case[n] for n in ("backend", "precision") if case.get(n)}
    extra = {}
    if case.get("is_causal"):
        extra["is_causal"] = True
    if case["impl"] == "ulysses":
        extra["all_to_all_method"] = case.get("method", "auto")
    fn = SP.ulysses_attention if case["impl"] == "ulysses" else SP.ring_attention
    K.stats.reset()
    real_all_to_all = SP.dist.all_to_all_single
    if case.get("no_all_to_all_single"):  # a gloo build without the collective
        def missing(*args, **kwargs):
            raise RuntimeError("ProcessGroupGloo does not support alltoall_base")
        SP.dist.all_to_all_single = missing
    try:
        out = fn(*shard, **extra, **kw)
    except ValueError as e:
        return {"error": str(e)}, None
    finally:
        SP.dist.all_to_all_single = real_all_to_all
    fell_back = bool(SP._no_collective_all_to_all)
    SP._no_collective_all_to_all.clear()
    return {"counts": K.stats.counts(), "all_to_all_fell_back": fell_back}, out


def run(rank: int, world: int, port: int, result_dir: str, cases: list) -> None:
    """torch.multiprocessing.spawn's entry: rank `rank` of `world` runs `cases`."""
    import torch
    import torch.distributed as dist

    K, SP = load_kernels()
    torch.set_num_threads(1)  # the CI machine has 2 cores for all ranks
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    try:
        results, outputs = {}, {}
        for case in cases:
            t0 = time.monotonic()
            results[case["name"]], out = run_case(dict(case, world=world), rank, world, K, SP, torch)
            results[case["name"]]["seconds"] = round(time.monotonic() - t0, 2)
            if out is not None:
                outputs[case["name"]] = out
            dist.barrier()
        torch.save(outputs, Path(result_dir, f"rank{rank}.pt"))
        Path(result_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
