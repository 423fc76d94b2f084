"""The conductor's drain on SIGTERM (conductor/drain.py), in process and served as in production
(``start_site``, then ``service.drain`` and ``runner.cleanup``, the steps ``serve_app`` takes on
the signal): streams in flight finish while heartbeats still arrive, new requests and ``/health``
get a 503, and a request that outlasts the drain (or is still running when a second signal cuts
it short) ends with an error naming the shutdown: a 503, not an upstream 502."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from mooncake_lite.common import service
from mooncake_lite.common.protocol import Register
from mooncake_lite.conductor.api.state import API
from mooncake_lite.conductor.app import make_app
from mooncake_lite.conductor.config import Config
from mooncake_lite.conductor.cluster.membership import Membership
from tests.conductor import fakes
from tests.conductor.fakes import FakeInstance

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def conductor(aiohttp_server):
    """``url, app, runner, session, decode = await conductor(dead_after=...)``: a conductor with
    one fake prefill and one fake decode (``decode_cls``) that heartbeat every 50 ms for as long
    as it listens."""
    started: list = []

    async def _start(decode_cls=FakeInstance, **overrides):
        app = make_app(Config(**{"model": "tiny", "block_size": 4, "admission": "none", **overrides}))
        runner, site = await service.start_site(app, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{service.bound_port(site)}"
        session = aiohttp.ClientSession()
        instances = [FakeInstance("prefill", "p0", store="store0:1"), decode_cls("decode", "d0")]
        for inst in instances:
            inst.server = await aiohttp_server(inst.make_app())
            assert (await fakes.register(session, url, inst))[0] == 200

        async def beat() -> None:
            while True:
                for inst in instances:
                    try:
                        await fakes.heartbeat(session, url, inst)
                    except aiohttp.ClientError:   # the listener closed: the cleanup's end
                        pass
                await asyncio.sleep(0.05)

        started.append((runner, session, asyncio.get_running_loop().create_task(beat())))
        return url, app, runner, session, instances[1]

    yield _start
    for runner, session, task in started:
        task.cancel()
        await runner.cleanup()
        await session.close()


async def _stream(session, url: str, max_tokens: int):
    """(status, the SSE events as JSON, whether it ended with [DONE]); returns after the first
    event so the caller can act mid-stream: ``rest`` reads the others."""
    body = {"model": "tiny", "prompt": "abc", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    resp = await session.post(url + "/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    first = await resp.content.readline()
    assert first.startswith(b"data: {")

    async def rest() -> tuple[list[dict], bool]:
        events, done = [], False
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: "):
                events.append(orjson.loads(line[6:]))
        resp.release()
        return events, done
    return rest


async def _new_request(session, url: str) -> tuple[int, dict]:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    async with session.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


async def _health(session, url: str) -> tuple[int, dict]:
    async with session.get(url + "/health") as r:
        return r.status, await r.json()


async def _placed(app, instance_id: str = "d0") -> None:
    """Until a request is placed on ``instance_id`` (the membership watches it there)."""
    while not app[API].svc.membership.instances[instance_id].watchers:
        await asyncio.sleep(0.01)


async def test_streams_in_flight_finish_during_the_drain_and_new_requests_get_503(conductor):
    """dead_after 0.5 s, a stream of ~1.2 s after the drain starts: closing the listener first
    made the heartbeats fail, and the reaper then failed the stream with "stopped heartbeating".
    ``/health`` says 503 draining meanwhile (out of rotation), the heartbeats are still taken."""
    url, app, runner, session, d0 = await conductor(dead_after=0.5)
    d0.behaviour.token_delay_s = 0.05
    assert (await _health(session, url))[1]["status"] == "ok"
    rest = await _stream(session, url, max_tokens=25)
    drain = asyncio.create_task(service.drain(app, 30.0))
    await asyncio.sleep(0)
    status, body = await _new_request(session, url)
    assert status == 503 and "shutting down" in body["error"]["message"], body
    assert body["error"]["code"] == "conductor_shutting_down"
    status, body = await _health(session, url)
    assert status == 503 and body["status"] == "draining" and body["ready"] is False, body
    assert body["in_flight"] == 1
    assert (await fakes.heartbeat(session, url, d0))[0] == 200     # still listening for them
    events, done = await rest()
    assert done and [e for e in events if "error" in e] == []
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert len([e for e in events if e["choices"] and e["choices"][0]["text"]]) == 24   # tokens 2..25
    await asyncio.wait_for(drain, 10)                 # over once the stream is
    membership = app[API].svc.membership
    assert membership.instances["d0"].is_alive and membership.events[("decode", "dead-silent")] == 0
    await runner.cleanup()


async def test_a_stream_outlasting_the_drain_ends_with_an_error_naming_the_shutdown(conductor):
    url, app, runner, session, d0 = await conductor(dead_after=60.0)
    d0.behaviour.token_delay_s = 0.05
    rest = await _stream(session, url, max_tokens=1000)
    await service.drain(app, 0.2)
    events, done = await rest()
    errors = [e["error"]["message"] for e in events if "error" in e]
    assert done and errors == ["the conductor shut down before the request completed (its drain of 0.2s ran out)"]
    membership = app[API].svc.membership
    assert membership.instances["d0"].is_alive          # nothing blamed on the decode
    assert not membership.instances["d0"].watchers       # the request is over there too
    await runner.cleanup()


async def test_a_non_streamed_request_outlasting_the_drain_gets_a_503_naming_the_shutdown(conductor):
    """The conductor's own stop is not the decode's failure: a 503 to retry, not a 502 upstream_error."""
    url, app, runner, session, d0 = await conductor(dead_after=60.0)
    d0.behaviour.token_delay_s = 0.05
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 1000, "temperature": 0}
    answer = asyncio.create_task(session.post(url + "/v1/completions", json=body))
    await asyncio.wait_for(_placed(app), 10)
    await service.drain(app, 0.2)
    async with await answer as resp:
        status, retry_after, error = resp.status, resp.headers.get("Retry-After"), (await resp.json())["error"]
    assert status == 503 and retry_after == "1", error
    assert error["code"] == "conductor_shutting_down" and error["type"] == "server_error"
    assert error["message"] == "the conductor shut down before the request completed (its drain of 0.2s ran out)"
    assert app[API].svc.membership.instances["d0"].is_alive
    await runner.cleanup()


async def test_hurrying_the_drain_ends_the_requests_in_flight_at_once(conductor):
    """What a second SIGTERM/Ctrl-C does (``service.serve_app`` sets ``hurry``): the drain's
    30 s bound is not waited out; the stream ends with the shutdown's error event."""
    url, app, runner, session, d0 = await conductor(dead_after=60.0)
    d0.behaviour.token_delay_s = 0.05
    rest = await _stream(session, url, max_tokens=1000)
    hurry = asyncio.Event()
    drain = asyncio.create_task(service.drain(app, 30.0, hurry))
    await asyncio.sleep(0.1)
    assert not drain.done()                       # waiting for the stream
    hurry.set()
    await asyncio.wait_for(drain, 10)
    events, done = await rest()
    errors = [e["error"]["message"] for e in events if "error" in e]
    assert done and errors == ["the conductor shut down before the request completed "
                               "(its drain was cut short by a second stop signal)"]
    assert app[API].svc.membership.instances["d0"].is_alive
    await runner.cleanup()


class SlowToReserve(FakeInstance):
    """A decode that takes the request but never answers ``/v1/generate`` (a loop stalled)."""

    async def generate(self, request):
        self.requests.append(await request.read())
        await asyncio.Event().wait()


async def test_a_request_still_waiting_for_its_decode_reservation_is_ended_by_the_drain(conductor):
    """The drain's end reaches a request before its workers start: it was waiting for the decode's
    answer, not reading the queue its watcher puts the shutdown on, so it fell to aiohttp's
    shutdown (a closed connection). Now a 503, and the decode told to drop what it took."""
    url, app, runner, session, d0 = await conductor(SlowToReserve, dead_after=60.0)
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 5, "temperature": 0}
    answer = asyncio.create_task(session.post(url + "/v1/completions", json=body))
    while not d0.requests:
        await asyncio.sleep(0.01)
    await service.drain(app, 0.2)
    async with await asyncio.wait_for(answer, 10) as resp:
        status, error = resp.status, (await resp.json())["error"]
    assert status == 503 and error["code"] == "conductor_shutting_down", error
    assert error["message"] == "the conductor shut down before the request completed (its drain of 0.2s ran out)"
    while not d0.aborts:    # the reservation it may hold is dropped (a background abort)
        await asyncio.sleep(0.01)
    assert d0.aborts == [orjson.loads(d0.requests[0])["request_id"]]
    assert not app[API].svc.membership.instances["d0"].watchers
    await runner.cleanup()


def test_ending_requests_tells_each_once_not_to_retry_and_kills_no_instance():
    m = Membership("tiny", 16, 0, dead_after_s=5)
    for role, iid in (("prefill", "p0"), ("decode", "d0")):
        m.register(Register(role=role, instance_id=iid, http=f"{iid}:1", data=f"{iid}:2" if role == "decode" else None,
                            store=None, model="tiny", block_size=16, hash_seed=0, kv_bytes_per_token=64,
                            max_context=4096), 0.0)
    told: list[tuple] = []
    for iid in ("p0", "d0"):
        m.watch(iid, "r1", lambda *args: told.append(args))
    m.watch("d0", "r2", lambda *args: told.append(args))
    assert m.end_requests("shutting down") == 2
    assert sorted(told) == [("shutting down", False)] * 2
    assert all(i.is_alive for i in m.instances.values())
    # a request placed after the drain ran out (its body was still arriving) is ended as it is watched
    m.watch("p0", "r3", lambda *args: told.append(("r3", *args)))
    assert told[-1] == ("r3", "shutting down", False)
