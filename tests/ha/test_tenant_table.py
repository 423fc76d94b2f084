"""Tenant definitions shared through etcd (``conductor/cluster/tenant_table.py``).

Conductor apps in this process (no instances: the table needs none) against a real etcd on
loopback (``tests/ha/cluster.py``): the first conductors to start seed the table exactly once,
a conductor with another ``--tenants`` adopts etcd's, a ``mooncake tenants push`` is applied live,
and an unsigned or invalid entry is skipped with the table in force kept. No API key is in etcd in clear.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from mooncake_lite.common import discovery as etcd_entries
from mooncake_lite.common import service
from mooncake_lite.common.etcd import Etcd as EtcdClient
from mooncake_lite.conductor.app import make_app
from mooncake_lite.conductor.cluster import discovery, tenant_table
from mooncake_lite.conductor.config import Config
from mooncake_lite.conductor.services import SERVICES
from mooncake_lite.conductor.tenants import TenantGate, key_digest
from mooncake_lite.conductor.tenants_push import main as push_main
from mooncake_lite.conductor.tenants_push import push
from mooncake_lite.scheduler import SchedulerConfig
from mooncake_lite.scheduler.tenants import parse_tenants
from tests.ha.cluster import Etcd, free_port

pytestmark = pytest.mark.timeout(60)
TOKEN = "tenant-table-token"
A = parse_tenants({"gold": {"api_keys": ["key-a"], "max_concurrency": 4, "priority": "high", "ttft_slo": "2s"}})
B = parse_tenants({"silver": {"api_keys": ["key-b"], "rate": 5.0, "priority": "low"}})


async def _until(ok, what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not ok():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.05)


async def _conductors(etcd: Etcd, *tables):
    """Conductor apps with ``--discovery``, one per tenant table, started at once."""
    async with aiohttp.ClientSession() as session:
        await EtcdClient(session, etcd.url).delete(tenant_table.KEY)   # each test starts with none
    apps = [make_app(Config(model="tiny", block_size=4, admission="none", tenants=t, discovery=etcd.url,
                            cluster_token=TOKEN)) for t in tables]
    ports = [free_port() for _ in apps]
    started = await asyncio.gather(*(service.start_site(app, "127.0.0.1", p) for app, p in zip(apps, ports)))
    for app, port in zip(apps, ports):
        discovery.note_address(app, {"http": f"127.0.0.1:{port}"})
    return [runner for runner, _ in started], [app[SERVICES].tenants for app in apps]


def _serves(gate: TenantGate, key: str) -> str | None:
    spec = gate.by_key(key)
    return None if spec is None else spec.name


def test_two_conductors_racing_seed_once_and_both_serve_the_winners_table(etcd, caplog):
    async def main() -> None:
        with caplog.at_level(logging.INFO, logger=tenant_table.__name__):
            runners, gates = await _conductors(etcd, A, B)
            try:
                await _until(lambda: all(g.tenants.specs[0].key_digests for g in gates), "both serve etcd's table")
                winner = _serves(gates[0], "key-a") and "gold" or "silver"
                assert [_serves(g, "key-a") or _serves(g, "key-b") for g in gates] == [winner, winner]
                assert _serves(gates[0], "key-a" if winner == "silver" else "key-b") is None   # the loser's key
                async with aiohttp.ClientSession() as session:
                    raw = (await EtcdClient(session, etcd.url).get_prefix(tenant_table.KEY))[0][tenant_table.KEY]
                assert b"key-a" not in raw and b"key-b" not in raw     # keys only as digests
                assert key_digest("key-a" if winner == "gold" else "key-b").encode() in raw
            finally:
                for runner in runners:
                    await runner.cleanup()
        seeded = [r for r in caplog.records if "seeded the shared tenant table" in r.getMessage()]
        differs = [r for r in caplog.records if "differs from the table in etcd" in r.getMessage()]
        assert len(seeded) == 1 and len(differs) == 1

    asyncio.run(main())


def test_a_push_is_applied_live_and_bad_entries_are_skipped(etcd, caplog):
    async def main() -> None:
        runners, (gate,) = await _conductors(etcd, A)
        try:
            await _until(lambda: gate.tenants.get("gold").key_digests, "serving by etcd's table")
            ledger = gate.ledger
            assert ledger.admit(gate.tenants.get("gold"), 0.0) is None      # one in flight across the change
            async with aiohttp.ClientSession() as session:
                client = EtcdClient(session, etcd.url)
                await client.put(tenant_table.KEY, b"not signed")
                await client.put(tenant_table.KEY, etcd_entries.sign(TOKEN, tenant_table.KEY, {"gold": {"rate": -1}}))
                await client.put(tenant_table.KEY, tenant_table.signed(B, "another-token"))
                await _until(lambda: sum(("skipped the tenant table in etcd" in r.getMessage() or "skipped the entry "
                                          + tenant_table.KEY in r.getMessage()) for r in caplog.records) >= 3,
                             "three entries skipped")
            assert _serves(gate, "key-a") == "gold" and gate.tenants.get("gold").max_concurrency == 4
            changed = parse_tenants({"gold": {"api_keys": ["key-a", "key-c"], "max_concurrency": 1, "rate": 2.0,
                                              "priority": "low", "ttft_slo": "5s"}})
            await push(etcd.url, changed, TOKEN)
            await _until(lambda: gate.tenants.get("gold").max_concurrency == 1, "the change applied live")
            gold = gate.tenants.get("gold")
            assert gold.priority == 0 and gate.configs["gold"].ttft_slo_s == 5.0 and _serves(gate, "key-c") == "gold"
            assert ledger is gate.ledger and ledger.buckets["gold"].rate == 2.0
            refusal = ledger.admit(gold, 0.0)                  # the request in flight still counts
            assert refusal is not None and refusal.limit == "concurrency"
        finally:
            for runner in runners:
                await runner.cleanup()

    with caplog.at_level(logging.INFO):
        asyncio.run(main())


def test_tenants_push_needs_a_table_and_names_a_bad_url(tmp_path, capsys):
    assert push_main(["push", "--discovery", "etcd://127.0.0.1:1"]) == 2
    assert "--tenants FILE is required" in capsys.readouterr().err
    path = tmp_path / "tenants.toml"
    path.write_text('[tenants.gold]\napi_keys = ["k"]\n')
    assert push_main(["push", "--discovery", "127.0.0.1:1", "--tenants", str(path)]) == 2
    assert "--discovery must be etcd://HOST:PORT" in capsys.readouterr().err


def test_the_last_table_stays_in_force_while_etcd_is_down_and_changes_apply_when_it_returns(etcd):
    async def main() -> None:
        runners, (gate,) = await _conductors(etcd, A)
        try:
            await _until(lambda: gate.tenants.get("gold").key_digests, "serving by etcd's table")
            etcd.kill()
            await asyncio.sleep(1.0)
            assert _serves(gate, "key-a") == "gold" and gate.tenants.get("gold").max_concurrency == 4
            etcd.start()
            await push(etcd.url, B, TOKEN)
            await _until(lambda: _serves(gate, "key-b") == "silver", "the push applied once etcd is back", 20.0)
            assert _serves(gate, "key-a") is None
        finally:
            for runner in runners:
                await runner.cleanup()

    asyncio.run(main())


def test_the_api_key_flag_stays_tenant_default_under_a_shared_table():
    gate = TenantGate(A, SchedulerConfig(), api_key="ops-key")
    gate.apply(parse_tenants(tenant_table.table_body(B)))          # as it comes back from etcd
    assert _serves(gate, "ops-key") == "default" and _serves(gate, "key-b") == "silver"
    assert _serves(gate, "key-a") is None and not gate.is_open
