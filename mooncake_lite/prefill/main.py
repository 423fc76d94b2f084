"""``mooncake --role prefill``: prefix reuse, chunked and layer-wise prefill, KV streamed to decode.

The flags are in ``config.py``, the stage and app are built in ``app.py``; this module starts the
rest of a CPP group or dials it (``--stages``; ``stage_process.py``), runs the app and keeps the
instance registered with the conductor. A process started as stage k > 0 of a group runs
``stage_process.run_stage``.
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
from mooncake_lite.prefill.config import Config, layer_slices
from mooncake_lite.prefill.pipeline import StageUnreachable
from mooncake_lite.prefill.stage_process import GroupMismatch, StageGroup, connect_group, profile_group, run_stage

# The head cannot serve as configured: it says why on stderr and exits 2 (not restarted in a loop).
REFUSALS = (StoreUnfit, StageUnreachable, GroupMismatch)

log = logging.getLogger(__name__)


async def _watch_stage_link(downstream, state: dict) -> None:
    """A CPP group without its next stage cannot serve: exit non-zero so a supervisor restarts it."""
    await asyncio.shield(downstream.client.conn.closed)   # cancelling us must not cancel the future
    log.error("the link to CPP stage 1 is gone; this group cannot prefill any more; exiting")
    state["exit"] = 1
    os.kill(os.getpid(), signal.SIGTERM)


async def _profile_group(cfg: Config, stage, downstream):
    """A CPP group's cost model, timed through all its stages (None if that failed: it then
    registers none, as with --no-profile)."""
    try:
        cost, samples = await profile_group(stage, downstream)
    except Exception as exc:
        log.warning("start-up profiling of the CPP group skipped: %s", exc)
        return None
    log.info("CPP group cost model %s from %d timings through its %d stages", cost.to_dict(), len(samples),
             cfg.pipeline_group)
    return cost


def run(cfg: Config) -> int:
    if cfg.pipeline_stage > 0:
        return run_stage(cfg)
    sdnotify.notify(f"STATUS=prefill loading {cfg.model}")
    group = None
    if cfg.pipeline_group > 1 and not cfg.stage_addresses:   # no --stages: the head starts its stages
        group = StageGroup.spawn(cfg, layer_slices(model_args(cfg.model).num_layers, cfg.pipeline_group))
    try:
        stage, cost = build_stage(cfg, cfg.layer_range)
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
        try:
            if cfg.stage_addresses:
                sdnotify.notify(f"STATUS=prefill dialling CPP stages {cfg.stages}")
            downstream = await connect_group(cfg, group, known_as)
        except REFUSALS:
            close = getattr(stage.store, "close", None)   # a private store has nothing to close
            if close is not None:
                await close()
            raise
        group_cost = await _profile_group(cfg, stage, downstream) if downstream and cfg.profile else cost
        app = build_app(cfg, stage, group_cost, downstream)
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
    except REFUSALS as exc:
        refused = exc
    finally:
        if group is not None:
            group.stop()
    if refused is not None:
        sys.stderr.write(f"mooncake --role prefill: error: {refused}\n")
        return 2
    return state["exit"]
