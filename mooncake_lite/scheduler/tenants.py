"""Tenants and priorities (issue #18 item 3): who a request belongs to, its limits, and the
priority-aware admission rule. Pure: no IO, no clock (``now`` is passed in); the live conductor
(``conductor/tenants.py``) and the simulator (``sim/tenants.py``) drive the same code.

A tenant (an API key maps to one) has its own TTFT/TBT SLOs, a priority class, a weight, a rate
limit (token bucket: ``rate`` requests/s, ``burst`` at once) and a concurrency limit. A request is
admitted in four steps, each refusal a 429 naming its limit: 1. ``concurrency`` (fewer than
``max_concurrency`` in flight); 2. ``rate`` (a token in the bucket; the refusal says when);
3. the scheduler's decision under the tenant's SLOs (:meth:`TenantSpec.scheduler_config`);
4. ``priority``, in the scheduler (``Scheduler.schedule(..., tenant)``, a ``RejectCause``): the
decision's *load* (predicted TTFT over the tenant's TTFT SLO: what a request behind it waits) is
compared with the tenant's ``shed_at`` (high 1.0, normal 0.25, low 0.05), only while the tenant
holds more than its weighted fair share (high 16, normal 4, low 1) of the requests in flight among
the tenants active lately (one with nothing in flight still gets one through every
``STARVE_AFTER_S``). So low is refused first, then normal, high only past its own SLO.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from mooncake_lite.common.config import ConfigError, require
from mooncake_lite.common.units import parse_duration
from mooncake_lite.scheduler.admission import ttft_load
from mooncake_lite.scheduler.config import SchedulerConfig
from mooncake_lite.scheduler.costs import CostModels
from mooncake_lite.scheduler.decision import Decision
from mooncake_lite.scheduler.state import ClusterState, ScheduleRequest

PRIORITIES = {"high": 2, "normal": 1, "low": 0}
DEFAULT_TENANT = "default"       # the tenant of every request when no tenants are configured
ACTIVE_WINDOW_S = 10.0           # a tenant with an arrival this recent counts in the fair share
STARVE_AFTER_S = 1.0             # a tenant the priority rule let nothing through for this long gets one
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")   # a Prometheus label value, readable in logs
SPEC_FIELDS = {"weight": "weight", "rate": "rate", "burst": "burst", "max_concurrency": "max_concurrency", "shed_at": "shed_at",
               "ttft_slo": "ttft_slo_s", "tbt_slo": "tbt_slo_s", "ttft_slo_factor": "ttft_slo_factor", "tbt_slo_factor": "tbt_slo_factor"}
_KEYS = frozenset({"api_keys", "api_key_sha256", "priority", *SPEC_FIELDS})


def default_shed_at(priority: int) -> float:
    """The load (predicted TTFT / TTFT SLO) above which a tenant of this class over its fair share is
    refused: 1.0 for high (only its own SLO refuses it), 0.25 normal, 0.05 low, 0.01 below
    (x5 per class)."""
    return min(1.0, 0.05 * 5.0 ** priority)


def default_weight(priority: int) -> float:
    """A class's weight in the fair share: x4 per class (high 16, normal 4, low 1), so a lower
    class keeps a small share it is never shed from, and never more while higher ones are busy."""
    return 4.0 ** priority


@dataclass(frozen=True)
class TenantSpec:
    """One tenant's configuration. ``None`` SLO fields: the conductor's (``SchedulerConfig``)."""

    name: str
    api_keys: tuple[str, ...] = field(default=(), repr=False)   # secrets: kept out of logs
    priority: int = PRIORITIES["normal"]
    weight: float | None = None          # None: default_weight(priority)
    rate: float | None = None            # requests/s; None: unlimited
    burst: int | None = None             # bucket size; None: max(1, ceil(rate))
    max_concurrency: int | None = None   # requests in flight; None: unlimited
    ttft_slo_s: float | None = None      # absolute; replaces the factor
    tbt_slo_s: float | None = None
    ttft_slo_factor: float | None = None
    tbt_slo_factor: float | None = None
    shed_at: float | None = None         # None: default_shed_at(priority)
    key_digests: tuple[str, ...] = field(default=(), repr=False)   # SHA-256 hex of more keys (etcd's table)

    def __post_init__(self) -> None:
        where = f"tenant {self.name!r}"
        require(bool(_NAME.match(self.name)), f"{where}: a name is 1-64 letters, digits, '_', '.' or '-'")
        require(all(isinstance(k, str) and k for k in self.api_keys), f"{where}: api_keys must be non-empty strings")
        require(all(isinstance(d, str) and re.fullmatch("[0-9a-f]{64}", d) for d in self.key_digests),
                f"{where}: api_key_sha256 must be SHA-256 digests (64 lowercase hex digits)")
        require(self.weight is None or self.weight > 0, f"{where}: weight must be positive, got {self.weight}")
        require(self.rate is None or (math.isfinite(self.rate) and self.rate > 0),
                f"{where}: rate must be a positive number of requests/s, got {self.rate}")
        require(self.burst is None or self.burst >= 1, f"{where}: burst must be >= 1, got {self.burst}")
        require(self.burst is None or self.rate is not None, f"{where}: burst needs a rate")
        require(self.max_concurrency is None or self.max_concurrency >= 1,
                f"{where}: max_concurrency must be >= 1, got {self.max_concurrency}")
        for slo in ("ttft_slo_s", "tbt_slo_s"):
            v = getattr(self, slo)
            require(v is None or v > 0, f"{where}: {slo[:-2]} must be positive, got {v}")
        for factor in ("ttft_slo_factor", "tbt_slo_factor"):
            v = getattr(self, factor)
            require(v is None or v >= 1, f"{where}: {factor} must be >= 1, got {v}")
        require(self.shed_at is None or 0 < self.shed_at <= 1,
                f"{where}: shed_at must be in (0, 1], got {self.shed_at}")

    @property
    def share_weight(self) -> float:
        return self.weight if self.weight is not None else default_weight(self.priority)

    @property
    def shed_threshold(self) -> float:
        return self.shed_at if self.shed_at is not None else default_shed_at(self.priority)

    @property
    def bucket_size(self) -> float:
        return float(self.burst) if self.burst is not None else max(1.0, math.ceil(self.rate or 1.0))

    @property
    def priority_name(self) -> str:
        return {v: k for k, v in PRIORITIES.items()}.get(self.priority, str(self.priority))

    def scheduler_config(self, base: SchedulerConfig) -> SchedulerConfig:
        """``base`` with this tenant's SLOs: an absolute SLO replaces the factor, a factor given
        alone makes that metric relative (the base's absolute one no longer applies)."""
        changes: dict[str, Any] = {}
        for metric in ("ttft", "tbt"):
            absolute, factor = getattr(self, f"{metric}_slo_s"), getattr(self, f"{metric}_slo_factor")
            if absolute is not None:
                changes[f"{metric}_slo_s"] = absolute
            elif factor is not None:
                changes[f"{metric}_slo_s"], changes[f"{metric}_slo_factor"] = None, factor
        return replace(base, **changes) if changes else base


@dataclass(frozen=True)
class Tenants:
    """Every configured tenant; ``anonymous`` names the one for requests without a known key
    (None: those are refused with 401). Empty: tenants are off, every request is ``default``."""

    specs: tuple[TenantSpec, ...] = ()
    anonymous: str | None = None
    _by_key: Mapping[str, TenantSpec] = field(default_factory=dict, repr=False, compare=False)
    _by_name: Mapping[str, TenantSpec] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name: dict[str, TenantSpec] = {}
        by_key: dict[str, TenantSpec] = {}
        for s in self.specs:
            require(s.name not in by_name, f"tenant {s.name!r} is configured twice")
            by_name[s.name] = s
            for k in s.api_keys:
                require(k not in by_key, f"an API key of tenant {s.name!r} is also tenant {by_key.get(k, s).name!r}'s")
                by_key[k] = s
        require(self.anonymous is None or self.anonymous in by_name,
                f"tenants: anonymous = {self.anonymous!r} names no configured tenant")
        object.__setattr__(self, "_by_key", by_key)
        object.__setattr__(self, "_by_name", by_name)

    def __bool__(self) -> bool:
        return bool(self.specs)

    def by_key(self, key: str | None) -> TenantSpec | None:
        """The tenant of an API key (the anonymous one for no key); None: refuse (401)."""
        if key is not None:
            return self._by_key.get(key)
        return self._by_name.get(self.anonymous) if self.anonymous is not None else None

    def get(self, name: str) -> TenantSpec:
        return self._by_name[name]

    def with_key(self, key: str, name: str = DEFAULT_TENANT) -> Tenants:
        """These tenants plus ``key`` (the conductor's ``--api-key``) as tenant ``name`` at
        normal priority, unless that key is already some tenant's."""
        if key in self._by_key:
            return self
        if name in self._by_name:
            spec = self._by_name[name]
            specs = tuple(replace(s, api_keys=s.api_keys + (key,)) if s is spec else s for s in self.specs)
        else:
            specs = self.specs + (TenantSpec(name, (key,)),)
        return Tenants(specs, self.anonymous)


def parse_tenants(table: Mapping[str, Any]) -> Tenants:
    """The ``[tenants]`` TOML table: ``[tenants.NAME]`` sub-tables (keys in ``_KEYS``), plus an
    optional ``anonymous = "NAME"``. Raises ConfigError naming the bad tenant and key."""
    require(isinstance(table, Mapping), f"tenants must be a table, got {type(table).__name__}")
    anonymous = table.get("anonymous")
    require(anonymous is None or isinstance(anonymous, str), "tenants: anonymous must be a tenant's name")
    specs = []
    for name, body in table.items():
        if name == "anonymous":
            continue
        require(isinstance(body, Mapping), f"tenants.{name} must be a table ([tenants.{name}])")
        specs.append(_spec(str(name), {k.replace("-", "_"): v for k, v in body.items()}))
    return Tenants(tuple(specs), anonymous)


def _spec(name: str, body: Mapping[str, Any]) -> TenantSpec:
    unknown = sorted(set(body) - _KEYS)
    require(not unknown, f"tenants.{name}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_KEYS))})")
    try:
        keys, digests = body.get("api_keys", []), body.get("api_key_sha256", [])
        require(isinstance(keys, list) and isinstance(digests, list), f"tenants.{name}: api_keys, api_key_sha256 must be lists")
        return TenantSpec(
            name, tuple(keys), _priority(name, body.get("priority", "normal")),
            _opt(body, "weight", float), _opt(body, "rate", float), _opt(body, "burst", int),
            _opt(body, "max_concurrency", int), _opt(body, "ttft_slo", parse_duration),
            _opt(body, "tbt_slo", parse_duration), _opt(body, "ttft_slo_factor", float),
            _opt(body, "tbt_slo_factor", float), _opt(body, "shed_at", float), tuple(digests))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"tenants.{name}: {exc}") from None


def _opt(body: Mapping[str, Any], key: str, conv) -> Any:
    v = body.get(key)
    if isinstance(v, bool):
        raise ValueError(f"{key} must be a number, got {v}")
    return None if v is None else conv(v)


def _priority(name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    require(isinstance(value, str) and value in PRIORITIES,
            f"tenants.{name}.priority must be one of {', '.join(PRIORITIES)} or an integer, got {value!r}")
    return PRIORITIES[value]


# ---- live state --------------------------------------------------------------------------------

class Refusal(NamedTuple):
    """Why a tenant's request is refused: ``limit`` (``concurrency``, ``rate`` or ``priority``),
    a message naming it, and the seconds after which a retry may succeed."""

    limit: str
    message: str
    retry_after_s: float


@dataclass
class TokenBucket:
    """``rate`` tokens/s up to ``size``; starts full."""

    rate: float
    size: float
    tokens: float
    updated: float | None = None

    def take(self, now: float) -> float:
        """Take one token: 0.0 if there was one, else the seconds until there will be (nothing taken)."""
        if self.updated is not None:
            self.tokens = min(self.size, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


def split(total: int, index: int, count: int) -> int:
    """Share ``index`` of ``total`` split in whole parts among ``count``: the first ``total % count``
    get one more, so the shares sum to ``total`` (a limit under ``count`` leaves some at 0)."""
    return total // count + (1 if index < total % count else 0)


class TenantLedger:
    """Each tenant's requests in flight, token bucket and last arrival. The owner calls
    :meth:`admit` on arrival and :meth:`end` once for every request :meth:`admit` let in, when it
    ends (refused later included); the scheduler calls :meth:`shed` on its accepted decision
    (through the request's :class:`Tenant`)."""

    def __init__(self, tenants: Tenants, active_window_s: float = ACTIVE_WINDOW_S,
                 starve_after_s: float = STARVE_AFTER_S) -> None:
        self.tenants = tenants
        self.active_window_s = active_window_s
        self.starve_after_s = starve_after_s
        self.in_flight: dict[str, int] = {}
        self.last_arrival: dict[str, float] = {}
        self.last_passed: dict[str, float] = {}   # the priority rule last let one through (or first seen)
        self.buckets: dict[str, TokenBucket] = {}
        self.index, self.count = 0, 1       # this conductor among the live ones (:meth:`divide`)
        self.cut_off: str | None = None     # why this conductor holds no share of the limits
        self.retable(tenants)

    def retable(self, tenants: Tenants) -> None:
        """Judge by ``tenants`` from now on (the shared table changed); counts and buckets carry over by name."""
        self.tenants, old = tenants, self.buckets
        self.buckets = {s.name: old.get(s.name) or TokenBucket(s.rate, s.bucket_size, s.bucket_size)
                        for s in tenants.specs if s.rate is not None}
        self.divide(self.index, self.count, self.cut_off)

    def divide(self, index: int, count: int, cut_off: str | None = None) -> None:
        """Several conductors: this one is ``index`` (0-based, in an order they all agree on) of
        ``count`` live ones, and holds that share of each limit: concurrency split in whole
        requests (:func:`split`, the shares sum to the limit), the rate divided by ``count`` with a
        bucket of ``max(1, burst / count)``. ``cut_off`` (a reason): it holds no share at all (the
        others may have counted it out), so its limited tenants are refused."""
        self.index, self.count, self.cut_off = index, max(1, count), cut_off
        for s in self.tenants.specs:
            bucket = self.buckets.get(s.name)
            if bucket is not None:
                bucket.rate, bucket.size = s.rate / self.count, max(1.0, s.bucket_size / self.count)
                bucket.tokens = min(bucket.tokens, bucket.size)

    def _refused_by_share(self, spec: TenantSpec, n: int) -> Refusal | None:
        if spec.max_concurrency is None and spec.rate is None:
            return None
        if self.cut_off is not None:
            return Refusal("rate" if spec.max_concurrency is None else "concurrency",
                           f"tenant {spec.name!r} has limits and this conductor holds no share of them: "
                           f"{self.cut_off}; retry (another conductor may take it)", 1.0)
        if spec.max_concurrency is None:
            return None
        limit = split(spec.max_concurrency, self.index, self.count)
        if n < limit:
            return None
        among = f", {limit} of it on this one of {self.count} conductors" if self.count > 1 else ""
        return Refusal("concurrency", f"tenant {spec.name!r} has {n} requests in flight here, its limit "
                                      f"(max_concurrency {spec.max_concurrency}{among}); retry when one ends", 1.0)

    def admit(self, spec: TenantSpec, now: float) -> Refusal | None:
        """A request of ``spec`` arrives: concurrency, then rate (a token is taken only when both
        pass). Admitted, it counts as in flight until :meth:`end`. Marks the tenant active."""
        self.last_arrival[spec.name] = now
        self.last_passed.setdefault(spec.name, now)
        n = self.in_flight.get(spec.name, 0)
        refusal = self._refused_by_share(spec, n)
        if refusal is not None:
            return refusal
        bucket = self.buckets.get(spec.name)
        wait = bucket.take(now) if bucket is not None else 0.0
        if bucket is not None and wait > 0:
            return Refusal("rate", f"tenant {spec.name!r} is over its rate limit ({bucket.rate:g} requests/s, "
                                   f"burst {bucket.size:g}{self._where()}); retry in {wait:.2f}s", wait)
        self.in_flight[spec.name] = n + 1
        return None

    def _where(self) -> str:
        return f" on this one of {self.count} conductors" if self.count > 1 else ""

    def over_share(self, spec: TenantSpec, now: float) -> bool:
        """Whether ``spec`` (its request being judged admitted, so counted) holds more than its
        weighted fair share of the requests in flight, among the tenants with requests in flight
        or recent arrivals."""
        active = {name for name, n in self.in_flight.items() if n > 0}
        active.update(name for name, t in self.last_arrival.items() if now - t <= self.active_window_s)
        active.add(spec.name)
        weights = sum(self._weight(name) for name in active)
        share = spec.share_weight / weights * sum(self.in_flight.values())
        return self.in_flight.get(spec.name, 0) > share

    def _weight(self, name: str) -> float:
        try:
            return self.tenants.get(name).share_weight
        except KeyError:
            return default_weight(PRIORITIES["normal"])

    def shed(self, spec: TenantSpec, decision: Decision, req: ScheduleRequest, cluster: ClusterState,
             cfg: SchedulerConfig, costs: CostModels, now: float) -> Refusal | None:
        """The priority rule on a decision the scheduler accepted under ``cfg`` (the tenant's)."""
        assert decision.predicted_ttft_s is not None, "an accepted decision predicts its TTFT"
        load = ttft_load(cfg, req, costs, cluster, decision.prefill_id, decision.predicted_ttft_s)
        return self.priority_refusal(spec, load, now)

    def priority_refusal(self, spec: TenantSpec, load: float, now: float) -> Refusal | None:
        """The priority rule on an accepted decision of predicted ``load``
        (``admission.ttft_load``: predicted TTFT / the tenant's TTFT SLO). A tenant with nothing
        else in flight that it let nothing through for ``starve_after_s`` gets this request
        through whatever the load: shed, never starved."""
        threshold = spec.shed_threshold
        if load <= threshold or threshold >= 1.0 or not self.over_share(spec, now) or \
                (self.in_flight.get(spec.name, 0) <= 1 and
                 now - self.last_passed.get(spec.name, now) >= self.starve_after_s):
            self.last_passed[spec.name] = now
            return None
        return Refusal("priority", f"the cluster is busy: predicted load {load:.2f} of tenant {spec.name!r}'s "
                                   f"SLO is above the {threshold:g} its {spec.priority_name} priority may use "
                                   f"beyond its fair share; retry later", min(60.0, max(1.0, load)))

    def end(self, name: str) -> None:
        n = self.in_flight.get(name, 0) - 1
        if n > 0:
            self.in_flight[name] = n
        else:
            self.in_flight.pop(name, None)


@dataclass(frozen=True, slots=True)
class Tenant:
    """A request's tenant as :meth:`Scheduler.schedule <mooncake_lite.scheduler.Scheduler.schedule>`
    judges it: its spec, the scheduler config under its SLOs (:meth:`TenantSpec.scheduler_config`)
    and the ledger of every tenant's requests (live state: the caller owns it and keeps it across
    requests). The owner builds one per tenant and passes it with each of its requests."""

    spec: TenantSpec
    config: SchedulerConfig
    ledger: TenantLedger

    def shed(self, decision: Decision, req: ScheduleRequest, cluster: ClusterState, costs: CostModels,
             now: float) -> Decision:
        """An accepted ``decision``, or it rejected with cause ``priority`` when the rule sheds it."""
        refusal = self.ledger.shed(self.spec, decision, req, cluster, self.config, costs, now)
        if refusal is None:
            return decision
        return decision._replace(accepted=False, reason=f"rejected: {refusal.message}", reject_cause="priority",
                                 migration=None)
