"""``mooncake tenants push --discovery etcd://HOST:PORT --tenants FILE``: replace the tenant table
the conductors share through etcd (``conductor/cluster/tenant_table.py``). Every conductor applies
it live; API keys are written as their SHA-256 digests, the entry signed with the cluster token
(``--cluster-token`` or ``MOONCAKE_CLUSTER_TOKEN``: the conductors skip an entry signed otherwise)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from mooncake_lite.common import discovery
from mooncake_lite.common.config import ConfigError, load_config, option, require
from mooncake_lite.common.etcd import EtcdError
from mooncake_lite.conductor.cluster import tenant_table
from mooncake_lite.conductor.config import load_tenants
from mooncake_lite.scheduler.tenants import Tenants


@dataclass(frozen=True)
class PushConfig:
    discovery: str = option("", "etcd://HOST:PORT of the cluster's etcd")
    tenants: Tenants = option(Tenants(), "TOML file with [tenants.NAME] tables (as the conductor's --tenants)",
                              parse=load_tenants)
    cluster_token: str | None = option(None, "the cluster token the conductors verify the entry with")

    def __post_init__(self) -> None:
        require(bool(self.discovery), "--discovery etcd://HOST:PORT is required")
        require(bool(self.tenants), "--tenants FILE is required (a table with at least one tenant)")


async def push(url: str, tenants: Tenants, token: str | None) -> None:
    """Write ``tenants`` as the shared table (raises EtcdError or ValueError for the URL)."""
    async with aiohttp.ClientSession() as session:
        etcd = discovery.client(session, url)
        await etcd.put(tenant_table.KEY, tenant_table.signed(tenants, token))


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] != "push":
        sys.stderr.write("usage: mooncake tenants push --discovery etcd://HOST:PORT --tenants FILE [--cluster-token T]\n")
        return 2
    try:
        cfg = load_config(PushConfig, argv[1:], prog="mooncake tenants push", section="tenants-push",
                          description=__doc__.split("\n\n")[0])
        asyncio.run(push(cfg.discovery, cfg.tenants, cfg.cluster_token))
    except (ConfigError, ValueError, EtcdError) as exc:
        sys.stderr.write(f"mooncake tenants push: error: {exc}\n")
        return 2
    print(f"pushed {len(cfg.tenants.specs)} tenant(s) to {tenant_table.KEY}; the conductors apply it live")
    return 0
