"""Summary figures of a trace (docs/paper.md §6): size, lengths, arrival rate and reuse."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from mooncake_lite.trace.format import TRACE_BLOCK_SIZE, TraceRequest


@dataclass(frozen=True)
class TraceStats:
    num_requests: int
    duration_s: float
    request_rate_per_s: float
    input_avg: float
    input_median: float
    input_p90: float
    input_max: int
    output_avg: float
    output_median: float
    output_max: int
    num_block_refs: int
    num_unique_blocks: int
    block_reuse_share: float     # block references that repeat an earlier block (infinite cache)
    token_reuse_share: float     # input tokens covered by an already-seen prefix (infinite cache)
    most_shared_block: int | None
    most_shared_block_share: float  # share of requests that reference the most shared block
    max_block_refs: int

    def to_dict(self) -> dict:
        return asdict(self)


def _median(sorted_vals: Sequence[float]) -> float:
    n = len(sorted_vals)
    mid = n // 2
    return float(sorted_vals[mid]) if n % 2 else (sorted_vals[mid - 1] + sorted_vals[mid]) / 2


def _quantile(sorted_vals: Sequence[float], q: float) -> float:
    """Nearest-rank quantile: the smallest value with at least q of the values at or below it."""
    idx = min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))
    return float(sorted_vals[idx])


def prefix_hit_blocks(hash_ids: Sequence[int], seen: set[int]) -> int:
    """How many leading blocks are already cached. Ids encode their prefix, so the walk stops at
    the first miss (a later "hit" after a miss cannot happen for chained ids)."""
    k = 0
    for h in hash_ids:
        if h not in seen:
            break
        k += 1
    return k


def compute_stats(requests: Sequence[TraceRequest], block_size: int = TRACE_BLOCK_SIZE) -> TraceStats:
    """Figures of a trace; reuse assumes an infinite cache holding every block seen before."""
    if not requests:
        raise ValueError("empty trace")
    ins = sorted(r.input_length for r in requests)
    outs = sorted(r.output_length for r in requests)
    t0 = min(r.timestamp_ms for r in requests)
    duration = (max(r.timestamp_ms for r in requests) - t0) / 1000.0
    seen: set[int] = set()
    refs = repeats = hit_tokens = 0
    usage: Counter[int] = Counter()
    for req in sorted(requests, key=lambda r: r.timestamp_ms):
        ids = req.hash_ids
        k = prefix_hit_blocks(ids, seen)
        hit_tokens += min(k * block_size, req.input_length)
        repeats += sum(1 for h in ids if h in seen)
        refs += len(ids)
        seen.update(ids)
        usage.update(set(ids))
    top, top_count = usage.most_common(1)[0] if usage else (None, 0)
    n = len(requests)
    return TraceStats(
        num_requests=n, duration_s=duration,
        request_rate_per_s=(n - 1) / duration if duration > 0 else float("inf"),
        input_avg=sum(ins) / n, input_median=_median(ins), input_p90=_quantile(ins, 0.9),
        input_max=ins[-1], output_avg=sum(outs) / n, output_median=_median(outs), output_max=outs[-1],
        num_block_refs=refs, num_unique_blocks=len(seen),
        block_reuse_share=repeats / refs if refs else 0.0,
        token_reuse_share=hit_tokens / sum(ins),
        most_shared_block=top, most_shared_block_share=top_count / n, max_block_refs=top_count,
    )


def format_stats(stats: TraceStats) -> str:
    """A human-readable block of text, one figure a line."""
    s = stats
    lines = [
        f"requests            {s.num_requests:,}",
        f"duration            {s.duration_s / 60:.2f} min ({s.duration_s:.1f} s)",
        f"arrival rate        {s.request_rate_per_s:.2f} req/s",
        f"input tokens        avg {s.input_avg:,.0f}  median {s.input_median:,.0f}  "
        f"p90 {s.input_p90:,.0f}  max {s.input_max:,}",
        f"output tokens       avg {s.output_avg:,.0f}  median {s.output_median:,.0f}  max {s.output_max:,}",
        f"block references    {s.num_block_refs:,} ({s.num_unique_blocks:,} unique blocks)",
        f"block reuse         {s.block_reuse_share:.1%} of block references repeat an earlier block",
        f"token reuse         {s.token_reuse_share:.1%} of input tokens hit a cached prefix (infinite cache)",
        f"most shared block   id {s.most_shared_block} in {s.most_shared_block_share:.1%} of requests",
    ]
    return "\n".join(lines)
