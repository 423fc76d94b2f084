from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

import pytest

from mooncake_lite.common.gpu import GpuCollector, nvml_devices


class FakeNvml:
    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return {"GPU-aaa": 0, "GPU-bbb": 1}[uuid]

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=50 + h)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=1000 * (h + 1), total=8000)

    def nvmlDeviceGetPowerUsage(self, h):
        return 250_000

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=7, usedGpuMemory=3 << 30), SimpleNamespace(pid=8 + h, usedGpuMemory=1 << 30),
                SimpleNamespace(pid=7, usedGpuMemory=None)]   # None: NVML cannot tell (some drivers)


class NoDriver:
    def nvmlInit(self):
        raise OSError("NVML Shared Library Not Found")


def scrape(collector) -> str:
    reg = CollectorRegistry()
    reg.register(collector)
    return generate_latest(reg).decode()


def test_gpu_metrics_from_nvml():
    text = scrape(GpuCollector(FakeNvml()))
    assert 'mooncake_gpu_utilization_ratio{gpu="1"} 0.51' in text
    assert 'mooncake_gpu_memory_used_bytes{gpu="0"} 1000.0' in text
    assert 'mooncake_gpu_power_watts{gpu="0"} 250.0' in text


def test_an_instance_exports_what_its_process_holds():
    text = scrape(GpuCollector(FakeNvml(), devices=[0, 1], pid=8))
    assert 'mooncake_gpu_process_memory_bytes{gpu="0"} 1.073741824e+09' in text
    assert 'mooncake_gpu_process_memory_bytes{gpu="1"} 0.0' in text
    assert 'mooncake_gpu_process_memory_bytes{gpu="0"} 3.221225472e+09' in scrape(GpuCollector(FakeNvml(), pid=7))
    assert "process_memory" not in scrape(GpuCollector(FakeNvml()))    # a store: no process of its own


def test_no_driver_means_no_gpu_metrics_and_no_error():
    text = scrape(GpuCollector(NoDriver()))
    assert "mooncake_gpu" not in text


def test_real_nvml_on_this_machine_never_raises():
    scrape(GpuCollector())  # CPU machine: no driver; GPU machine: real figures


def test_an_instance_exports_only_its_own_gpu():
    text = scrape(GpuCollector(FakeNvml(), devices=[1]))
    assert 'mooncake_gpu_utilization_ratio{gpu="1"} 0.51' in text and 'gpu="0"' not in text
    text = scrape(GpuCollector(FakeNvml(), devices=["GPU-aaa"]))
    assert 'mooncake_gpu_memory_used_bytes{gpu="GPU-aaa"} 1000.0' in text and 'gpu="1"' not in text
    assert "mooncake_gpu_power_watts{" not in scrape(GpuCollector(FakeNvml(), devices=[]))   # a CPU instance


@pytest.mark.parametrize("device, env, expected", [
    ("cpu", {}, []),
    ("cuda", {}, [0]),
    ("cuda:1", {}, [1]),
    ("cuda:1", {"CUDA_VISIBLE_DEVICES": "4,6"}, [6]),          # torch numbers the visible ones
    ("cuda:0", {"CUDA_VISIBLE_DEVICES": "GPU-bbb"}, ["GPU-bbb"]),
    ("cuda:2", {"CUDA_VISIBLE_DEVICES": "4,6"}, []),
])
def test_nvml_device_of_a_torch_device(device, env, expected):
    assert nvml_devices(device, env) == expected


class MigNvml(FakeNvml):
    def nvmlDeviceGetUtilizationRates(self, h):
        raise RuntimeError("Not Supported")

    def nvmlDeviceGetPowerUsage(self, h):
        raise RuntimeError("Not Supported")


def test_a_device_without_utilization_or_power_still_reports_its_memory():
    text = scrape(GpuCollector(MigNvml(), devices=["GPU-bbb"]))
    assert 'mooncake_gpu_memory_used_bytes{gpu="GPU-bbb"} 2000.0' in text
    assert "mooncake_gpu_utilization_ratio{" not in text and "mooncake_gpu_power_watts{" not in text
