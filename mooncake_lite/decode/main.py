"""``mooncake --role decode``: receive KV from prefill, continuous batching, stream tokens.

The flags are in ``config.py``, the engine and app are built in ``app.py``; this module runs the
app and keeps the instance registered with the conductor.
"""

from __future__ import annotations

import asyncio

from mooncake_lite.common import sdnotify
from mooncake_lite.common.membership import exit_process, keep_membership
from mooncake_lite.common.service import run as run_loop
from mooncake_lite.common.service import serve_app
from mooncake_lite.decode.app import (RUNTIME, DecodeAppSettings, build_engine, make_app, registration,
                                      reported_cost)
from mooncake_lite.decode.config import Config


def run(cfg: Config) -> int:
    sdnotify.notify(f"STATUS=decode loading {cfg.model}")
    engine = build_engine(cfg)
    app = make_app(engine, DecodeAppSettings(cfg.host, cfg.data_port, cfg.cluster_token,
                                             advertise_host=cfg.advertise_host,
                                             data_handshake_timeout=cfg.data_handshake_timeout,
                                             data_stall_timeout=cfg.data_stall_timeout,
                                             data_idle_timeout=cfg.data_idle_timeout or None,
                                             data_inflight=cfg.data_inflight))
    state = {"exit": 0}
    tasks: list[asyncio.Task] = []

    def on_ready(addresses: dict[str, str]) -> None:
        if cfg.conductor:
            msg = registration(cfg, engine, addresses)
            # systemd hears READY=1 only once the conductor can send us work.
            sdnotify.notify(f"STATUS=decode registering with {cfg.conductor}")
            tasks.append(asyncio.ensure_future(keep_membership(
                cfg.conductor, msg, engine.load, cfg.heartbeat_interval, cfg.cluster_token,
                exit_process(state, "exit"), on_registered=lambda: sdnotify.ready(
                    f"decode serving on {addresses['http']}, registered with {cfg.conductor}"),
                cost=lambda: reported_cost(engine))))

    async def main() -> None:
        try:
            await serve_app(app, cfg.host, cfg.port, role="decode", advertise_host=cfg.advertise_host,
                            extra_addresses=lambda: {"data": app[RUNTIME]["data"]}, on_ready=on_ready,
                            notify_ready=not cfg.conductor)
        finally:
            for t in tasks:
                t.cancel()

    run_loop(main)
    return state["exit"]
