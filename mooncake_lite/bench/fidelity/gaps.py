"""``bench fidelity``'s measured modelling gaps: what the live run shows that the simulator does not
model, counted from the client's records and the metrics scraped before and after the replay
(HTTP + SSE overhead, the decode step against the exported model, gaps beside a prefill, first
tokens that came packed or together)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from mooncake_lite.bench.fidelity.live import server_tokens
from mooncake_lite.bench.replay.metrics import token_gaps
from mooncake_lite.bench.fidelity.report import Side, rel_error



def delta(before: Mapping[str, float] | None, after: Mapping[str, float] | None, key: str) -> float | None:
    if not after or key not in after:
        return None
    return after[key] - (before or {}).get(key, 0.0)


def measured_gaps(live: Side, records: Sequence, before: Mapping, after: Mapping, hw) -> dict:
    """Two modelling gaps, measured: (1) what HTTP + SSE to the client add to the conductor's own
    TTFT and inter-token gaps (client means − the conductor's histograms over the same run); (2)
    the decode step: live mean gap per step and mean batch (the decodes' step counters) against
    the exported model's step at that batch and the mean context, and the decodes' own mean step
    time (their step clocks), so what lies between steps shows."""
    c = "mooncake_conductor_"
    out: dict[str, float | None] = {}
    n_ttft, s_ttft = delta(before["conductor"], after["conductor"], c + "ttft_seconds_count"), \
        delta(before["conductor"], after["conductor"], c + "ttft_seconds_sum")
    n_itl, s_itl = delta(before["conductor"], after["conductor"], c + "itl_seconds_count"), \
        delta(before["conductor"], after["conductor"], c + "itl_seconds_sum")
    ok = [r for r in records if r.is_ok]
    gaps = [g for r in ok for g in token_gaps(r)]
    client_ttft = statistics.fmean(live.ttft) if live.ttft else None
    client_itl = statistics.fmean(gaps) if gaps else None
    if n_ttft and client_ttft is not None:
        out["conductor_ttft_mean_s"] = s_ttft / n_ttft
        out["http_sse_ttft_overhead_s"] = client_ttft - s_ttft / n_ttft
    if n_itl and client_itl is not None:
        out["conductor_itl_mean_s"] = s_itl / n_itl
        out["http_sse_itl_overhead_s"] = client_itl - s_itl / n_itl
    steps = sum(v for k, v in _deltas(before["decode"], after["decode"]).items() if k.endswith("steps_total"))
    tokens = sum(max(0, (r.output_tokens or len(r.chunk_s)) - 1) for r in ok)
    if steps and client_itl is not None:
        batch = tokens / steps
        ctx = statistics.fmean(server_tokens(r) + (r.output_tokens or 0) / 2 for r in ok)
        out.update(decode_steps=steps, mean_batch=batch, live_itl_mean_s=client_itl,
                   model_step_s=hw.decode.predict(max(1, round(batch)), round(ctx * batch)))
        out["step_model_error"] = rel_error(out["model_step_s"], client_itl)
        # The decodes' own step clocks: what of a gap is the step, what is between steps.
        step_s = sum(v for k, v in _deltas(before["decode"], after["decode"]).items()
                     if k.endswith("step_seconds_total"))
        if step_s:
            out["live_step_mean_s"] = step_s / steps
            out["between_steps_s"] = client_itl - step_s / steps
    out.update(gaps_by_prefill_activity(ok))
    out.update(first_token_shapes(ok))
    out.update(prefill_steal(before.get("prefill") or {}, after.get("prefill") or {}))
    return out


def prefill_steal(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What the hypervisor took while the prefills computed, over the replay: CPU seconds stolen
    per second of forwards (summed over the machine's CPUs). Where it is high a run's speed follows
    it (one Zen 3 run: chunks at 0.05 ran 1.01x their price, at 0.09 1.24x; at 0.02 it explained
    nothing: docs/results/2026-12-01-zen3-admission.md §18), so a figure says the hour it had.
    The prefills' threads' seconds on a CPU and on the run queue per second of forwards say the
    rest: a forward slower with neither more steal nor more waiting ran slower on its CPU."""
    d = _deltas(before, after)
    seconds = sum(v for k, v in d.items() if k.endswith("forward_seconds_total"))
    if seconds <= 0:
        return {}
    totals = {name: [v for k, v in d.items() if k.endswith(f"forward_{name}_seconds_total")]
              for name in ("steal", "cpu", "runqueue")}
    return {f"prefill_{name}_per_forward_s": sum(vs) / seconds for name, vs in totals.items() if vs}


def first_token_shapes(ok: Sequence, within_s: float = 0.05) -> dict[str, float]:
    """Two live behaviours the simulator does not have, counted: requests whose first token
    reached the client within ``within_s`` of another request's (prefill batching packs queued
    prompts into one forward; the simulated prefill runs one at a time), and requests whose
    first two tokens arrived together (until the conductor wrote token 1 at once and the prefill
    answered before decode's END reply, the first was held until the decode's first step: the
    live TTFT included that step and the first gap was ~0)."""
    firsts = sorted(r.chunk_s[0] for r in ok)
    packed = sum(1 for i, t in enumerate(firsts)
                 if (i > 0 and t - firsts[i - 1] <= within_s) or (i + 1 < len(firsts) and firsts[i + 1] - t <= within_s))
    two = [r for r in ok if len(r.chunk_s) > 1]
    together = sum(1 for r in two if r.chunk_s[1] - r.chunk_s[0] <= within_s)
    return {"first_tokens_packed": float(packed), "first_two_tokens_together": float(together),
            "requests_with_two_tokens": float(len(two))}


def gaps_by_prefill_activity(ok: Sequence) -> dict[str, float]:
    """Token gaps split by whether a prefill was in progress (some request sent and without its
    first token: the prefill queue is not empty, so the prefill computes) at the gap's midpoint.
    On one box prefill and decode share the CPU; the simulator's nodes do not interfere."""
    busy = sorted((r.send_s, r.chunk_s[0]) for r in ok)
    during, idle = [], []
    for r in ok:
        for a, gap in zip(r.chunk_s, token_gaps(r)):
            mid = a + gap / 2
            (during if any(s <= mid <= e for s, e in busy) else idle).append(gap)
    out = {"gaps_during_prefill": float(len(during)), "gaps_prefill_idle": float(len(idle))}
    if during and idle:
        out.update(gap_mean_during_prefill_s=statistics.fmean(during), gap_mean_prefill_idle_s=statistics.fmean(idle),
                   gap_ratio_during_vs_idle=statistics.fmean(during) / statistics.fmean(idle))
    return out


def _deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}
