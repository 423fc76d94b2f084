"""In-process tensor-parallel ranks for tests: ``torch.multiprocessing`` starts N ranks joined by
gloo on 127.0.0.1; each runs a job and leaves its result in a file the parent reads back."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from mooncake_lite.common.ports import free_port
from mooncake_lite.model.tp_comms import GroupAddress, TPComms, backend_for

# Ranks fork from one server process that imported torch and the TP model once (forkserver): a
# spawned rank imported them afresh, ~2.5 s of CPU for each of the ~20 ranks the suite starts.
# The server has run nothing else: no threads, CUDA or event loop of this process are forked.
multiprocessing.set_forkserver_preload(["torch", "mooncake_lite.model.tensor_parallel"])


def _rank_main(rank: int, address: GroupAddress, job: Callable[[TPComms, Any], Any], arg: Any, out: str,
               devices: list[str]) -> None:
    torch.set_num_threads(1)   # N ranks share this machine's two cores
    comms = TPComms(address, rank, devices[rank]).join()
    try:
        result = job(comms, arg)
        torch.save(_to_cpu(result), Path(out) / f"rank{rank}.pt")
    finally:
        comms.close()


def run_ranks(size: int, job: Callable[[TPComms, Any], Any], arg: Any, tmp: Path,
              timeout_s: float = 60.0, devices: list[str] | None = None) -> list[Any]:
    """``job(comms, arg)`` on each of ``size`` ranks (``job`` a module-level function; rank r on
    ``devices[r]``, default the CPU); their results in rank order, on the CPU. A rank that
    fails fails the call (its traceback in the error)."""
    devices = devices or ["cpu"] * size
    address = GroupAddress("127.0.0.1", free_port(), size, timeout_s, backend_for(devices))
    mp.start_processes(_rank_main, args=(address, job, arg, str(tmp), devices), nprocs=size, join=True,
                       start_method="forkserver")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(size)]


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value
