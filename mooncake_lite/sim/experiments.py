"""The paper reproductions, one function each. Every function returns a JSON-ready dict with
``rows`` (simulated next to paper), ``table`` (terminal text), ``notes`` and ``plots``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mooncake_lite.scheduler import SchedulerConfig
from mooncake_lite.sim import paper, plots
from mooncake_lite.sim.capacity import ProbeCache, find_capacity
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.colocated import ColocatedSim
from mooncake_lite.sim.config import ColocatedConfig, SimConfig
from mooncake_lite.sim.hitrate import PAPER_CAPACITIES, PAPER_POLICIES, hit_rate_table
from mooncake_lite.sim.metrics import summarize
from mooncake_lite.sim.runner import run_with_progress
from mooncake_lite.trace.format import TraceRequest, scale_time

Tick = Callable[[str], None]   # reports progress of the whole reproduction ("what just ran")

TTFT_SLO_S = 30.0
TBT_SLO_S = 0.1     # the paper's real-workload TBT threshold (FAST'25 §6.3 / arXiv Fig. 13)


def _cap(c: int | None) -> str:
    return "Inf" if c is None else f"{c // 1000}k"


def table1(trace: Sequence[TraceRequest], out: Path, tick: Tick) -> dict[str, Any]:
    cells = hit_rate_table(trace, PAPER_POLICIES, PAPER_CAPACITIES, progress=lambda: tick("table1 cell"))
    rows = [{"policy": h.policy, "capacity": _cap(h.capacity_blocks), "block_hit_rate": h.block_hit_rate,
             "token_hit_rate": h.token_hit_rate, "paper": paper.TABLE1[h.policy][h.capacity_blocks]}
            for h in cells]
    lines = ["Table 1 - block hit rate (sim block / sim token-weighted / paper on the arXiv trace)",
             f"{'policy':<14}" + "".join(f"{_cap(c):>19}" for c in PAPER_CAPACITIES)]
    for policy in PAPER_POLICIES:
        mine = [r for r in rows if r["policy"] == policy]
        lines.append(f"{policy:<14}" + "".join(
            f"{r['block_hit_rate']:>7.2f}/{r['token_hit_rate']:.2f}/{r['paper']:.2f}" for r in mine))
    return {"rows": rows, "table": "\n".join(lines),
            "plots": [plots.hitrate_plot(rows, out / "table1_hit_rate.png")]}


def _mooncake(scheduler: SchedulerConfig, seed: int, **kw: Any) -> MooncakeSim:
    return MooncakeSim(SimConfig(scheduler=scheduler, seed=seed, **kw))


# (admission, predicted output lengths?) per Table 3 column: predictive admission sizes t_d with
# the client's max_tokens, or with scheduler/predict.py's prediction.
TABLE3_COLUMNS = (("none", False), ("early", False), ("predictive", False), ("predictive", True))


def _column(admission: str, predict: bool) -> str:
    return admission + ("+predictor" if predict else "")


def table3(trace: Sequence[TraceRequest], out: Path, tick: Tick, seed: int, speed: float = 2.0,
           tbt_slo_s: float = TBT_SLO_S, decode_bound_tbt_s: float | None = 0.06,
           policies: Sequence[str] = ("output", "cap:4096"), decode_check: str = "reserve") -> dict[str, Any]:
    """Rejections by admission policy, 8P+8D at ``speed``; again with a TBT SLO tight enough to
    make the decode pool the bottleneck, which is where the policies differ most. Each under
    every max_tokens policy (what clients send), with the decode's own check where
    ``decode_check`` says."""
    fast = scale_time(trace, speed)
    rows, runs = [], {}
    variants = [("paper SLOs", tbt_slo_s, 8)]
    if decode_bound_tbt_s:
        # 8P+4D overloads the decode pool as a whole, the situation of the paper's Fig. 9/10.
        variants += [("decode-bound", decode_bound_tbt_s, 8),
                     ("decode-bound, 8P+4D", decode_bound_tbt_s, 4)]
    for variant, tbt, num_decode in variants:
        for policy in policies:
            for admission, predict in TABLE3_COLUMNS:
                sc = SchedulerConfig(admission=admission, ttft_slo_s=TTFT_SLO_S, tbt_slo_s=tbt)
                sim = _mooncake(sc, seed, local_ttft_check=admission == "none", sample_interval_s=5.0,
                                num_decode=num_decode, max_tokens_policy=policy, predict_output=predict,
                                decode_check=decode_check)
                name = f"{variant} {policy} {_column(admission, predict)}"
                res = run_with_progress(sim, fast, f"table3 {name}")
                tick(f"table3 {name}")
                rows.append(_table3_row(res, fast[-1].arrival_s, variant, num_decode, tbt, policy, admission,
                                        predict))
                runs[f"{variant} (TBT {tbt * 1e3:.0f} ms), max_tokens {policy}: {_column(admission, predict)}"] = res
    plot_paths = [plots.load_plot({k: v for k, v in runs.items() if k.startswith(f"{variant} (") and
                                   k.split("max_tokens ")[1].startswith(policy + ":")},
                                  out / f"table3_load_{i}_{policy.replace(':', '')}.png",
                                  title=f"prefill/decode load over time, {variant}, max_tokens {policy}")
                  for i, (variant, *_) in enumerate(variants) for policy in policies]
    last = variants[-1][0]   # the most overloaded variant: who refuses, early vs predictive
    plot_paths += [plots.refusals_plot({k: v for k, v in runs.items() if k.startswith(f"{last} (") and
                                        k.split("max_tokens ")[1].startswith(policy + ":") and ": none" not in k},
                                       out / f"table3_refusals_{policy.replace(':', '')}.png",
                                       title=f"who refuses, {last}, max_tokens {policy}")
                   for policy in policies]
    return {"rows": rows, "table": _table3_text(rows, speed, len(trace)), "plots": plot_paths}


def _table3_row(res: Any, last_arrival_s: float, variant: str, num_decode: int, tbt: float, policy: str,
                admission: str, predict: bool) -> dict[str, Any]:
    s = summarize(res, TTFT_SLO_S, tbt)
    loads = [r["decode_load"] for r in res.timeline if r["t"] <= last_arrival_s]   # not the drain
    mean = sum(loads) / len(loads) if loads else 0.0
    return {"variant": variant, "num_decode": num_decode, "tbt_slo_s": tbt, "max_tokens_policy": policy,
            "admission": admission, "output_prediction": predict,
            "rejected": s["rejected"], "rejected_by": s["rejected_by"],
            "wasted_prefills": s["wasted_prefills"], "completed": s["completed"],
            "slo_attainment": s["slo_attainment"], "goodput": round(s["slo_attainment"] * len(res.requests)),
            "ttft_mean_s": s["ttft_s"]["mean"], "decode_load_mean": mean,
            "decode_load_sd": (sum((x - mean) ** 2 for x in loads) / len(loads)) ** 0.5 if loads else 0.0,
            "t_d_error": res.extra.get("output_prediction"),
            "paper_rejected": paper.TABLE3[admission] if variant == "paper SLOs" and not predict else None}


def _table3_text(rows: Sequence[dict[str, Any]], speed: float, n: int) -> str:
    lines = [f"Table 3 - rejected requests, 8P+8D unless noted, {speed:g}x replay of {n:,} requests "
             f"(paper: ~{paper.TABLE3_REQUESTS:,} requests); goodput = requests within both SLOs",
             f"{'variant':<22}{'max_tokens':<11}{'admission':<22}{'rejected':>9}{'share':>7}{'wasted':>7}"
             f"{'goodput':>8}{'t_d MAE':>8}{'paper':>7}"]
    for r in rows:
        p = r["paper_rejected"]
        err = r["t_d_error"]["mae_tokens"] if r["t_d_error"] else float("nan")
        lines.append(f"{r['variant']:<22}{r['max_tokens_policy']:<11}{_column(r['admission'], r['output_prediction']):<22}"
                     f"{r['rejected']:>9,}{r['rejected'] / n:>7.1%}{r['wasted_prefills']:>7,}{r['goodput']:>8,}"
                     f"{err:>8.0f}{p if p else '-':>7}")
    return "\n".join(lines)


def strategies(trace: Sequence[TraceRequest], out: Path, tick: Tick, seed: int,
               speeds: Sequence[float] = (1.0, 0.5)) -> dict[str, Any]:
    """Average TTFT by prefill scheduling strategy (no rejection, so TTFT shows everything), at
    the trace's own rate and at a lighter load."""
    rows, runs = [], {}
    for speed in speeds:
        scaled = scale_time(trace, speed)
        for strategy in ("random", "load-balance", "cache-aware", "kvcache-centric"):
            sc = SchedulerConfig(strategy=strategy, admission="none", ttft_slo_s=TTFT_SLO_S, tbt_slo_s=1e3)
            res = run_with_progress(_mooncake(sc, seed), scaled, f"strategy {strategy} {speed:g}x")
            tick(f"strategy {strategy}")
            s = summarize(res, TTFT_SLO_S, TBT_SLO_S)
            ok = sum(1 for r in res.requests if r.ttft is not None and r.ttft <= TTFT_SLO_S) / len(trace)
            rows.append({"speed": speed, "strategy": strategy, "ttft_mean_s": s["ttft_s"]["mean"],
                         "ttft_p90_s": s["ttft_s"]["p90"], "ttft_slo_attainment": ok,
                         "reused_token_share": s["reused_token_share"], "migrations": res.counters["migrations"],
                         "paper_ttft_mean_s": paper.STRATEGY_TTFT[strategy]})
            if speed == speeds[0]:
                runs[strategy] = res
    lines = ["TTFT by prefill strategy - 8P+8D, no rejection (paper: FAST'25 Fig. 5)",
             f"{'speed':<7}{'strategy':<18}{'TTFT avg':>10}{'TTFT p90':>10}{'<=30s':>8}{'reused':>8}{'paper avg':>11}"]
    for r in rows:
        lines.append(f"{r['speed']:<7g}{r['strategy']:<18}{r['ttft_mean_s']:>9.2f}s{r['ttft_p90_s']:>9.2f}s"
                     f"{r['ttft_slo_attainment']:>8.1%}{r['reused_token_share']:>8.1%}{r['paper_ttft_mean_s']:>10.2f}s")
    first = [r for r in rows if r["speed"] == speeds[0]]
    return {"rows": rows, "table": "\n".join(lines), "plots": [
        plots.bar_plot({r["strategy"]: r["ttft_mean_s"] for r in first}, out / "strategies_ttft.png",
                       "average TTFT (s)", paper.STRATEGY_TTFT, f"TTFT by prefill strategy ({speeds[0]:g}x)"),
        plots.cdf_plot(runs, out / "strategies_cdf.png", TTFT_SLO_S, None)]}


def capacity(trace: Sequence[TraceRequest], out: Path, tick: Tick, seed: int,
             thresholds: Sequence[float] = (0.1, 0.2, 0.3), target: float = 0.9,
             iterations: int = 3, chunk_tokens: int | None = 2048) -> dict[str, Any]:
    """Highest replay speed meeting the SLOs for ``target`` of requests: Mooncake 8P+8D
    (early admission at each TBT threshold) vs 16 colocated instances (the same 16 nodes),
    vLLM-v0 style and, for reference, with chunked prefill."""
    on_probe = lambda: tick("capacity probe")  # noqa: E731
    baselines = {"colocated": ColocatedConfig(num_instances=16, seed=seed)}
    if chunk_tokens:
        baselines["colocated-chunked"] = ColocatedConfig(num_instances=16, seed=seed,
                                                         chunked_prefill_tokens=chunk_tokens)
    caches = {name: ProbeCache(lambda c=c: ColocatedSim(c), trace, TTFT_SLO_S, thresholds, target, on_probe)
              for name, c in baselines.items()}
    rows = []
    for tbt in thresholds:
        sc = SchedulerConfig(admission="early", ttft_slo_s=TTFT_SLO_S, tbt_slo_s=tbt)
        mine = ProbeCache(lambda: _mooncake(sc, seed), trace, TTFT_SLO_S, [tbt], target, on_probe)
        m = find_capacity("mooncake", mine, tbt, iterations=iterations)
        row = {"tbt_slo_s": tbt, "mooncake_speed": m.speed, "mooncake_rps": m.speed * _rate(trace),
               "paper_gain": paper.CAPACITY_GAIN.get(tbt), "mooncake_probes": m.probes}
        for name, cache in caches.items():
            b = find_capacity(name, cache, tbt, iterations=iterations)
            row[f"{name}_speed"] = b.speed
            row[f"{name}_rps"] = b.speed * _rate(trace)
            row[f"{name}_probes"] = b.probes
            row[f"{name}_gain"] = m.speed / b.speed - 1 if b.speed > 0 else None
        row["gain"] = row["colocated_gain"]
        rows.append(row)
    values = {paper.capacity_label(r["tbt_slo_s"]): (r["gain"] or 0.0) * 100 for r in rows}
    ref = {paper.capacity_label(t): g * 100 for t, g in paper.CAPACITY_GAIN.items()}
    return {"rows": rows, "table": _capacity_table(rows, target, chunk_tokens), "plots": [
        plots.bar_plot(values, out / "capacity_gain.png", "capacity gain over colocated vLLM-v0 (%)", ref,
                       "Effective request capacity gain")]}


def _capacity_table(rows: list[dict[str, Any]], target: float, chunk_tokens: int | None) -> str:
    """The capacity rows as the printed table."""
    lines = [f"Effective request capacity - TTFT<=30s and TBT<=X for {target:.0%} of requests "
             f"(Mooncake 8P+8D vs 16 colocated nodes)",
             f"{'TBT SLO':<10}{'Mooncake':>11}{'vLLM-v0':>11}{'gain':>9}{'paper gain':>12}"
             + (f"{'chunked':>11}{'gain':>9}" if chunk_tokens else "")]

    def pct(g: float | None) -> str:
        return "inf" if g is None else f"{g:+.0%}"

    for r in rows:
        line = (f"{r['tbt_slo_s'] * 1e3:>5.0f} ms {r['mooncake_rps']:>7.2f} r/s{r['colocated_rps']:>7.2f} r/s"
                f"{pct(r['gain']):>9}{pct(r['paper_gain']):>12}")
        if chunk_tokens:
            line += f"{r['colocated-chunked_rps']:>7.2f} r/s{pct(r['colocated-chunked_gain']):>9}"
        lines.append(line)
    return "\n".join(lines)


def _rate(trace: Sequence[TraceRequest]) -> float:
    span = trace[-1].arrival_s - trace[0].arrival_s
    return (len(trace) - 1) / span if span > 0 else 0.0

