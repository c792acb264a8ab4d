"""Launching an already compiled Triton kernel without the JIT's per-call argument binding.

Triton's JIT launch binds and specialises every argument on every call (~45 for the
attention kernel): tens of microseconds, as long as a small attention kernel runs. A
launcher remembers, per call signature (everything the JIT specialises on, chosen by the
caller), the compiled kernel and its grid; from the second call of a signature on, the
direct launch runs once beside the JIT launch and must agree bit for bit, after which
later calls go straight to the compiled kernel. A mismatch or an error switches direct
launches off for the process. TRITON_ACCEL_FAST_LAUNCH=0 disables them.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from . import cache_registry, env_settings
from .kernel_common import LAUNCH_OPTIONS

log = logging.getLogger("triton_accel.kernels.core.direct_launch")  # not __name__: the clone's folder name

ENABLED = env_settings.fast_launch_enabled()


class Plan(NamedTuple):
    kernel: object  # triton CompiledKernel
    grid: tuple
    consts: tuple  # constexpr values, in signature order after the runtime arguments
    verified: bool


_plans: dict = {}  # caller's signature key -> Plan
cache_registry.register("kernels.core.direct_launch.plans", _plans.clear)


def constexpr_order(kernel) -> tuple:
    """A @triton.jit kernel's constexpr names in signature order: launch() appends the plan's
    constexpr values after the runtime args in this order, read from the kernel itself so a
    constexpr added to it cannot be missed."""
    import inspect

    return tuple(p.name for p in inspect.signature(kernel.fn).parameters.values()
                 if "constexpr" in str(p.annotation))


def usable(t: torch.Tensor) -> bool:
    # Verification synchronises (torch.equal), which a stream capture does not allow.
    return ENABLED and t.device.type == "cuda" and not torch.cuda.is_current_stream_capturing()


def lookup(key) -> Plan | None:
    plan = _plans.get(key)
    return plan if plan is not None and plan.verified else None


_triton_mods: tuple | None = None  # (knobs, driver), imported once: this runs on every call


def _triton_runtime() -> tuple:
    global _triton_mods
    if _triton_mods is None:
        from triton import knobs
        from triton.runtime import driver

        _triton_mods = (knobs, driver)
    return _triton_mods


def current_stream(device_index: int) -> int:
    """The raw handle of the stream launches on this device go to now."""
    return _triton_runtime()[1].active.get_current_stream(device_index)


def launch(plan: Plan, device_index: int, args: tuple) -> None:
    knobs, _driver = _triton_runtime()
    stream = current_stream(device_index)
    full = (*args, *plan.consts)
    kernel, grid = plan.kernel, plan.grid
    meta = kernel.launch_metadata(grid, stream, *full)
    kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
               kernel.function, kernel.packed_metadata, meta,
               knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *full)


def record(key, kernel, grid: tuple, consts: tuple, args: tuple, out_index: int | None = None,
           out: torch.Tensor | None = None, rebind=None, written=None) -> None:
    """After a JIT launch of `key` wrote args[out_index]: remember it, or verify the plan.
    Where the output reaches the kernel inside another argument (a TMA descriptor), pass the
    output tensor as `out` and `rebind(probe)`: the same args writing to `probe` instead.
    `written(t)`: the part of the output the kernel writes, where it writes only part of it
    (kernels/fused/qk_norm_rope.py fills rows offset.. of a buffer another launch fills the rest of):
    only that part of the probe is compared, the rest of it was never written."""
    global ENABLED
    if kernel is None or not ENABLED:
        return
    plan = _plans.get(key)
    if plan is None:
        _plans[key] = Plan(kernel, tuple(grid), tuple(consts), False)
        return
    if plan.verified:
        return
    out = args[out_index] if out is None else out
    probe = torch.empty_like(out)
    if rebind is None:
        probe_args = list(args)
        probe_args[out_index] = probe
    else:
        probe_args = rebind(probe)
    try:
        launch(plan, out.device.index, tuple(probe_args))
        same = torch.equal(probe, out) if written is None else torch.equal(written(probe), written(out))
    except Exception as e:  # a Triton version whose launcher differs: keep the JIT path
        log.warning("direct kernel launch unavailable (%s: %s); using Triton's JIT launch", type(e).__name__, e)
        same = False
    if same:
        _plans[key] = plan._replace(verified=True)
    else:
        log.warning("direct kernel launch disagreed with the JIT launch; disabled for this process")
        ENABLED = False
        _plans.clear()


_orders: dict = {}  # @triton.jit kernel -> constexpr_order(kernel), read once
cache_registry.register("kernels.core.direct_launch.orders", _orders.clear)


def signature_key(name: str, args: tuple) -> tuple:
    """What Triton's JIT specialises a launch on, per runtime argument: tensors by dtype and
    16-byte alignment of the pointer, ints by value (covers its == 1 and % 16 classes),
    floats not at all."""
    return (name, *[(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                    else a if isinstance(a, int) else float for a in args])


def jit_or_plan(kernel, grid: tuple, args: tuple, consts: dict, out_index: int, name: str, written=None,
                **options) -> Plan | None:
    """kernel[grid](*args, **consts, **options) through Triton's JIT launch, or, from the
    third call of one signature on (the second verifies it), the compiled kernel launched
    directly. The signature is the grid, the constexpr values, the options and
    signature_key(args): a grid or constexpr the caller derives from something outside the
    args (a batch size, whether a pointer is a placeholder) still gets its own plan.
    `consts` must name every constexpr of the kernel; `written` as record()'s. Returns the
    signature's verified plan, or None while it has none (see SiteMemo)."""
    out = args[out_index]
    if not usable(out):
        kernel[grid](*args, **consts, **options, **LAUNCH_OPTIONS)
        return None
    order = _orders.get(kernel)
    if order is None:
        order = _orders[kernel] = constexpr_order(kernel)
    values = tuple(consts[n] for n in order)
    key = (out.device.index, grid, values, tuple(options.items()), *signature_key(name, args))
    plan = lookup(key)
    if plan is not None:
        launch(plan, out.device.index, args)
        return plan
    record(key, kernel[grid](*args, **consts, **options, **LAUNCH_OPTIONS), grid, values, args, out_index=out_index,
           written=written)
    return lookup(key)


class SiteMemo:
    """What a launcher worked out for one call signature (its verified plan and the layout its
    checks derived), by a fingerprint the launcher reads cheaply off its inputs (dtypes, shapes,
    strides, 16-byte alignments, flags): a repeated call skips its checks, signature_key and
    the JIT binding, about two thirds of a row kernel's ~60 us of host time, which the
    host-bound Flux step pays ~190 times. Only layouts the checks took as they are (no copy)
    belong here, so the fingerprint's tensors are the kernel's. Emptied with the plans."""

    LIMIT = 256  # fingerprints kept per launcher; a new one past that starts over

    def __init__(self, name: str):
        self.entries: dict = {}
        cache_registry.register(f"kernels.core.direct_launch.memo.{name}", self.entries.clear)

    def get(self, fingerprint):
        """The remembered (plan, layout...) for this fingerprint, where direct launches may run
        now (on and not inside a stream capture); else None."""
        hit = self.entries.get(fingerprint)
        return hit if hit is not None and ENABLED and not torch.cuda.is_current_stream_capturing() else None

    def put(self, fingerprint, entry: tuple) -> None:
        if len(self.entries) >= self.LIMIT:
            self.entries.clear()
        self.entries[fingerprint] = entry


def verified_count() -> int:
    return sum(p.verified for p in _plans.values())
