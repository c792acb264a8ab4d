"""HTTP routes on ComfyUI's server: what the patched attention did (for users and tests)."""
from __future__ import annotations

import logging

from .. import kernels
from . import call_stats

log = logging.getLogger("triton_accel")


def stats_payload() -> dict:
    payload = call_stats.snapshot()
    payload["kernels"] = kernels.stats.counts()
    return payload


def register_routes() -> bool:
    try:
        from aiohttp import web
        from server import PromptServer
    except Exception:
        return False
    if getattr(PromptServer, "instance", None) is None:  # imported outside a running server
        return False
    routes = PromptServer.instance.routes

    @routes.get("/triton_accel/stats")
    async def get_stats(request):
        return web.json_response(stats_payload())

    @routes.post("/triton_accel/stats/reset")
    async def reset_stats(request):
        call_stats.reset()
        kernels.stats.reset()
        return web.json_response(stats_payload())

    return True
