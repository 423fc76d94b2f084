"""The store's data port fuzzed over real sockets (issue #15): random frames (real ops, random
metas, announced lengths up to 2^64, truncated anywhere) after a valid or missing HELLO never grow
the store's memory beyond a bound, and a well-behaved client is served after every one."""

from __future__ import annotations


import orjson
import pytest
from hypothesis import strategies as st

from mooncake_lite.store.client import StoreClient
from mooncake_lite.transfer.framing import HEADER, MAGIC, VERSION
from tests.store.helpers import block, chain
from tests.transfer.peers import fuzz_peak_rss

pytestmark = pytest.mark.timeout(120)

KEY = chain(1, seed=77)[0].hex()
METAS = st.fixed_dictionaries({}, optional={
    "keys": st.one_of(st.just(KEY), st.just(KEY * 3), st.lists(st.just(KEY), max_size=3), st.text(max_size=40)),
    "sizes": st.lists(st.one_of(st.integers(0, 2 << 20), st.integers(-5, 2**63)), max_size=3),
    "num_layers": st.one_of(st.integers(-2, 64), st.text(max_size=3)),
    "first_pos": st.integers(-2, 1 << 40),
    "lease_s": st.one_of(st.none(), st.floats(-1, 5)),
    "lease_id": st.integers(-1, 5),
    "peer": st.text(max_size=20),
})
FRAMES = st.builds(
    lambda op, flags, meta, meta_len, announced, sent: (
        HEADER.pack(MAGIC, VERSION, op, flags, 9, len(meta) if meta_len is None else meta_len, announced)
        + meta + b"\xab" * min(sent, announced)),
    st.sampled_from([0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 99]), st.sampled_from([0, 1, 2]),
    METAS.map(orjson.dumps),
    st.one_of(st.none(), st.none(), st.integers(0, 2**32 - 1), st.sampled_from([4 << 20, (1 << 20) + 1])),
    st.one_of(st.integers(0, 3 << 20), st.integers(0, 2**64 - 1), st.sampled_from([1 << 33, 2 << 30, 64 << 20])),
    st.integers(0, 300_000))
STREAMS = st.tuples(st.sampled_from(["hello", "hello", "none", "wrong"]), st.lists(FRAMES, min_size=1, max_size=4))


def test_random_frames_never_grow_the_store_nor_stop_a_good_client(role_procs):
    store = role_procs("store", "--port", "0", "--data-port", "0", "--dram", "8MiB", "--slot-bytes", "1MiB",
                       "--cluster-token", "tok")
    host, port = store.addresses["data"].rsplit(":", 1)
    keys = chain(2, seed=78)
    data = [block(k, 200_000) for k in keys]

    async def good() -> None:
        client = await StoreClient.connect(store.addresses["data"], token="tok", timeout=5)
        try:
            await client.put(keys, data)
            assert [bytes(b) for b in await client.get(keys)] == data
        finally:
            await client.close()

    peak = fuzz_peak_rss(STREAMS, host, int(port), store.pid, good)
    assert peak < 50 << 20, f"store RSS grew by {peak >> 20} MiB"
    assert "Traceback" not in store.logs()
