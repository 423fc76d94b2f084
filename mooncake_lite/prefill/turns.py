"""Whose turn it is on a prefill instance: the waiting list in the queue order.

Requests run one at a time per group; a job lands in the waiting list where
``scheduler.waiting.land`` puts it (FIFO with ``overtakes`` 0, else shortest uncached prompt
first, each passed by at most ``overtakes`` later arrivals; a continuation, a stream whose decode
failed mid-answer, ahead of every new request: issue #37), and the head is given its turn when the
instance is free. Every change of the list goes into ``turns`` (``scheduler.waiting.TurnRecord``),
which rebuilds it offline. Kept apart from ``service.py``, which serves a turn (a pack), so the
order's bookkeeping (placeholders, aborts, cancelled turns) reads as one piece."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from mooncake_lite.common.protocol import PrefillRequest, PrefillResult
from mooncake_lite.prefill.job import PrefillAborted
from mooncake_lite.scheduler.waiting import FREE, GRANT, HOLD, LAND, LEAVE, TurnRecord, land

_HOLDS = itertools.count()   # a hold's name in the record


@dataclass(eq=False)    # a job is itself: the waiting list finds it by identity
class QueuedJob:
    request_id: str
    num_tokens: int
    num_prefix_tokens: int
    started_at: float | None = None
    # For prefill batching: what a pack's leader needs to serve this request along with its own.
    req: PrefillRequest | None = None
    keys: list[bytes] | None = None
    hit: int | None = None                      # leading blocks found in the store, once matched
    stop_keepalive: Callable[[], object] | None = None
    result: asyncio.Future | None = None        # set by the leader that served it in its pack
    migrated: tuple[float, float] | None = None # its hot-spot migration: (bytes copied, seconds)
    # Told the result once the first token is sampled, before decode answers END (which waits
    # for decode's running step): the HTTP answer goes out then (prefill/app.py).
    on_first: Callable[[PrefillResult], object] | None = None
    arrived_at: float = 0.0
    # Queue order: the uncached tokens it is ordered by (the prompt less the prefix the
    # conductor expects to be cached, ``prefix_keys``: the figure the conductor orders its view
    # with), the later arrivals that passed it, and the future its turn is given through.
    expected_uncached: int = 0
    passed: int = 0
    turn: asyncio.Future | None = None
    placed: tuple[str, int] | None = None       # where its conductor placed it (PrefillRequest.placed)
    overtook: tuple = ()                        # what its landing counted (waiting.land: undone if it lands again)
    counted: int = 0

    @property
    def is_continuation(self) -> bool:
        """A stream continued after its decode failed: its client is mid-answer."""
        return self.req is not None and self.req.sampling.num_generated > 0


class TurnTaking:
    """The waiting list of a PrefillService (mixed in): it sets ``_waiting`` (jobs in serving
    order), ``_busy`` (whether one holds the instance) and ``overtakes`` (the order's bound)."""

    _waiting: list[QueuedJob]
    _busy: bool
    overtakes: int
    turns: TurnRecord     # what the waiting list did (GET /v1/timeline): an offline reader replays it

    def _drop_waiting(self, job: QueuedJob) -> None:
        """An aborted job that still waits for its turn (not started, in no pack) leaves the
        waiting list now, as it leaves the conductor's view: it no longer counts in ``load()``,
        nor holds back or is passed by later arrivals. Its turn raises PrefillAborted."""
        if job.started_at is not None or job.result.done() or job.turn is None or job.turn.done():
            return
        if any(j is job for j in self._waiting):
            self._waiting.remove(job)
            self.turns.note(LEAVE, job.request_id)
            job.turn.set_exception(PrefillAborted("aborted while queued (by the conductor, or decode dropped it)"))

    @contextlib.asynccontextmanager
    async def _turn(self, job: QueuedJob):
        """Wait until ``job`` is first in the queue order and the instance is free, then hold it.
        The job lands where ``scheduler.waiting.land`` puts it (with ``overtakes`` 0, last: the
        FIFO an asyncio.Lock gave); pack members a running leader serves stay at the head."""
        land(self._waiting, job, self.overtakes, _started)
        self.turns.note(LAND, job.request_id, job.expected_uncached, job.is_continuation, job.placed)
        job.turn = asyncio.get_running_loop().create_future()
        self._grant()
        await self._await_turn(job)
        try:
            yield
        finally:
            self._release()

    async def _await_turn(self, job: QueuedJob) -> None:
        """Wait for ``job``'s turn; if that ends otherwise, it leaves the waiting list, and gives the
        instance back if it had been given it (an abort, :meth:`_drop_waiting`, gave it nothing)."""
        try:
            await job.turn
        except BaseException:
            if any(j is job for j in self._waiting):
                self._waiting.remove(job)
                self.turns.note(LEAVE, job.request_id)
            elif job.turn.done() and not job.turn.cancelled() and job.turn.exception() is None:
                self._release()                # given its turn, then cancelled before taking it
            raise

    async def hold(self) -> None:
        """Take the instance as a request would, behind every queued one and passed by none
        (nothing is shorter than 0 tokens); :meth:`unhold` gives it back. Tests queue bursts
        behind a hold."""
        loop = asyncio.get_running_loop()
        holder = QueuedJob(f"(hold {next(_HOLDS)})", 0, 0, result=loop.create_future(),
                           turn=loop.create_future())
        self._waiting.append(holder)
        self.turns.note(HOLD, holder.request_id)
        self._grant()
        await self._await_turn(holder)     # a cancelled hold leaves the list

    def unhold(self) -> None:
        """Give back the instance :meth:`hold` took."""
        self._release()

    def _release(self) -> None:
        self._busy = False
        self.turns.note(FREE)
        self._grant()

    def _grant(self) -> None:
        """The instance is free: give the first job still waiting its turn."""
        while not self._busy and self._waiting:
            job = self._waiting.pop(0)
            if not job.turn.done():            # else cancelled while waiting: it removes nothing more
                self._busy = True
                self.turns.note(GRANT, job.request_id)
                job.turn.set_result(None)
            else:
                self.turns.note(LEAVE, job.request_id)


def _started(job: QueuedJob) -> bool:
    """Chosen for a running leader's pack, or served in one: it keeps its place at the head."""
    return job.started_at is not None or job.result.done()
