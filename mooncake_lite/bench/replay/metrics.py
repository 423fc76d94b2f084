"""Serving metrics of a replay, computed from recorded timestamps (pure: no IO, no clock).

Names and definitions follow vLLM's ``bench serve`` so numbers compare across servers:

* **TTFT**: send → first streamed chunk.
* **ITL**: every gap between consecutive chunks of a request, pooled over all requests.
* **TPOT**: per request ``(E2EL − TTFT) / (output_tokens − 1)``; requests with one token have none.
* **E2EL**: send → last chunk.
* **goodput**: requests per second that met *every* given SLO (``ttft``, ``tpot``, ``e2el``, ms).

plus **TBT as the Mooncake paper defines it**: per request, the mean of the slowest 10% of its
token gaps (at least one gap), summarized over requests. Percentiles use linear interpolation
(``numpy.percentile``), as vLLM does. All times are seconds in, milliseconds out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from mooncake_lite.common.tbt import paper_tbt

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request. Times are seconds on one monotonic clock."""
    request_id: int
    scheduled_s: float                  # when the trace said to send it (after --speed)
    send_s: float                       # when it was actually sent
    chunk_s: tuple[float, ...] = ()     # arrival of every streamed chunk that carried a choice
    prompt_tokens: int = 0              # tokens we meant to send
    output_tokens: int | None = None    # usage.completion_tokens if reported, else len(chunk_s)
    status: int | None = None           # HTTP status (None: no response at all)
    error: str | None = None
    cached_tokens: int | None = None    # usage.prompt_tokens_details.cached_tokens, if reported
    server_prompt_tokens: int | None = None  # usage.prompt_tokens, if reported (the server's count)
    reused_blocks: int | None = None    # X-Mooncake-Reused-Blocks, if reported
    predicted_ttft_s: float | None = None  # X-Mooncake-Predicted-TTFT: what admission predicted
    predicted_tbt_s: float | None = None   # X-Mooncake-Predicted-TBT
    bound_ttft_s: float | None = None      # X-Mooncake-Bound-TTFT, on a refusal: what admission judged
    slo_s: tuple[float | None, float | None] = (None, None)   # X-Mooncake-SLO-TTFT/-TBT: the limits applied
    num_prompt_blocks: int | None = None  # full trace blocks (scaled) in the synthesized prompt
    completion_id: str | None = None    # X-Request-Id: the conductor's id, which its instances' records name it by
    num_placed: int | None = None       # X-Mooncake-Placed: where it fell in the conductor's order
    extra: Mapping[str, object] = field(default_factory=dict)

    @property
    def is_ok(self) -> bool:
        return self.status == 200 and self.error is None and bool(self.chunk_s)

    @property
    def is_rejected(self) -> bool:
        return self.status == 429


def ttft(r: RequestRecord) -> float:
    return r.chunk_s[0] - r.send_s


def e2el(r: RequestRecord) -> float:
    return r.chunk_s[-1] - r.send_s


def num_output_tokens(r: RequestRecord) -> int:
    return r.output_tokens if r.output_tokens is not None else len(r.chunk_s)


def tpot(r: RequestRecord) -> float | None:
    n = num_output_tokens(r)
    return (e2el(r) - ttft(r)) / (n - 1) if n > 1 else None


def itls(r: RequestRecord) -> list[float]:
    return [b - a for a, b in zip(r.chunk_s, r.chunk_s[1:])]


def token_gaps(record: RequestRecord) -> list[float]:
    """The gaps between a request's tokens as the client got them. The stream's last chunk
    carries only the finish reason, right after the last token: ``itls`` counts that 0 s gap
    too, which the simulator has no twin of — 32 gaps for 31, a mean gap
    3% low, and the slowest tenth of a different count whenever the real count ends in 9."""
    gaps = itls(record)
    return gaps[: record.output_tokens - 1] if record.output_tokens else gaps


def summarize_ms(values_s: Sequence[float], name: str) -> dict[str, float | None]:
    """``mean_/median_/std_/p90_/p99_{name}_ms``; None when there are no values."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"] + \
           [f"p{p}_{name}_ms" for p in PERCENTILES if p != 50]
    if not values_s:
        return dict.fromkeys(keys)
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    out.update({f"p{p}_{name}_ms": float(np.percentile(arr, p)) for p in PERCENTILES if p != 50})
    return out


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` → ``{"ttft": 0.5, "tpot": 0.05}`` (seconds)."""
    slos = {}
    for item in items:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput {item!r}: expected METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput {item!r}: the SLO must be a positive number of milliseconds")
        slos[name] = ms / 1000.0
    return slos


def meets_slos(r: RequestRecord, slos: Mapping[str, float]) -> bool:
    """A request that finished and stayed within every SLO (a missing TPOT counts as 0, as in vLLM)."""
    if not r.is_ok:
        return False
    observed = {"ttft": ttft(r), "tpot": tpot(r) or 0.0, "e2el": e2el(r)}
    return all(observed[name] <= limit for name, limit in slos.items())


def compute_metrics(records: Sequence[RequestRecord], duration_s: float,
                    slos: Mapping[str, float] | None = None) -> dict[str, float | int | None]:
    """All summary figures of a run lasting ``duration_s`` seconds."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in records if r.is_ok]
    out_tokens = sum(num_output_tokens(r) for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    result: dict[str, float | int | None] = {
        "num_requests": len(records), "completed": len(ok),
        "num_rejected_429": sum(r.is_rejected for r in records),
        "num_failed": sum(not r.is_ok and not r.is_rejected for r in records),
        "duration_s": duration_s, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s, "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
    }
    if slos:
        result["request_goodput"] = sum(meets_slos(r, slos) for r in ok) / duration_s
    result.update(summarize_ms([ttft(r) for r in ok], "ttft"))
    result.update(summarize_ms([t for r in ok if (t := tpot(r)) is not None], "tpot"))
    result.update(summarize_ms([g for r in ok for g in itls(r)], "itl"))
    result.update(summarize_ms([e2el(r) for r in ok], "e2el"))
    result.update(summarize_ms([t for r in ok if (t := paper_tbt(itls(r))) is not None], "tbt"))
    return result


def prefix_hit_request_share(records: Sequence[RequestRecord]) -> float | None:
    """Share of finished requests the server says reused a cached prefix (``X-Mooncake-Reused-Blocks``
    > 0), when it says so at all. Unit-free: the header counts the *server's* blocks, whose size
    the client does not know."""
    told = [r.reused_blocks for r in records if r.is_ok and r.reused_blocks is not None]
    return sum(1 for n in told if n > 0) / len(told) if told else None


def cached_token_hit_rate(records: Sequence[RequestRecord]) -> dict[str, float | int | None]:
    """The prefix hit rate the server measured: prompt tokens it served from cache
    (``usage.prompt_tokens_details.cached_tokens``; mooncake-lite: the tokens prefill really
    reused) over the prompt tokens of the same finished requests (``usage.prompt_tokens``, else
    the tokens we sent). Only requests that report ``cached_tokens`` count; None when none do."""
    told = [r for r in records if r.is_ok and r.cached_tokens is not None]
    cached = sum(r.cached_tokens for r in told)
    prompt = sum(r.server_prompt_tokens if r.server_prompt_tokens is not None else r.prompt_tokens for r in told)
    return {"cached_token_hit_rate": cached / prompt if prompt > 0 else None,
            "cached_tokens": cached, "cached_of_prompt_tokens": prompt,
            "requests_reporting_cached_tokens": len(told),
            "requests_with_cached_tokens": (sum(r.cached_tokens > 0 for r in told) / len(told)) if told else None}


def prediction_errors(records: Sequence[RequestRecord], first: int = 50) -> dict[str, dict[str, float | int | None]]:
    """How far the server's predictions (``X-Mooncake-Predicted-*``, made at admission) were from
    what this client measured, per metric over the finished requests that carried one
    (:func:`error_figures`, in the order they were sent). The client's TTFT also holds the HTTP
    and tokenizing the prediction does not."""
    in_order = sorted(records, key=lambda r: (r.send_s, r.request_id))
    return {name: error_figures([m / p for r in in_order if r.is_ok and (p := predicted(r)) and
                                 (m := measure(r)) is not None], first)
            for name, measure, predicted in (("ttft", ttft, lambda r: r.predicted_ttft_s),
                                             ("tbt", lambda r: paper_tbt(itls(r)), lambda r: r.predicted_tbt_s))}


def error_figures(ratios: Sequence[float], first: int = 50) -> dict[str, float | int | None]:
    """Measured / predicted ``ratios``, in the order the requests were sent: how many, the median
    and p90 of |ratio − 1|, the median ratio (> 1: the prediction was optimistic);
    ``first_median_error``: the median error of the ``first`` of them (issue #36: the online
    correction must hold ≤ 15% within 50 requests of a change), and ``by_tens``: the median error
    of each ten (how it converged)."""
    if not ratios:
        return {"count": 0, "median_error": None, "p90_error": None, "median_ratio": None,
                "first_median_error": None, "by_tens": []}
    errors = [abs(x - 1.0) for x in ratios]
    return {"count": len(ratios), "median_error": float(np.percentile(errors, 50)),
            "p90_error": float(np.percentile(errors, 90)), "median_ratio": float(np.median(ratios)),
            "first": min(first, len(errors)), "first_median_error": float(np.median(errors[:first])),
            "by_tens": [round(float(np.median(errors[i:i + 10])), 4) for i in range(0, len(errors), 10)]}
