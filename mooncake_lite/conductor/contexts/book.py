"""The conductor's cached contexts (``routes.py``): one record per context, and the book of
them by id with the tenant checks, the quota count and the ids of expired ones. No IO."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from mooncake_lite.conductor.api.errors import ApiError, short

MAX_TOMBSTONES = 10_000   # expired ids remembered, so using one says "expired", not "unknown"


@dataclass
class Context:
    context_id: str
    tenant: str
    kind: str                            # "prompt" (completions) | "messages" (chat)
    model: str
    prompt_ids: tuple[int, ...]
    messages: tuple[dict[str, str], ...]
    keys: tuple[bytes, ...]              # its full blocks: what is held in the store
    store: str                           # the store holding them (data address)
    created: int
    expires_at: float
    name: str | None = None
    cached_tokens: int = 0

    def public(self) -> dict[str, Any]:
        return {"id": self.context_id, "object": "context", "model": self.model, "created": self.created,
                "expires_at": int(self.expires_at), "kind": self.kind, "name": self.name,
                "num_tokens": len(self.prompt_ids), "cached_tokens": self.cached_tokens}


@dataclass
class ContextBook:
    """The live contexts by id, and the ids of expired ones (for a clear error)."""

    contexts: dict[str, Context] = field(default_factory=dict)
    expired: OrderedDict[str, str] = field(default_factory=OrderedDict)   # id -> tenant
    creating: dict[str, int] = field(default_factory=dict)   # tenant -> tokens of contexts being made

    def get(self, tenant: str, context_id: Any, now: float) -> Context:
        """The tenant's live context ``context_id``; 404 unknown (or another tenant's), 410 expired."""
        self.sweep(now)
        ctx = self.contexts.get(context_id) if isinstance(context_id, str) else None
        if ctx is not None and ctx.tenant == tenant:
            return ctx
        if isinstance(context_id, str) and self.expired.get(context_id) == tenant:
            raise ApiError(410, f"context {short(context_id)} has expired; create it again",
                           code="context_expired", param="context_id")
        raise ApiError(404, f"no context {short(context_id)} (unknown, deleted, or another tenant's)",
                       code="context_not_found", param="context_id")

    def used_tokens(self, tenant: str) -> int:
        """Held tokens of the tenant's live contexts, and of those being created (so two
        concurrent creations cannot both pass the quota)."""
        held = sum(c.cached_tokens for c in self.contexts.values() if c.tenant == tenant)
        return held + self.creating.get(tenant, 0)

    def reserve(self, tenant: str, num_tokens: int, delta: int = 1) -> None:
        """Count (``delta`` 1) or stop counting (-1) a creation in progress."""
        self.creating[tenant] = self.creating.get(tenant, 0) + delta * num_tokens
        if not self.creating[tenant]:
            del self.creating[tenant]

    def of(self, tenant: str, now: float) -> list[Context]:
        self.sweep(now)
        return sorted((c for c in self.contexts.values() if c.tenant == tenant), key=lambda c: c.created)

    def sweep(self, now: float) -> list[Context]:
        """Move expired contexts to the tombstones (their stores end the holds themselves)."""
        gone = [c for c in self.contexts.values() if c.expires_at <= now]
        for ctx in gone:
            del self.contexts[ctx.context_id]
            self.expired[ctx.context_id] = ctx.tenant
        while len(self.expired) > MAX_TOMBSTONES:
            self.expired.popitem(last=False)
        return gone
