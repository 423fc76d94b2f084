"""The single-get channel bounds what a stranger on the node can hold (store/fastget.py): a
connection that shows no secret is closed, a data connection's secrets and read leases are
capped. Its client end (store/fastget_client.py) waits for an answer without the event loop, and on
the loop only for a slow one; late replies are skipped and their leases handed back."""

import asyncio
import functools
import socket
from types import SimpleNamespace

import pytest

from mooncake_lite.store import fastget
from mooncake_lite.store.fastget import FastGets


def data_connection():
    return SimpleNamespace(state={}, closed=asyncio.get_running_loop().create_future())


async def test_a_connection_without_a_secret_is_closed(monkeypatch):
    monkeypatch.setattr(fastget, "ADMIT_TIMEOUT_S", 0.2)
    gets = FastGets(shm=None)   # no request is admitted, so nothing reads the store
    await gets.start()
    loop = asyncio.get_running_loop()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.setblocking(False)
            await loop.sock_connect(raw, gets.name)
            await loop.sock_sendall(raw, b"\x01" * (fastget.SECRET_BYTES - 1))   # not a whole secret
            closed = await asyncio.wait_for(loop.sock_recv(raw, 1), timeout=5)
            assert closed == b""    # the store hung up; without the timer this waits for ever
    finally:
        gets.close()


async def test_a_data_connection_holds_at_most_max_grants_secrets():
    gets = FastGets(shm=None)
    await gets.start()
    try:
        conn = data_connection()
        secrets = [bytes.fromhex(gets.grant(conn)["secret"]) for _ in range(fastget.MAX_GRANTS + 2)]
        assert len(gets._grants) == fastget.MAX_GRANTS == len(conn.state["fast_secrets"])
        assert [gets.admit(s) for s in secrets[:2]] == [None, None]          # the oldest retired
        assert all(gets.admit(s) is conn for s in secrets[2:])
        gets.connection_lost(conn)
        assert not gets._grants
    finally:
        gets.close()


# ---- read leases a client never hands back are bounded per connection ------------------------
class _Transport:
    def __init__(self):
        self.written = []
        self.aborted = False

    def abort(self):
        self.aborted = True

    def write(self, data):
        self.written.append(data)

    def is_closing(self):
        return False


def _channel_on_a_store(monkeypatch, bound: int):
    """A store's channel, in process: an 8-slot shared slab with 3 blocks, one admitted channel."""
    import time

    from mooncake_lite.store import shm as shm_service
    from mooncake_lite.store.blocks import BlockStore
    from mooncake_lite.store.eviction import make_policy
    from mooncake_lite.store.slab import Slab
    monkeypatch.setattr(shm_service, "MAX_READ_LEASES", bound)
    store = BlockStore(Slab(8 << 12, 1 << 12, pin=False, shared=True), make_policy("lru"))
    keys = [bytes([i]) * 16 for i in range(3)]
    store.commit(store.reserve(keys, [1000] * 3, 1))
    service = shm_service.ShmService(store, staging_bytes=0, lease_ttl=60, clock=time.monotonic)
    channel = fastget._Channel(service.fast)
    channel.conn, channel.transport = data_connection(), _Transport()
    return store, channel, keys


async def test_read_leases_never_handed_back_are_bounded(monkeypatch):
    """A client asking gets and never handing a lease back holds at most MAX_READ_LEASES of
    them: the oldest end (their blocks unpinned, counted), the newest stay valid."""
    store, channel, keys = _channel_on_a_store(monkeypatch, bound=4)
    replies = []
    for request_id in range(1, 11):
        channel.data_received(fastget.REQUEST.pack(fastget.GET, request_id, 0, keys[request_id % 3]))
        replies.append(fastget.REPLY.unpack(channel.transport.written[-1]))
    reads = channel.conn.state["reads"]
    lease_ids = [r[1] for r in replies]
    assert list(reads) == lease_ids[-4:]                          # the newest four, in order
    assert store.num_leases == 4 and store.stats.read_leases_dropped == 6
    assert sum(store._dram[k].pins for k in keys) == 4            # the dropped ones unpinned
    # The newest lease is still good: handing it back (on a hand-back-only request) ends it.
    channel.data_received(fastget.REQUEST.pack(fastget.GET, 0, lease_ids[-1], bytes(16)))
    assert store.num_leases == 3 and lease_ids[-1] not in reads
    # A dropped lease handed back late is ignored, not an error (and not a second unpin).
    channel.data_received(fastget.REQUEST.pack(fastget.GET, 0, lease_ids[0], bytes(16)))
    assert store.num_leases == 3 and sum(store._dram[k].pins for k in keys) == 3


async def test_retire_aborts_a_connections_channels_and_forgets_its_secrets(monkeypatch):
    """FAST_ATTACH with ``retire`` (its client gave the channel up): the data connection's
    channels are aborted (nothing they still carry is read), its secrets admit no one, and the
    answer says ``retired``: the client may reuse the staging ranges it named there."""
    from mooncake_lite.store.protocol import Op
    _, channel, _ = _channel_on_a_store(monkeypatch, bound=4)
    conn, gets = channel.conn, channel.gets
    secret = b"s" * fastget.SECRET_BYTES
    gets._grants[secret] = conn
    conn.state.update(fast_secrets=[secret], fast_channels=[channel])
    sent = []
    conn.send = lambda op, request_id, meta=None, payload=(), flags=0: sent.append((op, request_id, meta))
    gets.shm.handle(conn, SimpleNamespace(op=Op.FAST_ATTACH, request_id=9, meta={"retire": True}))
    assert channel.transport.aborted and gets.admit(secret) is None and not gets._grants
    assert sent == [(Op.FAST_ATTACH, 9, {"retired": True})]


async def test_a_well_behaved_client_never_meets_the_bound(monkeypatch):
    store, channel, keys = _channel_on_a_store(monkeypatch, bound=2)
    done = 0
    for request_id in range(1, 50):   # each get hands back the one before, as the client does
        channel.data_received(fastget.REQUEST.pack(fastget.GET, request_id, done, keys[request_id % 3]))
        done = fastget.REPLY.unpack(channel.transport.written[-1])[1]
    assert store.num_leases == 1 and store.stats.read_leases_dropped == 0


async def test_a_staged_put_on_the_channel_is_checked_copied_and_committed(monkeypatch):
    """PUT names a range of the connection's staging area: the block is in the store when the
    answer comes; a range outside the area, or no area at all, is refused (the client then puts
    the framed way) and takes no slot; an unknown op closes the channel, not the store."""
    from mooncake_lite.transfer.shm import Region
    store, channel, _ = _channel_on_a_store(monkeypatch, bound=4)

    def put(request_id, key, offset, size):
        channel.data_received(fastget.REQUEST.pack(fastget.PUT, request_id, 0, key)
                              + fastget.PUT_BODY.pack(offset, size, 2, 5))
        return fastget.REPLY.unpack(channel.transport.written[-1])
    assert put(1, b"n" * 16, 0, 1000)[2:4] == (fastget.REFUSED, 0)    # no staging area yet
    staging = channel.conn.state["staging"] = Region(8192, populate=False)
    try:
        data = bytes(range(256)) * 4
        staging.view[64:64 + 1024] = data
        free = store.slab.num_free
        assert put(2, b"n" * 16, 64, 1024)[:4] == (2, 0, 0, 1)        # new
        block = store._dram[b"n" * 16]
        assert bytes(store.view(block)) == data and (block.num_layers, block.chain_pos) == (2, 5)
        assert put(3, b"n" * 16, 64, 1024)[2:4] == (0, 0)              # there already
        for offset, size in ((8192 - 100, 1024), (0, 0), (0, 5000), (0, 1001)):  # outside; empty; > a slot; 2 layers?
            assert put(4, b"m" * 16, offset, size)[2:4] == (fastget.REFUSED, 0)
        assert store.slab.num_free == free - 1 and b"m" * 16 not in store._dram
        # A big block is answered before its copy (COPYING), in the same callback as the commit.
        monkeypatch.setattr(fastget, "ANSWER_FIRST_BYTES", 1024)
        seen = []
        write = channel.transport.write
        channel.transport.write = lambda d: (seen.append(b"b" * 16 in store._dram), write(d))
        staging.view[2048:2048 + 1024] = data[::-1]
        assert put(5, b"b" * 16, 2048, 1024)[:4] == (5, 0, fastget.COPYING, 1) and seen == [False]
        assert bytes(store.view(store._dram[b"b" * 16])) == data[::-1]
        channel.data_received(b"\x07" + bytes(fastget.REQUEST.size - 1))
        assert channel.transport.aborted and bytes(store.view(block)) == data
    finally:
        staging.close()


# ---- the client's channel: a synchronous round trip, the loop only for a slow answer -----------
def _client_channel():
    from mooncake_lite.store.fastget_client import FastChannel
    mine, store_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    store_end.settimeout(5)
    return FastChannel(mine), store_end


def _reply(request_id: int, lease: int, size: int = 100) -> bytes:
    return fastget.REPLY.pack(request_id, lease, 4096, size, 1, 0, 7)


async def test_client_channel_skips_late_replies_and_hands_their_leases_back():
    from mooncake_lite.transfer.client import NoAnswer
    channel, store_end = _client_channel()
    try:
        store_end.sendall(_reply(1, 11))   # in before we ask: answered without the loop
        stray: list[tuple] = []
        ask = functools.partial(channel.ask, fastget.GET, b"k" * 16, peer="store", on_late=stray.append)
        assert await ask(0, 5) == (11, 4096, 100, 1, 0, 7)
        assert fastget.REQUEST.unpack(store_end.recv(fastget.REQUEST.size)) == (fastget.GET, 1, 0, b"k" * 16)
        with pytest.raises(NoAnswer):      # nobody answers request 2 in time
            await ask(11, 0.05)
        assert channel.usable              # the channel is kept: request 2's answer comes late
        store_end.sendall(_reply(2, 12) + _reply(3, 13))
        assert await ask(0, 5) == (13, 4096, 100, 1, 0, 7)
        assert stray == [(12, 4096, 100, 1, 0, 7)]   # the late reply, for the caller (its lease handed back)
    finally:
        channel.close()
        store_end.close()


async def test_client_channel_waits_on_the_loop_for_a_slow_answer_and_notices_a_closed_store():
    from mooncake_lite.store import fastget_client
    channel, store_end = _client_channel()
    try:
        loop = asyncio.get_running_loop()
        asking = asyncio.ensure_future(channel.ask(fastget.GET, b"k" * 16, 0, 5, "store"))
        await asyncio.sleep(fastget_client.SYNC_WAIT_S * 20)
        assert not asking.done() and not channel.usable   # waiting on the loop: others go framed
        await loop.run_in_executor(None, store_end.sendall, _reply(1, 21)[:10])   # in two pieces
        await asyncio.sleep(0.01)
        store_end.sendall(_reply(1, 21)[10:])
        assert await asyncio.wait_for(asking, 5) == (21, 4096, 100, 1, 0, 7) and channel.usable
        store_end.close()
        assert await channel.ask(fastget.GET, b"k" * 16, 0, 5, "store") is None and channel.is_closed
    finally:
        channel.close()


async def test_client_channel_gives_up_on_a_store_that_never_answers(monkeypatch):
    """With a timeout longer than GIVE_UP_S, a request left unanswered that long closes the
    channel and returns None: the caller goes framed, and so does every later request."""
    from mooncake_lite.store import fastget_client
    monkeypatch.setattr(fastget_client, "GIVE_UP_S", 0.05)
    channel, store_end = _client_channel()
    try:
        assert await channel.ask(fastget.GET, b"k" * 16, 0, 30, "store") is None
        assert channel.is_closed and not channel.usable
    finally:
        channel.close()
        store_end.close()


async def test_a_retire_answered_late_still_frees_the_channels_ranges(caplog, monkeypatch):
    """The store retires the channel even when its answer comes after the client stopped
    waiting: that late ``retired`` must settle the channel (free its staged ranges), or they
    stay taken for the connection's life. An older store's grant is said once, as a warning."""
    from mooncake_lite.store import fastget_client
    from mooncake_lite.store.fastget_client import FastPath
    monkeypatch.setattr(fastget_client, "_told_old_store", False)
    answer = asyncio.get_running_loop().create_future()
    settled = asyncio.Event()

    async def request(op, meta):
        return await answer

    owner = SimpleNamespace(frames=SimpleNamespace(request=request, label="store x"), is_closed=False)
    fast = SimpleNamespace(owes=True, settle=settled.set)
    await FastPath._retire(owner, fast, 0.01)   # gives up waiting
    assert not settled.is_set()
    answer.set_result(SimpleNamespace(meta={"retired": True}))
    await asyncio.wait_for(settled.wait(), 10)

    grant = asyncio.get_running_loop().create_future()
    grant.set_result(SimpleNamespace(meta={"secret": "00"}))
    owner.frames.request = lambda op, meta: grant
    other = SimpleNamespace(owes=True, settle=lambda: pytest.fail("an ordinary grant settled the channel"))
    with caplog.at_level("WARNING", logger="mooncake_lite.store.fastget_client"):
        await FastPath._retire(owner, other, 1.0)
        await asyncio.sleep(0)
    assert "older store" in caplog.text
