"""Tenants at the conductor (issue #18 item 3): the API key names the tenant, whose limits,
SLOs and priority apply to its requests (the rules are ``scheduler/tenants.py``'s; this module
holds their live state and turns refusals into 429s).

* :func:`tenant_middleware` replaces the single ``--api-key`` check on ``/v1/``: a known key (a
  tenant's, or ``--api-key``, tenant ``default``) or, without one, the ``anonymous`` tenant if
  configured; anything else is a 401. The tenant's name is kept on the request
  (``request[TENANT]``); the handlers pass it on as a value (to the flight, to placement).
* :meth:`TenantGate.admit` (completions and chat): concurrency and rate limits, 429 +
  ``Retry-After`` naming the limit; an admitted request counts as in flight until
  :meth:`TenantGate.end`.
* :func:`schedule` (``flight/placement.place``): the scheduler's decision for the tenant's request,
  under its own SLOs and priority (``Scheduler.schedule`` with its :class:`Tenant`).

No tenants configured: every request is tenant ``default``, with no limits and the
conductor's SLOs, so the per-tenant metrics still read.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time

from aiohttp import web

from mooncake_lite.common.auth import bearer_key
from mooncake_lite.conductor.api.errors import ApiError, Rejected
from mooncake_lite.scheduler import ClusterState, Decision, Scheduler, ScheduleRequest, SchedulerConfig
from mooncake_lite.scheduler.tenants import DEFAULT_TENANT, Refusal, Tenant, TenantLedger, Tenants, TenantSpec

log = logging.getLogger(__name__)
TENANT: web.RequestKey[str] = web.RequestKey("tenant", str)   # request[TENANT]: the caller's tenant name
EXEMPT = ("/health", "/metrics")
_CODES = {"rate": "rate_limit_exceeded", "concurrency": "concurrency_limit_exceeded",
          "priority": "priority_shed"}


def key_digest(key: str) -> str:
    # Keys are looked up by hash: a dict probe on the raw key could leak its prefix by timing.
    return hashlib.sha256(key.encode()).hexdigest()


def spec_digests(spec: TenantSpec) -> frozenset[str]:
    """Every digest a request's key may match for ``spec``: its table's (etcd), and those of the
    keys it was given in clear (config)."""
    return frozenset((*spec.key_digests, *map(key_digest, spec.api_keys)))


class TenantGate:
    """The tenants, their SLO-specific scheduler configs and the ledger of their requests.
    ``api_key`` (``--api-key``) is one more key, tenant ``default``, whatever the table."""

    def __init__(self, tenants: Tenants, base: SchedulerConfig, api_key: str | None = None) -> None:
        self.base, self.api_key, self.own = base, api_key, tenants   # own: this conductor's --tenants
        self.ledger = TenantLedger(Tenants())
        self.apply(tenants)

    def apply(self, tenants: Tenants) -> None:
        """Serve by ``tenants`` from now on (at start, or when the table shared in etcd changes):
        keys, SLOs and limits; the requests in flight keep counting by tenant name."""
        if self.api_key and not any(key_digest(self.api_key) in spec_digests(s) for s in tenants.specs):
            tenants = tenants.with_key(self.api_key)
        self.tenants = tenants if tenants else Tenants((TenantSpec(DEFAULT_TENANT),), anonymous=DEFAULT_TENANT)
        self.is_open = not tenants   # no tenants configured: no key needed, one tenant
        self.ledger.retable(self.tenants)
        self.configs = {s.name: s.scheduler_config(self.base) for s in self.tenants.specs}
        # One lookup path: a key's digest, for keys given in clear (config) or as digests (etcd)
        self._by_digest = {d: s for s in self.tenants.specs for d in spec_digests(s)}

    def by_key(self, key: str | None) -> TenantSpec | None:
        if key is None:
            return self.tenants.by_key(None)
        return self._by_digest.get(key_digest(key))

    def admit(self, name: str) -> None:
        """Let a request of tenant ``name`` in (it counts as in flight until :meth:`end`), or
        raise its 429."""
        refusal = self.ledger.admit(self.tenants.get(name), time.monotonic())
        if refusal is not None:
            raise refused(refusal)

    def end(self, name: str) -> None:
        self.ledger.end(name)


def refused(r: Refusal) -> Rejected:
    """A tenant limit's 429: OpenAI's rate-limit shape, the code and the cause naming the limit."""
    return Rejected(r.message, max(1, math.ceil(r.retry_after_s)), r.limit, code=_CODES[r.limit])


def schedule(gate: TenantGate | None, scheduler: Scheduler, req: ScheduleRequest, cluster: ClusterState,
             now: float, *, tenant: str) -> Decision:
    """The scheduler's decision for a request of ``tenant``, under its SLOs and priority (an
    accepted one the priority rule refuses comes back rejected with cause ``priority``)."""
    if gate is None:
        return scheduler.schedule(req, cluster, now)
    spec = gate.tenants.get(tenant)
    return scheduler.schedule(req, cluster, now, Tenant(spec, gate.configs[spec.name], gate.ledger))


def tenant_middleware(gate: TenantGate, *, prefixes: tuple[str, ...] = ("/v1/",)):
    """Resolve the caller's tenant on ``prefixes`` (401 for a missing or unknown key when no
    anonymous tenant takes it); ``/health`` and ``/metrics`` stay open."""

    @web.middleware
    async def resolve_tenant(request: web.Request, handler) -> web.StreamResponse:
        if request.path in EXEMPT or not request.path.startswith(prefixes):
            return await handler(request)
        presented = bearer_key(request)
        spec = gate.by_key(None) if gate.is_open else gate.by_key(presented)
        if spec is None:
            log.warning("refused %s %s from %s: %s API key", request.method, request.path, request.remote,
                        "missing" if presented is None else "unknown")
            message = ("You didn't provide an API key. Send it as 'Authorization: Bearer KEY'."
                       if presented is None else "Incorrect API key provided.")
            resp = ApiError(401, message, code="invalid_api_key").response()
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        request[TENANT] = spec.name
        return await handler(request)

    return resolve_tenant
