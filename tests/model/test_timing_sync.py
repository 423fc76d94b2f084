"""Every timer brackets the work with a device sync (on CUDA a clock read after a launch times
the launch): the self-profile, bench model's timings and a prefill chunk's refiner sample. On
CPU sync is a no-op, so the order of calls is what is checked. Also: bench model's GPU roofs
read "unknown" where the datasheet figure is not known, and --device cuda refuses without one."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mooncake_kernels import timing
from mooncake_lite.bench.model import gpu_roofs
from mooncake_lite.bench.model import cli as bench_model
from mooncake_lite.bench.model import measure as bench_measure
from mooncake_lite.instance import profile
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill import engine as prefill_engine

BS = 8


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(build_model("tiny"), num_blocks=32, block_size=BS)


def record(monkeypatch, runner) -> list:
    """Log syncs (the one timer's, ``kernels/timing.py``) and the runner's model calls, in order."""
    calls = []
    monkeypatch.setattr(timing, "sync", lambda device: calls.append(("sync", str(device))))
    for name in ("prefill", "decode"):
        real = getattr(runner, name)
        monkeypatch.setattr(runner, name, lambda *a, _r=real, _n=name, **k: (calls.append((_n,)), _r(*a, **k))[1])
    return calls


def bracketed(calls: list, op: str) -> bool:
    """Every ``op`` call sits between two syncs."""
    return all(i > 0 and calls[i - 1][0] == "sync" and calls[i + 1][0] == "sync"
               for i, c in enumerate(calls) if c == (op,)) and (op,) in calls


def test_self_profile_timers_sync(monkeypatch, runner):
    calls = record(monkeypatch, runner)
    profile.time_prefill(runner, 16, 8, repeats=2)
    profile.time_decode(runner, 2, 16, repeats=2)
    timed = calls[1:]   # the first prefill (the cached prefix) is not timed
    assert bracketed(timed, "prefill") and bracketed(timed, "decode")
    assert {c[1] for c in calls if c[0] == "sync"} == {str(runner.device)}


def test_bench_model_timers_sync(monkeypatch, runner):
    calls = record(monkeypatch, runner)
    bar = type("Bar", (), {"update": lambda self, n: None})()
    assert len(bench_measure.bench_prefill(runner, 16, 2, bar)) == 2
    assert calls[0] == ("prefill",) and bracketed(calls[1:], "prefill")   # a warm-up, untimed, first
    del calls[:]
    assert len(bench_measure.bench_decode(runner, 2, 16, 2, bar)) == 2
    assert calls[0] == ("decode",)
    assert bracketed(calls[1:], "decode")


def test_prefill_chunk_time_includes_a_sync(monkeypatch, runner):
    syncs = []
    monkeypatch.setattr(prefill_engine, "sync", lambda device: syncs.append(device))
    stage = prefill_engine.StageEngine(runner, None, ThreadPoolExecutor(1))
    seen = []
    stage.refiner = type("R", (), {"observe": lambda self, *a: seen.append((len(syncs), a))})()

    class Sender:
        error = None

        def send_layer(self, *a):
            pass

    async def go():
        job = stage.begin("r", list(range(12)), [], 0, Sender())
        try:
            await stage.run_chunk(job, 0, token_ids=list(range(12)))
        finally:
            stage.jobs.pop("r")
            runner.allocator.free(job.block_ids)

    asyncio.run(go())
    assert seen and seen[0][0] == 1 and syncs == [runner.device]   # synced before the sample was taken


def gpu(name="NVIDIA H100 80GB HBM3", hbm=3350.0, link=50.0, tflops=None):
    return {"name": name, "memory_gib": 80.0, "multiprocessors": 132, "hbm_gbps": hbm, "host_link_gbps": link,
            "dense_tflops": tflops, "h2d_pinned_gbps": 40.0, "d2h_pinned_gbps": 45.0}


def test_gpu_roofs_fractions_and_unknowns():
    known = gpu(tflops={"bfloat16": 989.0})
    f = gpu_roofs.fractions(known, "bfloat16", 98.9e12, 1675e9)
    assert f["mfu"] == pytest.approx(0.1) and f["fraction_of_hbm"] == pytest.approx(0.5)
    assert gpu_roofs.fractions(known, "float32", 1e12)["mfu"] is None          # no float32 figure given
    line = gpu_roofs.render_machine(known)
    assert "HBM 3350 GB/s" in line and "80.0%" in line and "bfloat16 989" in line   # 40 of 50 GB/s
    unknown = gpu("Mystery GPU", None, None, None)
    assert gpu_roofs.fractions(unknown, "bfloat16", 1e12, 1e9) == {"mfu": None, "fraction_of_hbm": None}
    assert gpu_roofs.render_machine(unknown).count("unknown") >= 4
    assert "unknown" in gpu_roofs.render_decode({"mfu": None, "fraction_of_hbm": None})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_refused_without_a_gpu(capsys):
    with pytest.raises(SystemExit):
        bench_model.parse_args(["--device", "cuda"])
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
def test_bench_model_on_cuda_prints_roofs(capsys):
    rc = bench_model.main(["--device", "cuda", "--models", "tiny", "--prompt-len", "64", "--context-len", "64",
                           "--batch-sizes", "1,4", "--decode-steps", "2", "--repeats", "1", "--dtype", "bfloat16"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "gpu:" in out and "MFU" in out and "HBM" in out and "host->device" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_pd_device_cuda_refused_without_a_gpu(capsys):
    from mooncake_lite.bench.pd import cli as pd
    with pytest.raises(SystemExit):
        pd.parse_args(["--device", "cuda"])
    assert "no CUDA device" in capsys.readouterr().err
    assert pd.parse_args([]).device == "cpu"
