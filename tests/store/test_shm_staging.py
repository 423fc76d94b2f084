"""The same-node client's staging window without a store process: a put waiting for room wakes
when the put in flight is answered, a put finding no room goes on the socket, and the window is
sized from the last-level cache."""

from __future__ import annotations

import asyncio

from mooncake_lite.store import shm_areas, shm_client
from mooncake_lite.store.protocol import Op


async def test_a_put_waiting_for_room_wakes_when_the_one_in_flight_answers_copying():
    """A put that finds no room while the only other staged put is in flight (nothing to flush
    yet) must look again when that one is answered ``copying``: its range can be flushed free
    then (an empty EXISTS), and without that wake-up the waiting put waited for ever."""
    from mooncake_lite.transfer.framing import Frame
    loop = asyncio.get_running_loop()
    answer_first = asyncio.Event()
    sent: list[Op] = []

    async def request(op, meta=None, payload=(), sink=None):
        sent.append(op)
        if op == Op.PUT and len(sent) == 1:
            await answer_first.wait()
        return Frame(None, {"num_new": 1, "copying": True} if op == Op.PUT else {}, [])
    path = _path_over_fake_frames(request, loop)
    try:
        first = asyncio.ensure_future(path.put({"keys": ["00" * 16]}, [memoryview(bytes(2 << 16))], None))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(path.put({"keys": ["01" * 16]}, [memoryview(bytes(3 << 16))], None))
        await asyncio.sleep(0.01)
        assert not second.done() and sent == [Op.PUT]   # no room, nothing to flush: waiting
        answer_first.set()
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert sent == [Op.PUT, Op.EXISTS, Op.PUT]
    finally:
        path.staging.populator.stop()


async def test_a_put_finding_no_room_that_could_come_goes_on_the_socket():
    """A range that stays taken (a channel the store never retired: an older store, a late
    retire) can leave no contiguous room for a half-window batch. A put finding none, with
    nothing of its client in flight that could free some, goes framed with its bytes on the
    socket at once; one waiting on something in flight that frees nothing goes framed when its
    timeout runs out. Before, both waited for ever, the put's timeout ignored."""
    from types import SimpleNamespace

    from mooncake_lite.transfer.framing import Frame
    loop = asyncio.get_running_loop()
    sent: list[tuple[Op, bool, int]] = []   # (op, staged, payload bytes)

    async def request(op, meta=None, payload=(), sink=None):
        sent.append((op, "staged" in (meta or {}), sum(v.nbytes for v in payload)))
        return Frame(None, {"num_new": 1}, [])
    path = _path_over_fake_frames(request, loop)
    try:
        path.staging._free = [(0, 3 << 15), (5 << 15, 3 << 15)]   # [96, 160) KiB stays taken
        data = memoryview(bytes(2 << 16))
        assert path.fits([data.nbytes])
        reply = await asyncio.wait_for(path.put({"keys": ["00" * 16]}, [data], None), 2)
        assert reply.meta["num_new"] == 1 and sent == [(Op.PUT, False, 2 << 16)]
        # A single-block request in flight (it could free room) that frees none: the put's
        # timeout bounds the wait.
        path.fast = SimpleNamespace(busy=True, is_closed=False, close=lambda: None)
        reply = await asyncio.wait_for(path.put({"keys": ["01" * 16]}, [data], 0.1), 2)
        assert sent == [(Op.PUT, False, 2 << 16)] * 2
        # With no timeout, once that request ends having freed nothing: framed too.
        loop.call_later(0.05, setattr, path.fast, "busy", False)
        await asyncio.wait_for(path.put({"keys": ["01" * 16]}, [data], None), 2)
        assert sent == [(Op.PUT, False, 2 << 16)] * 3
        # Room for it: staged as before.
        path.fast = None
        await asyncio.wait_for(path.put({"keys": ["02" * 16]}, [memoryview(bytes(3 << 15))], None), 2)
        assert sent[-1] == (Op.PUT, True, 0)
    finally:
        path.staging.populator.stop()


def test_puts_are_staged_in_a_cache_sized_window():
    """A staging area is used only up to about the last-level cache (what a put copies in is
    still cached when the store copies it out), never less than two of the store's largest
    blocks; an area smaller than that is used whole."""
    import mmap
    from types import SimpleNamespace
    area = mmap.mmap(-1, 8 << 20)
    mapping = SimpleNamespace(map=area, view=memoryview(area), size=8 << 20, close=lambda: None)
    staging, whole = shm_areas.Staging(mapping, window=2 << 20), shm_areas.Staging(mapping, window=64 << 20)
    try:
        assert staging.size == 2 << 20 and staging._take(2 << 20) == 0 and staging._take(64) is None
        assert whole.size == 8 << 20
    finally:
        staging.populator.stop()
        whole.populator.stop()
    cache = shm_areas.last_level_cache_bytes()
    assert cache >= 1 << 20
    assert shm_areas.staging_window(None) == cache and shm_areas.staging_window(cache) == 2 * cache


def _path_over_fake_frames(request, loop) -> shm_client.ShmPath:
    """A same-node client path whose control frames go to ``request`` (a fake store), over a
    256 KiB private staging area."""
    import mmap
    from types import SimpleNamespace
    area = mmap.mmap(-1, 4 << 16)
    mapping = SimpleNamespace(map=area, view=memoryview(area), size=4 << 16, close=lambda: None)
    frames = SimpleNamespace(request=request, label="store", piggyback=None,
                             conn=SimpleNamespace(closed=loop.create_future(), name="store"))
    return shm_client.ShmPath(frames, SimpleNamespace(close=lambda: None), shm_areas.Staging(mapping))
