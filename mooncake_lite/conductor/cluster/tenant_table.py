"""Tenant definitions shared through etcd (``--discovery``): one signed entry, ``/mooncake/tenants/table``.

A conductor that finds none seeds it from its own ``--tenants`` (create-if-absent: an etcd
transaction on create revision 0, so of several starting at once exactly one writes it); one
that finds it serves by it (logging once when its own file differs), follows the key and applies
each change live: keys, limits, SLOs, priorities (``TenantGate.apply``; requests in flight keep
counting). The entry holds each API key as its SHA-256 digest, never in clear; requests are
matched by the digest of the key they present (the gate's one lookup path). An entry that is
unsigned, signed with another token or not a valid table is logged and skipped, the table in force
kept; while etcd is away, or when the entry is deleted, the last table stays in force. A conductor
without ``--tenants`` seeds nothing (it would impose "no tenants" on the others) but adopts one.
Operators change it with ``mooncake tenants push`` (``conductor/tenants_push.py``).
"""

from __future__ import annotations

import asyncio
import logging

from mooncake_lite.common import discovery
from mooncake_lite.common.config import ConfigError
from mooncake_lite.common.etcd import Etcd, EtcdError
from mooncake_lite.conductor.tenants import TenantGate, spec_digests
from mooncake_lite.scheduler.tenants import SPEC_FIELDS, Tenants, parse_tenants

log = logging.getLogger(__name__)
PREFIX = discovery.ROOT + "tenants/"
KEY = PREFIX + "table"


def table_body(tenants: Tenants) -> dict:
    """``tenants`` as the ``[tenants]`` table :func:`parse_tenants` reads, API keys as digests."""
    body: dict = {} if tenants.anonymous is None else {"anonymous": tenants.anonymous}
    for s in tenants.specs:
        spec: dict = {"priority": s.priority, "api_key_sha256": sorted(spec_digests(s))}
        spec.update({k: getattr(s, f) for k, f in SPEC_FIELDS.items() if getattr(s, f) is not None})
        body[s.name] = spec
    return body


def signed(tenants: Tenants, token: str | None) -> bytes:
    """The entry's value for ``tenants``, signed with the cluster token."""
    return discovery.sign(token, KEY, table_body(tenants))


async def seed(etcd: Etcd, own: Tenants, token: str | None) -> None:
    """Write ``own`` as the shared table unless one is there (retried until etcd answers)."""
    delay = 0.5
    while True:
        try:
            created, _ = await etcd.create(KEY, signed(own, token))
            if created:
                log.info("tenants: seeded the shared tenant table in etcd (%s) from --tenants", KEY)
            return
        except EtcdError as exc:
            if delay == 0.5:
                log.warning("tenants: cannot seed the shared tenant table (%s); retrying", exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, discovery.RETRY_MAX_S)


class SharedTable:
    """Applies the table found in etcd to ``gate`` (``on_change`` of a ``Directory`` of :data:`PREFIX`)."""

    def __init__(self, gate: TenantGate) -> None:
        self.gate = gate
        self.body: dict | None = None        # the table in force, as etcd holds it
        self.warned = False

    def changed(self, entries: dict[str, dict]) -> None:
        body = entries.get("table")
        if body is None or body == self.body:
            if body is None and self.body is not None:
                log.warning("tenants: no valid shared tenant table in etcd now; keeping the one in force")
            return
        try:
            tenants = parse_tenants(body)
        except ConfigError as exc:
            log.error("tenants: skipped the tenant table in etcd (%s); keeping the one in force", exc)
            return
        self.gate.apply(tenants)
        first, self.body = self.body is None, body
        log.info("tenants: %s the shared tenant table from etcd (%d tenants)",
                 "serving by" if first else "applied a change to", len(tenants.specs))
        own = table_body(self.gate.own)
        if self.gate.own and own != body and not self.warned:
            self.warned = True
            log.warning("tenants: this conductor's --tenants differs from the table in etcd; serving by etcd's "
                        "(change it with `mooncake tenants push`)")


async def run(gate: TenantGate, etcd: Etcd, token: str | None) -> None:
    """Seed (when this conductor has tenants), then follow the shared table (a task)."""
    if gate.own:
        await seed(etcd, gate.own, token)
    await discovery.Directory(etcd, PREFIX, token, SharedTable(gate).changed).run()
