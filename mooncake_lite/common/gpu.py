"""GPU telemetry for ``/metrics`` through NVML (pynvml, package nvidia-ml-py).

Absent driver, absent GPU or absent module all mean "no GPU metrics", never an error: the
collector then yields nothing. NVML is initialised once, lazily, at the first scrape.

A prefill or decode instance exports only the GPU it computes on (one instance per GPU is the
usual layout, and every instance exporting every GPU would report each one several times); the
store, which serves all of a node's GPUs, exports them all.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

log = logging.getLogger(__name__)


def nvml_devices(device: Any, env: Mapping[str, str] = os.environ) -> list[int | str]:
    """The NVML device a process computing on torch ``device`` uses: ``cuda:N`` is the Nth
    entry of CUDA_VISIBLE_DEVICES (an index, or a full GPU UUID) or index N when it is unset; a
    CPU device uses none. CUDA numbers devices fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID,
    NVML in PCI order: on a node with mixed GPU models, set PCI_BUS_ID (or list UUIDs) so the
    two agree."""
    text = str(device)
    if not text.startswith("cuda"):
        return []
    index = int(text.partition(":")[2] or 0)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [index]
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries):
        return []
    return [int(entries[index]) if entries[index].isdigit() else entries[index]]


class GpuCollector:
    """Prometheus collector: ``mooncake_gpu_*`` gauges labelled by GPU (NVML index or UUID).
    ``devices``: the NVML indices / UUIDs to export (see :func:`nvml_devices`); None = all.
    ``pid``: also export what that process holds on each of them (an instance passes its own:
    with several instances on one GPU, each one's share of it, ``--gpu-memory-fraction``)."""

    def __init__(self, nvml: Any | None = None, devices: Sequence[int | str] | None = None,
                 pid: int | None = None) -> None:
        self._nvml = nvml          # injectable for tests; real pynvml otherwise
        self._devices = devices
        self._pid = pid
        self._ready: bool | None = None
        self._unsupported: set[tuple[str, str]] = set()

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
        mine = GaugeMetricFamily("mooncake_gpu_process_memory_bytes", "GPU memory this process holds",
                                 labels=["gpu"])
        try:
            devices = self._devices if self._devices is not None else range(nv.nvmlDeviceGetCount())
        except Exception as exc:  # a driver gone bad must not break /metrics
            log.warning("GPU telemetry failed: %s", exc)
            devices = ()
        for d in devices:
            label = [str(d)]
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(d) if isinstance(d, int) else nv.nvmlDeviceGetHandleByUUID(d)
            except Exception as exc:  # a GPU falling off the bus
                log.warning("GPU %s telemetry failed: %s", d, exc)
                continue
            # Each figure on its own: some devices (MIG instances) support memory but not
            # utilization or power, and what is supported is still worth exporting.
            self._add((util,), label, lambda: (nv.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0,))
            self._add((used, total), label, lambda: _memory(nv.nvmlDeviceGetMemoryInfo(handle)))
            self._add((power,), label, lambda: (nv.nvmlDeviceGetPowerUsage(handle) / 1000.0,))
            if self._pid is not None:
                self._add((mine,), label, lambda: (_held_by(nv.nvmlDeviceGetComputeRunningProcesses(handle),
                                                            self._pid),))
        yield from (util, used, total, power) + ((mine,) if self._pid is not None else ())

    def _add(self, families: tuple[GaugeMetricFamily, ...], label: list[str], read: Any) -> None:
        """One NVML query, ``read()``, feeding one value to each of ``families``."""
        try:
            values = read()
        except Exception as exc:
            name = families[0].name
            if (name, label[0]) not in self._unsupported:   # say it once, not every scrape
                self._unsupported.add((name, label[0]))
                log.info("GPU %s: no %s (%s)", label[0], name, exc)
            return
        for family, value in zip(families, values):
            family.add_metric(label, value)


def _held_by(processes: Sequence[Any], pid: int) -> float:
    """``pid``'s GPU memory among NVML's running compute processes (0 when it holds none yet, and
    in a PID namespace where NVML reports the host's PIDs)."""
    return float(sum(p.usedGpuMemory or 0 for p in processes if p.pid == pid))


def _memory(info: Any) -> tuple[float, float]:
    return float(info.used), float(info.total)
