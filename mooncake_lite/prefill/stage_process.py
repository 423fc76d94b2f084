"""The processes of a CPP group: stages 1..X-1, each running one layer slice behind a stage socket.

Stage k is ``mooncake --role prefill --pipeline-group X --pipeline-stage k`` (plus ``--next-stage``,
the socket of stage k+1, unless it is the last). Either its head starts it as a child
(``StageGroup``: no ``--stages``; the stage then exits with its head), or it is started like any
other role, on any node (its own unit, ``--host`` its node's address, ``--data-port`` its socket),
and the head is given the stages' addresses (``--stages``). Either way a stage prints a ready line
with its ``"stage"`` socket address once its link to the next stage is up, and the head checks the
group it dialled (``check_group``: every stage in its place, contiguous layers, one model) and
times chunks through it for its cost model (``profiling.profile_served``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from functools import partial

from aiohttp import web

from mooncake_lite.common.config import flag_name
from mooncake_lite.common.launch import RoleProcess, role_argv, to_stderr
from mooncake_lite.common.lifecycle import EXIT, ExitStatus, Listener, serve_role
from mooncake_lite.common.service import run as run_loop
from mooncake_lite.instance.runner import build_runner
from mooncake_lite.instance.tp_ranks import watch_tensor_parallel
from mooncake_lite.model.checkpoint_config import model_args
from mooncake_lite.prefill.app import StoreUnfit, make_store, pack_weights, store_id
from mooncake_lite.prefill.rank_store import follower_stores
from mooncake_lite.prefill.config import Config, layer_slices
from mooncake_lite.prefill.engine import StageEngine
from mooncake_lite.prefill.kv_sender import DecodeLinks
from mooncake_lite.prefill.pipeline import NextStage, StageServer
from mooncake_lite.transfer.server import server_address, start_server

__all__ = ["GroupMismatch", "StageGroup", "check_group", "connect_group", "layer_slices", "run_stage",
           "stage_argv"]
log = logging.getLogger(__name__)

SKIP_FLAGS = {"pipeline_stage", "next_stage", "port", "data_port", "conductor", "instance_id", "profile",
              "stages", "layers", "head_pid"}
# What every stage of a group must agree on with its head (INFO): one model, one cache layout.
SHARED = ("group", "model", "dtype", "block_size", "kv_compression", "seed")


class GroupMismatch(RuntimeError):
    """The stages a head dialled do not make up its group (places, layers, model)."""


def stage_argv(cfg, stage: int, next_address: str | None) -> list[str]:
    """The command line of stage ``stage``: the head's own settings plus its place in the group."""
    argv = role_argv("prefill")
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in SKIP_FLAGS or value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag_name(f) if value else "--no-" + flag_name(f)[2:])
        else:
            argv += [flag_name(f), str(value)]
    argv += ["--pipeline-stage", str(stage), "--port", "0", "--data-port", "0", "--no-profile",
             "--head-pid", str(os.getpid())]
    if next_address:
        argv += ["--next-stage", next_address]
    return argv


class StageGroup:
    """Stages 1..X-1 of a group, started by its head (last stage first, so each knows its next)."""

    def __init__(self, procs: list[RoleProcess], first_address: str):
        self.procs = procs
        self.first_address = first_address

    @classmethod
    def spawn(cls, cfg, slices: list[tuple[int, int]], timeout_s: float | None = None) -> StageGroup:
        procs: list[RoleProcess] = []
        address = None
        try:
            for stage in range(len(slices) - 1, 0, -1):
                # a stage logs through its head's stderr, as if it were part of the head
                proc = RoleProcess(f"pipeline stage {stage}", stage_argv(cfg, stage, address), on_line=to_stderr)
                procs.append(proc)
                address = proc.wait_ready(timeout_s)["stage"]
        except BaseException:
            cls(procs, "").stop()
            raise
        log.info("CPP group of %d stages ready; stage 1 at %s", len(slices), address)
        return cls(procs, address)

    async def connect(self, token: str | None) -> NextStage:
        return await NextStage.connect(self.first_address, token)

    def stop(self) -> None:
        for proc in self.procs:  # all drain at once
            proc.send(signal.SIGTERM)
        for proc in self.procs:
            proc.stop(10)


def identity(cfg: Config, next_stage: str | None = None, store: str | None = None) -> dict:
    """What INFO says of a process of a group, and what its head compares (``store``: the id of
    the store it writes to, None for a private one)."""
    return {"stage": cfg.pipeline_stage, "group": cfg.pipeline_group, "layers": list(cfg.layer_range),
            "model": cfg.model, "dtype": cfg.dtype, "block_size": cfg.block_size,
            "kv_compression": cfg.kv_compression, "seed": cfg.seed, "next": next_stage, "store": store}


async def connect_group(cfg: Config, group: StageGroup | None, store: str | None = None) -> NextStage | None:
    """The head's link to stage 1: to the stages it started, or dialled at ``--stages`` (each
    until ``--stage-connect-timeout``, so one that is not up is named); the group is checked
    (``store``: the id of the head's store)."""
    if group is not None:
        downstream = await group.connect(cfg.cluster_token)
    elif cfg.stage_addresses:
        deadline = time.monotonic() + cfg.stage_connect_timeout
        links: list[NextStage] = []
        try:   # the last first: a stage opens its socket only once its own next stage answers
            for address in reversed(cfg.stage_addresses):
                links.append(await NextStage.connect(address, cfg.cluster_token,
                                                     max(0.1, deadline - time.monotonic())))
        except BaseException:
            for link in links:
                await link.close()
            raise
        for link in links[:-1]:   # only stage 1's link carries requests
            await link.close()
        downstream = links[-1]
    else:
        return None
    try:
        check_group(cfg, await downstream.info(), store)
    except BaseException:
        await downstream.close()
        raise
    return downstream


def check_group(cfg: Config, stages: list[dict], store: str | None = None) -> None:
    """GroupMismatch unless ``stages`` (INFO from stage 1 on) are stages 1..X-1 of this head's
    group in order, on the same model and cache layout, with layers following on from the head's.
    A stage writing to another store than the head's (``store``) is only warned about."""
    me = identity(cfg)
    where = cfg.stage_addresses or ["(started by this head)"] * (cfg.pipeline_group - 1)
    if len(stages) != cfg.pipeline_group - 1:
        raise GroupMismatch(f"the CPP group behind stage 1 ({where[0]}) has {len(stages)} stage(s); "
                            f"--pipeline-group {cfg.pipeline_group} needs {cfg.pipeline_group - 1}")
    end = me["layers"][1]
    for k, (info, address) in enumerate(zip(stages, where), start=1):
        wrong = [f"{key} {info.get(key)!r} (head: {me[key]!r})" for key in SHARED if info.get(key) != me[key]]
        if info.get("stage") != k:
            wrong.insert(0, f"it is --pipeline-stage {info.get('stage')}")
        if info.get("layers", [None])[0] != end:
            wrong.append(f"its layers {info.get('layers')} do not start where the stage before ends ({end})")
        if wrong:
            raise GroupMismatch(f"CPP stage {k} at {address}: " + "; ".join(wrong))
        end = info["layers"][1]
        if k < len(stages) and cfg.stage_addresses and info.get("next") != where[k]:
            log.warning("CPP stage %d dials %s as its next stage, --stages names %s", k, info.get("next"), where[k])
    num_layers = model_args(cfg.model).num_layers
    if end != num_layers:
        raise GroupMismatch(f"the group's layers end at {end}, the model has {num_layers}")
    for k, info in enumerate(stages, start=1):
        if store is not None and info.get("store") != store:
            log.warning("CPP stage %d writes its layer slices to store %s, this head to %s: a block is whole "
                        "only in a store that gets every stage's slice, so this group will not reuse the "
                        "prefixes it computes", k, info.get("store"), store)


def run_stage(cfg: Config) -> int:
    """Main of a stage > 0: its layer slice, a stage socket, a /health endpoint."""
    spawned = cfg.head_pid is not None
    if spawned:   # only the group head speaks to systemd (NotifyAccess=main): its READY=1 covers the group
        os.environ.pop("NOTIFY_SOCKET", None)
    if cfg.conductor:
        log.info("CPP stage %d does not register with %s: its group's head does", cfg.pipeline_stage, cfg.conductor)
    runner = build_runner(cfg, cfg.layer_range, follower_stores(cfg.store, cfg.cluster_token, cfg.kv_compression,
                                                                cfg.tensor_parallel))
    pack_weights(runner.model, cfg.pack_weights, cfg.prefill_chunk)   # as the head does for its slice
    stage = StageEngine(runner, make_store(cfg, runner), ThreadPoolExecutor(1, thread_name_prefix="stage"),
                        write_back=cfg.write_back)
    try:
        return run_loop(lambda: _serve_stage(cfg, stage))
    except StoreUnfit as exc:
        sys.stderr.write(f"mooncake --role prefill: error: {exc}\n")
        return 2


async def _serve_stage(cfg: Config, stage: StageEngine) -> int:
    """Check the store, dial the next stage, then serve the stage socket (the exit status)."""
    # As a head does: a store whose slots or encoding do not fit ours would refuse or misread.
    try:
        known_as = await store_id(cfg, stage.store, check=True)
    except StoreUnfit:
        await stage.store.close()
        raise
    spawned = cfg.head_pid is not None   # a stage its head started watches it (and exits with it)
    watchers = [asyncio.ensure_future(_watch_head(cfg.head_pid, cfg.pipeline_stage))] if spawned else []
    # A stage started apart may come up before its next one: dial until the deadline.
    next_stage = (await NextStage.connect(cfg.next_stage, cfg.cluster_token, cfg.stage_connect_timeout)
                  if cfg.next_stage else None)
    links = DecodeLinks(cfg.cluster_token)
    me = identity(cfg, cfg.next_stage, known_as)
    server = await start_server(StageServer(stage, links, next_stage, me), cfg.host, cfg.data_port,
                                token=cfg.cluster_token, name="stage")
    app = web.Application()
    app[EXIT] = ExitStatus()
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok", **me}))
    watch_tensor_parallel(app, stage.runner)   # a TP stage: exits 1 once a rank is lost; its group stops last
    app.cleanup_ctx.append(partial(_stage_lifetime, cfg.pipeline_stage, stage, server, links, next_stage, watchers))
    return await serve_role(app, Listener("prefill-stage", cfg.host, cfg.port, cfg.advertise_host),
                            extra_addresses=lambda: {"stage": server_address(server, cfg.advertise_host)})


async def _stage_lifetime(k: int, stage: StageEngine, server: asyncio.Server, links: DecodeLinks,
                          next_stage: NextStage | None, watchers: list[asyncio.Future], app: web.Application):
    """A stage's sockets and links, closed once it stops. Without its next stage this one cannot
    serve: it exits non-zero so a supervisor restarts it (it dials again; its head, losing this
    link in turn, does the same)."""
    if next_stage is not None:
        watchers.append(asyncio.ensure_future(app[EXIT].fail_when_done(
            next_stage.client.conn.closed, f"the link to CPP stage {k + 1} ({next_stage.address}) is gone; "
            f"stage {k} exits", log)))
    yield
    for watcher in watchers:   # shutting down closes the links on purpose
        watcher.cancel()
    server.close()
    await stage.drain_puts()
    await links.close()
    if next_stage is not None:
        await next_stage.close()


async def _watch_head(head_pid: int, stage: int) -> None:
    """A stage its head started must not outlive it (e.g. the head was killed with SIGKILL)."""
    while os.getppid() == head_pid:
        await asyncio.sleep(1.0)
    log.warning("group head %d is gone; stage %d exits", head_pid, stage)
    os.kill(os.getpid(), signal.SIGTERM)
