"""The conductor learns each store pair's speed from the migrations prefills time, exports it,
and Algorithm 1 prices the next fetch over that pair with it (fake instances); the prefill's
side: what it reports of a migration its store ran."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp import web

from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.common.protocol import PrefillRequest, Sampling
from mooncake_lite.prefill.service import PrefillService
from mooncake_lite.prefill.turns import QueuedJob
from tests.conductor import fakes
from tests.conductor.test_api import TOK, client

PROMPT = "0123456789abcdefghij"
MIB = 1 << 20


def _timing_prefill(seconds_per_mib: float):
    """A fake prefill handler that, asked to migrate, reports 1 MiB moved in ``seconds_per_mib``."""
    original = fakes.FakeInstance.prefill

    async def prefill(self, request: web.Request) -> web.Response:
        body = await request.read()
        resp = await original(self, _Replayed(request, body))
        if fakes.loads(PrefillRequest, body).migrate_keys and resp.status == 200:
            result = orjson.loads(resp.body)
            result["timings"] = {"migrate_bytes": MIB, "migrate_s": seconds_per_mib}
            resp = web.Response(body=orjson.dumps(result), content_type="application/json")
        return resp
    return prefill


class _Replayed:
    """The request with its body already read, for the wrapped handler."""

    def __init__(self, request: web.Request, body: bytes) -> None:
        self._body = body

    async def read(self) -> bytes:
        return self._body


async def _ask(c) -> tuple[str, str]:
    raw = await c.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=2)
    return raw.headers["X-Mooncake-Prefill"], raw.headers["X-Mooncake-Route"]


async def _gauge(cluster) -> dict[tuple[str, str], float]:
    async with cluster.session.get(cluster.url + "/metrics") as resp:
        text = await resp.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("mooncake_conductor_link_bytes_per_second{"):
            labels, value = line[line.index("{") + 1:].split("} ")
            pairs = dict(kv.split("=", 1) for kv in labels.split(","))
            out[(pairs["source"].strip('"'), pairs["dest"].strip('"'))] = float(value)
    return out


@pytest.mark.parametrize("seconds_per_mib, then", [(1000.0, ("p0", "local-hit")),   # 1 KiB/s
                                                     (0.001, ("p1", "transfer"))])     # 1 GiB/s
async def test_the_measured_link_decides_whether_the_prefix_migrates(make_cluster, monkeypatch,
                                                                      seconds_per_mib, then):
    monkeypatch.setattr(fakes.FakeInstance, "prefill", _timing_prefill(seconds_per_mib))
    cluster = await make_cluster(prefill=2, decode=1, strategy="kvcache-centric")
    # 1 ms a token: p0's busy 2,000-token prompt is priced 2 s, which no slow test run outlives
    # (under the prior's microseconds, a CI run that took a few ms longer saw p0's queue drained)
    for name in ("p0", "p1"):
        status, body = await fakes.register(cluster.session, cluster.url, cluster.instances[name],
                                            cost={"c0": 0.0, "c1": 1e-3, "c2": 0.0, "c3": 0.0})
        assert status == 200, body
    keys = prefix_hash(TOK.encode(PROMPT), 4, 0)
    await fakes.block_events(cluster.session, cluster.url, "store0:1", stored=keys[:5])
    p0 = cluster.instances["p0"]
    p0.behaviour.hang = True                    # p0 holds the prefix but is busy with a long prompt
    c = client(cluster)
    busy = asyncio.create_task(c.completions.create(model="tiny", prompt=[1] * 2000, max_tokens=2))
    while not p0.requests:
        await asyncio.sleep(0.01)
    p0.behaviour.hang = False                   # (only that first request stays stuck)
    assert await _gauge(cluster) == {}          # nothing measured yet: the 2 GB/s prior
    # the prior prices 5 blocks (10 KiB) at ~5 us: p1 fetches them from p0's store
    assert await _ask(c) == ("p1", "transfer")
    assert cluster.instances["p1"].requests[-1].migrate_from == "store0:1"
    # p1 timed that migration: the pair's speed is exported, and prices the same request again
    # (slow: 10 KiB take ~10 s, more than p0's queue, so p0 serves it from its own store)
    speed = (await _gauge(cluster))[("store0:1", "store1:1")]
    assert abs(speed - MIB / seconds_per_mib) < 1e-6 * speed
    assert await _ask(c) == then
    async with cluster.session.get(cluster.url + "/internal/v1/cost_model") as resp:   # sim export-costs
        profile = await resp.json()
    assert profile["network_bytes_per_s_measured"] and profile["network_bytes_per_s"] == speed
    busy.cancel()
    await c.close()


class _Store:
    """A prefill's store whose replication copies ``copied`` blocks (or fails)."""

    def __init__(self, copied: int | None) -> None:
        self.copied, self.asked = copied, []

    async def replicate(self, keys, peer):
        self.asked.append((len(keys), peer))
        if self.copied is None:
            raise ConnectionError("peer unreachable")
        return {"num_copied": self.copied, "num_present": len(keys) - self.copied, "num_missing": 0}

    async def match(self, keys) -> int:
        return 0


class _Stage:
    def __init__(self, store: _Store) -> None:
        self.store = store

    async def match(self, keys) -> int:
        return await self.store.match(keys)


@pytest.mark.parametrize("copied, expected", [(3, 3 * 4096.0), (0, None), (None, None)])
async def test_the_prefill_times_the_blocks_its_store_pulled(copied, expected):
    store = _Store(copied)
    svc = PrefillService(_Stage(store), links=None, block_size=4, hash_seed=0, chunk_size=64, block_bytes=4096)
    keys = prefix_hash(list(range(20)), 4, 0)
    req = PrefillRequest("r", "t", tuple(range(20)), "127.0.0.1:1", Sampling(max_tokens=2),
                         migrate_from="store0:1", migrate_keys=tuple(k.hex() for k in keys[:4]))
    job = QueuedJob("r", 20, 0, req=req, keys=keys)
    await svc._match(job)
    assert store.asked == [(4, "store0:1")]
    if expected is None:                  # nothing moved (or it failed): nothing to report
        assert job.migrated is None
    else:
        assert job.migrated[0] == expected and job.migrated[1] > 0
