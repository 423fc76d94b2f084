"""Several conductors from a static list (``--conductor URL1,URL2``): every conductor gets every
registration, heartbeat and block event; one that is down delays no other; the instance ends
only when every conductor refused it; signed etcd entries are verified on read."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from mooncake_lite.common import discovery
from mooncake_lite.common.membership import (NUDGE_MIN_GAP, Conductor, Nudge, RegistrationRefused, conductor_urls,
                                             keep_membership)
from mooncake_lite.common.ports import free_port
from mooncake_lite.common.protocol import BlockEvents, InstanceLoad, Register, RunningPrefill, loads
from mooncake_lite.store.event_fanout import BlockEventFanout
from tests.fakes import fake_conductor, serve_on_loopback

pytestmark = pytest.mark.timeout(60)
MSG = Register("prefill", "p0", "127.0.0.1:1", None, None, "tiny", 16, 0, 64, 128)


def dead_url() -> str:
    """A loopback port nothing listens on (connections are refused at once)."""
    return f"http://127.0.0.1:{free_port()}"


async def until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def test_conductor_urls_parse_and_refuse():
    assert conductor_urls("http://a:1, http://b:2/") == ("http://a:1", "http://b:2")
    assert conductor_urls(None) == ()
    with pytest.raises(ValueError, match="--conductor"):
        conductor_urls("http://a:1,b:2")


async def test_instance_reports_to_every_conductor_and_a_dead_one_slows_none():
    (r1, u1, seen1), (r2, u2, seen2) = await fake_conductor(), await fake_conductor()
    registered = asyncio.Event()
    conductor = Conductor(f"{u1},{dead_url()},{u2}", None, heartbeat_interval_s=0.05)
    running = RunningPrefill("r7", 0.25)       # a prefill's job in progress rides every heartbeat
    task = asyncio.create_task(keep_membership(conductor, MSG, InstanceLoad, lambda: None, lambda: running,
                                               on_registered=registered.set))
    try:
        await asyncio.wait_for(registered.wait(), 5)
        # Both live conductors hear the registration and a steady stream of heartbeats, while
        # the third refuses every connection.
        await until(lambda: len(seen1["heartbeat"]) >= 10 and len(seen2["heartbeat"]) >= 10, "heartbeats to both")
        assert [m.instance_id for m in seen1["register"]] == ["p0"] == [m.instance_id for m in seen2["register"]]
        assert {hb.running for hb in seen1["heartbeat"] + seen2["heartbeat"]} == {running}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await r1.cleanup()
        await r2.cleanup()


async def test_a_nudge_sends_the_next_heartbeat_to_every_conductor_at_once_but_not_within_the_gap():
    """A prefill nudges its links as a chunk ends (``PrefillService.progressed``): each conductor
    hears the new report long before the interval is up, yet no sooner than its share of it after
    the last heartbeat; a nudge during that gap is kept, not lost."""
    (r1, u1, seen1), (r2, u2, seen2) = await fake_conductor(), await fake_conductor()
    registered, nudge, interval = asyncio.Event(), Nudge(), 4.0
    reports = iter(RunningPrefill("r9", 10.0 - i) for i in range(100))
    task = asyncio.create_task(keep_membership(Conductor(f"{u1},{u2}", None, heartbeat_interval_s=interval), MSG,
                                               InstanceLoad, lambda: None, lambda: next(reports),
                                               on_registered=registered.set, nudge=nudge))
    try:
        await asyncio.wait_for(registered.wait(), 5)
        t0 = time.monotonic()
        await asyncio.sleep(0.1)            # (the links are waiting on their interval)
        nudge.fire()                        # within the gap: it goes at the gap's end
        await until(lambda: seen1["heartbeat"] and seen2["heartbeat"], "a nudged heartbeat to both", 3.0)
        took = time.monotonic() - t0
        assert interval * NUDGE_MIN_GAP - 0.05 <= took < interval / 2, took
        assert len(seen1["heartbeat"]) == len(seen2["heartbeat"]) == 1   # one each, not one a nudge
        nudge.fire()
        await until(lambda: len(seen1["heartbeat"]) == 2 and len(seen2["heartbeat"]) == 2, "a second, nudged", 3.0)
        assert time.monotonic() - t0 < interval
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await r1.cleanup()
        await r2.cleanup()


async def test_refused_by_one_conductor_the_instance_stays_with_the_others_and_ends_when_all_refuse():
    (r1, u1, _), (r2, u2, seen2) = await fake_conductor(refuse_roles={"prefill"}), await fake_conductor()
    try:
        task = asyncio.create_task(keep_membership(Conductor(f"{u1},{u2}", None, 0.05), MSG, InstanceLoad,
                                                   lambda: None))
        await until(lambda: len(seen2["heartbeat"]) >= 3, "heartbeats to the conductor that accepted")
        assert not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        with pytest.raises(RegistrationRefused, match="refused registration"):
            await asyncio.wait_for(keep_membership(Conductor(u1, None, 0.05), MSG, InstanceLoad, lambda: None), 5)
    finally:
        await r1.cleanup()
        await r2.cleanup()


async def block_event_sink() -> tuple[web.AppRunner, str, list[BlockEvents]]:
    got: list[BlockEvents] = []

    async def events(request: web.Request) -> web.Response:
        got.append(loads(BlockEvents, await request.read()))
        return web.json_response({"ok": True, "resync": False, "dead_after_s": 10})

    app = web.Application()
    app.router.add_post("/internal/v1/block_events", events)
    return (*await serve_on_loopback(app), got)


async def test_store_sends_every_event_to_every_conductor_past_a_dead_one():
    (r1, u1, got1), (r2, u2, got2) = await block_event_sink(), await block_event_sink()
    fan = BlockEventFanout(Conductor(f"{u1},{dead_url()},{u2}"), interval=0.02, keepalive=5.0)
    fan.store_address = "127.0.0.1:9"
    held = [b"\x01" * 16]
    fan.enable_full_sync(lambda: list(held))
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(fan.run(session))
        try:
            await until(lambda: any(e.full for e in got1) and any(e.full for e in got2), "a full sync to each")
            fan.stored(b"\x02" * 16)
            fan.evicted(b"\x01" * 16)
            want_stored, want_evicted = ("02" * 16,), ("01" * 16,)
            for got in (got1, got2):
                await until(lambda got=got: any(e.stored == want_stored and e.evicted == want_evicted for e in got),
                            "the events at both live conductors")
            assert all(e.store == "127.0.0.1:9" for e in got1 + got2)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await r1.cleanup()
            await r2.cleanup()


def test_signed_entries_verify_and_bad_ones_say_why():
    key = discovery.CONDUCTORS + "http://a:1"
    value = discovery.sign("tok", key, {"url": "http://a:1", "model": "tiny"})
    assert discovery.verify("tok", key, value) == {"url": "http://a:1", "model": "tiny"}
    with pytest.raises(ValueError, match="signature"):
        discovery.verify("other-token", key, value)
    with pytest.raises(ValueError, match="signature"):
        discovery.verify("tok", discovery.CONDUCTORS + "http://evil:1", value)   # moved to another key
    for junk in (b"not json", b'{"url": "http://a:1"}', b'{"body": 3, "sig": "x"}', b"[]"):
        with pytest.raises(ValueError, match="signed entry"):
            discovery.verify("tok", key, junk)


def test_conductor_of_another_cluster_is_refused():
    c = Conductor("", expects=(("model", "tiny"), ("block_size", 16), ("hash_seed", 0)))
    assert c.refuses({"url": "x", "model": "tiny", "block_size": 16, "hash_seed": 0}) is None
    why = c.refuses({"url": "x", "model": "small", "block_size": 16, "hash_seed": 1})
    assert "model 'small'" in why and "hash_seed 1" in why and "block_size" not in why
