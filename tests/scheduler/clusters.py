"""Small hand-built clusters with round numbers, so tests can state the expected times.

Block size 10 tokens. Prefill costs 1 ms per new token; fetching KV costs 0.1 ms per token
(1 byte per token at 10 kB/s); a decode step costs 10 ms + 10 ms per request in the batch.
"""

from __future__ import annotations

from mooncake_lite.scheduler import (BlockIndex, ClusterState, CostModels, DecodeCostModel,
                                     DecodeInstanceState, DecodingRequest, IncomingRequest,
                                     PrefillCostModel,
                                     PrefillInstanceState, QueuedPrefill, ScheduleRequest,
                                     SchedulerConfig)

BS = 10
COSTS = CostModels(prefill=PrefillCostModel(c1=1e-3), decode=DecodeCostModel(c0=0.01, c1=0.01),
                   kv_bytes_per_token=1, bandwidth_bytes_per_s=10_000)


def cfg(**kw) -> SchedulerConfig:
    base = dict(strategy="kvcache-centric", admission="early", ttft_slo_s=1.0, tbt_slo_s=0.1,
                kvcache_balancing_threshold=1.5, block_size=BS)
    base.update(kw)
    return SchedulerConfig(**base)


def request(num_blocks: int = 10, rid: str = "r", max_output_tokens: int = 16) -> ScheduleRequest:
    """A request whose keys are 0..num_blocks-1 and whose prompt is exactly num_blocks blocks."""
    return ScheduleRequest(rid, tuple(range(num_blocks)), num_blocks * BS, max_output_tokens)


def queued(*num_tokens: int, tag: str = "q") -> tuple[QueuedPrefill, ...]:
    """Queued jobs with no cached prefix (1 ms per token each), ids ``{tag}{i}``."""
    return tuple(QueuedPrefill(f"{tag}{i}", n) for i, n in enumerate(num_tokens))


def bound(*jobs: QueuedPrefill) -> tuple[IncomingRequest, ...]:
    """The decode side of queued jobs committed to a decode instance (``decode(incoming=...)``)."""
    return tuple(IncomingRequest(j.request_id, j.num_tokens) for j in jobs)


def prefill(name: str, queue=(), **kw) -> PrefillInstanceState:
    return PrefillInstanceState(name, store_id=f"s-{name}", queue=tuple(queue), **kw)


def decode(name: str, batch: int = 0, context_each: int = 100, joined_at: float = 0.0,
           **kw) -> DecodeInstanceState:
    running = tuple(DecodingRequest(f"{name}-{i}", context_each, joined_at) for i in range(batch))
    return DecodeInstanceState(name, running=running, **kw)


def cluster(prefills, decodes=None) -> ClusterState:
    return ClusterState(tuple(prefills), tuple(decodes if decodes is not None else [decode("d0")]))


def index(**held: int) -> BlockIndex:
    """index(p0=8) = prefill p0's store holds the first 8 request keys."""
    idx = BlockIndex()
    for name, n in held.items():
        idx.add(f"s-{name}", range(n))
    return idx
