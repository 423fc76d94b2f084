"""In-process tensor-parallel ranks for tests: ``torch.multiprocessing`` spawns N ranks joined by
gloo on 127.0.0.1; each runs a job and leaves its result in a file the parent reads back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from mooncake_lite.model.tp_comms import GroupAddress, TPComms, free_port


def _rank_main(rank: int, address: GroupAddress, job: Callable[[TPComms, Any], Any], arg: Any, out: str) -> None:
    torch.set_num_threads(1)   # N ranks share this machine's two cores
    comms = TPComms(address, rank).join()
    try:
        torch.save(job(comms, arg), Path(out) / f"rank{rank}.pt")
    finally:
        comms.close()


def run_ranks(size: int, job: Callable[[TPComms, Any], Any], arg: Any, tmp: Path,
              timeout_s: float = 60.0) -> list[Any]:
    """``job(comms, arg)`` on each of ``size`` ranks (``job`` a module-level function); their
    results in rank order. A rank that fails fails the call (its traceback in the error)."""
    address = GroupAddress("127.0.0.1", free_port(), size, timeout_s)
    mp.spawn(_rank_main, args=(address, job, arg, str(tmp)), nprocs=size, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(size)]
