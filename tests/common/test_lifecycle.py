"""``common/lifecycle.serve_role``, in process, against a conductor that records what it hears:
an instance registers with its real address once it listens, heartbeats its load and cost model
until its own cleanup is over, and a refusal stops it with exit status 1, drained like a SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from aiohttp import web

from mooncake_lite.common.cost_report import CostReport, DecodeCost
from mooncake_lite.common.lifecycle import EXIT, Listener, Membership, serve_role
from mooncake_lite.common.membership import Conductor
from mooncake_lite.common.protocol import InstanceLoad, Register
from tests.fakes import fake_conductor

pytestmark = pytest.mark.timeout(30)
COST = CostReport(decode=DecodeCost(c0=0.5))


def _membership(url: str) -> Membership:
    def registration(addresses: dict[str, str]) -> Register:
        return Register("decode", f"decode@{addresses['http']}", addresses["http"], None, None, "tiny", 16, 0, 64, 128)
    return Membership(Conductor(url, None, heartbeat_interval_s=0.02), registration,
                      lambda: InstanceLoad(num_running=3), lambda: COST)


async def _until(condition) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def test_an_instance_registers_then_heartbeats_until_its_cleanup_is_over():
    conductor, url, seen = await fake_conductor()
    beats_at_cleanup: list[int] = []

    async def lifetime(app: web.Application):
        yield
        beats_at_cleanup.append(len(seen["heartbeat"]))
        await _until(lambda: len(seen["heartbeat"]) > beats_at_cleanup[0])   # still heartbeating

    app = web.Application()
    app.cleanup_ctx.append(lifetime)
    task = asyncio.create_task(serve_role(app, Listener("decode", "127.0.0.1", 0), _membership(url)))
    try:
        await _until(lambda: len(seen["heartbeat"]) >= 2)
        reg = seen["register"][0]
        assert reg.instance_id == f"decode@{reg.http}" and reg.http.startswith("127.0.0.1:")
        beat = seen["heartbeat"][0]
        assert (beat.instance_id, beat.load, beat.cost) == (reg.instance_id, InstanceLoad(num_running=3.0), COST)
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(task, 10) == 0
        assert beats_at_cleanup and app[EXIT].code == 0
    finally:
        task.cancel()
        await conductor.cleanup()


async def test_a_refused_instance_stops_with_exit_status_1():
    conductor, url, seen = await fake_conductor(refuse_roles={"decode"})
    try:
        status = await asyncio.wait_for(serve_role(web.Application(), Listener("decode", "127.0.0.1", 0),
                                                   _membership(url)), 10)
        assert status == 1 and len(seen["register"]) == 1 and seen["heartbeat"] == []
    finally:
        await conductor.cleanup()


async def test_a_heartbeat_the_conductor_refuses_otherwise_is_logged_and_beating_goes_on(caplog):
    conductor, url, seen = await fake_conductor(heartbeat_status=400)
    task = asyncio.create_task(serve_role(web.Application(), Listener("decode", "127.0.0.1", 0), _membership(url)))
    try:
        await _until(lambda: len(seen["heartbeat"]) >= 2)        # still beating after the first 400
        assert any("answered a heartbeat with 400" in r.getMessage() and "new_figure" in r.getMessage()
                   for r in caplog.records)
    finally:
        task.cancel()
        await conductor.cleanup()
