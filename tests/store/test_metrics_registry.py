"""The store's /metrics registry is built once: each scrape reads the live objects, and GPU
telemetry (NVML) starts once per process, not once per scrape."""

from types import SimpleNamespace

import mooncake_lite.store.metrics as store_metrics
from mooncake_lite.store.app import DATA, make_app, metrics
from mooncake_lite.store.config import Config


async def test_scrapes_share_one_registry_and_see_the_live_store(monkeypatch):
    built = []

    class CountingGpu(store_metrics.GpuCollector):
        def __init__(self):
            super().__init__(SimpleNamespace(nvmlInit=lambda: (_ for _ in ()).throw(OSError("no driver"))))
            built.append(self)

    monkeypatch.setattr(store_metrics, "GpuCollector", CountingGpu)
    app = make_app(Config(port=0, data_port=0, dram=1 << 20, slot_bytes=1 << 16, pin_memory=False))
    request = SimpleNamespace(app=app)
    first = (await metrics(request)).body.decode()
    store = app[DATA].store                             # a stored block shows at the next scrape
    store.commit(store.reserve([b"k" * 16], [100], 1))
    second = (await metrics(request)).body.decode()
    assert len(built) == 1
    assert "mooncake_store_blocks" in first and first != second
