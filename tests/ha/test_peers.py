"""Tenant limits among conductors given a static ``--peers`` list, without etcd.

Three conductor apps in this process, each served on its own loopback port and listing all three
(``--peers``, as every conductor of a static cluster is given the same list): each holds its share
of a tenant's concurrency limit while the others answer ``/health``, and the two left take over
the share of one that stops. No instances: the shares need none, so no cluster is started.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from mooncake_lite.common import service
from mooncake_lite.common.config import ConfigError
from mooncake_lite.conductor.app import make_app
from mooncake_lite.conductor.cluster import discovery
from mooncake_lite.conductor.config import Config
from mooncake_lite.conductor.services import SERVICES
from mooncake_lite.scheduler.tenants import TenantLedger, parse_tenants
from tests.ha.cluster import free_port

pytestmark = pytest.mark.timeout(60)
TENANTS = parse_tenants({"limited": {"api_keys": ["k"], "max_concurrency": 5}})


async def _until(ok, what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not ok():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.05)


def _admitted(ledger: TenantLedger) -> int:
    spec = ledger.tenants.specs[0]
    taken = [ledger.admit(spec, 0.0) is None for _ in range(10)]
    for _ in range(sum(taken)):
        ledger.end(spec.name)
    return sum(taken)


def test_static_peers_divide_the_limits_among_those_answering_health():
    async def main() -> None:
        ports = [free_port() for _ in range(3)]
        peers = ",".join(f"http://127.0.0.1:{p}" for p in ports)
        runners = []
        for port in ports:
            app = make_app(Config(model="tiny", block_size=4, admission="none", tenants=TENANTS, peers=peers))
            runner, _ = await service.start_site(app, "127.0.0.1", port)
            discovery.note_address(app, {"http": f"127.0.0.1:{port}"})   # what serve_app's ready line does
            runners.append((runner, app[SERVICES].tenants.ledger))
        ledgers = [ledger for _, ledger in runners]
        try:
            await _until(lambda: all(le.count == 3 for le in ledgers), "each sees three live conductors")
            assert sorted(le.index for le in ledgers) == [0, 1, 2]
            assert sorted(_admitted(le) for le in ledgers) == [1, 2, 2]       # 5 among 3: the shares sum to it
            await runners[2][0].cleanup()                                     # the last one stops
            await _until(lambda: ledgers[0].count == ledgers[1].count == 2, "the two left count it out")
            assert sorted(_admitted(le) for le in ledgers[:2]) == [2, 3]
        finally:
            for runner, _ in runners:
                await runner.cleanup()

    asyncio.run(main())


@pytest.mark.parametrize("overrides, names", [
    ({"peers": "127.0.0.1:8000"}, "--peers must be http(s) URLs"),
    ({"peers": "http://127.0.0.1:8000,ftp://x"}, "--peers must be http(s) URLs separated by commas, got 'ftp://x'"),
    ({"peers": " , "}, "--peers must name at least one conductor URL"),
    ({"peers": "http://127.0.0.1:8000", "discovery": "etcd://127.0.0.1:2379"}, "--peers and --discovery"),
])
def test_bad_peers_are_refused_naming_the_flag(overrides, names):
    with pytest.raises(ConfigError, match=re.escape(names)):
        Config(model="tiny", **overrides)
