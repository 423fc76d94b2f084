"""Prometheus metrics of a store, read from the live objects at scrape time (no hot-path cost)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mooncake_lite.common.gpu import GpuCollector
from mooncake_lite.store.blocks import BlockStore

P = "mooncake_store_"


class StoreCollector:
    def __init__(self, store: BlockStore, extra: Callable[[], dict[str, float]] | None = None) -> None:
        self.store = store
        self.extra = extra or (lambda: {})

    def collect(self) -> Iterator[Metric]:
        store, stats, ssd = self.store, self.store.stats, self.store.ssd
        yield _gauge("capacity_bytes", "bytes each tier can hold", [
            ("dram", store.slab.capacity_bytes), ("ssd", ssd.capacity_bytes if ssd else 0)])
        yield _gauge("used_bytes", "bytes in use per tier (DRAM counts whole slots)", [
            ("dram", store.dram_used_bytes), ("ssd", ssd.used_bytes if ssd else 0)])
        yield _gauge("blocks", "blocks held per tier", [
            ("dram", store.num_dram_blocks), ("ssd", len(ssd) if ssd else 0)])
        yield _counter("hits", "block reads served, by the tier that held the block", [
            ("dram", stats.hits_dram), ("ssd", stats.hits_ssd)])
        yield _counter("evictions", "blocks evicted per tier", [
            ("dram", stats.evictions_dram), ("ssd", ssd.num_evicted if ssd else 0)])
        yield _counter("misses", "block reads a tier could not serve (tier=ssd: no tier could)", [
            ("dram", stats.misses_dram), ("ssd", stats.misses)])
        yield _counter("bytes_in", "block bytes received by puts", value=stats.bytes_in)
        yield _counter("bytes_out", "block bytes sent by gets", value=stats.bytes_out)
        yield _counter("blocks_put", "blocks committed by puts", value=stats.blocks_put)
        yield _counter("full_errors", "puts refused because no slot could be freed", value=stats.full_errors)
        yield _counter("corrupt_blocks", "SSD blocks that failed their header or checksum check",
                       value=ssd.num_corrupt if ssd else 0)
        yield _counter("ssd_writes", "blocks written back to SSD", value=ssd.num_writes if ssd else 0)
        yield _counter("ssd_dropped", "evicted blocks not written to SSD (queue full, too big, IO error)",
                       value=ssd.num_dropped if ssd else 0)
        yield _counter("leases_expired", "leases that expired (their connection was closed)",
                       value=stats.leases_expired)
        yield _counter("read_leases_dropped", "same-node read leases ended early: their connection held "
                       "more than 1024 (it was not handing them back)", value=stats.read_leases_dropped)
        yield _gauge_value("leases", "active leases (blocks being sent)", store.num_leases)
        yield from _assembly(store)
        for name, value in self.extra().items():
            yield _gauge_value(name, name.replace("_", " "), value)


def _assembly(store: BlockStore) -> Iterator[Metric]:
    """Blocks put in layer slices (CPP stages): partial ones each hold a DRAM slot until whole."""
    asm = store.assembly
    yield _gauge_value("partial_blocks", "blocks being assembled from layer slices (each holds a DRAM slot)",
                       asm.num_partial)
    yield _gauge_value("partial_blocks_max", "most blocks held partial at once", asm.max_partial)
    yield _counter("slices", "layer slices received (per key; no-ops included)", value=asm.stats.slices)
    yield _counter("slices_dropped", "layer slices that were no-ops (block held, or range put already)",
                   value=asm.stats.slices_dropped)
    yield _counter("blocks_assembled", "blocks made whole from layer slices", value=asm.stats.assembled)
    yield _counter("partial_expired", "partial blocks dropped unfinished (a layer range never came)",
                   value=asm.stats.expired)
    yield _counter("slices_refused", "slice puts refused (bad range or size, or partial blocks at their bound)",
                   value=asm.stats.refused)


def _gauge(name: str, doc: str, per_tier: list[tuple[str, float]]) -> Metric:
    g = GaugeMetricFamily(P + name, doc, labels=["tier"])
    for tier, value in per_tier:
        g.add_metric([tier], value)
    return g


def _gauge_value(name: str, doc: str, value: float) -> Metric:
    return GaugeMetricFamily(P + name, doc, value=value)


def _counter(name: str, doc: str, per_tier: list[tuple[str, float]] | None = None, value: float = 0) -> Metric:
    if per_tier is None:
        return CounterMetricFamily(P + name, doc, value=value)
    c = CounterMetricFamily(P + name, doc, labels=["tier"])
    for tier, v in per_tier:
        c.add_metric([tier], v)
    return c


def make_registry(collector: StoreCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    registry.register(GpuCollector())  # the store's slab is pinned for the node's GPUs
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
