"""Prometheus ``/metrics`` for roles whose figures already live in plain dicts.

Prefill and decode keep their load figures (queue lengths, batch sizes, free blocks) and
cumulative counters (tokens reused, KV bytes moved) as numbers on their service objects; this
collector reads them at scrape time, so the hot path pays nothing. Names are
``mooncake_<role>_<key>``; keys ending in ``_total`` become counters, everything else gauges.
"""

from __future__ import annotations

import os

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mooncake_lite.common.gpu import GpuCollector, nvml_devices


class FiguresCollector:
    def __init__(self, role: str, read: Callable[[], dict[str, float]]) -> None:
        self.prefix = f"mooncake_{role}_"
        self.read = read

    def collect(self) -> Iterator[Metric]:
        for key, value in sorted(self.read().items()):
            if key.endswith("_total"):
                yield CounterMetricFamily(self.prefix + key[:-len("_total")], key, value=float(value))
            else:
                yield GaugeMetricFamily(self.prefix + key, key, value=float(value))


def add_metrics_route(app: web.Application, role: str, read: Callable[[], dict[str, float]],
                      device: Any, extra: Iterable[Any] = ()) -> None:
    """``GET /metrics`` on ``app``: the role's figures plus telemetry of the GPU it computes on
    (torch ``device``), if any, plus the ``extra`` collectors (e.g. labelled counters)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FiguresCollector(role, read))
    for collector in extra:
        registry.register(collector)
    registry.register(GpuCollector(devices=nvml_devices(device), pid=os.getpid()))

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/metrics", metrics)
