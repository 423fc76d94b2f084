"""What the conductor's request path and endpoints share, one per app: the HTTP session to the
instances, the membership, the scheduler, the metrics, and the request path's settings.

Its own module (not ``flight/``'s) so that every part that needs it imports it downward: the
public API and the flights, the contexts, the internal endpoints and the background loops.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from mooncake_lite.conductor.cluster.metrics import ConductorMetrics
from mooncake_lite.conductor.flight.arrivals import Arrivals, reprice
from mooncake_lite.conductor.flight.output_lengths import OutputHistory
from mooncake_lite.conductor.flight.predictions import PredictionBook
from mooncake_lite.conductor.cluster.membership import Membership
from mooncake_lite.conductor.tenants import TenantGate
from mooncake_lite.scheduler import Decision, Scheduler

RECENT_CONTINUATIONS = 20


@dataclass
class Services:
    """What a request needs from the app (one per conductor). ``session`` is opened by the app's
    ``cleanup_ctx``, once the event loop runs."""

    session: aiohttp.ClientSession
    membership: Membership
    scheduler: Scheduler
    metrics: ConductorMetrics
    block_size: int
    hash_seed: int
    cluster_token: str | None = None
    upstream_timeout_s: float = 300.0
    kv_timeout_s: float = 30.0
    max_retries: int = 2          # re-dispatches of a request that failed before its first token
    migration_limit: int = 2      # continuations of a request whose decode failed mid-stream
    background: set[asyncio.Task] = field(default_factory=set)
    outputs: OutputHistory = field(default_factory=OutputHistory)   # predicted output lengths
    tenants: TenantGate | None = None   # per-tenant limits, SLOs and priorities (conductor/tenants.py)
    # a burst placed together, shortest first (flight/arrivals.py); Arrivals(0): each as it comes
    arrivals: Arrivals = field(default_factory=lambda: Arrivals(0.0))
    # told each accepted placement (decision, block keys, now): hot-block heat (cluster/hot_replication.py)
    on_placed: Callable[[Decision, list[bytes], float], None] | None = None
    # every prediction checked, and the online correction it feeds (conductor/flight/predictions.py)
    predictions: PredictionBook = field(init=False)
    # requests placed so far (X-Mooncake-Placed): where a refusal fell among them (bench fidelity);
    # each admitted one's number goes to its prefill with this process's name (PrefillRequest.placed)
    num_placed: int = 0
    placer: str = field(default_factory=lambda: secrets.token_hex(4))
    # the last continuations (flight/continuation.py), newest last, for ``mooncake status``
    continuations: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=RECENT_CONTINUATIONS))

    def __post_init__(self) -> None:
        self.predictions = PredictionBook(self.membership, self.metrics, lambda: self.scheduler.costs)
        if self.arrivals.on_placed is None:   # a burst's forwards priced as it left them (arrivals.py)
            self.arrivals.on_placed = lambda flights: reprice(flights, self.membership,
                                                              lambda: self.scheduler.costs.prefill)

    def spawn(self, coro: Any) -> None:
        """Fire-and-forget work (aborts) that must outlive a cancelled handler."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


SERVICES: web.AppKey[Services] = web.AppKey("services", Services)
