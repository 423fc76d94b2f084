"""Cached contexts shared by the conductors through etcd (with ``--discovery``).

A context created on one conductor is put under ``/mooncake/contexts/<id>`` (signed with the
cluster token, ``common/discovery.py``) on a lease of its remaining lifetime, so etcd forgets it
when it expires; every conductor watches the prefix and keeps its book in step: a context made
elsewhere can be used, listed, extended and deleted here. Extending puts it again on a new lease;
deleting deletes the key. The store holding its blocks is told by the conductor that serves the
call (PIN, UNPIN), as with one conductor. While etcd is unreachable new contexts are refused with
a 503 naming etcd (a context only one conductor knew would 404 on the others); the contexts
already known stay usable.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from mooncake_lite.common import discovery
from mooncake_lite.common.etcd import Etcd, EtcdError
from mooncake_lite.conductor.api.errors import unavailable
from mooncake_lite.conductor.contexts.book import Context, ContextBook

log = logging.getLogger(__name__)
PREFIX = discovery.ROOT + "contexts/"
EXPIRY_SLACK_S = 2.0   # a context gone from etcd this close to its expiry expired (410), else was deleted (404)


def to_entry(ctx: Context) -> dict[str, Any]:
    return {"context_id": ctx.context_id, "tenant": ctx.tenant, "kind": ctx.kind, "model": ctx.model,
            "prompt_ids": list(ctx.prompt_ids), "messages": list(ctx.messages), "keys": [k.hex() for k in ctx.keys],
            "store": ctx.store, "created": ctx.created, "expires_at": ctx.expires_at, "name": ctx.name,
            "cached_tokens": ctx.cached_tokens}


def from_entry(body: dict[str, Any]) -> Context:
    """The context an entry describes; ValueError (naming the field) when it is not one."""
    try:
        ctx = Context(str(body["context_id"]), str(body["tenant"]), str(body["kind"]), str(body["model"]),
                      tuple(int(t) for t in body["prompt_ids"]),
                      tuple({"role": str(m["role"]), "content": str(m["content"])} for m in body["messages"]),
                      tuple(bytes.fromhex(k) for k in body["keys"]), str(body["store"]), int(body["created"]),
                      float(body["expires_at"]), body.get("name"), int(body["cached_tokens"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a context entry ({exc!r})") from None
    if ctx.kind not in ("prompt", "messages"):
        raise ValueError(f"not a context entry (kind {ctx.kind!r})")
    return ctx


class SharedContexts:
    """The book kept in step with etcd (:meth:`follow`, the watch's callback) and the writes."""

    def __init__(self, etcd: Etcd, token: str | None, book: ContextBook) -> None:
        self.etcd, self.token, self.book = etcd, token, book
        self.directory = discovery.Directory(etcd, PREFIX, token, self.follow)
        self.seen: set[str] = set()   # ids read from etcd: only those can be deleted elsewhere

    def check_reachable(self) -> None:
        if not self.directory.connected:
            raise unavailable("etcd is unreachable: new cached contexts are refused until it is back "
                              "(the other conductors could not use them)")

    async def publish(self, ctx: Context) -> None:
        """Put ``ctx`` (new or extended) on a lease of its remaining lifetime; 503 naming etcd."""
        try:
            lease = await self.etcd.grant(max(1, math.ceil(ctx.expires_at - time.time())))
            key = PREFIX + ctx.context_id
            await self.etcd.put(key, discovery.sign(self.token, key, to_entry(ctx)), lease)
        except EtcdError as exc:
            raise unavailable(f"etcd is unreachable ({exc}): the context could not be shared with the other "
                              "conductors") from None

    async def withdraw(self, context_id: str) -> None:
        """Delete it for every conductor; without etcd the others forget it at its expiry."""
        try:
            await self.etcd.delete(PREFIX + context_id)
        except EtcdError as exc:
            log.warning("context %s deleted here, but etcd is unreachable (%s): other conductors keep it "
                        "until its expiry", context_id, exc)

    def follow(self, entries: dict[str, dict]) -> None:
        contexts, now = self.book.contexts, time.time()
        for name, body in entries.items():
            try:
                ctx = from_entry(body)
            except ValueError as exc:
                log.error("cached contexts: skipped the entry %s in etcd: %s", name, exc)
                continue
            self.seen.add(ctx.context_id)
            old = contexts.get(ctx.context_id)
            if old is None or old.expires_at != ctx.expires_at or old.store != ctx.store:
                contexts[ctx.context_id] = ctx
        for context_id in [i for i in contexts if i in self.seen and i not in entries]:
            self.seen.discard(context_id)
            ctx = contexts.pop(context_id)
            if ctx.expires_at <= now + EXPIRY_SLACK_S:
                self.book.expired[context_id] = ctx.tenant
