"""The paper's published figures the reproductions are printed next to (docs/paper.md §3–4)."""

from __future__ import annotations

# Table 1 (arXiv paper): block hit rate on *its* trace, capacity in 512-token blocks.
TABLE1 = {
    "lru": {None: 0.51, 100_000: 0.51, 50_000: 0.50, 30_000: 0.48, 10_000: 0.40, 1_000: 0.30},
    "lfu": {None: 0.51, 100_000: 0.51, 50_000: 0.49, 30_000: 0.43, 10_000: 0.35, 1_000: 0.30},
    "length-aware": {None: 0.51, 100_000: 0.50, 50_000: 0.48, 30_000: 0.42, 10_000: 0.35, 1_000: 0.30},
}

# Table 3: rejected requests, 8P+8D, ~23k real requests replayed at 2x.
TABLE3 = {"none": 4183, "early": 3771, "predictive": 3589}
TABLE3_REQUESTS = 23_000

# FAST'25 Fig. 5: average TTFT (s) by prefill scheduler on the conversation trace.
STRATEGY_TTFT = {"random": 19.65, "load-balance": 5.27, "cache-aware": 3.58, "kvcache-centric": 3.07}

# FAST'25: effective request capacity gain over colocated vLLM at TBT thresholds (TTFT <= 30 s).
CAPACITY_GAIN = {0.1: 4.98, 0.2: 1.57, 0.3: 0.59}


def capacity_label(tbt_s: float) -> str:
    return f"TBT<={tbt_s * 1e3:.0f}ms"
