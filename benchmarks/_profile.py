"""Device time per kernel from torch.profiler, shared by the benchmark scripts."""
from collections import defaultdict


def device_ms_per_kernel(fn, iters: int = 1, warmup: bool = True) -> dict:
    """{kernel name: device ms per call of fn}, over `iters` calls under torch.profiler
    (one untimed call first when `warmup`: compilation and allocation stay out)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if warmup:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total = defaultdict(float)
    for ev in prof.key_averages():
        # device_time_total since torch 2.4; cuda_time_total before.
        dev = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if dev and ev.key and not ev.key.startswith("ProfilerStep"):
            total[ev.key] += dev / 1000.0 / iters
    return dict(total)
