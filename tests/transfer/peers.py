"""Raw-socket peers for the data-port limit and fuzz tests: hand-made frames, a check that the
server closed on us, and a hostile peer that reports the server's RSS while still connected."""

from __future__ import annotations

import asyncio

from mooncake_lite.transfer.framing import encode_frame


def frame(op, rid, meta=None, payload=()) -> bytes:
    return b"".join(bytes(p) for p in encode_frame(op, rid, meta, payload))


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """True if the peer closed the connection within ``seconds`` (whatever it sent first)."""
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(65536):
                pass
        return True
    except ConnectionError:     # reset: closed too
        return True
    except asyncio.TimeoutError:
        return False


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


async def one_peer(host: str, port: int, hello: str, frames: list[bytes], pid: int) -> int:
    """Send (after a good, wrong or no HELLO), give the server 50 ms, and return its RSS while
    the connection is still open."""
    token = {"hello": "tok", "wrong": "nope"}.get(hello)
    prefix = frame(0, 1, {"token": token}) if token else b""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(prefix + b"".join(frames))
        try:
            async with asyncio.timeout(0.05):
                while await reader.read(1 << 16):
                    pass
        except (asyncio.TimeoutError, ConnectionError):
            pass
        return rss_of(pid)
    finally:
        writer.close()


def fuzz_peak_rss(streams, host: str, port: int, pid: int, good, max_examples: int = 40) -> int:
    """Send hypothesis-drawn ``(hello, frames)`` streams as hostile peers, each followed by the
    well-behaved ``good()`` coroutine (which must still be served); the largest RSS growth of
    the server ``pid`` seen while a hostile peer was connected."""
    from hypothesis import HealthCheck, given, settings

    asyncio.run(good())
    base = rss_of(pid)
    peak = 0

    @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(streams)
    def fuzz(stream):
        nonlocal peak
        hello, frames = stream

        async def run() -> int:
            during = await one_peer(host, port, hello, frames, pid)
            await good()
            return during

        peak = max(peak, asyncio.run(run()) - base)

    fuzz()
    return peak


class FakeTransport:
    """An asyncio transport that only records: feeds a FrameConnection with no socket."""

    def __init__(self) -> None:
        self.closed = False
        self.written: list = []

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def get_extra_info(self, name, default=None):
        return default

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0

    def writelines(self, parts) -> None:
        self.written.append(b"".join(bytes(p) for p in parts))

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def abort(self) -> None:
        self.closed = True

    close = abort
