"""Finding each other through etcd (``--discovery etcd://HOST:PORT``): signed entries under a lease.

Keys: ``/mooncake/conductors/<url>`` (a conductor: its URL, model id, block size, hash seed),
``/mooncake/instances/<id>`` (a prefill or decode: its registration) and
``/mooncake/stores/<address>``. Each process puts its own entry under a lease it keeps alive
(:func:`announce`); the entry disappears a TTL after the process dies, so a lease is a hint, and
death is still what the heartbeats say. Readers keep a :class:`Directory` of one prefix: a read of
the whole prefix, then a watch; while etcd is away they keep the last entries they read.

Every value is signed with the cluster token (HMAC-SHA256 over the key and the body), verified on
read: an entry that is not JSON, not signed, or signed with another token is logged once and
skipped, never applied (without a token anything that can write to etcd can add entries: set one).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
from collections.abc import Callable

import aiohttp
import orjson

from mooncake_lite.common.etcd import Etcd, EtcdError, parse_url

log = logging.getLogger(__name__)
ROOT = "/mooncake/"
CONDUCTORS, INSTANCES, STORES = ROOT + "conductors/", ROOT + "instances/", ROOT + "stores/"
LEASE_TTL_S = 5
RETRY_MAX_S = 5.0


def _signature(token: str | None, key: str, body: bytes) -> str:
    return hmac.new((token or "").encode(), key.encode() + b"\0" + body, hashlib.sha256).hexdigest()


def sign(token: str | None, key: str, body: dict) -> bytes:
    """The value stored under ``key``: the body and its signature."""
    raw = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    return orjson.dumps({"body": raw.decode(), "sig": _signature(token, key, raw)})


def verify(token: str | None, key: str, value: bytes) -> dict:
    """The body of a value :func:`sign` made; ValueError saying what is wrong otherwise."""
    try:
        entry = orjson.loads(value)
        raw, sig = entry["body"].encode(), entry["sig"]
        body = orjson.loads(raw)
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise ValueError("not a signed entry (JSON with 'body' and 'sig')") from None
    if not isinstance(sig, str) or not hmac.compare_digest(sig, _signature(token, key, raw)):
        raise ValueError("bad signature (another cluster token?)")
    if not isinstance(body, dict):
        raise ValueError("body is not an object")
    return body


def client(session: aiohttp.ClientSession, url: str) -> Etcd:
    return Etcd(session, parse_url(url))


async def announce(etcd: Etcd, key: str, body: dict, token: str | None, ttl_s: int = LEASE_TTL_S,
                   on_renewed: Callable[[float], None] = lambda sent_at: None) -> None:
    """Keep ``body`` under ``key`` for as long as this runs (a task; cancel it to leave): a lease
    of ``ttl_s`` renewed three times per TTL, granted again and the entry put again when etcd lost
    it (etcd restarted, or we were cut off longer than the TTL). Cancelled: the lease is revoked,
    so readers see the entry go at once. ``on_renewed(sent_at)`` follows each renewal etcd
    answered, with the loop time it was sent at: etcd keeps the entry at least a TTL past it."""
    value, lease, delay = sign(token, key, body), None, 0.5
    try:
        while True:
            try:
                sent_at = asyncio.get_running_loop().time()
                if lease is None or not await etcd.keepalive(lease):
                    lease = await etcd.grant(ttl_s)
                    await etcd.put(key, value, lease)
                    log.info("discovery: %s announced in etcd (lease %x, %ds)", key, lease, ttl_s)
                on_renewed(sent_at)
                delay = 0.5
                await asyncio.sleep(ttl_s / 3)
            except EtcdError as exc:
                if delay == 0.5:
                    log.warning("discovery: cannot keep %s in etcd (%s); retrying", key, exc)
                lease = None
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
    finally:
        if lease is not None:
            with contextlib.suppress(EtcdError, asyncio.CancelledError):
                await asyncio.shield(etcd.revoke(lease))


class Directory:
    """The verified entries under one prefix, by the key's last part, kept current by
    :meth:`run` (a task). ``on_change`` is called with the entries after each change;
    ``loaded`` is set once the first read is done. While etcd is away the entries stay."""

    def __init__(self, etcd: Etcd, prefix: str, token: str | None,
                 on_change: Callable[[dict[str, dict]], None] = lambda entries: None) -> None:
        self.etcd, self.prefix, self.token, self.on_change = etcd, prefix, token, on_change
        self.entries: dict[str, dict] = {}
        self.loaded = asyncio.Event()
        self.connected = False
        self._refused: set[tuple[str, bytes]] = set()   # logged once each

    async def run(self) -> None:
        delay = 0.5
        while True:
            try:
                kvs, revision = await self.etcd.get_prefix(self.prefix)
                self.entries = {}
                for key, value in kvs.items():
                    self._apply(key, value)
                self._connected()
                self.on_change(dict(self.entries))
                delay = 0.5
                async for event in self.etcd.watch(self.prefix, revision + 1):
                    if self._apply(event.key, event.value):
                        self.on_change(dict(self.entries))
            except EtcdError as exc:
                if self.connected or delay == 0.5:
                    log.warning("discovery: %s: %s; keeping the last %d entr(ies), retrying",
                                self.prefix, exc, len(self.entries))
                self.connected = False
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)

    def _connected(self) -> None:
        if not self.connected and self.loaded.is_set():
            log.info("discovery: %s read again from etcd (%d entries)", self.prefix, len(self.entries))
        self.connected = True
        self.loaded.set()

    def _apply(self, key: str, value: bytes | None) -> bool:
        """Apply one key's new value (None: gone); True when the entries changed."""
        name = key[len(self.prefix):]
        if value is None:
            return self.entries.pop(name, None) is not None
        try:
            body = verify(self.token, key, value)
        except ValueError as exc:
            if (key, value) not in self._refused:
                if len(self._refused) > 1024:   # bounded: entries written in a loop do not grow it
                    self._refused.clear()
                self._refused.add((key, value))
                log.error("discovery: skipped the entry %s in etcd: %s", key, exc)
            return self.entries.pop(name, None) is not None
        if self.entries.get(name) == body:
            return False
        self.entries[name] = body
        return True
