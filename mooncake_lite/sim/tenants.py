"""Tenants in the simulator (issue #18 item 3): each trace request is given a tenant, and the
simulated conductor applies the live one's rules (``scheduler/tenants.py``): concurrency and
rate limits, then the scheduler under the tenant's SLOs and priority (``Scheduler.schedule`` with
the request's :class:`~mooncake_lite.scheduler.tenants.Tenant`, as the live conductor calls it).

``mooncake sim TRACE --tenants FILE`` reads ``[tenants.NAME]`` tables as the conductor does, plus
one simulator key per tenant, ``share``: the fraction of the trace's requests that are that
tenant's (drawn per request id, so a run that leaves a tenant out keeps every other request's
tenant). ``--tenants-without NAME`` also runs the trace without NAME's requests and prints each
tenant's p90 TTFT in both runs: what a flood of NAME costs the others.
"""

from __future__ import annotations

import random
import tomllib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from mooncake_lite.scheduler import Decision, ScheduleRequest
from mooncake_lite.scheduler.tenants import Tenant, TenantLedger, Tenants, parse_tenants
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.metrics import quantile
from mooncake_lite.sim.recorder import SimResult
from mooncake_lite.sim.request import SimRequest
from mooncake_lite.trace.format import TraceRequest


class TenantMix:
    """Which tenant each request belongs to: tenant i with probability ``shares[i]`` (shares
    sum to 1), drawn from the request id and the seed alone."""

    def __init__(self, tenants: Tenants, shares: Mapping[str, float], seed: int = 0) -> None:
        total = sum(shares.values())
        if set(shares) != {s.name for s in tenants.specs}:
            raise ValueError("every tenant needs a share (and only tenants have one)")
        if any(v < 0 for v in shares.values()) or abs(total - 1.0) > 1e-6:
            raise ValueError(f"tenant shares must be >= 0 and sum to 1, got {dict(shares)}")
        self.tenants, self.seed = tenants, seed
        self._cumulative: list[tuple[float, str]] = []
        acc = 0.0
        for name, share in shares.items():
            acc += share
            self._cumulative.append((acc, name))

    def of(self, request_id: int) -> str:
        u = random.Random(self.seed * 1_000_003 + request_id).random()
        return next((name for bound, name in self._cumulative if u < bound), self._cumulative[-1][1])

    def without(self, trace: Iterable[TraceRequest], name: str) -> Iterator[TraceRequest]:
        return (tr for tr in trace if self.of(tr.request_id) != name)


def read_mix(path: str, seed: int = 0) -> TenantMix:
    """A ``--tenants`` file: ``[tenants.NAME]`` tables, each with a ``share``."""
    with open(path, "rb") as fh:
        table = tomllib.load(fh).get("tenants")
    if not isinstance(table, dict):
        raise ValueError(f"{path} has no [tenants] table")
    shares, conductor_view = {}, {}
    for name, body in table.items():
        if not isinstance(body, dict):
            conductor_view[name] = body
            continue
        body = dict(body)
        shares[name] = float(body.pop("share", 0.0))
        conductor_view[name] = body
    return TenantMix(parse_tenants(conductor_view), shares, seed)


class TenantSim(MooncakeSim):
    """:class:`MooncakeSim` whose conductor knows each request's tenant."""

    def __init__(self, cfg, mix: TenantMix, hardware=None) -> None:
        super().__init__(cfg, hardware)
        self.mix = mix
        self.ledger = TenantLedger(mix.tenants)
        self.tenants = {s.name: Tenant(s, s.scheduler_config(cfg.scheduler), self.ledger) for s in mix.tenants.specs}
        self.tenant_of: dict[int, str] = {}
        self._admitted: set[int] = set()

    def _decide(self, now: float, req: SimRequest, sreq: ScheduleRequest) -> Decision:
        tenant = self.tenants[self.mix.of(req.request_id)]
        self.tenant_of[req.request_id] = tenant.spec.name
        refusal = self.ledger.admit(tenant.spec, now)
        if refusal is not None:
            return Decision(False, refusal.message, reject_cause=refusal.limit)   # type: ignore[arg-type]
        self._admitted.add(req.request_id)
        return self.scheduler.schedule(sreq, self.cluster_state(), now, tenant)

    def _left(self, req: SimRequest) -> None:
        if req.request_id in self._admitted:
            self._admitted.discard(req.request_id)
            self.ledger.end(self.tenant_of[req.request_id])

    def _finish(self, now: float, req: SimRequest) -> None:
        self._left(req)
        super()._finish(now, req)

    def _reject(self, now: float, req: SimRequest, stage: str, cause: str | None) -> None:
        self._left(req)
        super()._reject(now, req, stage, cause)

    def run(self, trace, progress=None) -> SimResult:
        res = super().run(trace, progress)
        res.extra["tenants"] = per_tenant(res, self.tenant_of)
        return res


def per_tenant(res: SimResult, tenant_of: Mapping[int, str]) -> dict[str, dict[str, Any]]:
    """Per tenant: requests, completed, rejections by cause, TTFT p50/p90/p99 of the completed."""
    rows: dict[str, dict[str, Any]] = {}
    ttfts: dict[str, list[float]] = {}
    for r in res.requests:
        name = tenant_of.get(r.request_id, "?")
        row = rows.setdefault(name, {"requests": 0, "completed": 0, "rejected_by": Counter()})
        row["requests"] += 1
        if r.status == "completed":
            row["completed"] += 1
            if r.ttft is not None:
                ttfts.setdefault(name, []).append(r.ttft)
        elif r.status == "rejected":
            row["rejected_by"][r.reject_cause or "?"] += 1
    for name, row in rows.items():
        vals = sorted(ttfts.get(name, []))
        row["rejected_by"] = dict(row["rejected_by"])
        row.update({f"ttft_p{q}_s": quantile(vals, q / 100) for q in (50, 90, 99)})
    return dict(sorted(rows.items()))


def format_tenants(with_all: Mapping[str, dict], without: Mapping[str, dict] | None, dropped: str | None) -> str:
    """The per-tenant table; with a run without ``dropped``, each tenant's p90 TTFT in both."""
    head = f"{'tenant':<12}{'requests':>9}{'done':>7}{'p50 TTFT':>10}{'p90 TTFT':>10}"
    if without is not None:
        head += f"{'p90 w/o ' + str(dropped):>18}{'ratio':>7}"
    lines = [head + "  rejected by"]
    for name, row in with_all.items():
        line = (f"{name:<12}{row['requests']:>9}{row['completed']:>7}{_s(row['ttft_p50_s']):>10}"
                f"{_s(row['ttft_p90_s']):>10}")
        if without is not None:
            base = without.get(name, {}).get("ttft_p90_s")
            ratio = row["ttft_p90_s"] / base if base and row["ttft_p90_s"] else None
            line += f"{_s(base):>18}{'-' if ratio is None else f'{ratio:.2f}':>7}"
        lines.append(line + f"  {row['rejected_by'] or 'none'}")
    return "\n".join(lines)


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


def tenant_runs(cfg, hw, trace: list[TraceRequest], path: str, without: str | None, seed: int,
                show: bool) -> tuple[dict[str, SimResult], str]:
    """``mooncake sim --tenants PATH [--tenants-without NAME]``: the run(s) by label, and the
    per-tenant table to print."""
    from mooncake_lite.sim.runner import run_with_progress
    mix = read_mix(path, seed)
    if without is not None and without not in {s.name for s in mix.tenants.specs}:
        raise ValueError(f"--tenants-without {without!r} names no tenant of {path}")
    label = f"mooncake {cfg.num_prefill * cfg.cpp_group_size}P+{cfg.num_decode}D tenants"
    runs = {label: run_with_progress(TenantSim(cfg, mix, hw), trace, "tenants", show)}
    base = None
    if without is not None:
        runs[f"{label} without {without}"] = res = run_with_progress(
            TenantSim(cfg, mix, hw), list(mix.without(trace, without)), f"without {without}", show)
        base = res.extra["tenants"]
    return runs, format_tenants(runs[label].extra["tenants"], base, without)
