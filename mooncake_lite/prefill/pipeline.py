"""Chunked Pipeline Parallelism: a prefill group of X processes, each owning a slice of layers.

The group head (stage 0, the one the conductor talks to) talks to stage 1 over the transfer
framing, and every stage talks to the next the same way (the processes: ``stage_process.py``):

    OP_STAGE_MATCH {rid, keys}                 -> {"num_blocks"}: min leading store hit, this stage and after
    OP_STAGE_BEGIN {rid, tid, token_ids, decode_data, sampling, keys, num_prefix_blocks} -> ok
    OP_STAGE_CHUNK {rid, start, n} + payload   the previous stage's activations [n][dim] (raw bytes);
                                               answered on receipt, so the sender computes its next
                                               chunk while this stage computes this one
    OP_STAGE_END   {rid}                       -> {"first_tokens", "first_logprobs", "prompt_logprobs"} once
                                                  every chunk went through all stages (the last
                                                  stage's: it holds the LM head)
    OP_STAGE_ABORT {rid, reason}               -> ok (forwarded down the group)
    OP_STAGE_INFO  {}                          -> {"stages": [what each stage is, this one first]}
    OP_STAGE_FLUSH {rid}                       -> ok once every chunk sent so far went through all stages

BEGIN with ``decode_data: null`` runs a request whose KV goes nowhere: the head's start-up
profile of the whole group (``profiling.profile_served``) times chunks that way, with FLUSH.
A request whose link from the previous stage is lost is dropped (its KV cache blocks freed).

Only stage-boundary activations cross between stages; each stage loads its own layers' prefix KV
from its store, streams its own layers' KV to decode, and writes its layer slice back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field

import torch

from mooncake_lite.common.protocol import Sampling, TokenLogprob, from_dict
from mooncake_lite.model.sampling import chunk_logprobs, reports_logprobs
from mooncake_lite.prefill.engine import StageEngine, StageJob
from mooncake_lite.prefill.kv_sender import DecodeLinks, KVSender, tensor_bytes
from mooncake_lite.prefill.results import Firsts, sample_firsts
from mooncake_lite.transfer.client import FrameClient, split_address
from mooncake_lite.transfer.connection import FrameConnection, FrameHandler
from mooncake_lite.transfer.framing import FLAG_REPLY, Frame
from mooncake_lite.transfer.server import reply_error

log = logging.getLogger(__name__)

OP_STAGE_MATCH, OP_STAGE_BEGIN, OP_STAGE_CHUNK, OP_STAGE_END, OP_STAGE_ABORT = 30, 31, 32, 33, 34
OP_STAGE_INFO, OP_STAGE_FLUSH = 35, 36
DIAL_INTERVAL_S = 0.5


class StageUnreachable(RuntimeError):
    """The next stage of a CPP group did not answer within the start-up deadline."""


class NextStage:
    """Client side of the link to the next stage."""

    def __init__(self, client: FrameClient, address: str = ""):
        self.client = client
        self.address = address

    @classmethod
    async def connect(cls, address: str, token: str | None, deadline_s: float | None = None) -> NextStage:
        """Dial the stage at ``address``; with ``deadline_s``, keep dialling (it may still be
        starting, e.g. its unit comes up after ours) until then, and raise StageUnreachable."""
        host, port = split_address(address)
        give_up = time.monotonic() + (deadline_s or 0.0)
        is_waiting = False
        while True:
            # Each attempt within what is left (a node that drops packets answers no connect at all).
            attempt_s = 10.0 if deadline_s is None else min(10.0, max(0.5, give_up - time.monotonic()))
            try:
                client = await FrameClient.connect(host, port, token=token, name="stage", timeout=attempt_s,
                                                   label=f"CPP stage {address}")
                return cls(client, address)
            except (ConnectionError, OSError, asyncio.TimeoutError) as exc:  # RemoteError (token): at once
                if deadline_s is None or time.monotonic() >= give_up:
                    raise StageUnreachable(
                        f"CPP stage at {address} did not answer within {deadline_s or 0:g} s ({exc}); is it "
                        "started (mooncake --role prefill --pipeline-stage K ...) and listening there?") from None
                if not is_waiting:
                    log.info("CPP stage at %s does not answer yet (%s); dialling it for up to %g s",
                             address, exc, deadline_s)
                    is_waiting = True
            await asyncio.sleep(DIAL_INTERVAL_S)

    async def info(self) -> list[dict]:
        """What each stage from this one to the last is (stage, group, layers, model, next)."""
        return list((await self.client.request(OP_STAGE_INFO, {})).meta["stages"])

    async def flush(self, rid: str) -> None:
        await self.client.request(OP_STAGE_FLUSH, {"rid": rid})

    async def match(self, rid: str, keys: list[bytes]) -> int:
        frame = await self.client.request(OP_STAGE_MATCH, {"rid": rid, "keys": [k.hex() for k in keys]})
        return int(frame.meta["num_blocks"])

    async def begin(self, rid: str, tid: str, token_ids, decode_data: str | None, sampling: dict,
                    keys: list[bytes], num_prefix_blocks: int) -> None:
        await self.client.request(OP_STAGE_BEGIN, {
            "rid": rid, "tid": tid, "token_ids": list(token_ids), "decode_data": decode_data,
            "sampling": sampling, "keys": [k.hex() for k in keys], "num_prefix_blocks": num_prefix_blocks})

    async def send_chunk(self, rid: str, start: int, hidden: torch.Tensor) -> None:
        hidden = hidden.detach().cpu().contiguous()
        await self.client.request(OP_STAGE_CHUNK, {"rid": rid, "start": start, "n": hidden.shape[0]},
                                  [tensor_bytes(hidden)])

    async def end(self, rid: str) -> tuple[Firsts, tuple[TokenLogprob, ...]]:
        """Token 1 of each choice, and the prompt's logprobs when the request asked for them."""
        meta = (await self.client.request(OP_STAGE_END, {"rid": rid})).meta
        firsts = Firsts(tuple(map(int, meta["first_tokens"])),
                        tuple(TokenLogprob(**lp) for lp in meta.get("first_logprobs", ())))
        return firsts, tuple(TokenLogprob(**lp) for lp in meta.get("prompt_logprobs", ()))

    async def abort(self, rid: str, reason: str) -> None:
        try:
            await asyncio.wait_for(self.client.request(OP_STAGE_ABORT, {"rid": rid, "reason": reason}), 5)
        except Exception as exc:
            log.warning("could not forward abort of %s to the next stage: %s", rid, exc)

    async def close(self) -> None:
        await self.client.close()


class NullSender:
    """The KV "stream" of a profiling request: nothing is sent anywhere."""
    error: str | None = None
    num_frames = num_bytes = 0

    def send_layer(self, layer: int, start: int, kv) -> None:
        pass

    async def end(self, first_layer: int, end_layer: int, first_token: int | None, resume: dict | None = None) -> None:
        pass

    async def flush(self) -> None:
        pass

    async def abort(self, reason: str) -> None:
        pass


@dataclass
class StageWork:
    """One request on a stage > 0: its job, its chunks in arrival order, the worker running them."""
    job: StageJob
    sampling: dict
    upstream: FrameConnection | None = None    # the link it came on: if that goes, so does the request
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    worker: asyncio.Task | None = None
    logits: torch.Tensor | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)   # the last stage's, when asked


class StageServer(FrameHandler):
    """A stage > 0: runs what the previous stage hands it, forwards to the next stage.
    ``identity`` is what INFO says of this stage (stage, group, layers, model, next)."""

    def __init__(self, stage: StageEngine, links: DecodeLinks, next_stage: NextStage | None,
                 identity: dict | None = None):
        self.stage = stage
        self.links = links
        self.next = next_stage
        self.identity = identity or {}
        self.works: dict[str, StageWork] = {}
        self.dim = stage.runner.args.dim

    def frame_received(self, conn: FrameConnection, frame: Frame) -> None:
        handlers = {OP_STAGE_MATCH: self._match, OP_STAGE_BEGIN: self._begin, OP_STAGE_CHUNK: self._chunk,
                    OP_STAGE_END: self._end, OP_STAGE_ABORT: self._abort, OP_STAGE_INFO: self._info,
                    OP_STAGE_FLUSH: self._flush}
        handler = handlers.get(frame.op)
        if handler is None:
            reply_error(conn, frame, "bad_op", f"unknown stage operation {frame.op}")
            return
        if frame.op == OP_STAGE_BEGIN:
            handler = functools.partial(self._begin, upstream=conn)
        asyncio.ensure_future(self._answer(conn, frame, handler))

    def connection_lost(self, conn: FrameConnection, exc: Exception | None) -> None:
        # The previous stage (or the head) is gone: nobody will end its requests here.
        for rid in [rid for rid, work in self.works.items() if work.upstream is conn]:
            asyncio.ensure_future(self._fail(rid, "the link from the previous CPP stage was lost"))

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

    async def _info(self, frame: Frame) -> dict:
        rest = await self.next.info() if self.next is not None else []
        return {"stages": [self.identity, *rest]}

    async def _begin(self, frame: Frame, upstream: FrameConnection | None = None) -> None:
        m = frame.meta
        rid, keys = m["rid"], [bytes.fromhex(k) for k in m["keys"]]
        decode = m["decode_data"]
        sender = NullSender() if decode is None else KVSender.for_runner(await self.links.get(decode), m["tid"],
                                                                         self.stage.runner, decode)
        job = self.stage.begin(rid, m["token_ids"], keys, int(m["num_prefix_blocks"]), sender,
                               reports_logprobs(from_dict(Sampling, m["sampling"])))
        work = StageWork(job, m["sampling"], upstream)
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

    async def _flush(self, frame: Frame) -> None:
        work = self._work(frame.meta["rid"])
        done = asyncio.get_running_loop().create_future()
        work.chunks.put_nowait(done)
        await asyncio.wait([done, work.worker], return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            raise RuntimeError("the request ended before its chunks went through")
        done.result()

    async def _run(self, rid: str, work: StageWork) -> None:
        while True:
            item = await work.chunks.get()
            if item is None:
                return
            if isinstance(item, asyncio.Future):   # FLUSH: every chunk before it went through
                try:
                    if self.next is not None:
                        await self.next.flush(rid)
                    item.set_result(None)
                except Exception as exc:
                    item.set_exception(exc)
                continue
            start, hidden = item
            k = work.sampling.get("prompt_logprobs") if self.next is None else None
            out = await self.stage.run_chunk(work.job, start, hidden=hidden, all_positions=k is not None)
            if self.next is not None:
                await self.next.send_chunk(rid, start, out)
            elif k is not None:
                work.logits, more = await asyncio.get_running_loop().run_in_executor(
                    self.stage.executor, chunk_logprobs, out, work.job.token_ids, start, int(k))
                work.prompt_logprobs += more
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
                first = sample_firsts(work.logits, from_dict(Sampling, work.sampling), work.job.token_ids,
                                      self.stage.runner.grammars)
                await self.stage.finish(work.job, first)
                prompt_lps = tuple(work.prompt_logprobs)
            else:
                await self.stage.finish(work.job, None)
                first, prompt_lps = await self.next.end(rid)
            return {"first_tokens": list(first.tokens),
                    "first_logprobs": [dataclasses.asdict(lp) for lp in first.logprobs],
                    "prompt_logprobs": [dataclasses.asdict(lp) for lp in prompt_lps]}
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
