"""PNG plots of simulation results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)

from mooncake_lite.sim.recorder import SimResult  # noqa: E402


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def cdf_plot(runs: Mapping[str, SimResult], path: Path, ttft_slo_s: float | None = None,
             tbt_slo_s: float | None = None) -> str:
    """TTFT and TBT CDFs of completed requests, one line per run."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for label, res in runs.items():
        done = [r for r in res.requests if r.status == "completed"]
        for ax, vals in ((ax1, sorted(r.ttft for r in done if r.ttft is not None)),
                         (ax2, sorted(r.tbt * 1e3 for r in done if r.tbt is not None))):
            if vals:
                ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], label=label)
    for ax, slo, name in ((ax1, ttft_slo_s, "TTFT (s)"), (ax2, tbt_slo_s and tbt_slo_s * 1e3, "TBT (ms)")):
        if slo:
            ax.axvline(slo, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(name)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    ax1.set_xscale("log")
    ax2.set_xscale("log")
    ax1.legend(fontsize=8)
    return _save(fig, path)


def load_plot(runs: Mapping[str, SimResult], path: Path, title: str = "") -> str:
    """Prefill and decode load over time (paper Fig. 9/10): one panel per run."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs)), sharex=True, squeeze=False)
    for ax, (label, res) in zip(axes[:, 0], runs.items()):
        t = [row["t"] / 60 for row in res.timeline]
        ax.plot(t, [row["prefill_load"] for row in res.timeline], label="prefill load (queue / TTFT SLO)")
        line, = ax.plot(t, [row["decode_load"] for row in res.timeline], label="decode load (TBT / TBT SLO)")
        if res.timeline and "decode_load_max" in res.timeline[0]:
            ax.plot(t, [row["decode_load_max"] for row in res.timeline], color=line.get_color(), linestyle=":",
                    linewidth=1, label="decode load, busiest instance")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_title(label, fontsize=9)
        ax.set_ylabel("load")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("simulated time (min)")
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def refusals_plot(runs: Mapping[str, SimResult], path: Path, title: str = "") -> str:
    """Who refuses, over time: per run, the decodes' load running and held (running + reserved,
    what their own check judges) and the cumulative rejections at the conductor and at decode."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs)), sharex=True, squeeze=False)
    for ax, (label, res) in zip(axes[:, 0], runs.items()):
        rows = [row for row in res.timeline if "decode_held_load" in row]
        t = [row["t"] / 60 for row in rows]
        ax.plot(t, [row["decode_load"] for row in rows], label="decode load, running (TBT / SLO)")
        ax.plot(t, [row["decode_held_load"] for row in rows], label="decode load, held (running + reserved)")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_ylabel("load")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
        twin = ax.twinx()
        twin.plot(t, [row["refused_conductor"] for row in rows], color="tab:red", linewidth=1,
                  label="refused at the conductor (cumulative)")
        twin.plot(t, [row["refused_decode"] for row in rows], color="tab:purple", linewidth=1,
                  label="refused by a decode (cumulative)")
        twin.set_ylabel("requests")
    axes[0, 0].legend(fontsize=8, loc="upper left")
    twin.legend(fontsize=8, loc="lower right")
    axes[-1, 0].set_xlabel("simulated time (min)")
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def bar_plot(values: Mapping[str, float], path: Path, ylabel: str, paper: Mapping[str, float] | None = None,
             title: str = "") -> str:
    """Side-by-side bars: simulated vs paper (when given)."""
    names = list(values)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.4 if paper else 0.7
    xs = range(len(names))
    ax.bar([x - (width / 2 if paper else 0) for x in xs], [values[n] for n in names], width, label="simulated")
    if paper:
        ax.bar([x + width / 2 for x in xs], [paper.get(n, 0.0) for n in names], width, label="paper")
        ax.legend()
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def hitrate_plot(rows: Sequence[dict], path: Path) -> str:
    """Hit rate vs capacity per policy (simulated solid, paper dashed)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy]
        labels = [r["capacity"] for r in mine]
        line, = ax.plot(labels, [r["block_hit_rate"] for r in mine], marker="o", label=f"{policy} (sim)")
        if mine[0].get("paper") is not None:
            ax.plot(labels, [r["paper"] for r in mine], linestyle="--", color=line.get_color(),
                    label=f"{policy} (paper, arXiv trace)")
    ax.set_xlabel("cache capacity (blocks)")
    ax.set_ylabel("block hit rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)
