"""GPU telemetry for ``/metrics`` through NVML (pynvml, package nvidia-ml-py).

Absent driver, absent GPU or absent module all mean "no GPU metrics", never an error: the
collector then yields nothing. NVML is initialised once, lazily, at the first scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

log = logging.getLogger(__name__)


class GpuCollector:
    """Prometheus collector: ``mooncake_gpu_*`` gauges labelled by GPU index."""

    def __init__(self, nvml: Any | None = None) -> None:
        self._nvml = nvml          # injectable for tests; real pynvml otherwise
        self._ready: bool | None = None

    def _init(self) -> bool:
        if self._ready is None:
            try:
                if self._nvml is None:
                    import pynvml
                    self._nvml = pynvml
                self._nvml.nvmlInit()
                self._ready = True
            except Exception as exc:  # no module, no driver, no device: all mean "no telemetry"
                log.info("no GPU telemetry: %s", exc)
                self._ready = False
        return self._ready

    def collect(self) -> Iterator[Metric]:
        if not self._init():
            return
        nv = self._nvml
        util = GaugeMetricFamily("mooncake_gpu_utilization_ratio", "GPU busy fraction (NVML)", labels=["gpu"])
        used = GaugeMetricFamily("mooncake_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu"])
        total = GaugeMetricFamily("mooncake_gpu_memory_total_bytes", "GPU memory size", labels=["gpu"])
        power = GaugeMetricFamily("mooncake_gpu_power_watts", "GPU power draw", labels=["gpu"])
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                handle, label = nv.nvmlDeviceGetHandleByIndex(i), [str(i)]
                util.add_metric(label, nv.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
                mem = nv.nvmlDeviceGetMemoryInfo(handle)
                used.add_metric(label, float(mem.used))
                total.add_metric(label, float(mem.total))
                power.add_metric(label, nv.nvmlDeviceGetPowerUsage(handle) / 1000.0)
        except Exception as exc:  # a GPU falling off the bus must not break /metrics
            log.warning("GPU telemetry failed: %s", exc)
        yield from (util, used, total, power)
