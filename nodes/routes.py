"""HTTP routes on ComfyUI's server: what the patched attention did (for users and tests)."""
from __future__ import annotations

import logging
import sys

from .. import kernels
from . import call_stats

log = logging.getLogger("triton_accel")


def stats_payload() -> dict:
    payload = call_stats.snapshot()
    payload["kernels"] = kernels.stats.counts()
    return payload


def register_routes() -> bool:
    # Only a running ComfyUI has imported its server module; importing it ourselves would drag
    # the whole server stack into scripts and benchmarks that merely load the pack.
    server = sys.modules.get("server")
    prompt_server = getattr(getattr(server, "PromptServer", None), "instance", None)
    if prompt_server is None:
        return False
    from aiohttp import web

    routes = prompt_server.routes

    @routes.get("/triton_accel/stats")
    async def get_stats(request):
        return web.json_response(stats_payload())

    @routes.post("/triton_accel/stats/reset")
    async def reset_stats(request):
        call_stats.reset()
        kernels.stats.reset()
        return web.json_response(stats_payload())

    return True
