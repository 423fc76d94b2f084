"""``bench fidelity``'s comparison and its report (pure but for the plot file): the live and
simulated runs' figures side by side with the simulator's relative error, whether the same
requests were rejected, the goals (issue #20), the terminal text and the CDF plot."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

GOAL_MEAN_ERROR = 0.15        # mean TTFT and mean TBT within 15% ...
GOAL_REJECTION_SHARE = 0.10   # ... and the same requests rejected within ±10% of the slice


def rel_error(sim: float | None, live: float | None) -> float | None:
    """(sim − live) / live; None when either is missing or live is 0 (no scale to judge by)."""
    if sim is None or live is None or live == 0 or not (math.isfinite(sim) and math.isfinite(live)):
        return None
    return (sim - live) / abs(live)


def dist(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90 (linear interpolation, as ``bench replay``); None for an empty list."""
    if not values:
        return {"mean": None, "p50": None, "p90": None}
    p50, p90 = np.percentile(values, [50, 90])
    return {"mean": sum(values) / len(values), "p50": float(p50), "p90": float(p90)}


def rejection_agreement(live: frozenset[int], sim: frozenset[int], num_requests: int) -> dict[str, float | int]:
    """How far the two runs' rejected *sets* differ: requests rejected by one side only, as a
    share of the slice (the goal: ≤ 10%). The sets go along (ids), for ``--runs`` to set one run's
    against another's (``runs.rerun_agreement``)."""
    differ = len(live ^ sim)
    return {"live": len(live), "sim": len(sim), "both": len(live & sim), "live_only": len(live - sim),
            "sim_only": len(sim - live), "differ_share": differ / num_requests if num_requests else 0.0,
            "of": num_requests, "live_ids": sorted(live), "sim_ids": sorted(sim)}


@dataclass(frozen=True)
class Side:
    """One run's figures (seconds; ``rejected`` holds request ids). ``prefix_hit_tokens`` sums
    the side's own completed requests; ``hit_tokens`` has each one's by id, so :func:`compare`
    can sum the requests both sides completed (the two refuse different ones)."""
    ttft: tuple[float, ...]
    tbt: tuple[float, ...]
    completed: int
    rejected: frozenset[int]
    failed: int
    prefix_hit_tokens: int
    prompt_tokens: int
    hit_tokens: Mapping[int, int] = field(default_factory=dict)


def compare(live: Side, sim: Side, num_requests: int) -> dict:
    """The side-by-side rows (metric → live, sim, relative error) and the goal verdicts."""
    rows: dict[str, dict[str, float | None]] = {}
    for name in ("ttft", "tbt"):
        a, b = dist(getattr(live, name)), dist(getattr(sim, name))
        for stat in ("mean", "p50", "p90"):
            rows[f"{name}_{stat}_s"] = {"live": a[stat], "sim": b[stat], "rel_error": rel_error(b[stat], a[stat])}
    for name in ("completed", "prefix_hit_tokens"):
        x, y = getattr(live, name), getattr(sim, name)
        rows[name] = {"live": x, "sim": y, "rel_error": rel_error(y, x)}
    both = live.hit_tokens.keys() & sim.hit_tokens.keys()   # the same population on both sides
    x, y = sum(live.hit_tokens[i] for i in both), sum(sim.hit_tokens[i] for i in both)
    rows["prefix_hit_tokens_both"] = {"live": x, "sim": y, "rel_error": rel_error(y, x), "requests": len(both)}
    rows["rejected"] = {"live": len(live.rejected), "sim": len(sim.rejected),
                        "rel_error": rel_error(len(sim.rejected), len(live.rejected))}
    agree = rejection_agreement(live.rejected, sim.rejected, num_requests)
    goals = {f"mean_{n}_within_15%": _within(rows[f"{n}_mean_s"]["rel_error"], GOAL_MEAN_ERROR)
             for n in ("ttft", "tbt")}
    goals["same_rejections_within_10%"] = agree["differ_share"] <= GOAL_REJECTION_SHARE
    return {"rows": rows, "rejections": agree, "goals": goals}


def _within(err: float | None, bound: float) -> bool | None:
    return None if err is None else abs(err) <= bound


def format_report(report: Mapping) -> str:
    """The terminal table of :func:`compare`'s dict plus the run's notes."""
    lines = [f"{'':<24}{'live':>12}{'sim':>12}{'sim error':>11}"]
    for name, row in report["rows"].items():
        ms = name.endswith("_s")
        label = name.removesuffix("_s") + (" (ms)" if ms else "")
        err = "—" if row["rel_error"] is None else f"{row['rel_error']:+.1%}"
        lines.append(f"{label:<24}{_fmt(row['live'], ms):>12}{_fmt(row['sim'], ms):>12}{err:>11}")
    agree = report["rejections"]
    lines.append(f"same requests rejected: {agree['both']} both, {agree['live_only']} live only, "
                 f"{agree['sim_only']} sim only ({agree['differ_share']:.1%} of the slice differ)")
    lines.append("goals: " + ", ".join(f"{k} {'—' if v is None else ('yes' if v else 'NO')}"
                                       for k, v in report["goals"].items()))
    return "\n".join(lines)


def _fmt(value: float | int | None, ms: bool) -> str:
    if value is None:
        return "—"
    return f"{value * 1e3:,.1f}" if ms else f"{value:,}"


def jitter_lines(jitter: Sequence[float]) -> list[str]:
    """The delivery jitter the simulated tokens were given (``delivery.py``: a client's gap less
    the gap between the step ends of its tokens), if any was measured."""
    if not jitter:
        return []
    return [f"delivery jitter (client gap − step-end gap), ms: {len(jitter)} equal-mass bins, lowest "
            f"{jitter[0] * 1e3:.2f}, median {jitter[len(jitter) // 2] * 1e3:.2f}, highest {jitter[-1] * 1e3:.2f}"]


def report_text(report: Mapping) -> str:
    s = report["slos"]
    lines = [format_report(report),
             f"SLOs: TTFT {s['ttft_slo_s'] * 1e3:.0f} ms, TBT {s['tbt_slo_s'] * 1e3:.1f} ms ({s['how']})",
             f"sim rejected by: {report['simrejected_by'] or 'none'}; live failed (not 429): {report['live_failed']}",
             "measured gaps: " + ", ".join(f"{k} {v:.4g}" for k, v in report["gaps"].items() if v is not None)]
    lines += cost_model_lines(report)
    for name in ("without_step_spread", "without_padded_context", "without_colocated_slowdown", "without_kv_writes",
                 "without_node_states", "without_any", "without_delivery_jitter"):
        rows = report.get(f"sim_{name}")
        if rows:
            lines.append(f"sim {name.replace('_', ' ')}: " + ", ".join(
                f"{k.removesuffix('_s')} {row['rel_error']:+.1%}" for k, row in rows.items()
                if k.startswith(("ttft_mean", "tbt_")) and row["rel_error"] is not None))
    from mooncake_lite.bench.replay.report import prediction_lines
    lines += prediction_lines(report.get("predictions") or {})
    sp = (report.get("sim_predictions") or {}).get("ttft") or {}
    if sp.get("count"):
        lines.append(f"TTFT prediction error in the simulator (queue order alone), median / first {sp['first']}: "
                     f"{sp['median_error']:.3f} / {sp['first_median_error']:.3f}")
    sp = (report.get("sim_predictions") or {}).get("tbt") or {}
    if sp.get("count"):
        lines.append(f"TBT prediction error in the simulator, median / first {sp['first']}: {sp['median_error']:.3f}"
                     f" / {sp['first_median_error']:.3f} (median ratio {sp['median_ratio']:.2f})")
    if report.get("held_out"):
        h = report["held_out"]
        lines.append(f"held out (the last {ns_of(h)} requests, simulated with the models exported before they "
                     "were sent):")
        lines += ["  " + line for line in format_report(h).splitlines()]
    if report.get("admission"):
        lines += admission_lines(report["admission"])
    lines.append(f"wrote {report['plot']}")
    return "\n".join(lines)


def cost_model_lines(report: Mapping) -> list[str]:
    """What the exported model adds to its fits (one-box effects), the delivery jitter, and the
    machine's own drift through the replay (``drift.py``)."""
    from mooncake_lite.bench.fidelity.drift import drift_line
    cm, lines = report["cost_model"], []
    if cm.get("decode_step_ratios"):
        lines.append("decode gap / model, exported deciles: " + " ".join(f"{r:.2f}" for r in cm["decode_step_ratios"]))
    if cm.get("decode_busy_step_ratios"):
        lines.append("  beside a prefill: " + " ".join(f"{r:.2f}" for r in cm["decode_busy_step_ratios"]))
    for d, split in (cm.get("colocation") or {}).items():
        lines.append(f"{d}: {split['gaps_busy']} gaps beside a prefill forward, mean "
                     f"{_ms(split['gap_mean_busy_s'])}; {split['gaps_idle']} without, mean {_ms(split['gap_mean_idle_s'])};"
                     f" per model step {_num(split['slowdown'])}x; steps {split['step_share']:.1%} of the gaps")
    lines.append(f"exported: decode_colocated_slowdown {_num(cm.get('decode_colocated_slowdown'))}, "
                 f"decode_padding_s_per_token {_num(cm.get('decode_padding_s_per_token'))}, "
                 f"decode_kv_write_s_per_token {_num(cm.get('decode_kv_write_s_per_token'))}")
    lines += jitter_lines(report.get("delivery_jitter_s") or ())
    if (line := drift_line(report.get("drift") or {})) is not None:
        lines.append(line)
    if cm.get("prefill_busy"):
        lines.append(f"exported prefill by node state, 512 tokens: idle {_ms(_pf(cm['prefill_idle']))}, busy "
                     f"{_ms(_pf(cm['prefill_busy']))}, weighed (the conductor's price) {_ms(_pf(cm['prefill']))}")
    return lines


def admission_lines(a: Mapping) -> list[str]:
    """The report's lines for ``bench/fidelity/admission.judge``'s dict."""
    def one(label: str, s: Mapping) -> str:
        if not s["of"]:
            return f"{label}: none"
        lo, hi = s["ci95"]
        verdict = "yes" if s["goal_met"] else "NO"
        sign = "≥" if label.startswith("admitted") else "≤"
        return (f"{label}: {s['met']}/{s['of']} = {s['share']:.1%} (95% CI {lo:.1%}–{hi:.1%}; "
                f"goal {sign} {s['goal']:.0%}: {verdict})")
    adjusted = a.get("refused_would_meet_bias_adjusted")
    j = a.get("judged") or {}
    return ["admission by outcome (SLOs: " + a.get("slos", "") + "):",
            *([f"  judged: {j['judged']} of {j['of']} requests, those whose TTFT limit ended by the last arrival "
               f"({j['end_s']:.1f} s; later, the slice's end would judge them, not the traffic they met)"]
              if j.get("end_s") is not None else []),
            "  " + one("admitted that met their SLO (live)", a["admitted_met"])
            + f"; missed by TTFT {a['admitted_missed_by']['ttft']}, TBT {a['admitted_missed_by']['tbt']}",
            "  " + one("refused that would have met it (sim counterfactual)", a["refused_would_meet"]),
            *(["    the same with its TTFT over the simulator's bias at their size (sim / live TTFT, "
               "within 2x their prompts): " + one("", adjusted)[2:]] if adjusted else []),
            *(["  " + one("refused that would have met it (TTFT on live's timeline)", anchored)]
              if (anchored := a.get("refused_would_meet_anchored")) else []),
            *([f"    placed by the prefills' own records of turns, which replay to their order at {r['agreed']} of "
               f"{r['grants']} turns" if r["grants"] else "    placed by the order guessed from the client's clock "
               "(the prefills kept no record of turns)"] if (r := a.get("turns_replayed")) else []),
            *([f"  refused on the measured spread alone (central TTFT under its SLO): {len(s['ids'])} of "
               f"{s['of']}, {s['would_meet']} of them meeting it in the counterfactual"]
              if (s := a.get("refused_on_spread")) else []),
            "  " + one("admitted that met it in the sim (the counterfactual's bias)", a["sim_admitted_met"])
            + f"; missed by TTFT {a['sim_admitted_missed_by']['ttft']}, TBT {a['sim_admitted_missed_by']['tbt']}"]


def ns_of(compared: Mapping) -> int:
    """How many requests a :func:`compare` dict is over."""
    r = compared["rows"]
    return int((r["completed"]["live"] or 0) + (r["rejected"]["live"] or 0))


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _pf(model: Mapping) -> float:
    """An exported prefill model's 512-token forward, seconds."""
    from mooncake_lite.scheduler.costs import PrefillCostModel
    return PrefillCostModel.from_dict(model).predict(512)


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"


def cdf_plot(path: Path, live: Side, sim: Side, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, name in zip(axes, ("ttft", "tbt")):
        for label, side, style in (("live", live, "-"), ("sim", sim, "--")):
            xs = sorted(v * 1e3 for v in getattr(side, name))
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], style, where="post",
                        label=f"{label} (n={len(xs)})")
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
