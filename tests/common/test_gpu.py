from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from mooncake_lite.common.gpu import GpuCollector


class FakeNvml:
    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=50 + h)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=1000 * (h + 1), total=8000)

    def nvmlDeviceGetPowerUsage(self, h):
        return 250_000


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


def test_no_driver_means_no_gpu_metrics_and_no_error():
    text = scrape(GpuCollector(NoDriver()))
    assert "mooncake_gpu" not in text


def test_real_nvml_on_this_machine_never_raises():
    scrape(GpuCollector())  # CPU machine: no driver; GPU machine: real figures
