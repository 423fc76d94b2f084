"""The Grafana dashboard (docs/grafana/mooncake.json) reads only metrics some role exports, and
the Prometheus example (docs/prometheus.yml) scrapes every role.

The exported names are collected from each role's own ``/metrics`` handler, built in process
the way the role builds it (conductor and store apps from their configs; prefill and decode
apps around a tiny model's engine; GPU telemetry through a fake NVML)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml   # pyyaml comes with transformers, a dev dependency
from aiohttp.test_utils import make_mocked_request
from prometheus_client import CollectorRegistry, generate_latest

from mooncake_lite.common.gpu import GpuCollector
from mooncake_lite.model.weights import build_model
from tests.common.test_gpu import FakeNvml
from tests.pd.harness import cluster

DOCS = Path(__file__).resolve().parents[1] / "docs"
METRIC = re.compile(r"\bmooncake_[a-z0-9_]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def series_names(exposition: str) -> set[str]:
    """Every series name a scrape can show: the samples, and for each ``# TYPE`` (labelled
    families with no sample yet included) the names its type produces."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            base = name.removesuffix("_total") if kind == "counter" else name
            names |= {base + s for s in SUFFIXES.get(kind, ("",))}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


async def scrape(app) -> str:
    route = next(r for r in app.router.routes() if r.method == "GET" and r.resource.canonical == "/metrics")
    resp = await route.handler(make_mocked_request("GET", "/metrics", app=app))
    return resp.body.decode()


@pytest.fixture(scope="module")
def exported() -> set[str]:
    import asyncio
    return asyncio.run(_exported())


async def _exported() -> set[str]:
    from mooncake_lite.conductor.app import make_app as conductor_app
    from mooncake_lite.conductor.config import Config as ConductorConfig
    from mooncake_lite.decode.app import DecodeAppSettings
    from mooncake_lite.decode.app import make_app as decode_app
    from mooncake_lite.prefill.app import make_app as prefill_app
    from mooncake_lite.store.app import make_app as store_app
    from mooncake_lite.store.config import Config as StoreConfig
    texts = [await scrape(conductor_app(ConductorConfig(model="tiny"))),
             await scrape(store_app(StoreConfig(dram=1 << 20, slot_bytes=1 << 18, ssd_queue=1 << 18,
                                                max_frame=1 << 20)))]
    async with cluster(build_model("tiny", seed=0)) as c:
        texts += [await scrape(prefill_app(c.prefill)), await scrape(decode_app(c.decode, DecodeAppSettings()))]
    registry = CollectorRegistry()
    registry.register(GpuCollector(nvml=FakeNvml(), devices=[0]))
    texts.append(generate_latest(registry).decode())
    return set().union(*(series_names(t) for t in texts))


def dashboard_metrics(dashboard: dict) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return set().union(*(METRIC.findall(e) for e in exprs))


def unknown_metrics(dashboard: dict, exported: set[str]) -> set[str]:
    return dashboard_metrics(dashboard) - exported


def test_every_metric_the_dashboard_names_is_exported(exported):
    dashboard = json.loads((DOCS / "grafana" / "mooncake.json").read_text())
    assert unknown_metrics(dashboard, exported) == set()
    used = dashboard_metrics(dashboard)
    # what an operator needs: latency quantiles, throughput, rejections, cache hits per tier,
    # bytes moved, KV use per instance, GPU telemetry
    for name in ("mooncake_conductor_ttft_seconds_bucket", "mooncake_conductor_tbt_seconds_bucket",
                 "mooncake_conductor_output_tokens_total", "mooncake_conductor_rejections_total",
                 "mooncake_store_hits_total", "mooncake_store_bytes_out_total", "mooncake_prefill_kv_bytes_sent_total",
                 "mooncake_decode_context_tokens", "mooncake_decode_max_context_tokens",
                 "mooncake_gpu_utilization_ratio"):
        assert name in used, name
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_a_misspelt_metric_is_caught(exported):
    bogus = {"panels": [{"targets": [{"expr": "rate(mooncake_store_hit_total[1m])"}]},
                        {"targets": [{"expr": "mooncake_decode_num_running"}]}]}
    assert unknown_metrics(bogus, exported) == {"mooncake_store_hit_total"}


def test_the_prometheus_example_scrapes_every_role():
    config = yaml.safe_load((DOCS / "prometheus.yml").read_text())
    roles = {c["labels"]["role"] for job in config["scrape_configs"] for c in job["static_configs"]}
    assert roles == {"conductor", "store", "prefill", "decode"}
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        assert all(re.fullmatch(r"[\w.-]+:\d+", t) for c in job["static_configs"] for t in c["targets"])
