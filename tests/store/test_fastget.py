"""The single-get channel bounds what a stranger on the node can hold (store/fastget.py): a
connection that shows no secret is closed, and a data connection's secrets are capped."""

import asyncio
import socket
from types import SimpleNamespace

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
