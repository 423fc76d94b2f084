"""Run a simulator over a trace with a tqdm progress bar (on stderr)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tqdm import tqdm

from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.colocated import ColocatedSim
from mooncake_lite.sim.recorder import SimResult
from mooncake_lite.trace.format import TraceRequest


def run_with_progress(sim: MooncakeSim | ColocatedSim, trace: Sequence[TraceRequest], desc: str,
                      show: bool = True) -> SimResult:
    """``sim.run(trace)`` with a bar counting ended requests (hidden when ``show`` is False or
    stderr is not a terminal)."""
    if not show:
        return sim.run(trace)
    bar = tqdm(total=len(trace), desc=desc, unit="req", file=sys.stderr, leave=False,
               disable=not sys.stderr.isatty(), dynamic_ncols=True)
    last = [0]

    def progress(n: int) -> None:
        bar.update(n - last[0])
        last[0] = n

    try:
        return sim.run(trace, progress=progress)
    finally:
        bar.close()
