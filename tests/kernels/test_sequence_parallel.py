"""Sequence-parallel attention (kernels/attention/sequence_parallel.py) with 2 and 4 gloo processes on
the CPU against single-process attention, and merge_partials on its own.

Ranks are spawned with torch.multiprocessing.spawn (entry point: seqpar_worker.run), once per
world size for every case; each holds an equal shard of a sequence generated from one seed
and returns its output shard, which the test joins and compares with kernels.attention over
the whole sequence in one process (same backend) and with the float64 reference. A hang fails
the test after SPAWN_TIMEOUT_S instead of blocking CI. Kernels run under the Triton
interpreter (float32 inputs, tiny shapes: B=1, H=4 or 8, D=32; tokens per rank in
cases_for()). Tolerances (relative L2):
- Triton backend, float32: 1e-5 against single-process attention (the same kernel; the LSE
  merge only changes the summation order) and 1e-5 against float64;
- reference backend ("reference", float32 PyTorch math): 1e-5 likewise;
- FP8 (precision="fp8", fp16 inputs, full-FP8 kernel; ring quantizes per K/V shard): 0.08
  against float64, what the FP8 kernel alone is held to on Gaussian inputs, and within 2x
  (+1e-3) of the single-process FP8 call's own error.
"""
from __future__ import annotations

import importlib
import json
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import triton_accel  # noqa: F401  (loaded by conftest under this name)

K = importlib.import_module("triton_accel.kernels")
SP = importlib.import_module("triton_accel.kernels.attention.sequence_parallel")

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # spawn hands sys.path to the children: they import the worker by name
import seqpar_worker  # noqa: E402

SPAWN_TIMEOUT_S = 150
TOL_FP32 = 1e-5
TOL_FP8 = 0.08
BASE = dict(B=1, H=4, HK=4, L=64, D=32, dtype="float32")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, cases: list, tmp_path) -> list[tuple[dict, dict]]:
    """Run `cases` on `world` gloo ranks: per rank (what ran or the error, {case: output shard}),
    or a test failure on a hang."""
    context = mp.spawn(seqpar_worker.run, args=(world, free_port(), str(tmp_path), cases), nprocs=world, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world} ranks did not finish within {SPAWN_TIMEOUT_S} s (hang?)")
    return [(json.loads((tmp_path / f"rank{r}.json").read_text()), torch.load(tmp_path / f"rank{r}.pt"))
            for r in range(world)]


def rel_l2(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def compare(c: dict, world: int, shards: list) -> dict:
    """The gathered output against single-process attention (same backend) and float64."""
    q, k, v = seqpar_worker.full_inputs(dict(c, world=world), torch)
    kw = {n: c[n] for n in ("backend", "precision") if c.get(n)}
    causal = bool(c.get("is_causal"))
    out = torch.cat(shards, dim=2)
    single = K.attention(q, k, v, is_causal=causal, **kw)
    exact = K.attention_ref(q, k, v, is_causal=causal, compute_dtype=torch.float64)
    return {"vs_single": rel_l2(out, single), "vs_fp64": rel_l2(out, exact), "single_vs_fp64": rel_l2(single, exact),
            "shape": list(out.shape)}


def case(name, impl, **kw):
    return dict(BASE, name=name, impl=impl, **kw)


def cases_for(world: int) -> list[dict]:
    """Cases run on `world` ranks. The flash kernel under the interpreter costs ~15 ms per
    16x16 tile per head, and 4 ranks share the CI machine's 2 cores: the Triton cases use 40
    (2 ranks) or 24 (4 ranks) tokens per rank, partial last tiles included, and GQA / causal
    run through the Triton kernel on 2 ranks, through the reference backend on 4."""
    tri = dict(backend="triton", L=40 if world == 2 else 24)
    gqa_causal = tri if world == 2 else dict(backend="reference")
    cases = [
        case("ulysses_triton", "ulysses", **tri),
        case("ring_triton", "ring", **tri),
        case("ulysses_causal_gqa", "ulysses", is_causal=True, H=8, HK=4, seed=1, **gqa_causal),
        case("ring_gqa", "ring", HK=2, seed=2, **gqa_causal),
        case("ring_reference", "ring", backend="reference"),
        case("ulysses_reference_p2p_all_to_all", "ulysses", backend="reference", method="p2p"),
        case("ulysses_reference_collective_all_to_all", "ulysses", backend="reference", method="collective"),
        case("ulysses_reference_all_to_all_missing", "ulysses", backend="reference", no_all_to_all_single=True),
    ]
    if world == 2:  # the quantized path: full-FP8 kernel, fp16 inputs
        cases += [case("ring_fp8", "ring", precision="fp8", dtype="float16", L=32),
                  case("ulysses_fp8", "ulysses", precision="fp8", dtype="float16", L=32)]
    return cases


ERROR_CASES = [
    case("ulysses_heads_not_divisible", "ulysses", backend="reference", H=3, HK=3),
    case("ring_causal_refused", "ring", backend="reference", is_causal=True),
    case("uneven_shards_ring", "ring", backend="reference", uneven=True),
    case("uneven_shards_ulysses", "ulysses", backend="reference", uneven=True),
]
ERROR_TEXT = {"ulysses_heads_not_divisible": "multiple of the world size", "ring_causal_refused": "is_causal",
              "uneven_shards_ring": "equal sequence shards", "uneven_shards_ulysses": "equal sequence shards"}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """One spawn per world size for all the tests below: (results, seconds)."""
    runs = {}

    def get(world):
        if world not in runs:
            t0 = time.monotonic()
            results = spawn(world, cases_for(world) + ERROR_CASES, tmp_path_factory.mktemp(f"world{world}"))
            runs[world] = (results, time.monotonic() - t0)
            per_case = {name: max(ran[name]["seconds"] for ran, _ in results) for name in results[0][0]}
            print(f"\n{world} ranks: {runs[world][1]:.1f} s; per case (slowest rank): {per_case}")
        return runs[world][0]

    return get


def _by_name(world, name):
    return next(c for c in cases_for(world) if c["name"] == name)


def _exact_cases(world):
    return [c["name"] for c in cases_for(world) if not c.get("precision")]


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_and_ring_match_single_process(world, spawned):
    results = spawned(world)
    for name in _exact_cases(world):
        c = _by_name(world, name)
        for rank, (ran, _) in enumerate(results):
            r = ran[name]
            assert "error" not in r, f"rank {rank} {name}: {r.get('error')}"
            if c.get("backend") == "triton":  # the kernel really ran (not a fallback)
                assert r["counts"].get("triton_attention", 0) >= (world if c["impl"] == "ring" else 1), r
            # "auto" falls back to isend/irecv only where all_to_all_single is missing
            assert r["all_to_all_fell_back"] == bool(c.get("no_all_to_all_single")), (name, r)
        got = compare(c, world, [outs[name] for _, outs in results])
        assert got["shape"] == [c["B"], c["H"], c["L"] * world, c["D"]]
        assert got["vs_single"] < TOL_FP32 and got["vs_fp64"] < TOL_FP32, (name, got)


@pytest.mark.parametrize("world", [2, 4])
def test_bad_calls_refused_on_every_rank(world, spawned):
    for ran, _ in spawned(world):
        for c in ERROR_CASES:
            assert ERROR_TEXT[c["name"]] in ran[c["name"]].get("error", ""), (c["name"], ran[c["name"]])


@pytest.mark.parametrize("name", ["ring_fp8", "ulysses_fp8"])
def test_fp8_matches_single_process(name, spawned):
    """precision="fp8" on 2 ranks: the full-FP8 kernel's LSE (K-mean shift restored) merges;
    the merged output is as close to float64 as the single-process FP8 call."""
    results = spawned(2)
    c = _by_name(2, name)
    for ran, _ in results:
        assert ran[name].get("counts", {}).get("triton_fp8", 0) >= 1, ran[name]
    got = compare(c, 2, [outs[name] for _, outs in results])
    assert got["vs_fp64"] < TOL_FP8, (name, got)
    assert got["vs_fp64"] < 2 * got["single_vs_fp64"] + 1e-3, (name, got)


# ---- merge_partials (no processes) -----------------------------------------------------------

def _split_merge(q, k, v, cut, **kw):
    a = K.attention(q, k[:, :, :cut], v[:, :, :cut], return_lse=True, **kw)
    b = K.attention(q, k[:, :, cut:], v[:, :, cut:], return_lse=True, **kw)
    return SP.merge_partials([a[0], b[0]], [a[1], b[1]])


@pytest.mark.parametrize("cut", [1, 20, 47], ids=["first_key_alone", "uneven", "last_key_alone"])
def test_merge_partials_reproduces_full_attention(cut):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 33, 16, generator=g) for _ in range(3))
    k, v = torch.randn(1, 2, 48, 16, generator=g), torch.randn(1, 2, 48, 16, generator=g)
    out, lse = _split_merge(q, k, v, cut, backend="reference")
    ref_out, ref_lse = K.attention_ref(q, k, v, return_lse=True, compute_dtype=torch.float64)
    assert (out.double() - ref_out).abs().max().item() < 1e-5
    assert (lse.double() - ref_lse).abs().max().item() < 1e-5


def test_merge_partials_masked_parts_and_rows():
    """A part that saw only masked keys weighs zero; a row masked everywhere stays 0 / -inf."""
    out1, out2 = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    lse1 = torch.tensor([[[0.5, float("-inf"), float("-inf")]]])
    lse2 = torch.tensor([[[0.5, 2.0, float("-inf")]]])
    out, lse = SP.merge_partials([out1, torch.zeros_like(out2)], [lse1, lse2])
    assert torch.allclose(out[0, 0, 0], out1[0, 0, 0] / 2)
    assert torch.equal(out[0, 0, 1], torch.zeros(4)) and lse[0, 0, 1].item() == 2.0
    assert torch.equal(out[0, 0, 2], torch.zeros(4)) and torch.isneginf(lse[0, 0, 2])
    assert abs(lse[0, 0, 0].item() - (0.5 + torch.log(torch.tensor(2.0)).item())) < 1e-6


def test_merge_partials_large_lse_does_not_overflow():
    out1, out2 = torch.ones(1, 1, 1, 2), 3 * torch.ones(1, 1, 1, 2)
    out, lse = SP.merge_partials([out1, out2], [torch.full((1, 1, 1), 1000.0), torch.full((1, 1, 1), 1000.0)])
    assert torch.allclose(out, 2 * torch.ones(1, 1, 1, 2)) and torch.isfinite(lse).all()


def test_merge_partials_rejects_mismatched_lists():
    with pytest.raises(ValueError, match="as many outputs as lses"):
        SP.merge_partials([torch.zeros(1, 1, 1, 1)], [])


def test_needs_initialised_process_group():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        SP.ring_attention(q, q, q)
