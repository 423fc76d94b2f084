"""Policy knobs of the scheduling core (SLOs, strategy, admission), validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mooncake_lite.common.config import require

Strategy = Literal["random", "load-balance", "cache-aware", "kvcache-centric"]
Admission = Literal["none", "early", "predictive"]

STRATEGIES: tuple[str, ...] = ("random", "load-balance", "cache-aware", "kvcache-centric")
ADMISSIONS: tuple[str, ...] = ("none", "early", "predictive")


@dataclass(frozen=True)
class SchedulerConfig:
    """How the conductor picks instances and when it rejects.

    strategy:
        ``random``          seeded random prefill and decode instance (local cache still reused);
        ``load-balance``    prefill with the smallest queue + cache-blind execution time;
        ``cache-aware``     prefill with the smallest queue + execution given its *local* prefix;
        ``kvcache-centric`` Algorithm 1 (docs/paper.md §2): may fetch the best prefix from another
                            store and asks the caller to replicate it (hot-spot migration).
    admission:
        ``none``        never reject here (the decode instance may still refuse after prefill);
        ``early``       reject at arrival if TTFT > SLO or the decode TBT *now* > SLO;
        ``predictive``  reject if TTFT > SLO or the decode TBT predicted for the moment this
                        request would finish prefill > SLO (docs/paper.md §3).
    kvcache_balancing_threshold:
        ratio ``best_len / p.prefix_len`` at or above which instance ``p`` is costed with the
        best global prefix fetched to it (Algorithm 1 line "if best_len / p.prefix_len < t").
    uniform_decode_s:
        the t_d of §3: every decoding request is assumed to leave the batch t_d seconds after it
        joined. ``None`` estimates it per request as max_output_tokens × the instance's current TBT.
    ttft_slo_s, tbt_slo_s, ttft_slo_factor, tbt_slo_factor:
        the SLOs admission checks, per metric either **absolute** (``ttft_slo_s``/``tbt_slo_s``
        in seconds: FAST'25's TTFT ≤ 30 s, TBT ≤ 100–300 ms) or, when that is ``None``,
        **relative** to the request's own latency without interference (docs/paper.md §4,
        arXiv: TTFT ≤ 10×, TBT ≤ 5×): TTFT ≤ ``ttft_slo_factor`` × the chosen prefill
        instance's predicted execution of the whole prompt alone (no queue, no cached prefix),
        TBT ≤ ``tbt_slo_factor`` × the chosen decode instance's predicted step for this request
        alone (batch 1, context = its prompt), each by that instance's own cost model. An
        absolute SLO given for a metric replaces its factor (they never combine). A factor is
        ≥ 1, so a request alone on an idle instance always meets its relative SLO. The
        dataclass defaults are the paper's absolute SLOs, which the simulator reproduces; the
        live conductor passes ``None`` for both unless ``--ttft-slo``/``--tbt-slo`` are given.
    ttft_admit_margin:
        admission refuses on TTFT only when the bound it judges is over the SLO by more than this
        share of it (0, the default: at the SLO). Over twelve live runs on Zen 3, 33 of the 52
        requests refused at 1-1.1x their SLO would have met it, each judged alone; admitted
        together they did not: live with 0.1 (`--ttft-admit-margin`), the admitted met their SLO
        90.6% of the time where the pair beside it at 0 met 96.5%, and it refused more (108
        against 86), a burst's borderline admissions delaying the bursts after them
        (docs/results/2026-12-01-zen3-admission.md §13); on the central prediction 0.05 met 93.1%
        where the same code at 0 met 96.8% within the hour (§15). A knob for who would rather admit.
    """

    strategy: Strategy = "kvcache-centric"
    admission: Admission = "early"
    ttft_slo_s: float | None = 30.0
    tbt_slo_s: float | None = 0.2
    kvcache_balancing_threshold: float = 1.5
    block_size: int = 512
    uniform_decode_s: float | None = None
    ttft_slo_factor: float = 10.0
    tbt_slo_factor: float = 5.0
    ttft_admit_margin: float = 0.0

    def __post_init__(self) -> None:
        require(self.strategy in STRATEGIES,
                f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        require(self.admission in ADMISSIONS,
                f"admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}")
        require(self.ttft_slo_s is None or self.ttft_slo_s > 0,
                f"ttft_slo_s must be positive (or None: relative), got {self.ttft_slo_s}")
        require(self.tbt_slo_s is None or self.tbt_slo_s > 0,
                f"tbt_slo_s must be positive (or None: relative), got {self.tbt_slo_s}")
        # >= 1: a relative SLO below the latency of the request alone would refuse an idle cluster.
        require(self.ttft_slo_factor >= 1.0, f"ttft_slo_factor must be >= 1, got {self.ttft_slo_factor}")
        require(self.tbt_slo_factor >= 1.0, f"tbt_slo_factor must be >= 1, got {self.tbt_slo_factor}")
        require(0.0 <= self.ttft_admit_margin < 1.0,
                f"ttft_admit_margin must be in [0, 1), got {self.ttft_admit_margin}")
        require(self.kvcache_balancing_threshold >= 1.0,
                f"kvcache_balancing_threshold is a ratio >= 1, got {self.kvcache_balancing_threshold}")
        require(self.block_size > 0, f"block_size must be positive, got {self.block_size}")
        require(self.uniform_decode_s is None or self.uniform_decode_s > 0,
                f"uniform_decode_s must be positive, got {self.uniform_decode_s}")
