"""Small fake prefill and decode instances (in-process aiohttp apps) that speak the protocol.

They stand in for the real roles so conductor behaviour can be asserted deterministically:
the "model" is ``fake_next(ids) = 'a' + sum(ids) % 26``, the KV stream is a shared in-process
dict keyed by transfer id (the fake prefill hands its first token to the fake decode, as the
real end frame does), and every request and abort is recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

import aiohttp
import orjson
from aiohttp import web

from mooncake_lite.common.auth import cluster_headers
from mooncake_lite.common.protocol import (AbortRequest, BlockEvents, GenerateRequest, Heartbeat, PrefillRequest,
                                           PrefillResult, Register, TokenEvent, dumps, loads)

MODEL = "tiny"
KV_BYTES = 2 * 4 * 2 * 16 * 4   # tiny: layers 4, kv heads 2, head dim 16, float32


def fake_next(ids: list[int] | tuple[int, ...]) -> int:
    return 97 + sum(ids) % 26


def _next_of(ids: list[int] | tuple[int, ...], stream: int) -> int:
    """The next token of a choice drawing from seed stream ``stream`` (seed + index, as sampling's);
    stream 0 is ``fake_next`` itself (which tests replace)."""
    return fake_next(ids) if stream == 0 else fake_next((*ids, stream))


def expected_tokens(prompt_ids: list[int], max_tokens: int, stop_ids: tuple[int, ...] = (),
                    stream: int = 0) -> list[int]:
    seq, out = list(prompt_ids), []
    while len(out) < max_tokens:
        out.append(_next_of(seq, stream))
        seq.append(out[-1])
        if out[-1] in stop_ids:
            break
    return out


# transfer id -> future of (prompt ids, first token): the fake "KV stream"
KV_WIRE: dict[str, asyncio.Future] = {}


def _wire(transfer_id: str) -> asyncio.Future:
    if transfer_id not in KV_WIRE:
        KV_WIRE[transfer_id] = asyncio.get_running_loop().create_future()
    return KV_WIRE[transfer_id]


@dataclass
class Behaviour:
    refuse: bool = False                 # answer 429 (decode: local TBT check; prefill: full)
    fail_status: int | None = None       # answer this HTTP error
    hang: bool = False                   # never answer (prefill) / never send tokens (decode)
    token_delay_s: float = 0.0           # decode: pause between tokens
    slow_token_every: int = 0            # decode: every Nth token pauses slow_token_delay_s more (0: none)
    slow_token_delay_s: float = 0.0
    break_after: int | None = None       # decode: drop the connection after N tokens
    pause_after: int | None = None       # decode: stop sending after N tokens (a hang) until ``resume`` is set
    resume: asyncio.Event = field(default_factory=asyncio.Event)
    die_after_kv: bool = False           # prefill: send the "KV", then drop the connection before the result
    die_before_kv: bool = False          # decode: reserve (200), then drop the connection before any KV
    result_delay_s: float = 0.0          # prefill: answer this long after the "KV" went to decode
    timings: dict = field(default_factory=dict)   # prefill: the timings its result reports


@dataclass
class FakeInstance:
    role: str
    instance_id: str
    store: str | None = None
    behaviour: Behaviour = field(default_factory=Behaviour)
    requests: list = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    cost: dict = field(default_factory=dict)
    load: dict = field(default_factory=dict)
    server: object = None
    is_heartbeating: bool = True
    token: str | None = None
    _active: dict[str, asyncio.Event] = field(default_factory=dict)

    # ---- app ----
    def make_app(self) -> web.Application:
        app = web.Application(handler_args={"handler_cancellation": True})
        app.router.add_post("/v1/prefill", self.prefill)
        app.router.add_post("/v1/generate", self.generate)
        app.router.add_post("/v1/abort", self.abort)
        return app

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def register_msg(self, **changes) -> Register:
        reg = Register(role=self.role, instance_id=self.instance_id, http=self.http,
                       data=f"127.0.0.1:{self.server.port}" if self.role == "decode" else None,
                       store=self.store, model=MODEL, block_size=4, hash_seed=0,
                       kv_bytes_per_token=KV_BYTES, max_context=4096, cost=self.cost)
        return dataclasses.replace(reg, **changes)

    async def prefill(self, request: web.Request) -> web.Response:
        req = loads(PrefillRequest, await request.read())
        self.requests.append(req)
        b = self.behaviour
        if b.refuse:
            return web.json_response({"error": {"message": "prefill queue full"}}, status=429)
        if b.fail_status:
            return web.json_response({"error": {"message": "prefill exploded"}}, status=b.fail_status)
        if b.hang:
            await asyncio.Event().wait()
        s = req.sampling
        firsts = tuple(_next_of(req.token_ids, (s.seed or 0) + i) for i in range(s.n))
        _wire(req.transfer_id).set_result((req.token_ids, firsts))
        if b.die_after_kv:
            request.transport.close()
            return web.Response()
        if b.result_delay_s:
            await asyncio.sleep(b.result_delay_s)
        return web.Response(body=dumps(PrefillResult(req.request_id, firsts[0], len(req.prefix_keys) * 4,
                                                     len(req.token_ids) - len(req.prefix_keys) * 4,
                                                     dict(b.timings), firsts if s.n > 1 else ())),
                            content_type="application/json")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = loads(GenerateRequest, await request.read())
        self.requests.append(req)
        b = self.behaviour
        if b.refuse:
            return web.json_response({"error": {"message": "TBT SLO would break"}}, status=429)
        if b.fail_status:
            return web.json_response({"error": {"message": "decode exploded"}}, status=b.fail_status)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        aborted = self._active[req.request_id] = asyncio.Event()
        try:
            if b.die_before_kv:
                request.transport.close()
                return resp
            prompt, firsts = await _wire(req.transfer_id)
            if b.hang:
                await asyncio.Event().wait()
            s = req.sampling
            seqs, n = [[*prompt, first] for first in firsts], 1 + s.num_generated   # (one per choice)
            ends = ["stop" if f in s.stop_token_ids else ("length" if n >= s.max_tokens else None) for f in firsts]
            for i in [i for i, e in enumerate(ends) if e is not None]:
                await resp.write(dumps(TokenEvent(finish_reason=ends[i], index=i)) + b"\n")
            while None in ends:
                if b.token_delay_s:
                    await asyncio.sleep(b.token_delay_s)
                if b.slow_token_every and n % b.slow_token_every == 0:
                    await asyncio.sleep(b.slow_token_delay_s)
                if aborted.is_set():   # (one line ends every choice)
                    await resp.write(dumps(TokenEvent(finish_reason="abort")) + b"\n")
                    break
                if b.break_after is not None and n - 1 - s.num_generated >= b.break_after:
                    request.transport.close()
                    return resp
                if b.pause_after is not None and n - 1 - s.num_generated == b.pause_after:
                    await b.resume.wait()
                n += 1
                for i in [i for i, e in enumerate(ends) if e is None]:
                    seqs[i].append(tok := _next_of(seqs[i], (s.seed or 0) + i))
                    await resp.write(dumps(TokenEvent(token=tok, index=i)) + b"\n")
                    ends[i] = "stop" if tok in s.stop_token_ids else ("length" if n >= s.max_tokens else None)
                    if ends[i] is not None:
                        await resp.write(dumps(TokenEvent(finish_reason=ends[i], index=i)) + b"\n")
            await resp.write_eof()
        finally:
            self._active.pop(req.request_id, None)
        return resp

    async def abort(self, request: web.Request) -> web.Response:
        req = loads(AbortRequest, await request.read())
        self.aborts.append(req.request_id)
        ev = self._active.get(req.request_id)
        if ev is None:
            return web.json_response({"error": {"message": "unknown request"}}, status=404)
        ev.set()
        return web.json_response({"ok": True})


async def post(session: aiohttp.ClientSession, url: str, msg, token: str | None = None):
    async with session.post(url, data=dumps(msg), headers=cluster_headers(token)) as resp:
        return resp.status, orjson.loads(await resp.read())


async def register(session, conductor_url: str, inst: FakeInstance, **changes):
    return await post(session, f"{conductor_url}/internal/v1/register", inst.register_msg(**changes), inst.token)


async def heartbeat(session, conductor_url: str, inst: FakeInstance):
    return await post(session, f"{conductor_url}/internal/v1/heartbeat", Heartbeat(inst.instance_id, inst.load),
                      inst.token)


async def block_events(session, conductor_url: str, store: str, stored=(), evicted=(), full=False):
    msg = BlockEvents(store, tuple(k.hex() for k in stored), tuple(k.hex() for k in evicted), full)
    return await post(session, f"{conductor_url}/internal/v1/block_events", msg)
