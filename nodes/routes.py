"""HTTP routes on ComfyUI's server: what the pack is doing, for the side panel, users and tests.

Read-only JSON under /triton_accel/: nothing in a request (path, query, body) names a file,
a command or code; the routes have fixed paths and ignore query strings. The one POST
(`/triton_accel/stats/reset`) needs no body and refuses one larger than MAX_BODY_BYTES
(ComfyUI's own limit is its upload size, 100 MB by default: far too much for a reset).
"""
from __future__ import annotations

import logging
import sys

from .. import kernels
from ..kernels.core import extensions
from ..runtime import call_stats
from ..runtime.linear_state import fallback_report
from . import benchmark_node
from .status import status_payload

log = logging.getLogger("triton_accel")

PREFIX = "/triton_accel"
MAX_BODY_BYTES = 4096


def stats_payload() -> dict:

    payload = call_stats.snapshot()
    payload["kernels"] = kernels.core.stats.counts()
    # Linear layers the quality guard (or a kernel error) sent back to ComfyUI's Linear for good.
    payload["linear_fallbacks"] = fallback_report()
    return payload


def reset_counts() -> None:
    """What POST /triton_accel/stats/reset zeroes: the per-call counts, the kernels' counters and
    the calls served / handed back per extension (the status panel's Extensions section), so
    the panel's numbers all start from the same moment."""
    call_stats.reset()
    kernels.core.stats.reset()
    extensions.reset_counts()


async def body_too_large(request) -> bool:
    """True when the request carries more than MAX_BODY_BYTES; reads at most that much + 1."""
    if request.content_length is not None:
        return request.content_length > MAX_BODY_BYTES
    if not request.can_read_body:
        return False
    return len(await request.content.read(MAX_BODY_BYTES + 1)) > MAX_BODY_BYTES


def _benchmark_routes(routes) -> None:
    """The Benchmark node's chart and JSON routes."""
    benchmark_node.register_benchmark_routes(routes)


def register_routes() -> bool:
    # Only a running ComfyUI has imported its server module; importing it ourselves would drag
    # the whole server stack into scripts and benchmarks that merely load the pack.
    server = sys.modules.get("server")
    prompt_server = getattr(getattr(server, "PromptServer", None), "instance", None)
    if prompt_server is None:
        return False
    from aiohttp import web

    routes = prompt_server.routes

    @routes.get(PREFIX + "/stats")
    async def get_stats(request):
        return web.json_response(stats_payload())

    @routes.get(PREFIX + "/status")
    async def get_status(request):
        return web.json_response(status_payload())

    @routes.post(PREFIX + "/stats/reset")
    async def reset_stats(request):
        if await body_too_large(request):
            return web.json_response({"error": f"this route takes no body (at most {MAX_BODY_BYTES} bytes)"},
                                     status=413)
        reset_counts()
        return web.json_response(stats_payload())

    try:
        _benchmark_routes(routes)
    except Exception:
        log.warning("Triton Accel: the benchmark routes could not be added", exc_info=True)
    return True
