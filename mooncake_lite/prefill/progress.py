"""How far the job a prefill runs alone has got, chunk by chunk: what its heartbeat reports
(``RunningPrefill``), priced by ``scheduler/progress.py``'s rule. A packed forward is one
forward: nothing to report before it ends."""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_lite.common.protocol import MAX_ID_CHARS, MAX_LEFT_S, RunningPrefill
from mooncake_lite.scheduler.costs import PrefillCostModel
from mooncake_lite.scheduler.progress import seconds_left


@dataclass
class ChunkProgress:
    """One request's chunks: its prompt, the uncached tokens computed so far and the seconds
    they took, and when the chunk in flight started (``since``, on ``time.perf_counter``)."""

    request_id: str
    num_tokens: int
    prefix_tokens: int
    done_tokens: int = 0
    done_s: float = 0.0
    since: float = 0.0
    chunks: int = 0

    def chunk_done(self, tokens: int, now: float) -> float:
        """Count a chunk of ``tokens`` ended ``now``; the seconds it ran."""
        took = now - self.since
        self.done_tokens += tokens
        self.done_s += took
        self.since = now
        self.chunks += 1
        return took

    def report(self, model: PrefillCostModel, now: float, later: float | None = None) -> RunningPrefill | None:
        """What the heartbeat says of it (None: an id the wire does not carry, from a client of
        this instance's own API; the conductor's are short). ``later``: how the instance's later
        chunks ran lately (``LaterChunks.ratio``), the price of the rest while only the first is done."""
        if len(self.request_id) > MAX_ID_CHARS:
            return None
        left = seconds_left(model, self.num_tokens, self.prefix_tokens, self.done_tokens, self.done_s,
                            now - self.since, later if self.chunks == 1 else None)
        return RunningPrefill(self.request_id, min(left, MAX_LEFT_S))
