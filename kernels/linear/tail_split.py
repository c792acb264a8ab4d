"""The FP8 GEMM's split tail (tail_split): how a persistent launch cuts its last partial wave
along K, the rows a split tile sums at once, and the arrival counters of split tiles.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..core import cache_registry
from ..core.kernel_common import sm_count

# Programs of the persistent grid under the interpreter (numpy has no SMs).
INTERPRETER_PROGRAMS = 3
# Split tail: at most this many K slices per tile; the rows of a partial tile summed at once
# (tail_rows).
TAIL_SPLIT_MAX = 8
TAIL_ROWS = 32
# Arrival counters of split tiles: one region of sm_count counters per call, taken in turn, so
# that calls in flight at once (other streams) do not share counters unless this many apart.
TAIL_LOCK_REGIONS = 64


class TailSplit(NamedTuple):
    """How a GEMM launch splits its last wave: `split` K slices for each of the tiles from
    `dp_tiles` on (1: none, every tile whole), `workspace` fp32 elements for their partials."""

    split: int
    dp_tiles: int
    workspace: int


def tail_split(tiles: int, programs: int, k_tiles: int, cost: float | None, block_m: int, block_n: int,
               forced: int | None = None) -> TailSplit:
    """The persistent GEMM's wave quantisation, undone where it pays. `tiles` output tiles on
    `programs` SMs take ceil(tiles / programs) tile times although the work is tiles / programs
    of them: Flux's 4608 x 3072 outputs have 432 tiles of 128x256, 3.27 waves on 132 SMs, run
    in 4 (the last wave leaves 96 SMs idle). Here the whole waves stay whole tiles and the rest
    (`tiles % programs`, or every tile of a GEMM with fewer tiles than SMs: Flux's 512 text
    tokens) is cut along K into S slices, one program each, S <= programs // rest. The last
    slice of a tile to finish sums the S partials, in a fixed order, and runs the epilogue: the
    tail then takes about k_tiles / S + S + `cost` K tiles (each partial read back once, and
    the split's fixed cost; None: never split). S minimises k_tiles / S + S, and the split is
    taken where the estimate stays within 85 % of k_tiles. `forced`: that S (benchmarks,
    tests), within the bounds."""
    whole = TailSplit(1, tiles, 0)
    rest = tiles % programs if tiles >= programs else tiles
    if rest == 0 or k_tiles < 2:
        return whole
    most = min(programs // rest, k_tiles, TAIL_SPLIT_MAX)
    if forced is not None:
        s = min(int(forced), most)
    elif cost is None or most < 2:
        return whole
    else:
        s = min(range(2, most + 1), key=lambda c: k_tiles / c + c)
        if k_tiles / s + s + cost > 0.85 * k_tiles:
            return whole
    if s < 2:
        return whole
    return TailSplit(s, tiles - rest, rest * s * block_m * block_n)


def tail_rows(split: int, block_m: int) -> int:
    """Rows of a split tile the last slice sums at once: the SPLIT_K loads of a chunk are issued
    together, so more slices take fewer rows (sm_90's 128x256 tile spills from 8 x 32 rows)."""
    return min(block_m, TAIL_ROWS if split <= 4 else TAIL_ROWS // 2)


_tail_locks: dict[tuple, list] = {}  # (device type, index) -> [int32 counters, next region]
cache_registry.register("kernels.linear.fp8.tail_locks", _tail_locks.clear)


def tail_lock_region(device: torch.device) -> torch.Tensor | None:
    """Zeroed arrival counters for one split launch (each launch leaves them zero again): the
    next of TAIL_LOCK_REGIONS regions of one per-device buffer. None inside a stream capture
    before the buffer exists (made there, it would be filled only when the graph replays)."""
    index = device.index or 0
    entry = _tail_locks.get((device.type, index))
    if entry is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        per = max(sm_count(index) if device.type == "cuda" else INTERPRETER_PROGRAMS, 1)
        entry = [torch.zeros((TAIL_LOCK_REGIONS, per), dtype=torch.int32, device=device), 0]
        _tail_locks[(device.type, index)] = entry
    locks, region = entry
    entry[1] = (region + 1) % TAIL_LOCK_REGIONS
    return locks[region]
