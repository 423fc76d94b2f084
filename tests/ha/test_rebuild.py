"""A started conductor's /health gate (conductor/cluster/rebuild.py): complete once everything
listed in etcd has reported, or when the bounded wait is over; never again incomplete."""

from mooncake_lite.conductor.cluster.rebuild import Rebuild


def test_complete_when_every_listed_instance_and_store_reported():
    r = Rebuild(started=100.0, wait_s=10.0)
    registered, synced = set(), set()
    done = lambda now: r.complete(now, registered.__contains__, synced.__contains__)   # noqa: E731
    assert not done(100.1)                       # etcd not read yet: nothing to compare with
    r.expect({"p0", "d0"}, {"10.0.0.1:8101"})
    registered |= {"p0", "d0"}
    assert not done(100.2) and r.missing(registered.__contains__, synced.__contains__) == ["10.0.0.1:8101"]
    synced.add("10.0.0.1:8101")
    assert done(100.3) and "listed in etcd reported" in r.how
    registered.clear()
    assert done(100.4)                           # once rebuilt, rebuilt for good
    r.expect({"late"}, ())                       # and nothing expected later reopens it
    assert done(100.5) and "late" not in r.expected_instances


def test_the_wait_is_bounded_and_says_what_is_missing():
    r = Rebuild(started=0.0, wait_s=2.0)
    r.expect({"p0", "gone"}, ())
    assert not r.complete(1.9, {"p0"}.__contains__, lambda s: True)
    assert r.complete(2.0, {"p0"}.__contains__, lambda s: True) and "still missing gone" in r.how
    static = Rebuild(started=0.0, wait_s=0.0)     # no discovery, no wait: complete at once
    assert static.complete(0.0, lambda i: False, lambda s: False)


async def test_health_for_a_balancer(aiohttp_client):
    """``/health?ready`` is 503 while the conductor cannot serve (no prefill or decode); plain
    ``/health`` stays 200 then; both are 503 ``rebuilding`` during ``--rebuild-wait``."""
    from mooncake_lite.conductor.app import make_app
    from mooncake_lite.conductor.config import Config

    client = await aiohttp_client(make_app(Config(model="tiny", block_size=4)))
    assert (await client.get("/health")).status == 200
    resp = await client.get("/health?ready")
    assert resp.status == 503 and (await resp.json())["ready"] is False
    client = await aiohttp_client(make_app(Config(model="tiny", block_size=4, rebuild_wait=60.0)))
    resp = await client.get("/health")
    assert resp.status == 503 and (await resp.json())["status"] == "rebuilding"
