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


def step_timeline(fn, top: int = 25) -> dict:
    """One call of fn under torch.profiler with host and device activity: how long the GPU
    was busy against the span from its first kernel to its last (the gaps are time it waited
    for the host: a host-bound step), and the host-side calls (CUDA runtime included) that took
    the most self time: a launch blocking on a full queue, a synchronisation, an allocation."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, cur_start, cur_end = 0.0, None, None
    for start, end in spans:  # union of the kernels' intervals: overlapping kernels count once
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        busy += cur_end - cur_start
    span = (spans[-1][1] - spans[0][0]) if spans else 0.0
    host = sorted(((ev.self_cpu_time_total / 1000.0, ev.count, ev.key) for ev in prof.key_averages()
                   if ev.self_cpu_time_total > 0), reverse=True)[:top]
    return {"device_busy_ms": busy / 1000.0, "device_span_ms": span / 1000.0, "kernels": len(spans),
            "host_self_ms": [(round(ms, 2), n, key) for ms, n, key in host]}
