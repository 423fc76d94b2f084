"""Send synthesized requests at their trace arrival times and collect the records."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
from tqdm import tqdm

from mooncake_lite.bench.replay.client import Clock, request_body, stream_one
from mooncake_lite.bench.replay.metrics import RequestRecord
from mooncake_lite.bench.replay.workload import SynthRequest


def select_window(arrivals_s: Sequence[float], *, max_requests: int | None, duration_s: float | None) -> int:
    """How many leading requests fall in the replay window (arrivals sorted, relative to the first)."""
    if not arrivals_s:
        return 0
    t0, count = arrivals_s[0], len(arrivals_s)
    if duration_s is not None:
        count = sum(1 for t in arrivals_s if t - t0 < duration_s)
    if max_requests is not None:
        count = min(count, max_requests)
    return count


async def replay(requests: Sequence[SynthRequest], url: str, model: str, *, headers: dict[str, str],
                 ignore_eos: bool = True, max_concurrency: int | None = None, request_timeout_s: float = 600.0,
                 progress: bool = True, clock: Clock = time.perf_counter,
                 on_record: Callable[[RequestRecord], None] | None = None) -> tuple[list[RequestRecord], float]:
    """Replay ``requests`` (arrival times relative to the first); returns records and the run time.

    Requests are sent open-loop at their arrival times, like real users; ``max_concurrency``
    optionally caps requests in flight (later ones then wait, which shows up in their TTFT).
    """
    if not requests:
        return [], 0.0
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, file=sys.stderr, unit="req", desc="replay")
    timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)

    async def one(req: SynthRequest, scheduled: float) -> RequestRecord:
        body = request_body(req, model, ignore_eos=ignore_eos)
        if limit is None:
            record = await stream_one(session, url, req, body, scheduled_s=scheduled, clock=clock)
        else:
            async with limit:
                record = await stream_one(session, url, req, body, scheduled_s=scheduled, clock=clock)
        bar.update(1)
        if record.is_rejected:
            bar.set_postfix_str("some 429s", refresh=False)
        if on_record:
            on_record(record)
        return record

    start = clock()
    try:
        async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
            records = await send_open_loop(requests, one, start, clock)
    finally:
        bar.close()
    return records, clock() - start


async def send_open_loop(requests: Sequence[SynthRequest], send: Callable[[SynthRequest, float], Awaitable],
                         start: float, clock: Clock) -> list:
    """``send(req, scheduled)`` for each request at its arrival time after ``start`` (relative to
    the first's), never waiting for the ones before; their results in order. Those still running
    when this is cancelled or fails are cancelled with it."""
    t_first = requests[0].arrival_s
    tasks: list[asyncio.Task] = []
    try:
        for req in requests:
            scheduled = start + (req.arrival_s - t_first)
            delay = scheduled - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(req, scheduled)))
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
