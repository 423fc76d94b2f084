"""Single-block gets and puts for same-node clients on a channel built for latency (store side).

A framed get that asks the store costs ~170 µs here, ~100 µs of it the frame layer and the
store's generic dispatch (docs/store.md §3); this channel answers one key with one fixed-layout
reply, so a 64 KiB get costs about what two processes' wake-ups cost at the least.

* The store listens on one Unix socket in the abstract namespace (nothing in any filesystem;
  reachable from its own network namespace only). A same-node client asks FAST_ATTACH on its
  authenticated data connection and gets the socket's name and a fresh 16-byte secret; it
  connects and sends the secret first. Anything else (a wrong secret, a connection of a data
  connection that closed) is closed at once, so the cluster token still gates every read.
* A request is ``REQUEST``: op, request id, the read lease the client is done with (0: none) and
  the key. The store ends that lease first. ``GET`` looks the key up in DRAM and, if it is there,
  pins it under a read lease of the data connection (ended like any other: ``reads_done``,
  READ_DONE, or with the connection) and answers ``REPLY``: where the block is, its generation
  and the lease. A block not in DRAM is answered ``size = 0`` and the client asks the framed way
  (which reads the SSD tier). A GET with id 0 is a lease hand-back only: no reply.
* ``PUT`` is followed by ``PUT_BODY``: where the block is in the data connection's staging area
  (``store/shm.py``), its size, layer count and chain position. The store checks the range
  against the staging area, reserves a slot, copies the block in and commits it. ``REPLY`` has
  lease 0, ``size`` = 1 if the key was new (else 0) and offset 0: sent after the copy, the
  client may reuse the range at once; ``COPYING`` (blocks of ``ANSWER_FIRST_BYTES`` and up):
  sent before the copy, in the same callback, so the range is free once any later reply on the
  channel arrives; ``REFUSED``: not taken (no staging area, a range outside it, a bad size, the
  store full), and the client puts the framed way, which says why.
* Anything else (an unknown op) closes the channel with a WARNING; the store carries on.
* A client that gives its channel up (no answer in its ``GIVE_UP_S``) asks FAST_ATTACH with
  ``retire`` on its data connection: the store closes that connection's channels and answers
  ``retired``, after which no request sent on them is handled any more, so the staging ranges
  they named are the client's to reuse.
* Anyone on the node can connect to an abstract socket, so what a stranger can hold is bounded:
  a connection must show a secret within ``ADMIT_TIMEOUT_S``; a data connection holds at most
  ``MAX_GRANTS`` secrets (asking again retires its oldest); and a channel stops reading while its
  replies are not being read (transport flow control), so a client that never reads cannot grow
  the store's write buffer.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
import struct
from typing import TYPE_CHECKING, Any, Protocol

from mooncake_lite.transfer.connection import FrameConnection

if TYPE_CHECKING:
    from mooncake_lite.store.blocks import Block, BlockStore, PutTicket

log = logging.getLogger(__name__)

SECRET_BYTES = 16
ADMIT_TIMEOUT_S = 5.0     # to show a secret after connecting
MAX_GRANTS = 4            # secrets live at once per data connection (one per channel a client opens)
# The offer's ``fast`` entry: the layout below. A store or client of another layout (the first
# one offered ``fast: true``, with 24-byte requests) never uses the other's channel: gets and
# puts between them go framed.
VERSION = 2
GET, PUT = 1, 2
REQUEST = struct.Struct("<B3xII16s")     # op, request id, read lease done with (0: none), key
PUT_BODY = struct.Struct("<QQII")        # after a PUT: staged offset, size, num_layers, first_pos
REPLY = struct.Struct("<IIqQIIQ")         # request id, read lease, slab offset, size, num_layers, slot, generation
REFUSED = -1                              # a PUT's reply offset when it was not taken
COPYING = 1                               # ... when answered before its copy (ANSWER_FIRST_BYTES and up)
ANSWER_FIRST_BYTES = 256 << 10            # smaller blocks are copied first (a few µs), then answered
_PUT_SIZE = REQUEST.size + PUT_BODY.size


class StoreSide(Protocol):
    """What a channel asks of the store's same-node service (``ShmService``, ``store/shm.py``,
    which builds ``FastGets`` and so is not imported here)."""

    store: BlockStore

    def read_lease(self, conn: FrameConnection, blocks: list[Block]) -> int: ...

    def fast_reserve(self, conn: FrameConnection, key: bytes, offset: int, size: int, num_layers: int,
                     first_pos: int) -> PutTicket | None: ...

    def fast_commit(self, conn: FrameConnection, ticket: PutTicket, offset: int) -> int: ...


class FastGets:
    """The store's listening socket and the secrets handed out, each tied to a data connection."""

    def __init__(self, shm: StoreSide) -> None:
        self.shm = shm
        self.name = f"\0mooncake-fastget-{secrets.token_hex(8)}"
        self._grants: dict[bytes, FrameConnection] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        # Bound here, not by the loop: libuv's pipes do not take abstract names.
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.name)
            sock.listen(64)
            sock.setblocking(False)
            self._server = await asyncio.get_running_loop().create_unix_server(lambda: _Channel(self), sock=sock)
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def grant(self, conn: FrameConnection) -> dict[str, Any]:
        """FAST_ATTACH's answer: where to connect and the secret that admits this connection."""
        if self._server is None:
            raise RuntimeError("no fast get channel here")
        secret = secrets.token_bytes(SECRET_BYTES)
        granted: list[bytes] = conn.state.setdefault("fast_secrets", [])
        while len(granted) >= MAX_GRANTS:   # an admitted channel keeps its connection; only the secret goes
            self._grants.pop(granted.pop(0), None)
        self._grants[secret] = conn
        granted.append(secret)
        return {"socket": self.name[1:], "secret": secret.hex()}

    def admit(self, secret: bytes) -> FrameConnection | None:
        for known, conn in self._grants.items():   # a few per store; constant-time compares
            if hmac.compare_digest(known, secret):
                return None if conn.closed.done() else conn
        return None

    def connection_lost(self, conn: FrameConnection) -> None:
        for secret in conn.state.pop("fast_secrets", []):
            self._grants.pop(secret, None)
        for channel in conn.state.pop("fast_channels", []):
            channel.close()

    def retire(self, conn: FrameConnection) -> None:
        """Close a data connection's channels and forget its secrets (FAST_ATTACH with
        ``retire``: its client gave the channel up). Each request is handled whole in the
        callback that reads it, so once this returns none is half-handled and none is read
        any more (what the client sent that was not read yet is dropped unread)."""
        for secret in conn.state.pop("fast_secrets", []):
            self._grants.pop(secret, None)
        for channel in conn.state.pop("fast_channels", []):
            channel.abort()


class _Channel(asyncio.Protocol):
    def __init__(self, gets: FastGets) -> None:
        self.gets = gets
        self.conn: FrameConnection | None = None   # the data connection whose secret we were shown
        self.transport: asyncio.Transport | None = None
        self._buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport   # type: ignore[assignment]
        self._admit_timer = asyncio.get_running_loop().call_later(ADMIT_TIMEOUT_S, self._not_admitted)

    def _not_admitted(self) -> None:
        if self.conn is None:
            log.warning("fast get channel closed: no secret within %.0f s", ADMIT_TIMEOUT_S)
            self.transport.abort()   # type: ignore[union-attr]

    # Flow control: stop reading requests while the client is not reading our replies.
    def pause_writing(self) -> None:
        self.transport.pause_reading()   # type: ignore[union-attr]

    def resume_writing(self) -> None:
        self.transport.resume_reading()   # type: ignore[union-attr]

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.conn is not None and not self._buf and len(data) == REQUEST.size and data[0] == GET:
            reply = self._get(*REQUEST.unpack(data)[1:])   # one get: most calls
            if reply and not self.transport.is_closing():   # type: ignore[union-attr]
                self.transport.write(reply)   # type: ignore[union-attr]
            return
        buf = self._buf + data
        if self.conn is None:
            if len(buf) < SECRET_BYTES:
                self._buf = buf
                return
            self.conn = self.gets.admit(buf[:SECRET_BYTES])
            self._admit_timer.cancel()
            if self.conn is None:
                log.warning("fast get channel refused: unknown secret")
                self.transport.abort()   # type: ignore[union-attr]
                return
            self.conn.state.setdefault("fast_channels", []).append(self)
            buf = buf[SECRET_BYTES:]
        replies, at = [], 0
        while len(buf) - at >= REQUEST.size:
            op, request_id, done, key = REQUEST.unpack_from(buf, at)
            if op == GET:
                replies.append(self._get(request_id, done, key))
                at += REQUEST.size
            elif op == PUT:
                if len(buf) - at < _PUT_SIZE:
                    break
                replies.append(self._put(request_id, done, key, *PUT_BODY.unpack_from(buf, at + REQUEST.size)))
                at += _PUT_SIZE
            else:
                log.warning("fast get channel closed: unknown op %d", op)
                self.transport.abort()   # type: ignore[union-attr]
                return
        self._buf = buf[at:]
        replies = [r for r in replies if r]
        if replies and not self.transport.is_closing():   # type: ignore[union-attr]
            self.transport.write(b"".join(replies))   # type: ignore[union-attr]

    def _end_read(self, done: int) -> None:
        """The lease of the client's previous get (a read lease of its data connection)."""
        lease = self.conn.state.get("reads", {}).pop(done, None)   # type: ignore[union-attr]
        if lease is not None:
            self.gets.shm.store.unpin(lease)

    def _get(self, request_id: int, done: int, key: bytes) -> bytes:
        if done:
            self._end_read(done)
        if not request_id:
            return b""
        shm = self.gets.shm
        store = shm.store
        block = store.touch_dram(key)
        if block is None:   # not here in DRAM: the client asks the framed way
            return REPLY.pack(request_id, 0, 0, 0, 0, 0, 0)
        slab = store.slab
        size = block.size   # a whole block: its span is its slot's first ``size`` bytes
        read_id = shm.read_lease(self.conn, [block])   # type: ignore[arg-type]
        store.stats.bytes_out += size
        return REPLY.pack(request_id, read_id, slab.slab_offset + slab.offset_of(block.slot), size,
                          block.num_layers, block.slot, slab.gens[block.slot])

    def _put(self, request_id: int, done: int, key: bytes, offset: int, size: int, num_layers: int,
             first_pos: int) -> bytes:
        if done:   # before reserving: the slot it pins may be needed (as a framed put does)
            self._end_read(done)
        shm, conn = self.gets.shm, self.conn
        ticket = shm.fast_reserve(conn, key, offset, size, num_layers, first_pos)   # type: ignore[arg-type]
        if ticket is None:
            return REPLY.pack(request_id, 0, REFUSED, 0, 0, 0, 0)
        if size < ANSWER_FIRST_BYTES:
            num_new = shm.fast_commit(conn, ticket, offset)   # type: ignore[arg-type]
            return REPLY.pack(request_id, 0, 0, num_new, 0, 0, 0)
        # A big block: answered before the copy, as a framed staged put is, so the client copies
        # its next block in while we copy this one out. Nothing runs between the answer and the
        # commit; the client frees the range at its next reply on this channel, which is
        # written after this callback, so after the copy.
        num_new = shm.store.num_new(ticket)
        if not self.transport.is_closing():   # type: ignore[union-attr]
            self.transport.write(REPLY.pack(request_id, 0, COPYING, num_new, 0, 0, 0))   # type: ignore[union-attr]
        shm.fast_commit(conn, ticket, offset)   # type: ignore[arg-type]
        return b""

    def connection_lost(self, exc: Exception | None) -> None:
        self._admit_timer.cancel()
        if self.conn is not None:
            channels = self.conn.state.get("fast_channels", [])
            if self in channels:
                channels.remove(self)
