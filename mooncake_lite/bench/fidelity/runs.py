"""``mooncake bench fidelity --runs K``: the same slice replayed K times, each on a fresh cluster,
and what one code gives across them.

One run does not tell a change of a few points from the spread between runs: on one quiet Zen 5
box the same code put the median TTFT prediction error at 17.2% and 26.0% (docs/results/
2026-11-30-zen5.md §14). So each figure is given as its median over the runs and their range, and
the admission outcomes are pooled (requests summed over the runs, one Wilson interval), which
narrows an interval a single run's handful of refusals leaves wide. Each run's own report is in
``OUT_DIR/run-I/`` as one run writes it. Pure here: the runs are the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from statistics import median
from typing import Any

from mooncake_lite.bench.fidelity.admission import GOAL_ADMITTED_MET, GOAL_REFUSED_MET, share

# (label, path in a run's report, goal: |value| at most this; None: none stated)
FIGURES = (
    ("TTFT prediction error, median", ("predictions", "ttft", "median_error"), 0.15),
    ("TTFT prediction error, first 50", ("predictions", "ttft", "first_median_error"), 0.15),
    ("TBT prediction error, median", ("predictions", "tbt", "median_error"), None),
    ("fidelity: mean TTFT, sim vs live", ("rows", "ttft_mean_s", "rel_error"), 0.15),
    ("fidelity: mean TBT, sim vs live", ("rows", "tbt_mean_s", "rel_error"), 0.15),
    ("fidelity: decisions that differ", ("rejections", "differ_share"), 0.10),
    # the machine's own: its thirds' slowest over fastest (drift.py), so a run's hour is seen
    ("machine drift, prefill forwards", ("drift", "prefill_spread"), None),
    ("machine drift, decode steps", ("drift", "decode_spread"), None),
)
# (label, path to a {met, of} count in a run's report, goal, at least)
POOLED = (
    ("admitted that met their SLO", ("admission", "admitted_met"), GOAL_ADMITTED_MET, True),
    ("refused that would have met it", ("admission", "refused_would_meet"), GOAL_REFUSED_MET, False),
    ("  ... over the counterfactual's bias", ("admission", "refused_would_meet_bias_adjusted"), GOAL_REFUSED_MET,
     False),
    ("  ... TTFT on live's timeline", ("admission", "refused_would_meet_anchored"), GOAL_REFUSED_MET, False),
)


def _at(report: Mapping[str, Any], path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(report, Mapping) or key not in report:
            return None
        report = report[key]
    return report


def summarize(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each figure's values over ``reports`` (one run's report each), their median and range, and
    the pooled admission outcomes with their interval (module doc). A run without a figure (a
    slice with no refusal has no refused share) leaves it out."""
    figures = {}
    for label, path, goal in FIGURES:
        values = [float(v) for r in reports if isinstance(v := _at(r, path), (int, float))]
        mid = median(values) if values else None
        figures[label] = {"values": values, "median": mid, "min": min(values, default=None),
                          "max": max(values, default=None), "goal": goal,
                          "goal_met": None if mid is None or goal is None else abs(mid) <= goal}
    pooled = {}
    for label, path, goal, at_least in POOLED:
        counts = [c for r in reports if isinstance(c := _at(r, path), Mapping)]
        met, of = sum(int(c.get("met", 0)) for c in counts), sum(int(c.get("of", 0)) for c in counts)
        pooled[label] = {**share(met, of, goal, at_least), "at_least": at_least}
    return {"runs": len(reports), "figures": figures, "pooled": pooled, "reruns": rerun_agreement(reports)}


def rerun_agreement(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The yardstick for "decisions that differ": the same slice, the same code, run again on a
    fresh cluster refuses other requests too. For each pair of runs, the share of the slice one
    live run refused and the other did not; and each run's simulation against the *other* runs'
    live sets. A simulation as far from its own live run as one live run is from another is as
    close as a rerun is; below two runs, or without the sets, None."""
    sets = [(frozenset(a["live_ids"]), frozenset(a["sim_ids"]), int(a["of"]))
            for r in reports if isinstance(a := _at(r, ("rejections",)), Mapping) and "live_ids" in a and a.get("of")]
    pairs = [(i, j) for i in range(len(sets)) for j in range(len(sets)) if i != j]
    if not pairs:
        return None
    live = [len(sets[i][0] ^ sets[j][0]) / sets[i][2] for i, j in pairs if i < j]
    cross = [len(sets[i][1] ^ sets[j][0]) / sets[i][2] for i, j in pairs]
    return {"live_vs_live": _spread(live), "sim_vs_other_live": _spread(cross)}


def _spread(values: Sequence[float]) -> dict[str, Any]:
    return {"values": list(values), "median": median(values), "min": min(values), "max": max(values)}


def summary_text(summary: Mapping[str, Any]) -> str:
    """The summary as a table: each figure's median [min, max] and goal; the pooled shares."""
    def pct(v: float | None) -> str:
        return "—" if v is None else f"{100 * v:+.1f}%"
    lines = [f"over {summary['runs']} runs: median [min, max]"]
    for label, f in summary["figures"].items():
        goal = "" if f["goal"] is None else f"  (goal within {100 * f['goal']:.0f}%: {'yes' if f['goal_met'] else 'NO'})"
        lines.append(f"  {label:<36} {pct(f['median'])} [{pct(f['min'])}, {pct(f['max'])}]{goal}")
    if (reruns := summary.get("reruns")) is not None:
        for label, key in (("decisions that differ, live vs live", "live_vs_live"),
                           ("  ... sim vs another run's live", "sim_vs_other_live")):
            f = reruns[key]
            lines.append(f"  {label:<36} {pct(f['median'])} [{pct(f['min'])}, {pct(f['max'])}]"
                         f"  (a rerun's own spread: no goal)")
    lines.append("admission, pooled over the runs:")
    for label, s in summary["pooled"].items():
        if not s["of"]:
            lines.append(f"  {label:<36} none")
            continue
        lo, hi = s["ci95"]
        lines.append(f"  {label:<36} {s['met']}/{s['of']} = {100 * s['share']:.1f}% "
                     f"(95% CI {100 * lo:.1f}%–{100 * hi:.1f}%; goal {'≥' if s['at_least'] else '≤'} "
                     f"{100 * s['goal']:.0f}%: {'yes' if s['goal_met'] else 'NO'})")
    return "\n".join(lines)


def repeated(runs: int, one: Callable[[int], Mapping[str, Any]]) -> dict[str, Any]:
    """``one(i)`` for i in 1..``runs`` (each a run's report), and their summary (``text`` too)."""
    reports = [one(i) for i in range(1, runs + 1)]
    summary = summarize(reports)
    return {**summary, "text": "\n\n".join([*(f"run {i}:\n{r.get('text', '')}" for i, r in enumerate(reports, 1)),
                                             summary_text(summary)])}
