"""The start-up profile sends its chunks' KV as served chunks do: to a peer process over a frame
connection (``prefill/profile_sink.py``, ``transfer/sink.py``), so what sending costs is in the price
the conductor is first given; a peer that will not start or breaks leaves the profile as it was."""

import asyncio
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mooncake_lite.prefill.kv_sender import KVSender
from mooncake_lite.prefill.profile_sink import ProfileSink
from mooncake_lite.prefill.profiling import profile_served
from mooncake_lite.transfer.client import FrameClient, RemoteError
from mooncake_lite.transfer.server import reply_error, server_address, start_server
from mooncake_lite.transfer.sink import Sink, start_sink
from tests.prefill.test_profiling import stage  # noqa: F401 - the tiny stage engine fixture

POINTS = ((32, 0), (64, 0), (96, 0), (32, 64))
SEND_S = 0.004   # per layer frame: a send path this slow on the loop


async def _profile_beside(stage, handler=None, token="t0k"):
    """The profile with its KV to a peer in this process (``handler``: a plain sink), so the test
    can count what it took; the peer's handler and the profile's samples."""
    if handler is None:
        server, handler = await start_sink(token)
    else:
        server = await start_server(handler, "127.0.0.1", 0, token=token)
    host, port = server_address(server).rsplit(":", 1)
    client = await FrameClient.connect(host, int(port), token=token)
    client.request_timeout = 5.0
    sink = ProfileSink(None, client)
    try:
        _, samples = await profile_served(stage, points=POINTS, repeats=1, sink=sink)
    finally:
        await client.close()
        server.close()
    return handler, sink, samples


def test_every_layer_of_every_profiled_chunk_goes_to_the_peer_and_its_send_is_priced(stage, monkeypatch):
    layers = stage.runner.args.num_layers
    send, calls = KVSender.send_layer, []

    def slow_send(self, *args, **kwargs):      # what a costly send does: holds the loop a while
        calls.append(1)
        time.sleep(SEND_S)
        return send(self, *args, **kwargs)
    monkeypatch.setattr(KVSender, "send_layer", slow_send)
    peer, sink, sent = asyncio.run(_profile_beside(stage))
    # three warm-ups, the four points, and the prefix chunk of the one with a prefix (untimed)
    assert peer.num_frames == layers * (3 + len(POINTS) + 1) and sink.broken is None
    assert all(s >= layers * SEND_S for *_, s in sent)      # each timed chunk paid its sends
    calls.clear()
    asyncio.run(profile_served(stage, points=POINTS, repeats=1))
    # with its KV to nowhere the send is never made (counted, not timed: a loaded CI box runs a
    # tiny chunk slower than the sends' sleep, which a bound on its time then read as paid)
    assert not calls
    assert not stage.jobs and stage.runner.allocator.num_free == stage.runner.cache.num_blocks


class _Refusing(Sink):
    """A peer that refuses every KV frame (a decode that lost the transfer, say)."""

    def frame_received(self, conn, frame):
        self.num_frames += 1
        reply_error(conn, frame, "unknown_transfer", "no such transfer")


def test_a_peer_that_refuses_the_kv_leaves_the_profile_to_send_it_nowhere(stage):
    peer, sink, samples = asyncio.run(_profile_beside(stage, _Refusing()))
    assert sink.broken and "no such transfer" in sink.broken
    assert len(samples) == len(POINTS) and all(0 < s < 10 for *_, s in samples)
    assert peer.num_frames >= 1
    assert not stage.jobs and stage.runner.allocator.num_free == stage.runner.cache.num_blocks


def test_the_peer_takes_only_its_token():
    async def dial():
        server, _ = await start_sink("right")
        host, port = server_address(server).rsplit(":", 1)
        try:
            with pytest.raises(RemoteError):
                await FrameClient.connect(host, int(port), token="wrong")
        finally:
            server.close()
    asyncio.run(dial())


def test_no_peer_where_its_process_cannot_start(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    assert asyncio.run(ProfileSink.start()) is None


_PARENT = textwrap.dedent("""
    import asyncio, sys
    from mooncake_lite.prefill.profile_sink import ProfileSink
    async def main():
        sink = await ProfileSink.start()
        print(sink.proc.pid, flush=True)
        await asyncio.sleep(60)
    asyncio.run(main())
""")


def test_the_peer_ends_with_its_parent_even_killed():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    """Running, not gone or a zombie waiting for a reaper."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False
