"""The one-key channel of the same-node fast path against a real store process: single gets
and puts skip the framed ops, the channel admits only its secret, a put given up on a stopped
store frees its staged range once the channel is retired."""

from __future__ import annotations

import asyncio
import os

from mooncake_lite.store.client import StoreClient
from mooncake_lite.store.protocol import Op
from tests.store.helpers import block, chain
from tests.store.shm_helpers import SLOT, TOKEN, leases_all_ended, needs_shm

pytestmark = needs_shm


async def test_single_gets_take_the_fast_channel(shm_store):
    """A one-key get goes on the single-get channel (no framed GET), into ``out`` when given;
    a key not in DRAM asks the framed way; the channel admits only the secret handed over the
    authenticated connection; every read lease ends."""
    import socket

    from mooncake_lite.store.fastget import GET, REPLY, REQUEST
    client = await StoreClient.connect(shm_store.addresses["data"], token=TOKEN)
    sent: list[int] = []
    send = client.frames.conn.send

    def recorded(op, request_id, meta=None, payload=(), flags=0):
        sent.append(op)
        return send(op, request_id, meta, payload, flags)
    try:
        assert client.shm.fast is not None
        keys = chain(3, seed=31)
        await client.put(keys, [block(k, 7000) for k in keys])
        client.frames.conn.send = recorded   # type: ignore[method-assign]
        for key in keys:
            assert bytes((await client.get([key]))[0]) == block(key, 7000)
        out = bytearray(8192)
        got = await client.get([keys[1]], out=[out])
        assert got[0].obj is out and bytes(out[:7000]) == block(keys[1], 7000)
        assert Op.GET not in sent
        assert await client.get(chain(1, seed=32)) == [None] and sent.count(Op.GET) == 1
        # A one-block put goes on the channel too (staged; no framed PUT), and is in the store.
        single = chain(1, seed=33)
        assert await client.put(single, [block(single[0], 9000)]) == 1
        assert await client.put(single, [block(single[0], 9000)]) == 0
        assert Op.PUT not in sent and await client.exists(single) == [True]
        assert [bytes(g) for g in await client.get(single + keys[:1])] == [block(single[0], 9000), block(keys[0], 7000)]
        # A big one (a whole slot here) is answered before the store copies it: its staged range
        # stays taken until the next reply on the channel, the next put's.
        big = chain(2, seed=34)
        assert await client.put(big[:1], [block(big[0], SLOT)]) == 1 and len(client.shm._fast_copying) == 1
        assert await client.put(big[1:], [block(big[1], 5000)]) == 1 and not client.shm._fast_copying
        assert Op.PUT not in sent
        assert [bytes(g) for g in await client.get(big)] == [block(big[0], SLOT), block(big[1], 5000)]
        # The channel: our secret admits a raw socket, any other is closed at once.
        grant = (await client.frames.request(Op.FAST_ATTACH, {})).meta
        for secret, answered in ((bytes.fromhex(grant["secret"]), True), (b"\x00" * 16, False)):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
                raw.settimeout(5)
                raw.connect("\0" + grant["socket"])
                raw.sendall(secret + REQUEST.pack(GET, 7, 0, keys[0]) + REQUEST.pack(GET, 0, 0, bytes(16)))
                reply = raw.recv(REPLY.size)
                assert (len(reply) == REPLY.size and REPLY.unpack(reply)[0] == 7 and REPLY.unpack(reply)[3] == 7000) \
                    if answered else reply == b""
        # The raw socket's lease ended with nothing (it never handed it back): it ends with the
        # data connection, closed below; every lease of the client's own gets is back already.
    finally:
        await client.close()
    await leases_all_ended(shm_store)


async def test_a_given_up_single_put_frees_its_staged_range(shm_store, monkeypatch):
    """A one-block put left unanswered for GIVE_UP_S (the store stopped) gives the channel up
    and goes framed. The store may still read that request later, so its staged range is let
    go only once the store has retired the channel (FAST_ATTACH ``retire``); before, it stayed
    taken until the connection closed. Reusing it afterwards corrupts nothing."""
    import signal

    from mooncake_lite.store import fastget_client
    monkeypatch.setattr(fastget_client, "GIVE_UP_S", 0.05)
    client = await StoreClient.connect(shm_store.addresses["data"], token=TOKEN)
    pid = shm_store.proc.pid
    keys = chain(3, seed=35)
    try:
        shm_path, staging = client.shm, client.shm.staging
        assert shm_path.fast is not None
        os.kill(pid, signal.SIGSTOP)
        asyncio.get_running_loop().call_later(0.3, os.kill, pid, signal.SIGCONT)
        assert await asyncio.wait_for(client.put(keys[:1], [block(keys[0], 5000)]), 10) in (0, 1)
        assert shm_path.fast.is_closed and not shm_path.fast._late
        held = staging.size - sum(n for _, n in staging._free)
        # Nothing held but what a later answer frees (the framed put's range, answered COPYING).
        assert held == sum(n for _, n in shm_path._copying + shm_path._fast_copying)
        for key in keys[1:]:   # framed now, through the same staging ranges
            assert await client.put([key], [block(key, 5000)]) == 1
        assert [bytes(g) for g in await client.get(keys)] == [block(k, 5000) for k in keys]
    finally:
        os.kill(pid, signal.SIGCONT)
        await client.close()
