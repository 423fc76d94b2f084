"""``GET /internal/v1/status``: what the cluster is doing now, in one JSON answer (``mooncake status``).

Instances from the membership table (role, node, queue or batch, KV use from their last
heartbeat, speed by its current cost model, health); stores from the block index and the usage each one sends
with its block events (DRAM/SSD use, hit counts); and the last ``WINDOW_S`` seconds of traffic:
TTFT/TBT quantiles, rejections by cause, requests and tokens per second; and how far the
predictions admission made were from what was measured (the last minute's median and p90 error
of TTFT and TBT) with each instance's online correction. The recent figures are
differences of the conductor's own Prometheus counters and histograms (``metrics.py``) between
now and a snapshot taken up to ``WINDOW_S`` ago by a sampler in ``cleanup_ctx`` — the same
numbers a Grafana panel over ``rate(...[1m])`` shows, at no cost on the request path.
Guarded by the cluster token like every ``/internal/`` endpoint.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import Metric

from mooncake_lite.conductor.cluster.metrics import FEW_SAMPLES, ConductorMetrics
from mooncake_lite.conductor.cluster.membership import Instance
from mooncake_lite.conductor.services import SERVICES

WINDOW_S = 60.0        # "recent": the last minute
SAMPLE_EVERY_S = 5.0
QUANTILES = (0.5, 0.9, 0.99)
SPEED_TOKENS = 1024    # profiled speed is quoted for a 1k-token prompt / a 1k-token context


@dataclass(frozen=True)
class Snapshot:
    """Cumulative figures at time ``t`` (monotonic seconds)."""

    t: float
    ttft: tuple[tuple[float, float], ...]       # (upper bound, cumulative count), +inf last
    tbt: tuple[tuple[float, float], ...]
    outcomes: dict[str, float]                  # requests by outcome
    rejections: dict[str, float]                # 429s by cause
    output_tokens: float


@dataclass
class Recent:
    snapshots: deque[Snapshot] = field(default_factory=deque)


RECENT = web.AppKey("status_recent", Recent)
STORE_USAGE = web.AppKey("status_store_usage", dict)   # store id -> (monotonic time, usage it sent)


def add_routes(app: web.Application) -> None:
    app[RECENT] = Recent()
    app[STORE_USAGE] = {}
    app.router.add_get("/internal/v1/status", status)
    app.cleanup_ctx.append(_sampler)


async def _sampler(app: web.Application) -> AsyncIterator[None]:
    recent, metrics = app[RECENT], app[SERVICES].metrics

    async def loop() -> None:
        while True:
            recent.snapshots.append(snapshot(metrics, time.monotonic()))
            while len(recent.snapshots) > WINDOW_S / SAMPLE_EVERY_S + 1:
                recent.snapshots.popleft()
            await asyncio.sleep(SAMPLE_EVERY_S)

    task = asyncio.get_running_loop().create_task(loop())
    yield
    task.cancel()


async def status(request: web.Request) -> web.Response:
    app = request.app
    svc = app[SERVICES]
    now = asyncio.get_running_loop().time()
    index = svc.scheduler.index
    stores = []
    for sid in svc.membership.stores.known(index.store_ids()):
        stores.append({"store": sid, "indexed_blocks": index.num_blocks(sid), "synced": index.is_synced(sid),
                       **store_usage(app, sid, time.monotonic())})
    body = {"model": svc.membership.model_id, "time": time.time(),
            "scheduler": {"strategy": svc.scheduler.config.strategy, "admission": svc.scheduler.config.admission},
            "instances": [describe(inst, now, svc.block_size)
                          for inst in sorted(svc.membership.instances.values(), key=lambda i: (i.role, i.instance_id))],
            "stores": stores,
            "requests": recent_figures(app[RECENT], svc.metrics, time.monotonic()),
            # each prediction checked (conductor/flight/predictions.py): the last minute's errors
            "predictions": {**svc.predictions.recent_errors(now), "corrections": svc.predictions.export()},
            # requests whose decode failed mid-stream, newest last (conductor/flight/continuation.py)
            "continuations": list(svc.continuations)}
    return web.json_response(body)


# ---- instances -------------------------------------------------------------------------------
def describe(inst: Instance, now: float, block_size: int) -> dict:
    load = inst.load
    out = {"instance_id": inst.instance_id, "role": inst.role, "http": inst.reg.http,
           "node": inst.reg.http.rsplit(":", 1)[0], "store": inst.reg.store,
           "health": "alive" if inst.is_alive else "dead", "last_seen_s": round(max(0.0, now - inst.last_seen), 3),
           "pipeline_stages": inst.reg.pipeline_stages, "kv_used": kv_used(inst, block_size), "load": load.reported()}
    if inst.role == "prefill":
        out["queue"] = len(inst.prefill_jobs)
        cost = inst.costs.prefill
        out["prefill_tokens_per_s"] = SPEED_TOKENS / cost.predict(SPEED_TOKENS, 0) if cost else None
    else:
        out["batch"] = len(inst.decode_jobs)
        out["incoming"] = len(inst.incoming_jobs)
        cost = inst.costs.decode
        out["decode_step_s"] = cost.predict(1, SPEED_TOKENS) if cost else None
    return out


def kv_used(inst: Instance, block_size: int) -> float | None:
    """Fraction of the instance's paged KV cache in use, from its last heartbeat (None before one)."""
    free = inst.load.free_blocks
    capacity_tokens = inst.load.max_context_tokens or inst.reg.max_context
    if free is None or not capacity_tokens:
        return None
    return min(1.0, max(0.0, 1.0 - free * block_size / capacity_tokens))


# ---- stores ----------------------------------------------------------------------------------
def note_store_usage(app: web.Application, store_id: str, usage: dict[str, float]) -> None:
    """Keep the usage a store sent with its block events (called by ``internal.block_events``)."""
    if usage:
        app[STORE_USAGE][store_id] = (time.monotonic(), dict(usage))


def store_usage(app: web.Application, store_id: str, now: float) -> dict:
    seen = app[STORE_USAGE].get(store_id)
    if seen is None:
        return {"usage": None}
    at, usage = seen
    hits = usage.get("hits_dram", 0.0) + usage.get("hits_ssd", 0.0)
    lookups = hits + usage.get("misses", 0.0)
    return {"usage": usage, "reported_s": round(now - at, 3), "hit_rate": hits / lookups if lookups else None}


# ---- recent traffic --------------------------------------------------------------------------
def snapshot(metrics: ConductorMetrics, t: float) -> Snapshot:
    outcomes: dict[str, float] = {}
    for s in _samples(metrics.requests.collect(), "_total"):
        outcomes[s.labels["outcome"]] = outcomes.get(s.labels["outcome"], 0.0) + s.value
    rejections = {s.labels["cause"]: s.value for s in _samples(metrics.rejections.collect(), "_total")}
    tokens = sum(s.value for s in _samples(metrics.output_tokens.collect(), "_total"))
    return Snapshot(t, _buckets(metrics.ttft.collect()), _buckets(metrics.tbt.collect()), outcomes, rejections,
                    tokens)


def _samples(families: list[Metric], suffix: str) -> list:
    return [s for fam in families for s in fam.samples if s.name.endswith(suffix)]


def _buckets(families: list[Metric]) -> tuple[tuple[float, float], ...]:
    return tuple(sorted((float(s.labels["le"]), s.value) for s in _samples(families, "_bucket")))


def recent_figures(recent: Recent, metrics: ConductorMetrics, now: float) -> dict:
    """Now minus the oldest snapshot still within the window (or since start-up)."""
    cur = snapshot(metrics, now)
    old = next((s for s in recent.snapshots if now - s.t <= WINDOW_S + SAMPLE_EVERY_S), None)
    old = old or Snapshot(now, (), (), {}, {}, 0.0)
    span = max(now - old.t, 1e-9)
    done = {k: v - old.outcomes.get(k, 0.0) for k, v in cur.outcomes.items()}
    return {"window_s": round(span, 3), "in_flight": metrics.in_flight.collect()[0].samples[0].value,
            "requests_per_s": sum(done.values()) / span, "tokens_per_s": (cur.output_tokens - old.output_tokens) / span,
            "outcomes": {k: v for k, v in done.items() if v},
            "rejections": {k: v - old.rejections.get(k, 0.0) for k, v in cur.rejections.items()
                           if v - old.rejections.get(k, 0.0)},
            "ttft_s": quantiles(_delta(cur.ttft, old.ttft), metrics.ttft.last),
            "tbt_s": quantiles(_delta(cur.tbt, old.tbt), metrics.tbt.last)}


def _delta(cur: tuple, old: tuple) -> tuple[tuple[float, float], ...]:
    before = dict(old)
    return tuple((le, n - before.get(le, 0.0)) for le, n in cur)


def quantiles(buckets: tuple[tuple[float, float], ...], last: Sequence[float] = ()) -> dict:
    """Prometheus' ``histogram_quantile``: linear within the bucket that holds the rank; the
    highest finite bound when the rank falls in the +Inf bucket. None without observations. Fewer
    than FEW_SAMPLES: their ``values`` (sorted; the newest of ``last``, the histogram's latest) and
    no quantiles, which interpolating within a bucket would make up."""
    total = buckets[-1][1] if buckets else 0.0
    few = 0 < total < FEW_SAMPLES and len(last) >= total
    out: dict = {f"p{round(q * 100)}": _quantile(buckets, q * total) if total > 0 and not few else None
                 for q in QUANTILES}
    out["count"] = total
    if few:
        out["values"] = sorted(list(last)[len(last) - round(total):])
    return out


def _quantile(buckets: tuple[tuple[float, float], ...], rank: float) -> float:
    lower, below = 0.0, 0.0
    for le, cum in buckets:
        if cum >= rank:
            if le == float("inf"):
                return lower
            in_bucket = cum - below
            return lower + (le - lower) * ((rank - below) / in_bucket if in_bucket else 1.0)
        lower, below = le, cum
    return lower
