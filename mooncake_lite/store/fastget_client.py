"""The client side of the store's single-block channel (the store side: ``store/fastget.py``).

``FastChannel`` is the channel itself, a plain socket on which a round trip is made from the
caller's thread; ``FastPath`` is what a same-node client (``store/shm_client.ShmPath``) does
with it: one-key gets copied from the slab under a read lease, one-key puts through its staging
area, and what a request that timed out, was cancelled or was given up still owes (a lease to
hand back, a staged range to free).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mooncake_lite.store.fastget import COPYING, GET, PUT, PUT_BODY, REFUSED, REPLY, REQUEST, SECRET_BYTES
from mooncake_lite.store.protocol import Op
from mooncake_lite.transfer.client import FrameClient, NoAnswer, RemoteError
from mooncake_lite.transfer.shm import align, aligned_buffer, copy

if TYPE_CHECKING:
    from mooncake_lite.store.shm_areas import SharedSlab, Staging

log = logging.getLogger(__name__)
ALIGN = 64   # staged blocks start on cache lines (copies between misaligned buffers are slow)
# How long a single-block request may block its event loop waiting for the store's answer before
# it waits the asynchronous way (the kernel rounds it up to a timer tick): 20x or more an answer's
# usual 45-140 µs here, so only a busy store makes a request wait so long.
SYNC_WAIT_S = 0.001
# A single-block request not answered in this long (a store that busy, or a channel that lost its
# way) gives the channel up: that request and all later ones go framed, which answer regardless.
GIVE_UP_S = 2.0


class FastChannel:
    """The client end of the store's single-block channel (``store/fastget.py``), on a plain
    socket: a round trip is made from the caller's thread with blocking calls, not through the
    event loop. An event loop hop on each side is most of what a 64 KiB get costs (the copy is
    a few µs); waiting here for the store's answer saves the client's: no future, no timer, no
    wake-up of the loop (a 64 KiB get 82-85 -> 44-51 µs p50 here). The loop is blocked at most
    ``SYNC_WAIT_S`` (rounded up to a kernel tick) per request: an answer not in by then (a busy
    store) is awaited the asynchronous way, and while one is, other single gets and puts go
    framed. Replies carry their request's id: one that comes after its request gave up is
    skipped and handed to that request's ``on_late`` (a get's lease back, a put's range free)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ids = itertools.count()
        self.busy = False        # a request's answer is being awaited asynchronously
        self.is_closed = False
        self._reply = memoryview(bytearray(REPLY.size))
        self._got = 0            # bytes of the reply being read (kept across a timeout)
        self._late: dict[int, Callable[[tuple], None]] = {}   # request id -> what its late reply is for
        # Blocking, with the wait bounded by the kernel (SO_RCVTIMEO): one recv per answer, where
        # Python's own socket timeout costs a failed recv and a poll first.
        sock.setblocking(True)
        wait = struct.pack("ll", 0, int(SYNC_WAIT_S * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, wait)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, wait)   # a request that cannot go: lost

    @property
    def usable(self) -> bool:
        return not (self.busy or self.is_closed)

    @property
    def owes(self) -> bool:
        """Some request sent on the channel has had no reply yet (its ``on_late`` is kept)."""
        return bool(self._late)

    async def ask(self, op: int, key: bytes, done: int, timeout: float | None, peer: str, body: bytes = b"",
                  on_late: Callable[[tuple], None] | None = None) -> tuple[int, int, int, int, int, int] | None:
        """The reply's (read lease, offset, size, num_layers, slot, generation); None when the
        channel is gone (or given up: no answer in ``GIVE_UP_S``, when ``timeout`` is longer;
        ``on_late`` is then kept for ``settle``). Raises ``NoAnswer`` after a shorter
        ``timeout``; the channel stays, and ``on_late`` gets that reply's fields when it comes
        (as it does if the caller is cancelled)."""
        request_id = next(self.ids) % 0xFFFFFFFF + 1   # u32 on the wire, never 0 (a hand-back)
        try:
            self.sock.send(REQUEST.pack(op, request_id, done, key) + body)
            while True:
                reply = self._read_now()
                if reply is None:
                    give_up = timeout is None or timeout > GIVE_UP_S
                    try:
                        reply = await self._read_later(GIVE_UP_S if give_up else timeout, peer)
                    except (NoAnswer, asyncio.CancelledError) as exc:
                        if give_up and isinstance(exc, NoAnswer):
                            log.warning("%s: no answer on the single-block channel in %.0f s: "
                                        "using framed requests from now on", peer, GIVE_UP_S)
                            return self._lost(request_id, on_late)
                        if on_late is not None:
                            self._late[request_id] = on_late
                        raise
                if reply[0] == request_id:
                    return reply[1:]
                late = self._late.pop(reply[0], None)
                if late is not None:
                    late(reply[1:])
        except NoAnswer:
            raise
        except (OSError, ValueError):   # the socket died or was closed under us
            return self._lost(request_id, on_late)

    def _lost(self, request_id: int, on_late: Callable[[tuple], None] | None) -> None:
        """Close the channel; the store may still have read the request (or be about to), so
        what it holds is let go only by ``settle``."""
        if on_late is not None:
            self._late[request_id] = on_late
        self.close()

    def settle(self) -> None:
        """The store has retired this channel (FAST_ATTACH ``retire`` answered): no request
        sent on it is being handled or will be, so none will be answered either. Each one
        still owed gets a reply of zeros (no lease, not ``COPYING``): what it held is free."""
        late, self._late = self._late, {}
        for on_late in late.values():
            on_late((0, 0, 0, 0, 0, 0))

    def _read_now(self) -> tuple | None:
        """A whole reply within ``SYNC_WAIT_S``, else None (the part read is kept)."""
        while self._got < REPLY.size:
            try:
                n = self.sock.recv_into(self._reply[self._got:])
            except BlockingIOError:   # SO_RCVTIMEO ran out
                return None
            if not n:
                raise ConnectionError("fast get channel closed")
            self._got += n
        self._got = 0
        return REPLY.unpack(self._reply)

    async def _read_later(self, timeout: float | None, peer: str) -> tuple:
        loop = asyncio.get_running_loop()
        self.busy = True
        self.sock.setblocking(False)
        try:
            async with asyncio.timeout(timeout):
                while self._got < REPLY.size:
                    n = await loop.sock_recv_into(self.sock, self._reply[self._got:])
                    if not n:
                        raise ConnectionError("fast get channel closed")
                    self._got += n
        except TimeoutError:
            raise NoAnswer(peer, "fast request", timeout or 0.0) from None
        finally:
            self.busy = False
            if not self.is_closed:
                self.sock.setblocking(True)
        self._got = 0
        return REPLY.unpack(self._reply)

    def close(self) -> None:
        if not self.is_closed:
            self.is_closed = True
            self.sock.close()


class FastPath:
    """One-key gets and puts of a same-node client on the single-block channel (a mixin of
    ``ShmPath``, which owns the state named here)."""

    frames: FrameClient
    slab: SharedSlab
    staging: Staging | None
    fast: FastChannel | None
    is_closed: bool
    _fast_copying: list[tuple[int, int]]   # ranges of puts answered COPYING (see ``ShmPath``)
    _reads_done: list[int]

    def _finished(self, read_id: object) -> None:
        raise NotImplementedError   # ShmPath's: ends a read lease

    async def fast_get(self, key: bytes, out: memoryview | None, timeout: float | None
                       ) -> tuple[memoryview, int] | None:
        """One block through the single-get channel; None: ask the framed way (not in the
        store's DRAM, the channel is gone or busy, or the slot changed while we copied)."""
        fast = self.fast
        if fast is None or not fast.usable or self.is_closed:
            return None
        reply = await self._ask_fast(fast, GET, key, timeout, self._late_get)
        if reply is None:
            return None
        read_id, offset, size, num_layers, slot, gen = reply
        if not size:
            return None
        target = target_for(None if out is None else [out], 0, size)
        try:
            self.slab.copy(offset, size, target)
            current = self.slab.is_current(slot, gen)
        finally:
            self._finished(read_id)
        return (target, num_layers) if current else None

    async def _ask_fast(self, fast: FastChannel, op: int, key: bytes, timeout: float | None,
                        on_late: Callable[[tuple], None], body: bytes = b"") -> tuple | None:
        # A lease we are done with rides on this request (the rest go as they would anyway).
        done = self._reads_done.pop() if self._reads_done else 0
        # The channel's replies come in the order the store wrote them, so this request's reply
        # comes after the copies of every put answered ``COPYING`` before it.
        owed, self._fast_copying = self._fast_copying, []
        try:
            reply = await fast.ask(op, key, done, timeout, self.frames.label, body, on_late)
        except BaseException:
            self._owed_back(owed)
            raise
        if reply is None:
            self._owed_back(owed)   # the framed ``_flush`` frees them
            if done:
                self._finished(done)   # maybe not delivered: READ_DONE says it again (harmless)
            await self._retire(fast, timeout)
            return None
        for start, need in owed:
            self.staging.free(start, need)   # type: ignore[union-attr]
        return reply

    async def _retire(self, fast: FastChannel, timeout: float | None) -> None:
        """The channel is gone with requests the store may still read (a put's staged range
        among them): ask the store, framed, to stop reading this connection's channels. Its
        answer comes after whatever it read was handled, so those ranges are free then, even
        when it comes after ``timeout`` (the request is shielded and a callback settles: the
        store retires the channel whether or not we still wait). With no such answer (an older
        store, which answers with an ordinary grant) they stay taken until the connection
        closes: a store that read the request later would copy whatever we had put there since."""
        if not fast.owes or self.is_closed:
            return
        label = self.frames.label
        request = asyncio.ensure_future(self.frames.request(Op.FAST_ATTACH, {"retire": True}))
        request.add_done_callback(lambda f: retire_answered(label, fast, f))
        try:
            await (asyncio.wait_for(asyncio.shield(request), timeout) if timeout else asyncio.shield(request))
        except TimeoutError:
            log.info("%s: single-block channel's retire not answered in %ss: its staged ranges stay "
                     "taken until the answer comes", label, timeout)
        except (RemoteError, ConnectionError):
            pass   # retire_answered says so

    def _owed_back(self, owed: list[tuple[int, int]]) -> None:
        if owed:
            self._fast_copying[:0] = owed
            self.staging.wake()   # type: ignore[union-attr]   # flushable again (see ``_answered``)

    async def fast_put(self, key: bytes, block: memoryview, num_layers: int, first_pos: int,
                       timeout: float | None) -> int | None:
        """One block through the staging area and the single-block channel: 1 if new, 0 if
        not; None: put it the framed way (no room in the staging area right now, the channel
        busy or gone, or the store did not take it, and the framed put says why). A big block
        is answered before the store copies it out (``COPYING``), so its range stays taken
        until the next reply on the channel; the next put is copied in meanwhile."""
        fast, staging = self.fast, self.staging
        if fast is None or staging is None or not fast.usable or self.is_closed:
            return None
        need = align(block.nbytes, ALIGN)
        start = staging._take(need)
        if start is None and self._fast_copying:   # room the store is done with: one reply frees it
            got = await self._ask_fast(fast, GET, bytes(16), timeout, self._late_get)
            if got is not None and got[0]:
                self._finished(got[0])
            start = staging._take(need) if fast.usable else None
        if start is None:
            return None
        copy(staging.mapping.view[start:start + block.nbytes], block)
        body = PUT_BODY.pack(start, block.nbytes, num_layers, first_pos)
        # A request that timed out or was cancelled is still read by the store: its range is
        # free only once its late answer (and, if that says COPYING, the one after) is in.
        reply = await self._ask_fast(fast, PUT, key, timeout, lambda late: self._put_answered(late, start, need), body)
        if reply is None:
            return None   # the channel is gone: the range is freed once the store retired it (``_retire``)
        self._put_answered(reply, start, need)
        return None if reply[1] == REFUSED else reply[2]

    def _put_answered(self, reply: tuple, start: int, need: int) -> None:
        if reply[1] == COPYING:
            self._fast_copying.append((start, need))
            self.staging.wake()   # type: ignore[union-attr]   # flushable now (see ``_answered``)
        else:
            self.staging.free(start, need)   # type: ignore[union-attr]

    def _late_get(self, reply: tuple) -> None:
        if reply[0]:
            self._finished(reply[0])


def target_for(outs: Sequence[memoryview | None] | None, i: int, size: int) -> memoryview:
    """Where block ``i`` of a get lands: the caller's buffer if it is big enough, else fresh
    64-byte aligned memory."""
    out = outs[i] if outs is not None else None
    return out[:size] if out is not None and out.nbytes >= size else aligned_buffer(size)


async def open_fast(frames: FrameClient) -> FastChannel | None:
    """The store's single-get channel: its name and our secret come on the authenticated
    connection; the secret is the first thing we send on the channel."""
    try:
        reply = await frames.request(Op.FAST_ATTACH, {})
        name, secret = str(reply.meta["socket"]), bytes.fromhex(reply.meta["secret"])
        if len(secret) != SECRET_BYTES:
            raise ValueError("a secret of the wrong size")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, "\0" + name)
            sock.setblocking(True)
            sock.sendall(secret)   # a few bytes into an empty socket buffer: never blocks
        except BaseException:
            sock.close()
            raise
    except (RemoteError, OSError, KeyError, TypeError, ValueError) as exc:
        log.info("store %s: single gets go framed (%s)", frames.conn.name, exc)
        return None
    return FastChannel(sock)


_told_old_store = False


def retire_answered(label: str, fast: FastChannel, request: asyncio.Future) -> None:
    """The answer to a FAST_ATTACH ``retire``, whenever it comes: ``retired`` settles the
    channel (its staged ranges are free); an ordinary grant is an older store that does not
    know retire (its ranges stay taken: said once, as a warning)."""
    global _told_old_store
    if request.cancelled():
        return
    exc = request.exception()
    if exc is not None:
        log.info("%s: single-block channel not retired (%s): its staged ranges stay taken", label, exc)
    elif request.result().meta.get("retired") is True:
        fast.settle()
    elif not _told_old_store:
        _told_old_store = True
        log.warning("%s: the store did not retire its single-block channel (an older store answered "
                    "with a grant): staged ranges it was given stay taken until the connection closes", label)
