"""Device helpers: the GPU table's lookup by reported name, and sync as a CPU no-op."""

import pytest
import torch

from mooncake_kernels.device import peaks_for_name, sync


@pytest.mark.parametrize("reported, entry", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"), ("NVIDIA A100-SXM4-40GB", "A100"),
    ("NVIDIA A10", "A10"), ("NVIDIA L4", "L4"), ("NVIDIA L40S", "L40S"), ("Tesla T4", "T4"),
])
def test_known_gpus_by_reported_name(reported, entry):
    peaks = peaks_for_name(reported)
    assert peaks.name == entry and peaks.hbm_gbps > 0 and peaks.host_link_gbps > 0
    assert peaks.tflops("float16") > peaks.tflops("float32") > 0


def test_unknown_gpu_has_no_figures():
    peaks = peaks_for_name("Some Future Accelerator")
    assert (peaks.hbm_gbps, peaks.host_link_gbps, peaks.tflops("bfloat16")) == (None, None, None)


def test_sync_off_cuda_is_a_no_op():
    sync("cpu")
    sync(None)
    sync(torch.device("cpu"))


@pytest.mark.gpu
def test_sync_waits_for_queued_kernels():
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        a = a @ a / 4096
    sync("cuda")
    assert torch.cuda.current_stream().query()
