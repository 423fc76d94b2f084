"""Chunked Pipeline Parallelism: a prefill group of X processes, each owning a slice of layers.

The group head (stage 0, the one the conductor talks to) starts stages 1..X-1 as child processes
and talks to stage 1 over the transfer framing; every stage talks to the next the same way:

    OP_STAGE_MATCH {rid, keys}                 -> {"num_blocks"}: min leading store hit, this stage and after
    OP_STAGE_BEGIN {rid, tid, token_ids, decode_data, sampling, keys, num_prefix_blocks} -> ok
    OP_STAGE_CHUNK {rid, start, n} + payload   the previous stage's activations [n][dim] (raw bytes);
                                               answered on receipt, so the sender computes its next
                                               chunk while this stage computes this one
    OP_STAGE_END   {rid}                       -> {"first_token"} once every chunk went through all stages
    OP_STAGE_ABORT {rid, reason}               -> ok (forwarded down the group)

Only stage-boundary activations cross between stages; each stage loads its own layers' prefix KV
from its store, streams its own layers' KV to decode, and writes its layer slice back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields

import orjson
import torch

from mooncake_lite.common.config import flag_name
from mooncake_lite.model.sampling import make_generator, sample
from mooncake_lite.prefill.engine import StageEngine, StageJob
from mooncake_lite.prefill.kv_sender import DecodeLinks, KVSender, tensor_bytes
from mooncake_lite.prefill.service import sampling_params
from mooncake_lite.transfer.client import FrameClient
from mooncake_lite.transfer.connection import FrameConnection, FrameHandler
from mooncake_lite.transfer.framing import FLAG_REPLY, Frame
from mooncake_lite.transfer.server import reply_error, server_address, start_server

log = logging.getLogger(__name__)

OP_STAGE_MATCH, OP_STAGE_BEGIN, OP_STAGE_CHUNK, OP_STAGE_END, OP_STAGE_ABORT = 30, 31, 32, 33, 34


class NextStage:
    """Client side of the link to the next stage."""

    def __init__(self, client: FrameClient):
        self.client = client

    @classmethod
    async def connect(cls, address: str, token: str | None) -> NextStage:
        host, _, port = address.rpartition(":")
        return cls(await FrameClient.connect(host, int(port), token=token, name="stage"))

    async def match(self, rid: str, keys: list[bytes]) -> int:
        frame = await self.client.request(OP_STAGE_MATCH, {"rid": rid, "keys": [k.hex() for k in keys]})
        return int(frame.meta["num_blocks"])

    async def begin(self, rid: str, tid: str, token_ids, decode_data: str, sampling: dict,
                    keys: list[bytes], num_prefix_blocks: int) -> None:
        await self.client.request(OP_STAGE_BEGIN, {
            "rid": rid, "tid": tid, "token_ids": list(token_ids), "decode_data": decode_data,
            "sampling": sampling, "keys": [k.hex() for k in keys], "num_prefix_blocks": num_prefix_blocks})

    async def send_chunk(self, rid: str, start: int, hidden: torch.Tensor) -> None:
        hidden = hidden.detach().cpu().contiguous()
        await self.client.request(OP_STAGE_CHUNK, {"rid": rid, "start": start, "n": hidden.shape[0]},
                                  [tensor_bytes(hidden)])

    async def end(self, rid: str) -> int:
        return int((await self.client.request(OP_STAGE_END, {"rid": rid})).meta["first_token"])

    async def abort(self, rid: str, reason: str) -> None:
        try:
            await asyncio.wait_for(self.client.request(OP_STAGE_ABORT, {"rid": rid, "reason": reason}), 5)
        except Exception as exc:
            log.warning("could not forward abort of %s to the next stage: %s", rid, exc)

    async def close(self) -> None:
        await self.client.close()


@dataclass
class StageWork:
    """One request on a stage > 0: its job, its chunks in arrival order, the worker running them."""
    job: StageJob
    sampling: dict
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    worker: asyncio.Task | None = None
    logits: torch.Tensor | None = None


class StageServer(FrameHandler):
    """A stage > 0: runs what the previous stage hands it, forwards to the next stage."""

    def __init__(self, stage: StageEngine, links: DecodeLinks, next_stage: NextStage | None):
        self.stage = stage
        self.links = links
        self.next = next_stage
        self.works: dict[str, StageWork] = {}
        self.dim = stage.runner.args.dim

    def frame_received(self, conn: FrameConnection, frame: Frame) -> None:
        handlers = {OP_STAGE_MATCH: self._match, OP_STAGE_BEGIN: self._begin, OP_STAGE_CHUNK: self._chunk,
                    OP_STAGE_END: self._end, OP_STAGE_ABORT: self._abort}
        handler = handlers.get(frame.op)
        if handler is None:
            reply_error(conn, frame, "bad_op", f"unknown stage operation {frame.op}")
            return
        asyncio.ensure_future(self._answer(conn, frame, handler))

    async def _answer(self, conn: FrameConnection, frame: Frame, handler) -> None:
        try:
            meta = await handler(frame)
        except Exception as exc:
            log.warning("stage op %d failed: %s", frame.op, exc)
            if not conn.closed.done():
                reply_error(conn, frame, "stage_failed", str(exc) or type(exc).__name__)
            return
        if not conn.closed.done():
            conn.send(frame.op, frame.request_id, meta or {"ok": True}, flags=FLAG_REPLY)

    async def _match(self, frame: Frame) -> dict:
        keys = [bytes.fromhex(k) for k in frame.meta["keys"]]
        hit = await self.stage.match(keys)
        if self.next is not None and hit:
            hit = min(hit, await self.next.match(frame.meta["rid"], keys[:hit]))
        return {"num_blocks": hit}

    async def _begin(self, frame: Frame) -> None:
        m = frame.meta
        rid, keys = m["rid"], [bytes.fromhex(k) for k in m["keys"]]
        sender = KVSender(await self.links.get(m["decode_data"]), m["tid"])
        job = self.stage.begin(rid, m["token_ids"], keys, int(m["num_prefix_blocks"]), sender)
        work = StageWork(job, m["sampling"])
        self.works[rid] = work
        try:
            if self.next is not None:
                await self.next.begin(rid, m["tid"], m["token_ids"], m["decode_data"], m["sampling"], keys,
                                      int(m["num_prefix_blocks"]))
        except BaseException as exc:
            await self._fail(rid, str(exc))
            raise
        work.worker = asyncio.ensure_future(self._run(rid, work))

    async def _chunk(self, frame: Frame) -> None:
        work = self._work(frame.meta["rid"])
        n = int(frame.meta["n"])
        raw = frame.payload[0] if len(frame.payload) == 1 else memoryview(bytearray(frame.payload_bytes()))
        hidden = torch.frombuffer(raw, dtype=self.stage.runner.dtype).view(n, self.dim)
        work.chunks.put_nowait((int(frame.meta["start"]), hidden))

    async def _run(self, rid: str, work: StageWork) -> None:
        while True:
            item = await work.chunks.get()
            if item is None:
                return
            start, hidden = item
            out = await self.stage.run_chunk(work.job, start, hidden=hidden)
            if self.next is not None:
                await self.next.send_chunk(rid, start, out)
            else:
                work.logits = out

    async def _end(self, frame: Frame) -> dict:
        rid = frame.meta["rid"]
        work = self._work(rid)
        error = None
        try:
            work.chunks.put_nowait(None)
            await work.worker
            if self.next is None:
                params = sampling_params(work.sampling)
                first = sample(work.logits, params, make_generator(params))
                await self.stage.finish(work.job, first)
            else:
                await self.stage.finish(work.job, None)
                first = await self.next.end(rid)
            return {"first_token": int(first)}
        except BaseException as exc:
            error = str(exc) or type(exc).__name__
            if self.next is not None:
                await self.next.abort(rid, error)
            raise
        finally:
            self.works.pop(rid, None)
            await self.stage.release(work.job, error)

    async def _abort(self, frame: Frame) -> None:
        await self._fail(frame.meta["rid"], str(frame.meta.get("reason", "aborted")))

    async def _fail(self, rid: str, reason: str) -> None:
        work = self.works.pop(rid, None)
        if work is not None:
            self.stage.abort(rid, reason)
            if work.worker is not None:
                work.worker.cancel()
            await self.stage.release(work.job, reason)
        if self.next is not None:
            await self.next.abort(rid, reason)

    def _work(self, rid: str) -> StageWork:
        work = self.works.get(rid)
        if work is None:
            raise KeyError(f"request {rid!r} is not running on this stage")
        return work


# --- processes ------------------------------------------------------------------------------------
SKIP_FLAGS = {"pipeline_stage", "next_stage", "port", "data_port", "conductor", "instance_id", "profile"}


def stage_argv(cfg, stage: int, next_address: str | None) -> list[str]:
    """The command line of stage ``stage``: the head's own settings plus its place in the group."""
    argv = [sys.executable, "-m", "mooncake_lite", "--role", "prefill"]
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

    def __init__(self, procs: list[subprocess.Popen], first_address: str):
        self.procs = procs
        self.first_address = first_address

    @classmethod
    def spawn(cls, cfg, slices: list[tuple[int, int]], timeout_s: float = 120.0) -> StageGroup:
        procs: list[subprocess.Popen] = []
        address = None
        try:
            for stage in range(len(slices) - 1, 0, -1):
                proc = subprocess.Popen(stage_argv(cfg, stage, address), stdout=subprocess.PIPE, text=True)
                procs.append(proc)
                address = _wait_ready(proc, stage)
        except BaseException:
            cls(procs, "").stop()
            raise
        log.info("CPP group of %d stages ready; stage 1 at %s", len(slices), address)
        return cls(procs, address)

    async def connect(self, token: str | None) -> NextStage:
        return await NextStage.connect(self.first_address, token)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _wait_ready(proc: subprocess.Popen, stage: int) -> str:
    for line in proc.stdout:
        try:
            msg = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(msg, dict) and msg.get("event") == "ready":
            return msg["stage"]
    raise RuntimeError(f"pipeline stage {stage} exited before it was ready (rc={proc.wait()})")


def run_stage(cfg) -> int:
    """Main of a stage > 0: its layer slice, a stage socket, a /health endpoint."""
    from aiohttp import web

    from mooncake_lite.common.service import run as run_loop
    from mooncake_lite.common.service import serve_app
    from mooncake_lite.model.weights import model_args
    from mooncake_lite.prefill.main import layer_slices, make_store
    from mooncake_lite.prefill.worker_config import build_runner

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
