"""The processes of a CPP group: the head starts stages 1..X-1, each runs one layer slice.

Stage k is the same ``mooncake --role prefill`` command as the head, plus ``--pipeline-stage k``
and ``--next-stage`` (the socket of stage k+1); it prints a ready line with its ``"stage"``
socket address and exits when its head disappears.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields

from aiohttp import web

from mooncake_lite.common.config import flag_name
from mooncake_lite.common.launch import RoleProcess, role_argv, to_stderr
from mooncake_lite.common.service import run as run_loop
from mooncake_lite.common.service import serve_app
from mooncake_lite.instance.runner import build_runner
from mooncake_lite.model.checkpoint_config import model_args
from mooncake_lite.prefill.app import make_store
from mooncake_lite.prefill.engine import StageEngine
from mooncake_lite.prefill.kv_sender import DecodeLinks
from mooncake_lite.prefill.pipeline import NextStage, StageServer
from mooncake_lite.transfer.server import server_address, start_server

log = logging.getLogger(__name__)

SKIP_FLAGS = {"pipeline_stage", "next_stage", "port", "data_port", "conductor", "instance_id", "profile"}


def layer_slices(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal layer ranges, one per stage."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    bounds = [round(i * num_layers / num_stages) for i in range(num_stages + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


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
    argv += ["--pipeline-stage", str(stage), "--port", "0", "--data-port", "0", "--no-profile"]
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


def run_stage(cfg) -> int:
    """Main of a stage > 0: its layer slice, a stage socket, a /health endpoint."""
    # Only the group head speaks to systemd (NotifyAccess=main): its READY=1 covers the group.
    os.environ.pop("NOTIFY_SOCKET", None)
    layer_range = layer_slices(model_args(cfg.model).num_layers, cfg.pipeline_group)[cfg.pipeline_stage]
    runner = build_runner(cfg, layer_range)
    stage = StageEngine(runner, make_store(cfg, runner), ThreadPoolExecutor(1, thread_name_prefix="stage"),
                        write_back=cfg.write_back)

    async def watch_parent(parent: int) -> None:
        # A stage must not outlive its group head (e.g. the head was killed with SIGKILL).
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        log.warning("group head %d is gone; stage %d exits", parent, cfg.pipeline_stage)
        os.kill(os.getpid(), signal.SIGTERM)

    parent_pid = os.getppid()

    async def main() -> None:
        watcher = asyncio.ensure_future(watch_parent(parent_pid))
        next_stage = await NextStage.connect(cfg.next_stage, cfg.cluster_token) if cfg.next_stage else None
        links = DecodeLinks(cfg.cluster_token)
        server = await start_server(StageServer(stage, links, next_stage), cfg.host, cfg.data_port,
                                    token=cfg.cluster_token, name="stage")
        app = web.Application()
        app.router.add_get("/health", lambda r: web.json_response({"status": "ok", "stage": cfg.pipeline_stage}))
        try:
            await serve_app(app, cfg.host, cfg.port, role="prefill-stage",
                            extra_addresses=lambda: {"stage": server_address(server)})
        finally:
            watcher.cancel()
            server.close()
            await stage.drain_puts()
            await links.close()
            if next_stage is not None:
                await next_stage.close()

    run_loop(main)
    return 0
