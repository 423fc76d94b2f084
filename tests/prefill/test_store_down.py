"""A store that stops answering (SIGSTOP: the kernel still accepts connections, nothing is
answered) costs the prefill one short deadline, not the whole hang (issue #37 item 3): ``match``
answers 0 (the prefix is recomputed), the store is then *down* and every op fails at once without
asking it, until the background probe gets its hello again after SIGCONT; then prefixes are
matched and loaded again. A real store process, because what is tested is how its stopped
process looks from the socket."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from mooncake_lite.prefill.remote_store import RemoteStore
from mooncake_lite.store.link import StoreDown
from mooncake_lite.store.client import NoAnswer
from tests.conftest import start_role
from tests.store.helpers import block, chain

pytestmark = pytest.mark.timeout(120)
LAYERS, LAYER_BYTES = 2, 256


@pytest.fixture(scope="module")
def store():
    proc = start_role("store", "--port", "0", "--data-port", "0", "--dram", str(64 * LAYERS * LAYER_BYTES),
                      "--slot-bytes", str(LAYERS * LAYER_BYTES))
    yield proc
    proc.stop()


async def test_a_stopped_store_is_skipped_until_it_answers_again(store):
    remote = RemoteStore(store.addresses["data"], None, LAYERS, LAYER_BYTES, timeout=5.0, quick_timeout=0.5)
    keys = chain(2, seed=3)
    values = [memoryview(block(k, LAYERS * LAYER_BYTES)) for k in keys]
    await remote.put_layers(keys, values, 0, LAYERS)
    assert await remote.match(keys) == 2
    remote.prefix_loaded(keys)
    sent: list[str] = []
    request = (await remote.client()).frames.request

    async def recorded(op, meta=None, payload=(), sink=None):
        if op.name != "RELEASE":   # (leases go back in the background)
            sent.append(op.name)
        return await request(op, meta, payload, sink)

    (await remote.client()).frames.request = recorded   # type: ignore[method-assign]
    os.kill(store.proc.pid, signal.SIGSTOP)
    try:
        assert await remote.match(keys) == 0            # no answer within quick_timeout: recompute
        assert remote.is_down and len(sent) == 1
        assert await remote.match(keys) == 0            # down: answered at once, the store not asked
        with pytest.raises(StoreDown):
            await remote.get_layers(keys, 0, LAYERS)
        with pytest.raises(StoreDown):
            await remote.put_layers(keys, values, 0, LAYERS)
        assert len(sent) == 1
        await asyncio.sleep(1.5)                         # the probe keeps dialling a store that answers nothing
        assert remote.is_down
    finally:
        os.kill(store.proc.pid, signal.SIGCONT)
    for _ in range(100):                                 # the probe's next hello comes back
        if not remote.is_down:
            break
        await asyncio.sleep(0.1)
    assert not remote.is_down
    assert await remote.match(keys) == 2                 # back: matched and loaded again
    got = await remote.get_layers(keys, 0, LAYERS)
    assert [bytes(v) for v in got] == [bytes(v) for v in values]
    remote.prefix_loaded(keys)
    await remote.close()


async def test_a_store_op_past_its_deadline_raises_no_answer_naming_the_store(store):
    remote = RemoteStore(store.addresses["data"], None, LAYERS, LAYER_BYTES, timeout=0.5, quick_timeout=0.5)
    keys = chain(1, seed=4)
    await remote.put_layers(keys, [memoryview(block(keys[0], LAYERS * LAYER_BYTES))], 0, LAYERS)
    os.kill(store.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(NoAnswer, match=store.addresses["data"].split(":")[-1]):
            await remote.get_layers(keys, 0, LAYERS)    # (the stage then recomputes: test_prefix_fallback)
        assert remote.is_down
    finally:
        os.kill(store.proc.pid, signal.SIGCONT)
    await remote.close()
