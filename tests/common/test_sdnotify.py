"""systemd's notify protocol: the roles tell a socket of ours READY, STATUS, STOPPING and WATCHDOG
the way systemd would hear them, and a wedged event loop stops the watchdog pings."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import textwrap
import threading
import time
import uuid

import pytest
from aiohttp import web

from mooncake_lite.common import sdnotify
from mooncake_lite.common.launch import RoleProcess
from tests.conftest import REPO, start_role

pytestmark = pytest.mark.timeout(120)


class Listener:
    """A unix datagram socket standing in for systemd's; ``address`` is what NOTIFY_SOCKET says.
    A thread stamps each state with its arrival time."""

    def __init__(self, tmp_path, abstract: bool = False) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"mooncake-test-{uuid.uuid4().hex}"
            self.sock.bind("\0" + name)
            self.address = "@" + name
        else:
            self.address = str(tmp_path / "notify.sock")
            self.sock.bind(self.address)
        self.sock.settimeout(0.1)
        self.states: list[tuple[float, str]] = []   # (arrival, "KEY=VALUE")
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                data = self.sock.recv(4096)
            except (socket.timeout, OSError):
                continue
            now = time.monotonic()
            self.states += [(now, line) for line in data.decode().split("\n")]

    def until(self, want: str, timeout: float = 60.0) -> str:
        """Wait for a state starting with ``want``; returns the first such state."""
        deadline = time.monotonic() + timeout
        while not (found := self.seen(want)):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {want!r} within {timeout}s; got {self.seen('')}")
            time.sleep(0.02)
        return found[0]

    def seen(self, prefix: str) -> list[str]:
        return [s for _, s in list(self.states) if s.startswith(prefix)]

    def close(self) -> None:
        self._closed.set()
        self._reader.join(2)
        self.sock.close()


@pytest.fixture
def listener(tmp_path):
    made: list[Listener] = []

    def _make(abstract: bool = False) -> Listener:
        made.append(Listener(tmp_path, abstract))
        return made[-1]
    yield _make
    for li in made:
        li.close()


@pytest.mark.parametrize("abstract", [False, True])
def test_notify_reaches_a_path_or_abstract_socket(listener, monkeypatch, abstract):
    li = listener(abstract)
    monkeypatch.setenv("NOTIFY_SOCKET", li.address)
    assert sdnotify.notify("READY=1", "STATUS=up")
    li.until("STATUS=up", 5)
    assert li.seen("READY=1") == ["READY=1"]


def test_without_notify_socket_nothing_is_sent_and_no_watchdog(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.watchdog_period() is None


def test_watchdog_period_is_half_of_watchdog_usec_for_this_pid_only(monkeypatch, tmp_path):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "x.sock"))
    monkeypatch.setenv("WATCHDOG_USEC", "3000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert sdnotify.watchdog_period() == 1.5
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_period() == 1.5
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))   # meant for another process
    assert sdnotify.watchdog_period() is None
    # a missing socket never raises: a role serves whether or not systemd listens
    assert sdnotify.notify("WATCHDOG=1") is False


async def test_decode_is_ready_once_registered_pings_and_says_stopping(listener, aiohttp_server):
    """A real decode process: READY=1 waits for the registration (a conductor that answers 503
    holds it back), WATCHDOG=1 pings come from its loop, SIGTERM sends STOPPING=1."""
    li = listener()
    accept = asyncio.Event()

    async def register(request: web.Request) -> web.Response:
        await request.read()
        if not accept.is_set():
            return web.json_response({"error": "not yet"}, status=503)
        return web.json_response({"ok": True})

    async def heartbeat(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/internal/v1/register", register)
    app.router.add_post("/internal/v1/heartbeat", heartbeat)
    server = await aiohttp_server(app)
    url = f"http://127.0.0.1:{server.port}"
    decode = await asyncio.to_thread(
        start_role, "decode", "--port", "0", "--data-port", "0", "--model", "tiny", "--no-profile",
        "--threads", "1", "--conductor", url, "--log-level", "warning",
        env={"NOTIFY_SOCKET": li.address, "WATCHDOG_USEC": "200000"})   # pings every 0.1 s
    try:
        await asyncio.to_thread(li.until, "STATUS=decode registering", 30)
        await asyncio.sleep(1.0)     # several refused registrations
        assert not li.seen("READY=1")
        accept.set()
        await asyncio.to_thread(li.until, "READY=1", 30)
        assert url in li.until("STATUS=decode serving")
        assert len(li.seen("WATCHDOG=1")) >= 3
        assert not li.seen("STOPPING=1")
        decode.send(signal.SIGTERM)
        await asyncio.to_thread(li.until, "STOPPING=1", 20)
        assert li.seen("STATUS=decode draining")
    finally:
        assert await asyncio.to_thread(decode.stop) == 0


# A tiny role: serve_app around one route that blocks the event loop for 1.5 s.
WEDGE_APP = textwrap.dedent("""
    import time
    from aiohttp import web
    from mooncake_lite.common.service import run, serve_app

    async def wedge(request):
        time.sleep(1.5)          # blocking: nothing else runs on this loop meanwhile
        return web.Response(text="unwedged")

    app = web.Application()
    app.router.add_get("/wedge", wedge)
    run(lambda: serve_app(app, "127.0.0.1", 0, role="wedge"))
""")


def test_a_wedged_event_loop_stops_the_watchdog_pings(listener):
    import urllib.request
    li = listener()
    env = {"NOTIFY_SOCKET": li.address, "WATCHDOG_USEC": "200000"}
    proc = RoleProcess.launch([sys.executable, "-c", WEDGE_APP], name="wedge", timeout=30, env=env, cwd=REPO)
    try:
        li.until("READY=1", 10)
        time.sleep(0.5)
        assert li.seen("WATCHDOG=1")
        with urllib.request.urlopen(proc.url() + "/wedge", timeout=20) as resp:   # returns after 1.5 s
            assert resp.read() == b"unwedged"
        unwedged = time.monotonic()
        time.sleep(0.5)
        # Pings every 0.1 s, but none while the loop was blocked (a slower machine only widens
        # the gap), and they resume afterwards.
        pings = [t for t, s in list(li.states) if s == "WATCHDOG=1"]
        gaps = [b - a for a, b in zip(pings, pings[1:])]
        assert max(gaps) >= 1.2, gaps
        assert any(t > unwedged for t in pings)
    finally:
        proc.stop()
