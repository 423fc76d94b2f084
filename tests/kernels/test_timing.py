"""The one timer (``kernels/timing.py``): each timed run between two device synchronisations
(checked on a fake CUDA device whose stream records them), warm-ups untimed, best-of the min."""

import torch

from mooncake_kernels import timing


class FakeStream:
    def __init__(self, log: list):
        self.log = log

    def synchronize(self) -> None:
        self.log.append("synchronize")


def fake_cuda(monkeypatch) -> list:
    """A CUDA device that is only a log: ``mooncake_kernels.device.sync`` reaches its stream's synchronize."""
    log = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(log))
    return log


def test_each_timed_run_sits_between_two_synchronisations_of_the_cuda_device(monkeypatch):
    log = fake_cuda(monkeypatch)
    times = timing.run_times(lambda: log.append("run"), "cuda", 3, warmup=2)
    assert len(times) == 3
    assert log == ["run", "run"] + ["synchronize", "run", "synchronize"] * 3   # warm-ups unsynchronised


def test_off_cuda_nothing_is_synchronised(monkeypatch):
    log = fake_cuda(monkeypatch)
    timing.run_times(lambda: log.append("run"), "cpu", 2)
    assert log == ["run", "run"]


def test_the_clock_brackets_the_synchronisations_and_best_of_is_the_min(monkeypatch):
    log = fake_cuda(monkeypatch)
    durations = iter([0.5, 0.25, 1.0])
    now = [0.0]

    def clock() -> float:
        log.append("clock")
        return now[0]

    def run() -> None:
        now[0] += next(durations)

    assert timing.timed(lambda: None, "cuda", clock) == 0.0
    assert log == ["synchronize", "clock", "synchronize", "clock"]   # queued work before t0, all after
    assert timing.run_times(run, "cuda", 3, clock=clock) == [0.5, 0.25, 1.0]
    durations = iter([0.5, 0.25, 1.0])
    assert timing.best_seconds(run, "cuda", 3, clock=clock) == 0.25
