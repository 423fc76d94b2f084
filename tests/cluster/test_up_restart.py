"""``mooncake up`` heals: a child killed with SIGKILL comes back on its ports and rejoins while the
rest keep serving (fake roles keep the process contract; tests/cluster/test_chaos.py does it with
real ones). ``--no-restart`` keeps the old behaviour: a death stops the cluster."""

import asyncio
import os
import re
import signal
import time
import urllib.request

import orjson
import pytest
from aiohttp import web

from mooncake_lite.cluster.supervisor import RestartPolicy, exit_reason, pinned
from mooncake_lite.common.membership import Conductor, keep_membership
from mooncake_lite.common.protocol import InstanceLoad, Register
from mooncake_lite.common.service import bound_port
from tests.cluster.helpers import marker, processes_with, read_err_until, read_until, start_up, wait_gone

pytestmark = pytest.mark.timeout(120)


def test_backoff_doubles_up_to_its_bound():
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=10.0)
    assert [policy.delay(n) for n in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert policy.delay(10_000) == 10.0
    with pytest.raises(ValueError):
        RestartPolicy(first_delay_s=0)


def test_a_restart_gets_the_ports_its_first_run_bound():
    argv = ("mooncake", "--role", "store", "--port", "0", "--data-port=0", "--conductor", "http://c:1")
    assert pinned(argv, {"http": "127.0.0.1:8100", "data": "127.0.0.1:8101"}) == (
        "mooncake", "--role", "store", "--port", "8100", "--data-port=8101", "--conductor", "http://c:1")
    assert pinned(("x", "--port", "0"), {"http": "h:7"}) == ("x", "--port", "7")


def test_an_exit_is_told_in_words():
    # a conductor SIGTERMed by hand drains and exits 0: restarted, but the log says it was stopped
    assert "stopped cleanly: a SIGTERM or SIGINT sent to it" in exit_reason(0)
    assert exit_reason(-15) == "exited with code -15 (killed by SIGTERM)"
    assert exit_reason(5) == "exited with code 5"


def pids_by_name(banner: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s+(\S+)\s+pid (\d+)", banner, re.M)}


def get_json(url: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url, data=orjson.dumps(body) if body else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return orjson.loads(resp.read())


def test_killed_decode_and_conductor_come_back_on_their_ports_and_serve():
    tag = marker()
    proc = start_up("--model", tag)
    try:
        banner = read_until(proc, "Ctrl-C stops every process")
        assert "A child that dies is restarted" in banner
        pids = pids_by_name(banner)
        api = re.search(r"OpenAI-compatible API: (http://\S+)/v1", banner).group(1)

        os.kill(pids["decode-0"], signal.SIGKILL)
        read_err_until(proc, "decode-0 is back")
        # it registered again with the conductor: a second decode entry, from a new pid
        decodes = [m for m in get_json(api + "/health")["instances"] if m["role"] == "decode"]
        assert len(decodes) == 2 and decodes[-1]["pid"] != pids["decode-0"]
        assert decodes[-1]["pid"] in processes_with(tag)

        os.kill(pids["conductor"], signal.SIGKILL)
        log = read_err_until(proc, "conductor is back")
        assert "conductor exited with code -9 (killed by SIGKILL)" in log and "restart 1 in 0.5s" in log
        done = get_json(api + "/v1/completions", {"model": tag, "prompt": "x"})  # same URL as before
        assert done["choices"][0]["text"] == "fake answer"
        assert len(processes_with(tag)) == 4   # conductor, store, prefill, decode: nothing doubled

        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "restarts: conductor=1, decode-0=1" in err or "restarts: decode-0=1, conductor=1" in err
    assert wait_gone(tag) == []


def test_no_restart_keeps_a_death_fatal():
    tag = marker()
    proc = start_up("--model", tag, "--no-restart", env={"FAKE_CRASH_AFTER": "decode:0.5"})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "decode-0: exited with code 5" in err
    assert "is back" not in err and wait_gone(tag) == []


async def test_an_instance_registers_again_with_a_conductor_restarted_on_its_port():
    """What a real prefill/decode does when ``mooncake up`` restarts the conductor: its heartbeats
    fail while the conductor is down, the new one answers 404 (it knows nobody), and the instance
    registers again (common/membership.keep_membership)."""
    async def conductor(port: int, registered: list) -> web.AppRunner:
        known: set[str] = set()

        async def register(request):
            body = await request.json()
            known.add(body["instance_id"])
            registered.append(body["instance_id"])
            return web.json_response({"ok": True})

        async def heartbeat(request):
            return web.json_response({}, status=200 if (await request.json())["instance_id"] in known else 404)

        app = web.Application()
        app.router.add_post("/internal/v1/register", register)
        app.router.add_post("/internal/v1/heartbeat", heartbeat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        return runner, bound_port(site)

    async def until(condition) -> None:
        for _ in range(200):
            if condition():
                return
            await asyncio.sleep(0.02)
        raise AssertionError("timed out")

    first, second = [], []
    runner, port = await conductor(0, first)
    msg = Register("decode", "decode@x:1", "x:1", None, None, "tiny", 16, 0, 64, 128)
    conductor_at = Conductor(f"http://127.0.0.1:{port}", None, heartbeat_interval_s=0.05)
    task = asyncio.create_task(keep_membership(conductor_at, msg, InstanceLoad, lambda: None))
    try:
        await until(lambda: first == ["decode@x:1"])
        await runner.cleanup()                   # killed: heartbeats are refused for a while
        await asyncio.sleep(0.2)
        runner, _ = await conductor(port, second)  # back on the same port, knowing nobody
        await until(lambda: second == ["decode@x:1"])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runner.cleanup()
