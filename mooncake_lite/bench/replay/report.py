"""Outputs of a replay: the JSON result file, the CDF plots and the text table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import orjson

from mooncake_lite.bench.replay.metrics import RequestRecord, e2el, itls, num_output_tokens, tpot, ttft
from mooncake_lite.common.tbt import paper_tbt


def per_request(records: Sequence[RequestRecord]) -> dict[str, list]:
    """Per-request series (vLLM's result-file names where they exist), for plots and re-analysis."""
    ok = [r for r in records if r.is_ok]
    return {
        "request_ids": [r.request_id for r in records],
        "statuses": [r.status for r in records],
        "errors": [r.error or "" for r in records],
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [num_output_tokens(r) if r.is_ok else 0 for r in records],
        "send_lag_ms": [(r.send_s - r.scheduled_s) * 1000 for r in records],
        "ttfts": [ttft(r) for r in ok],
        "tpots": [t for r in ok if (t := tpot(r)) is not None],
        "e2els": [e2el(r) for r in ok],
        "tbts": [t for r in ok if (t := paper_tbt(itls(r))) is not None],
        "itls": [itls(r) for r in ok],
        "reused_blocks": [r.reused_blocks for r in records],
        "cached_tokens": [r.cached_tokens for r in records],
        "server_prompt_tokens": [r.server_prompt_tokens for r in records],
    }


def write_result(path: Path, summary: Mapping, series: Mapping) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps({**summary, "per_request": series}, option=orjson.OPT_INDENT_2
                                  | orjson.OPT_SERIALIZE_NUMPY))


def plot_cdfs(path: Path, series: Mapping[str, list], title: str) -> bool:
    """One PNG with the CDFs of TTFT, TPOT, ITL, E2EL and TBT (ms). False when nothing to plot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("TTFT", series["ttfts"]), ("TPOT", series["tpots"]),
              ("ITL", [g for gaps in series["itls"] for g in gaps]), ("E2EL", series["e2els"]),
              ("TBT (paper: slowest 10% of gaps)", series["tbts"])]
    if not any(values for _, values in panels):
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    for ax, (name, values) in zip(axes, panels):
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
        if not values:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        xs = np.sort(np.asarray(values, dtype=np.float64) * 1000)
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
        ax.set_ylim(0, 1.02)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def prediction_lines(predictions: Mapping) -> list[str]:
    """The server's admission predictions against this client's measurements (``prediction_errors``)."""
    lines = []
    for name in ("ttft", "tbt"):
        p = predictions.get(name) or {}
        if not p.get("count"):
            continue
        if not lines:
            lines.append(f"{'-' * 16}Predictions (server's, at admission){'-' * 9}")
        label = f"{name.upper()} |measured/predicted - 1| median / p90:"
        lines.append(f"{label:<48}{_fmt(p['median_error']):>6} / {_fmt(p['p90_error'])}")
        label = f"{name.upper()} measured/predicted, median (n={p['count']}):"
        lines.append(f"{label:<48}{_fmt(p['median_ratio']):>12}")
        if p.get("first_median_error") is not None:
            label = f"{name.upper()} median error, first {p['first']} sent:"
            lines.append(f"{label:<48}{_fmt(p['first_median_error']):>12}")
            lines.append(f"{name.upper()} median error by ten sent: " + " ".join(f"{e:.2f}" for e in p["by_tens"]))
    return lines


def format_table(summary: Mapping) -> str:
    m = summary["metrics"]
    rows = [("Successful requests", m["completed"]), ("Rejected (429)", m["num_rejected_429"]),
            ("Failed (other)", m["num_failed"]), ("Benchmark duration (s)", m["duration_s"]),
            ("Total input tokens", m["total_input_tokens"]), ("Total generated tokens", m["total_output_tokens"]),
            ("Request throughput (req/s)", m["request_throughput"])]
    if "request_goodput" in m:
        slos = " ".join(f"{k}<={v:g}ms" for k, v in summary["config"].get("goodput_slos_ms", {}).items())
        rows.append((f"Request goodput (req/s, {slos})", m["request_goodput"]))
    rows += [("Output token throughput (tok/s)", m["output_throughput"]),
             ("Total token throughput (tok/s)", m["total_token_throughput"])]
    lines = [f"{'=' * 20} Trace replay result {'=' * 20}"]
    lines += [f"{k:<48}{_fmt(v):>12}" for k, v in rows]
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"),
                        ("tbt", "TBT (paper: mean of slowest 10% gaps)")):
        lines.append(f"{'-' * 16}{label}{'-' * max(0, 45 - len(label))}")
        for stat in ("mean", "median", "p90", "p99"):
            lines.append(f"{f'{stat.capitalize()} {name.upper()} (ms):':<48}{_fmt(m.get(f'{stat}_{name}_ms')):>12}")
    cache = summary["cache"]
    lines.append(f"{'-' * 16}Prefix cache{'-' * 33}")
    lines.append(f"{'Hit rate (usage cached_tokens / prompt tokens):':<48}"
                 f"{_fmt(cache.get('cached_token_hit_rate')):>12}")
    lines.append(f"{'Cluster block hit rate (conductor /metrics):':<48}{_fmt(cache.get('cache_hit_rate')):>12}")
    if cache.get("requests_with_prefix_hit") is not None:
        share = _fmt(cache["requests_with_prefix_hit"])
        lines.append(f"{'Requests reusing a cached prefix (headers):':<48}{share:>12}")
    lines.append(f"{'Ideal (infinite cache) block reuse of slice:':<48}{_fmt(cache.get('ideal_block_hit_rate')):>12}")
    lines += prediction_lines(summary.get("predictions") or {})
    for note in summary.get("notes", []):
        lines.append(f"note: {note}")
    lines.append("=" * 61)
    return "\n".join(lines)
