"""Small fakes more than one test package uses: a conductor that records what instances tell it,
and a tree of source files written for a checker to read."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from mooncake_lite.common.protocol import Heartbeat, Register, loads
from mooncake_lite.common.service import bound_port


async def fake_conductor(refuse_roles: set[str] = frozenset(), heartbeat_status: int = 200
                         ) -> tuple[web.AppRunner, str, dict[str, list]]:
    """A conductor on 127.0.0.1 that keeps every decoded registration and heartbeat in
    ``seen``, answers a registration of a role in ``refuse_roles`` with a 409, and every
    heartbeat with ``heartbeat_status``."""
    seen: dict[str, list] = {"register": [], "heartbeat": []}

    async def register(request: web.Request) -> web.Response:
        msg = loads(Register, await request.read())
        seen["register"].append(msg)
        if msg.role in refuse_roles:
            return web.json_response({"error": "model mismatch: cluster runs small"}, status=409)
        return web.json_response({"ok": True})

    async def heartbeat(request: web.Request) -> web.Response:
        seen["heartbeat"].append(loads(Heartbeat, await request.read()))
        if heartbeat_status != 200:
            return web.json_response({"error": "unknown field(s) ['new_figure']"}, status=heartbeat_status)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/internal/v1/register", register)
    app.router.add_post("/internal/v1/heartbeat", heartbeat)
    return (*await serve_on_loopback(app), seen)


async def serve_on_loopback(app: web.Application) -> tuple[web.AppRunner, str]:
    """``app`` served on a free 127.0.0.1 port: its runner (to clean up) and base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{bound_port(site)}"


def write_tree(root: Path, files: dict[str, str]) -> None:
    """Write ``files`` (relative path -> text) under ``root``, making folders as needed."""
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
