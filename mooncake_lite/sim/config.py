"""What to simulate: cluster shape, hardware, stores, scheduler policy, seed."""

from __future__ import annotations

from dataclasses import dataclass, field

from mooncake_lite.scheduler.config import SchedulerConfig
from mooncake_lite.sim.request import MaxTokensPolicy
from mooncake_lite.store.eviction import POLICY_NAMES

DECODE_CHECKS = ("reserve", "arrival")


@dataclass(frozen=True)
class SimConfig:
    """A Mooncake cluster of ``num_prefill`` prefill instances (each a CPP group of
    ``cpp_group_size`` nodes) and ``num_decode`` decode instances, one node each.

    local_ttft_check:
        with admission ``none``, a prefill instance still refuses a request whose predicted TTFT
        is over the SLO when it arrives (the paper's Table 3 "baseline": each stage checks only
        its own SLO, when the request reaches it). Off = nothing is ever refused for TTFT.

    The conductor's decode snapshot holds each decode's running batch plus, as ``incoming``,
    the requests dispatched there whose KV has not arrived yet (the scheduler core's contract).

    No oracle: the conductor and the decodes know a request's ``max_tokens`` (what the client
    sends, by ``max_tokens_policy``: ``output`` or ``cap:N``, see ``sim/request.MaxTokensPolicy``)
    and, with ``predict_output``, the output length ``scheduler/predict.py`` expects from what
    has finished before (else max_tokens sizes t_d); the true output length only ends a request.

    decode_check:
        ``reserve`` — as the live decode: at dispatch, before the prefill, room for prompt +
        max_tokens beside everything the decode holds and the TBT with what still decodes when
        the KV is due (``scheduler/admission.held_load_at``); a refusal costs no prefill.
        ``arrival`` — the paper's local scheduler: when the KV arrives, on the running batch; a
        refusal wastes the prefill.

    The SLOs are the scheduler's: absolute (``scheduler.ttft_slo_s``/``tbt_slo_s``, the paper's
    tables) or, where None, relative as the live conductor's defaults (factor × the request alone
    by the instance's cost model, ``scheduler/admission.slo_limits``); every check reads them so.
    """

    num_prefill: int = 8
    num_decode: int = 8
    cpp_group_size: int = 1
    prefill_chunk: int = 8192
    # Prompts over prefill_chunk run, and are priced, chunk by chunk, as the live role's (a model
    # fitted per chunk: Hardware.with_prefill_chunk); off: in one pass, as the paper presets' fits.
    prefill_chunked: bool = False
    # Prefill batching, as the role's --prefill-batch-tokens (capped at prefill_chunk): a single-node
    # prefill instance packs queued prompts by scheduler.costs.pack_sizes; 0: one prompt at a time.
    prefill_batch_tokens: int = 0
    # The prefill queue's order, as the role's --queue-order shortest --queue-overtakes K: shortest
    # uncached prompt first, at most K later arrivals passing any one (scheduler/queue_order.py);
    # 0: FIFO, which the paper presets keep.
    prefill_queue_overtakes: int = 0
    # The live conductor's online correction (issue #36), fed by the simulated requests
    # (sim/correcting.py): prefill compute factors and overtake shares, decode factors and tails.
    # Off: the paper presets'.
    correct: bool = False
    # A burst decided together, as the conductor's --burst-window: requests arriving within this
    # many seconds of the first, while every prefill has a job, are placed shortest uncached
    # first (scheduler/arrivals.py); 0: each at its arrival.
    burst_window_s: float = 0.0
    hardware: str = "llama2-70b-a800"
    # None: the hardware's (a live store's, from its profile), else lru, the DRAM's worth, no SSD tier
    eviction: str | None = None
    store_blocks_per_node: int | None = None
    ssd_blocks_per_node: int | None = None       # 0 = no SSD tier
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    local_ttft_check: bool = False
    decode_max_batch: int | None = None
    sample_interval_s: float = 5.0
    seed: int = 0
    max_tokens_policy: str = "output"
    predict_output: bool = False
    decode_check: str = "reserve"

    def __post_init__(self) -> None:
        MaxTokensPolicy.parse(self.max_tokens_policy)   # raises ValueError naming the bad value
        if self.decode_check not in DECODE_CHECKS:
            raise ValueError(f"decode_check must be one of {', '.join(DECODE_CHECKS)}, got {self.decode_check!r}")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("need at least one prefill and one decode instance")
        if self.cpp_group_size < 1 or self.prefill_chunk < 1:
            raise ValueError("cpp_group_size and prefill_chunk must be >= 1")
        if self.prefill_batch_tokens < 0:
            raise ValueError("prefill_batch_tokens must be >= 0")
        if self.prefill_queue_overtakes < 0:
            raise ValueError("prefill_queue_overtakes must be >= 0")
        if not 0 <= self.burst_window_s < float("inf"):
            raise ValueError(f"burst_window_s must be >= 0 seconds, got {self.burst_window_s}")
        if self.eviction is not None and self.eviction not in POLICY_NAMES:
            raise ValueError(f"eviction must be one of {', '.join(POLICY_NAMES)}, got {self.eviction!r}")
        if self.store_blocks_per_node is not None and self.store_blocks_per_node < 0:
            raise ValueError("store_blocks_per_node must be >= 0")
        if self.ssd_blocks_per_node is not None and self.ssd_blocks_per_node < 0:
            raise ValueError("ssd_blocks_per_node must be >= 0")
        if self.sample_interval_s <= 0:
            raise ValueError("sample_interval_s must be positive")


@dataclass(frozen=True)
class ColocatedConfig:
    """The vLLM-style baseline: ``num_instances`` instances each doing prefill and decode with
    continuous batching, prefix caching local to the instance (in GPU memory), and prefill
    steps that stall the running decode batch (prefill-priority scheduling as in vLLM v0)."""

    num_instances: int = 16
    hardware: str = "llama2-70b-a800"
    eviction: str = "lru"
    routing: str = "cache-aware"
    max_batch: int | None = None
    chunked_prefill_tokens: int | None = None   # None = vLLM v0 (whole prompt, decode stalls)
    sample_interval_s: float = 5.0
    ttft_slo_s: float = 30.0     # only to normalise the load timeline; the baseline never rejects
    tbt_slo_s: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_instances < 1:
            raise ValueError("need at least one instance")
        if self.chunked_prefill_tokens is not None and self.chunked_prefill_tokens < 1:
            raise ValueError("chunked_prefill_tokens must be >= 1 (or None)")
        if self.routing not in ("cache-aware", "load-balance", "random"):
            raise ValueError(f"routing must be cache-aware, load-balance or random, got {self.routing!r}")
        if self.eviction not in POLICY_NAMES:
            raise ValueError(f"eviction must be one of {', '.join(POLICY_NAMES)}, got {self.eviction!r}")
