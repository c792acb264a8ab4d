"""A one-minute demonstration: our attention kernel against PyTorch SDPA on this machine.

On a GPU it times both at an SDXL-sized shape. Without one it runs the kernel on the CPU
through Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported) at a small
shape: slow by design, but it proves the kernel computes the right thing here.

    python benchmarks/demo.py
"""
from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import load_pack  # noqa: E402

K = importlib.import_module(load_pack("triton_accel_demo").__name__ + ".kernels")


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> int:
    torch.manual_seed(0)
    if GPU:
        dev, dtype, shape = "cuda", torch.bfloat16, (2, 10, 4096, 4096, 64)
    else:
        dev, dtype, shape = "cpu", torch.float16, (1, 2, 192, 160, 64)
    B, H, Lq, Lk, D = shape
    q = torch.randn(B, H, Lq, D, device=dev, dtype=dtype)
    k = torch.randn(B, H, Lk, D, device=dev, dtype=dtype)
    v = torch.randn(B, H, Lk, D, device=dev, dtype=dtype)
    ok, reason = K.attention_support(q, k, v)
    where = torch.cuda.get_device_name() if GPU else "CPU (Triton interpreter)"
    print(f"device: {where}; shape B={B} H={H} Lq={Lq} Lk={Lk} D={D} {str(dtype)[6:]}")
    if not ok:
        print(f"Triton attention cannot run here: {reason}")
        return 1
    ref = K.attention_ref(q, k, v)
    K.stats.reset()
    t0 = time.perf_counter()
    out = K.attention(q, k, v, backend="triton")
    t_first = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    sdpa = K.attention(q, k, v, backend="torch")
    t_sdpa_first = (time.perf_counter() - t0) * 1e3
    assert K.stats.counts().get("triton_attention") == 1, "the Triton kernel did not run"
    flops = 4 * B * H * Lq * Lk * D
    if GPU:
        import triton.testing

        t_ours = triton.testing.do_bench(lambda: K.attention(q, k, v, backend="triton"), return_mode="median")
        t_sdpa = triton.testing.do_bench(lambda: K.attention(q, k, v, backend="torch"), return_mode="median")
    else:
        t_ours, t_sdpa = t_first, t_sdpa_first  # one interpreted call is slow enough
    print(f"{'':16}{'time ms':>10}{'TFLOP/s':>10}{'rel L2 vs fp32':>17}")
    for name, t, o in (("triton_accel", t_ours, out), ("PyTorch SDPA", t_sdpa, sdpa)):
        print(f"{name:16}{t:10.3f}{flops / t / 1e9:10.3f}{rel_l2(o, ref):17.5f}")
    if not GPU:
        print("(the interpreter runs the kernel in numpy, so its time says nothing about GPU speed)")
    err = rel_l2(out, ref)
    limit = 1e-2 if dtype == torch.bfloat16 else 2e-3
    print("accuracy: OK" if err < limit else f"accuracy: FAILED ({err:.4g} >= {limit})")
    return 0 if err < limit else 1


if __name__ == "__main__":
    sys.exit(main())
