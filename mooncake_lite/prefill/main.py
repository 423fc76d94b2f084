"""``mooncake --role prefill``: prefix reuse, chunked and layer-wise prefill, KV streamed to decode.

The flags are in ``config.py``, the stage and app are built in ``app.py``; this module starts the
rest of a CPP group (``stage_process.py``), runs the app and keeps the instance registered with
the conductor. A process started as stage k > 0 of a group runs ``stage_process.run_stage``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from mooncake_lite.common import sdnotify
from mooncake_lite.common.membership import exit_process, keep_membership
from mooncake_lite.common.service import run as run_loop
from mooncake_lite.common.service import serve_app
from mooncake_lite.model.checkpoint_config import model_args
from mooncake_lite.prefill.app import (EXTRA_CLEANUP, SERVICE, StoreUnfit, build_app, build_stage, registration,
                                       reported_cost, store_id)
from mooncake_lite.prefill.config import Config
from mooncake_lite.prefill.stage_process import StageGroup, layer_slices, run_stage

log = logging.getLogger(__name__)


async def _watch_stage_link(downstream, state: dict) -> None:
    """A CPP group without its next stage cannot serve: exit non-zero so a supervisor restarts it."""
    await asyncio.shield(downstream.client.conn.closed)   # cancelling us must not cancel the future
    log.error("the link to CPP stage 1 is gone; this group cannot prefill any more; exiting")
    state["exit"] = 1
    os.kill(os.getpid(), signal.SIGTERM)


def run(cfg: Config) -> int:
    if cfg.pipeline_stage > 0:
        return run_stage(cfg)
    sdnotify.notify(f"STATUS=prefill loading {cfg.model}")
    slices = layer_slices(model_args(cfg.model).num_layers, cfg.pipeline_group)
    group = None
    if cfg.pipeline_group > 1:
        group = StageGroup.spawn(cfg, slices)
    try:
        stage, cost = build_stage(cfg, slices[0])
    except BaseException:
        if group is not None:
            group.stop()
        raise
    state = {"exit": 0}
    tasks: list[asyncio.Task] = []

    async def main() -> None:
        # Before serving: a store whose slots cannot hold our blocks refuses every write-back, and
        # one that encodes blocks otherwise (--kv-compression) would have them misread.
        try:
            known_as = await store_id(cfg, stage.store, check=True)
        except StoreUnfit:
            await stage.store.close()
            raise
        downstream = await group.connect(cfg.cluster_token) if group is not None else None
        app = build_app(cfg, stage, cost, downstream)
        service = app[SERVICE]
        if downstream is not None:
            watcher = asyncio.ensure_future(_watch_stage_link(downstream, state))

            async def stop_watching() -> None:   # shutting down closes the link on purpose
                watcher.cancel()
            app[EXTRA_CLEANUP] += [stop_watching, downstream.close]

        def on_ready(addresses: dict[str, str]) -> None:
            if cfg.conductor:
                msg = registration(cfg, service, addresses, known_as)
                # systemd hears READY=1 only once the conductor can send us work.
                sdnotify.notify(f"STATUS=prefill registering with {cfg.conductor}")
                tasks.append(asyncio.ensure_future(keep_membership(
                    cfg.conductor, msg, service.load, cfg.heartbeat_interval, cfg.cluster_token,
                    exit_process(state, "exit"), on_registered=lambda: sdnotify.ready(
                        f"prefill serving on {addresses['http']}, registered with {cfg.conductor}"),
                    cost=lambda: reported_cost(service))))
        try:
            await serve_app(app, cfg.host, cfg.port, role="prefill", on_ready=on_ready,
                            advertise_host=cfg.advertise_host, notify_ready=not cfg.conductor)
        finally:
            for t in tasks:
                t.cancel()

    refused = None
    try:
        run_loop(main)
    except StoreUnfit as exc:
        refused = exc
    finally:
        if group is not None:
            group.stop()
    if refused is not None:
        sys.stderr.write(f"mooncake --role prefill: error: {refused}\n")
        return 2
    return state["exit"]
