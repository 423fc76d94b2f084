"""Prometheus metrics of the conductor (``mooncake_conductor_*``), one registry per app so
several conductors (tests) never share counters: the requests it serves, the same per tenant,
and the cluster (gauges refreshed from the membership table at scrape time, hot-block copies)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from mooncake_lite.conductor.cluster.membership import Membership
from mooncake_lite.scheduler.links import LinkSpeeds

PREFIX = "mooncake_conductor_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1)
# measured / predicted: 1 is a perfect prediction; the buckets are about 10% apart near 1
RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.87, 0.93, 1.0, 1.07, 1.15, 1.25, 1.5, 2, 4, 10)
FEW_SAMPLES = 10   # `mooncake status` shows fewer in its window as measured (conductor/cluster/status.py)


class LatencyHistogram(Histogram):
    """A histogram that also keeps its last FEW_SAMPLES observations: three quantiles read off the
    buckets of one sample would be made up (its value is somewhere in one bucket)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.last: deque[float] = deque(maxlen=FEW_SAMPLES)

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        super().observe(amount, exemplar)
        self.last.append(amount)


class ConductorMetrics:
    """The requests the conductor serves; :attr:`tenant`: the same per tenant; :attr:`cluster`:
    the cluster it schedules on."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = PREFIX
        self.requests = Counter(p + "requests", "API requests by endpoint and outcome "
                                "(ok, rejected, bad_request, unavailable, upstream_error, aborted)",
                                ["endpoint", "outcome"], registry=r)
        self.rejections = Counter(p + "rejections", "429s by cause (ttft, tbt, no-decode, decode-refused, prefill-refused)",
                                  ["cause"], registry=r)
        self.routes = Counter(p + "routes", "accepted requests by prefill route "
                              "(local-hit, transfer, balance, random)", ["route"], registry=r)
        self.migrations = Counter(p + "migrated_blocks", "blocks asked to be replicated by hot-spot migration",
                                  registry=r)
        self.reused_blocks = Counter(p + "reused_prefix_blocks", "prompt blocks scheduled as prefix hits",
                                     registry=r)
        self.prompt_blocks = Counter(p + "prompt_blocks", "full prompt blocks scheduled", registry=r)
        self.ttft = LatencyHistogram(p + "ttft_seconds", "time from request arrival to the first token",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "itl_seconds", "gap between consecutive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tbt = LatencyHistogram(p + "tbt_seconds", "per request: mean of the slowest 10%% of token gaps "
                                    "(the paper's TBT)", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_seconds", "request arrival to last token", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.decision = Histogram(p + "decision_seconds", "time to snapshot the cluster and schedule",
                                  buckets=DECISION_BUCKETS, registry=r)
        self.output_tokens = Counter(p + "output_tokens", "tokens sent to clients", registry=r)
        self.in_flight = Gauge(p + "requests_in_flight", "requests being served", registry=r)
        self.retries = Counter(p + "retries", "requests sent again to other instances after a failure "
                               "before their first token, by reason (prefill-unreachable, prefill-error, "
                               "decode-unreachable, decode-error, instance-dead)", ["reason"], registry=r)
        self.continuations = Counter(p + "continuations", "requests whose decode failed mid-stream, by cause "
                                     "(decode-unreachable, decode-error, decode-abort, instance-dead, ...) and "
                                     "outcome (continued; limit, refused, unsupported: the client got the error)",
                                     ["cause", "outcome"], registry=r)
        self.prediction_ratio = Histogram(p + "prediction_ratio", "measured over predicted, per request, by "
                                          "instance and metric (ttft, tbt, gap: the mean token gap against "
                                          "the predicted TBT, and TTFT's parts queue, compute, transfer: "
                                          "the predictions made at admission)", ["instance", "metric"],
                                          buckets=RATIO_BUCKETS, registry=r)
        self.prediction_refused = Counter(p + "prediction_refused", "measurements refused by the online "
                                          "correction (not finite, negative, or beyond its ratio bound), by "
                                          "instance and term", ["instance", "term"], registry=r)
        self.correction = Gauge(p + "cost_correction", "the online correction's factor per instance and term "
                                "(scale: the one the scheduler's model is multiplied by)", ["instance", "term"],
                                registry=r)
        self.tenant = TenantMetrics(r)
        self.cluster = ClusterMetrics(r)

    def render(self, membership: Membership, num_indexed_blocks: int, links: LinkSpeeds | None = None) -> bytes:
        self.cluster.refresh(membership, num_indexed_blocks, links)
        return generate_latest(self.registry)


class TenantMetrics:
    """Per tenant (docs/conductor.md, Tenants): ``default`` when no tenants are configured."""

    def __init__(self, r: CollectorRegistry) -> None:
        p = PREFIX
        self.requests = Counter(p + "tenant_requests", "API requests by tenant and outcome (as requests)",
                                ["tenant", "outcome"], registry=r)
        self.rejections = Counter(p + "tenant_rejections", "429s by tenant and reason (rate, concurrency, "
                                  "priority, ttft, tbt, no-decode, upstream-refused)", ["tenant", "reason"],
                                  registry=r)
        self.ttft = Histogram(p + "tenant_ttft_seconds", "time from request arrival to the first token, "
                              "by tenant", ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge(p + "tenant_requests_in_flight", "requests being served, by tenant",
                               ["tenant"], registry=r)


class ClusterMetrics:
    """The cluster as the membership table describes it (refreshed at scrape time, :meth:`refresh`),
    the store links' measured speeds, and the hot blocks copied ahead of need
    (``cluster/hot_replication.py``)."""

    def __init__(self, r: CollectorRegistry) -> None:
        p = PREFIX
        self.instances = Gauge(p + "instances", "instances by role and state", ["role", "state"], registry=r)
        self.prefill_queue = Gauge(p + "prefill_queue", "requests dispatched and not yet prefilled, "
                                   "per prefill instance", ["instance"], registry=r)
        self.decode_running = Gauge(p + "decode_running", "requests decoding per decode instance",
                                    ["instance"], registry=r)
        self.indexed_blocks = Gauge(p + "indexed_blocks", "block keys in the global index (all stores)",
                                    registry=r)
        self.stores = Gauge(p + "stores", "stores heard from within --dead-after", registry=r)
        self.link_speed = Gauge(p + "link_bytes_per_second", "measured KV transfer speed per store pair "
                                "(EWMA of hot-spot migrations; absent before the first: the prior applies)",
                                ["source", "dest"], registry=r)
        self.hot_blocks = Gauge(p + "hot_blocks", "prefix blocks reused by at least --hot-threshold requests "
                                "within --hot-window, at the last plan", registry=r)
        self.hot_replications = Counter(p + "hot_replications", "background replications of hot blocks asked "
                                        "of a store, by outcome (ok, failed)", ["outcome"], registry=r)
        self.hot_replicated_bytes = Counter(p + "hot_replicated_bytes", "bytes stores pulled from their peers "
                                            "for background replications of hot blocks", registry=r)
        self._membership: Membership | None = None
        r.register(_MembershipEvents(lambda: self._membership))

    def refresh(self, membership: Membership, num_indexed_blocks: int, links: LinkSpeeds | None) -> None:
        self._membership = membership
        self.instances.clear()
        self.prefill_queue.clear()
        self.decode_running.clear()
        for inst in membership.instances.values():
            state = "dead" if not inst.is_alive else ("suspect" if inst.is_suspect else "alive")
            self.instances.labels(inst.role, state).inc()
            if inst.is_alive and inst.role == "prefill":
                self.prefill_queue.labels(inst.instance_id).set(len(inst.prefill_jobs))
            elif inst.is_alive:
                self.decode_running.labels(inst.instance_id).set(len(inst.decode_jobs))
        self.indexed_blocks.set(num_indexed_blocks)
        self.stores.set(membership.stores.num_live())
        for source, dest, speed in links.items() if links is not None else ():
            self.link_speed.labels(str(source), str(dest)).set(speed)


class _MembershipEvents:
    """Counters the membership keeps itself (it has no metrics): instance failures and deaths
    by role and event, connection failures, stores dropped as silent."""

    def __init__(self, membership) -> None:
        self.membership = membership

    def collect(self) -> Iterator[Metric]:
        m = self.membership()
        events = CounterMetricFamily("mooncake_conductor_instance_events", "instance failures seen: "
                                     "connection-failure (refused or broken), suspect, cleared (answered or "
                                     "heartbeated again), dead-failures, dead-silent, dead-replaced",
                                     labels=["role", "event"])
        for (role, event), n in sorted(m.events.items() if m is not None else ()):
            events.add_metric([role, event], float(n))
        yield events
        yield CounterMetricFamily("mooncake_conductor_stores_dropped", "stores silent for --dead-after whose "
                                  "blocks left the index", value=float(m.stores.num_dropped if m else 0))
