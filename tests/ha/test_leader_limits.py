"""Run-once jobs' leader through a real etcd, and tenant limits divided among conductors.

The election runs against a real etcd (its own, on loopback: ``tests/ha/cluster.py``), with
three candidates in this process and a 2 s lease, so a failover takes seconds; a candidate is
cut off from etcd by pointing its client at a closed port (what a partition looks like from its
side). The limit shares are pure (``TenantLedger.divide``) but for the partition check, which
asks a peer conductor's ``/internal/v1/etcd`` over loopback.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from mooncake_lite.common.etcd import Etcd as EtcdClient
from mooncake_lite.conductor.cluster import leader, limits
from mooncake_lite.scheduler.tenants import TenantLedger, Tenants, TenantSpec, split
from tests.fakes import serve_on_loopback
from tests.ha.cluster import Etcd, free_port

TOKEN = "leader-test-token"
TTL = 2


async def _leaders(cands: list[leader.Leadership], seconds: float, samples: list[int]) -> None:
    for _ in range(int(seconds / 0.02)):
        samples.append(sum(c.is_leader for c in cands))
        await asyncio.sleep(0.02)


async def _until_one_leads(cands: list[leader.Leadership], samples: list[int], timeout: float) -> float:
    start = asyncio.get_running_loop().time()
    while sum(c.is_leader for c in cands) != 1:
        assert asyncio.get_running_loop().time() - start < timeout, [c.is_leader for c in cands]
        samples.append(sum(c.is_leader for c in cands))
        await asyncio.sleep(0.02)
    return asyncio.get_running_loop().time() - start


def test_one_leader_and_it_moves_when_cut_off_or_stopped(etcd):
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            clients = [EtcdClient(session, etcd.url, timeout=0.5) for _ in range(3)]
            cands = [leader.Leadership(TOKEN, ttl_s=TTL) for _ in range(3)]
            tasks = [asyncio.create_task(c.run(e, f"http://c{k}")) for k, (c, e) in enumerate(zip(cands, clients))]
            try:
                await _elections(etcd, cands, clients, tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


async def _elections(etcd: Etcd, cands: list[leader.Leadership], clients: list[EtcdClient], tasks) -> None:
        samples: list[int] = []
        await _until_one_leads(cands, samples, timeout=5)
        await _leaders(cands, 1.0, samples)            # it stays the only one
        first = next(k for k, c in enumerate(cands) if c.is_leader)
        clients[first].base = f"http://127.0.0.1:{free_port()}"   # cut off from etcd
        moved = await _until_one_leads_other(cands, first, samples, timeout=TTL * 3)
        clients[first].base = etcd.url                  # back: the key is the other's now
        await _leaders(cands, 1.0, samples)
        assert not cands[first].is_leader
        second = next(k for k, c in enumerate(cands) if c.is_leader)
        for _ in range(200):   # its retries back off: it reads the new leader within a few seconds
            if cands[first].holder == f"http://c{second}":
                break
            await asyncio.sleep(0.05)
        assert cands[first].holder == f"http://c{second}" and not cands[first].is_leader
        tasks[second].cancel()                          # a stop revokes its lease: the next leads soon
        await asyncio.gather(tasks[second], return_exceptions=True)
        again = await _until_one_leads(cands, samples, timeout=TTL * 2)
        print(f"\nleader: moved {moved:.2f}s after the cut (lease {TTL}s), {again:.2f}s after a stop")
        assert max(samples) == 1, "two leaders at once"


async def _until_one_leads_other(cands, old: int, samples: list[int], timeout: float) -> float:
    start = asyncio.get_running_loop().time()
    while not any(c.is_leader for k, c in enumerate(cands) if k != old):
        assert asyncio.get_running_loop().time() - start < timeout, "no new leader"
        samples.append(sum(c.is_leader for c in cands))
        await asyncio.sleep(0.02)
    return asyncio.get_running_loop().time() - start


LIMITED = TenantSpec("limited", ("k",), rate=4.0, burst=3, max_concurrency=3)


def test_split_shares_sum_to_the_limit():
    for total in range(0, 9):
        for count in range(1, 5):
            shares = [split(total, i, count) for i in range(count)]
            assert sum(shares) == total and max(shares) - min(shares) <= 1


def test_each_conductor_holds_its_share_of_the_limits():
    conc, rate = TenantSpec("conc", ("k",), max_concurrency=3), TenantSpec("rate", ("r",), rate=4.0, burst=4)
    ledgers = [TenantLedger(Tenants((conc, rate))) for _ in range(2)]
    for i, ledger in enumerate(ledgers):
        ledger.divide(i, 2)
    assert [sum(ledger.admit(conc, 0.0) is None for _ in range(5)) for ledger in ledgers] == [2, 1]
    refusal = ledgers[1].admit(conc, 0.0)
    assert refusal.limit == "concurrency" and "1 of it on this one of 2 conductors" in refusal.message
    # rate 4/s burst 4 halved: 2/s, 2 tokens each; 1 s later 2 more each: 4 + 4 over the second
    got = [sum(ledger.admit(rate, t) is None and not ledger.end("rate") for t in (0.0,) * 5 + (1.0,) * 5)
           for ledger in ledgers]
    assert got == [4, 4]
    ledgers[0].divide(0, 1)       # the other left: this one holds the whole limit again
    assert sum(ledgers[0].admit(conc, 1.0) is None for _ in range(5)) == 1   # 2 in flight + 1
    ledgers[0].divide(0, 1, cut_off="cut off from etcd")
    refusal = ledgers[0].admit(TenantSpec("conc", ("k",), max_concurrency=9), 2.0)
    assert refusal.limit == "concurrency" and "cut off from etcd" in refusal.message
    assert ledgers[0].admit(TenantSpec("open"), 2.0) is None   # a tenant without limits is let in


def test_a_conductor_cut_off_from_etcd_gives_its_share_up_only_when_a_peer_reaches_it():
    async def main() -> None:
        peer = limits.Limits(TenantLedger(Tenants((LIMITED,))), {"model": "tiny"}, ttl_s=TTL)
        app = web.Application()
        app[limits.LIMITS] = peer
        app.router.add_get("/internal/v1/etcd", limits.reaches_etcd)
        runner, url = await serve_on_loopback(app)
        try:
            me = limits.Limits(TenantLedger(Tenants((LIMITED,))), {"model": "tiny"}, ttl_s=TTL)
            me.listed({url: {"model": "tiny"}, "http://other-model": {"model": "small"}})
            me.place("http://127.0.0.1:1")     # sorts before the peer: share 2 of 3
            assert (me.ledger.index, me.ledger.count) == (0, 2)
            now = asyncio.get_running_loop().time()
            async with aiohttp.ClientSession() as session:
                me.renewed(now - TTL)          # etcd may have dropped us; the peer does not reach it either
                peer.renewed_at = now - TTL
                await me.check(session, None, now)
                assert me.cut_off is None, "every conductor cut off: an etcd outage, the share is kept"
                peer.renewed(now)              # the peer reaches etcd: a partition
                await me.check(session, None, now)
                assert me.cut_off and url in me.cut_off
                assert me.ledger.admit(LIMITED, now).limit == "concurrency"
                me.renewed(now)                # back
                assert me.cut_off is None and me.ledger.admit(LIMITED, now) is None
        finally:
            await runner.cleanup()

    asyncio.run(main())
