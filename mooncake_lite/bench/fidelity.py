"""``mooncake bench fidelity``: one trace slice, replayed live and simulated, side by side.

    mooncake bench fidelity --ttft-slo 45 --tbt-slo 1.33   # smollm2-135m, 1P+1D, 30 requests at 0.03x
    mooncake bench fidelity --conductor http://127.0.0.1:8000 --block-tokens 64   # a running cluster

1. Starts ``mooncake up`` (``--model``, ``--prefill``/``--decode``, ``--block-size`` = the trace
   block's tokens, so one trace block is one KV block) unless ``--conductor`` names a running one.
2. Replays the first ``-n`` requests of ``--trace`` through ``bench replay``'s own pieces
   (lengths scaled ``--block-tokens``/512, outputs scaled by ``--output-scale`` and capped at
   ``--max-output-tokens``, ``max_tokens`` = the output, ``ignore_eos``), at ``--speed``.
3. Exports the cluster's own cost models as ``mooncake sim export-costs`` does (in-process; the
   models as refined by the replay's own chunks and steps).
4. Simulates the same slice — the prompts' lengths as the server counted them, the same outputs,
   arrivals, instance counts, block size and admission — with that cost model.
5. Prints TTFT and TBT (the paper's: mean of each request's slowest 10% of gaps) mean/p50/p90,
   rejections (and whether the *same* requests were rejected), prefix-hit tokens, each with the
   simulator's relative error, plus the measured modelling gaps (``gaps``), the export's split of
   the decode's gaps beside a prefill forward from those without (``cost_model.colocation``),
   and the same slice simulated without each one-box effect the profile models (``ablations``);
   writes a CDF plot, and the instances' step and forward timelines (``timelines.json``).

SLOs: the live conductor's default SLOs are relative (TTFT ≤ 10× the prompt's prefill alone, TBT ≤
5× one step alone, by the chosen instance's own profile); the simulator's are absolute. Without
``--ttft-slo``/``--tbt-slo`` the simulator gets the median over the slice of the per-request
limits the exported model gives (``scheduler.admission.slo_limits``); with them, both sides use
the same absolute SLOs (passed to the conductor this command starts).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import orjson

from mooncake_lite.model.source import DEFAULT_MODEL
from mooncake_lite.trace.format import TraceRequest

DEFAULT_TRACE = "/work/shared/traces/conversation_trace.jsonl"
GOAL_MEAN_ERROR = 0.15        # mean TTFT and mean TBT within 15% ...
GOAL_REJECTION_SHARE = 0.10   # ... and the same requests rejected within ±10% of the slice


# ---- the arithmetic (pure) ------------------------------------------------------------------

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
    share of the slice (the goal: ≤ 10%)."""
    differ = len(live ^ sim)
    return {"live": len(live), "sim": len(sim), "both": len(live & sim), "live_only": len(live - sim),
            "sim_only": len(sim - live), "differ_share": differ / num_requests if num_requests else 0.0}


@dataclass(frozen=True)
class Side:
    """One run's figures (seconds; ``rejected`` holds request ids)."""
    ttft: tuple[float, ...]
    tbt: tuple[float, ...]
    completed: int
    rejected: frozenset[int]
    failed: int
    prefix_hit_tokens: int
    prompt_tokens: int


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
    lines = [f"{'':<20}{'live':>12}{'sim':>12}{'sim error':>11}"]
    for name, row in report["rows"].items():
        ms = name.endswith("_s")
        label = name.removesuffix("_s") + (" (ms)" if ms else "")
        err = "—" if row["rel_error"] is None else f"{row['rel_error']:+.1%}"
        lines.append(f"{label:<20}{_fmt(row['live'], ms):>12}{_fmt(row['sim'], ms):>12}{err:>11}")
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


def converted_slos(prompt_tokens: Sequence[int], hw, ttft_factor: float, tbt_factor: float) -> dict:
    """The absolute SLOs the simulator gets for the conductor's relative ones: each request's
    limits by the exported model (factor × its prefill alone; factor × one step alone with its
    prompt as context), and their median over the slice (with the range, for the report)."""
    ttft = [ttft_factor * hw.prefill.predict(n) for n in prompt_tokens]
    tbt = [tbt_factor * hw.decode.predict(1, n) for n in prompt_tokens]
    return {"ttft_slo_s": statistics.median(ttft), "tbt_slo_s": statistics.median(tbt),
            "ttft_range_s": [min(ttft), max(ttft)], "tbt_range_s": [min(tbt), max(tbt)],
            "how": f"median over the slice of {ttft_factor:g}x prefill alone / {tbt_factor:g}x one step alone "
                   f"(exported model)"}


# ---- the two sides ---------------------------------------------------------------------------

def live_side(records: Sequence) -> Side:
    from mooncake_lite.bench.replay.metrics import ttft
    from mooncake_lite.common.tbt import paper_tbt
    ok = [r for r in records if r.is_ok]
    return Side(ttft=tuple(ttft(r) for r in ok),
                tbt=tuple(t for r in ok if (t := paper_tbt(token_gaps(r))) is not None),
                completed=len(ok), rejected=frozenset(r.request_id for r in records if r.is_rejected),
                failed=sum(not r.is_ok and not r.is_rejected for r in records),
                prefix_hit_tokens=sum(r.cached_tokens or 0 for r in ok),
                prompt_tokens=sum(_server_tokens(r) for r in ok))


def token_gaps(record) -> list[float]:
    """The gaps between a request's tokens as the client got them. The stream's last chunk
    carries only the finish reason, right after the last token: ``bench replay`` counts that
    0 s gap too (``itls``), which the simulator has no twin of — 32 gaps for 31, a mean gap
    3% low, and the slowest tenth of a different count whenever the real count ends in 9."""
    from mooncake_lite.bench.replay.metrics import itls
    gaps = itls(record)
    return gaps[: record.output_tokens - 1] if record.output_tokens else gaps


def sim_side(result) -> Side:
    done = [r for r in result.requests if r.status == "completed"]
    return Side(ttft=tuple(r.ttft for r in done if r.ttft is not None),
                tbt=tuple(r.tbt for r in done if r.tbt is not None), completed=len(done),
                rejected=frozenset(r.request_id for r in result.requests if r.status == "rejected"),
                failed=sum(r.status not in ("completed", "rejected") for r in result.requests),
                prefix_hit_tokens=sum(r.reused_tokens for r in done),
                prompt_tokens=sum(r.input_length for r in done))


def _server_tokens(record) -> int:
    return record.server_prompt_tokens if record.server_prompt_tokens is not None else record.prompt_tokens


def sim_trace(window: Sequence[TraceRequest], requests: Sequence, records: Sequence, block: int) -> list[TraceRequest]:
    """The slice as the simulator sees it: the server's prompt length (its tokenizer adds BOS;
    a request it never counted — rejected — gets the client's count plus the same offset), the
    output the client asked for and read, the trace's hash ids cut to the scaled length (one
    trace block = ``block`` tokens), the replay's arrival times (ms, relative to the first)."""
    offsets = [r.server_prompt_tokens - r.prompt_tokens for r in records if r.server_prompt_tokens is not None]
    offset = int(statistics.median(offsets)) if offsets else 0
    by_id = {r.request_id: r for r in records}
    t0 = requests[0].arrival_s if requests else 0.0
    out = []
    for tr, req in zip(window, requests):
        rec = by_id.get(req.request_id)
        n_in = _server_tokens(rec) if rec is not None and rec.server_prompt_tokens is not None \
            else req.num_prompt_tokens + offset
        n_out = req.stop_after if req.stop_after is not None else req.max_tokens
        ids = tuple(tr.hash_ids[: max(1, math.ceil(n_in / block))])
        out.append(TraceRequest(tr.request_id, (req.arrival_s - t0) * 1e3, n_in, max(1, n_out), ids))
    return out


def simulate(trace: Sequence[TraceRequest], hw, *, prefill: int, decode: int, admission: str, ttft_slo_s: float,
             tbt_slo_s: float, block: int, batch_tokens: int = 0):
    from mooncake_lite.scheduler import SchedulerConfig
    from mooncake_lite.sim.cluster import MooncakeSim
    from mooncake_lite.sim.config import SimConfig
    sched = SchedulerConfig(admission=admission, ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s, block_size=block)
    cfg = SimConfig(num_prefill=prefill, num_decode=decode, hardware=hw.name, scheduler=sched,
                    max_tokens_policy="output", decode_check="reserve", prefill_batch_tokens=batch_tokens)
    return MooncakeSim(cfg, replace(hw, block_size=block)).run(trace)


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


# ---- measured gaps ---------------------------------------------------------------------------

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
        ctx = statistics.fmean(_server_tokens(r) + (r.output_tokens or 0) / 2 for r in ok)
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
    return out


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


# ---- the live side: cluster, replay, export ---------------------------------------------------

def scrape(url: str) -> dict[str, float]:
    import urllib.request

    from mooncake_lite.bench.replay.client import parse_prometheus
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as resp:
            return parse_prometheus(resp.read().decode())
    except OSError:
        return {}


def scrape_all(api: str, decodes: Sequence[str]) -> dict[str, dict[str, float]]:
    merged: dict[str, float] = {}
    for i, url in enumerate(decodes):
        merged.update({f"{i}.{k}": v for k, v in scrape(url).items()})
    return {"conductor": scrape(api), "decode": merged}


def replay_namespace(ns: argparse.Namespace, api: str, out_dir: str) -> argparse.Namespace:
    from mooncake_lite.bench.replay.cli import build_parser
    argv = ["--trace", ns.trace, "--base-url", api, "--max-requests", str(ns.num_requests),
            "--speed", str(ns.speed), "--block-tokens", str(ns.block_tokens), "--output-scale",
            str(ns.output_scale), "--max-output-tokens", str(ns.max_output_tokens), "--no-progress",
            "--output-dir", out_dir, "--tokenizer", ns.tokenizer, "--prompt-mode", ns.prompt_mode]
    return build_parser().parse_args(argv)


async def live_replay(rns: argparse.Namespace, headers: dict[str, str]) -> tuple[list, list, list, dict]:
    """(trace window, synthesized requests, records, the served model's context) — the replay's
    own pieces, so the prompts are exactly what ``bench replay`` would send."""
    import aiohttp

    from mooncake_lite.bench.replay.client import served_model_info
    from mooncake_lite.bench.replay.run import build_requests, length_scale, read_window
    from mooncake_lite.bench.replay.sender import replay
    from mooncake_lite.bench.replay.workload import PromptConfig
    window = read_window(rns)
    base = rns.base_url.rstrip("/")
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as session:
        model, max_context = await served_model_info(session, base)
    if model is None:
        raise ValueError(f"{base}/v1/models names no model: is the conductor up?")
    pcfg = PromptConfig(scale=length_scale(rns, window, max_context), output_scale=rns.output_scale,
                        max_output_tokens=rns.max_output_tokens, max_context=max_context, mode=rns.prompt_mode,
                        seed=rns.seed)
    notes: list[str] = []
    requests, _ = build_requests(rns, window, pcfg, model, notes)
    records, _ = await replay(requests, base + rns.endpoint, model, headers=headers, progress=False)
    return window, requests, records, {"model": model, "max_context": max_context, "notes": notes}


def warm_up(api: str, num: int, timeout_s: float = 120.0) -> None:
    """``num`` short completions, one after another, before the replay (and before the metrics it
    is measured by): a freshly started instance's first forwards and steps run cold (in one run
    the first 211-token prefill took 2.6 s against the model's 0.8), which is start-up, not the
    steady state the simulator prices. Each prompt differs from its first block on, so neither
    these nor the trace's prompts reuse each other's blocks."""
    import urllib.request
    model = served_model(api) if num > 0 else None
    for i in range(num):
        body = {"model": model, "max_tokens": 8, "stream": False,
                "prompt": f"Warm-up {i}, not part of the trace. " + "The quick brown fox jumps over the lazy dog. " * 20}
        req = urllib.request.Request(api.rstrip("/") + "/v1/completions", data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                resp.read()
        except OSError as exc:
            raise RuntimeError(f"warm-up request {i} failed: {exc}") from None


def served_model(api: str) -> str | None:
    import urllib.request
    with urllib.request.urlopen(api.rstrip("/") + "/v1/models", timeout=10) as resp:
        data = orjson.loads(resp.read()).get("data") or [{}]
    return data[0].get("id")


def export_profile(api: str, token: str | None, path: Path) -> dict:
    """``mooncake sim export-costs`` in-process: the file it writes, and that file's dict."""
    from mooncake_lite.sim.cli import export_costs_main
    argv = ["--conductor", api, "-o", str(path)] + (["--token", token] if token else [])
    if export_costs_main(argv) != 0:
        raise RuntimeError(f"exporting the cost models from {api} failed")
    return orjson.loads(path.read_bytes())


def conductor_config(api: str, token: str | None) -> dict:
    """What the conductor says of itself in ``/internal/v1/status`` (instances; admission if shown)."""
    import urllib.request

    from mooncake_lite.common.auth import cluster_headers
    req = urllib.request.Request(api.rstrip("/") + "/internal/v1/status", headers=cluster_headers(token))
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return orjson.loads(resp.read())
    except (OSError, ValueError):
        return {}


def decode_urls(status: Mapping, role: str = "decode") -> list[str]:
    urls = []
    for inst in status.get("instances", []):
        if isinstance(inst, dict) and inst.get("role") == role and inst.get("http"):
            http = str(inst["http"])
            urls.append(http if "://" in http else f"http://{http}")
    return urls


def timelines(status: Mapping, token: str | None) -> dict[str, dict]:
    """Every instance's ``GET /v1/timeline`` (decode steps, prefill forwards on the host's
    monotonic clock) by URL, as the cost export read them: kept for offline analysis."""
    import urllib.request

    from mooncake_lite.common.auth import cluster_headers
    out = {}
    for url in decode_urls(status, "prefill") + decode_urls(status, "decode"):
        req = urllib.request.Request(url.rstrip("/") + "/v1/timeline", headers=cluster_headers(token))
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                out[url] = orjson.loads(resp.read())
        except (OSError, ValueError):
            continue
    return out


# ---- the command ------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mooncake bench fidelity", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=DEFAULT_TRACE)
    # 30 requests at 0.03x: about 63% of one prefill instance on a 2-core box shared with other work
    p.add_argument("-n", "--num-requests", type=int, default=30, help="the first N requests of the trace")
    p.add_argument("--speed", type=float, default=0.03, help="replay speed (0.03: 3%% of the recorded rate)")
    p.add_argument("--block-tokens", type=int, default=16,
                   help="tokens per 512-token trace block, and the cluster's KV block size")
    p.add_argument("--output-scale", type=float, default=1.0, help="output length scale")
    p.add_argument("--max-output-tokens", type=int, default=32, help="output cap")
    p.add_argument("--conductor", default=None, help="a running cluster's conductor URL (default: start one)")
    p.add_argument("--token", default=os.environ.get("MOONCAKE_CLUSTER_TOKEN"), help="its cluster token")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model of the cluster this command starts")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--admission", default="predictive", help="the conductor's admission (its default)")
    p.add_argument("--ttft-slo", type=float, default=None, help="absolute TTFT SLO, seconds, on both sides")
    p.add_argument("--tbt-slo", type=float, default=None, help="absolute TBT SLO, seconds, on both sides")
    p.add_argument("--ttft-slo-factor", type=float, default=10.0, help="the conductor's relative TTFT SLO")
    p.add_argument("--tbt-slo-factor", type=float, default=5.0, help="the conductor's relative TBT SLO")
    p.add_argument("--prefill-batch-tokens", type=int, default=512,
                   help="the simulated prefill packs queued prompts up to this many uncached tokens, as the "
                        "live prefill does by default (its --prefill-batch-tokens; 0: one prompt at a time)")
    p.add_argument("--warmup", type=int, default=2,
                   help="short completions sent (and not measured) before the replay, so it meets warm instances")
    p.add_argument("--tokenizer", default="auto")
    p.add_argument("--prompt-mode", choices=("text", "tokens"), default="text")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--plot", default=None, help="CDF plot path (default: OUT_DIR/fidelity_cdf.png)")
    p.add_argument("--output-dir", default="fidelity-results")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: Sequence[str]) -> int:
    ns = build_parser().parse_args(list(argv))
    if ns.num_requests < 1 or ns.speed <= 0 or ns.block_tokens < 1:
        sys.stderr.write("mooncake bench fidelity: error: -n, --speed and --block-tokens must be positive\n")
        return 2
    cluster = None
    try:
        if ns.conductor is None:
            cluster = start_cluster(ns)
        api = ns.conductor or cluster.api
        report = run(ns, api.removesuffix("/v1"))
    except (ValueError, OSError, RuntimeError) as exc:
        sys.stderr.write(f"mooncake bench fidelity: error: {exc}\n")
        return 2
    finally:
        if cluster is not None:
            cluster.stop()
    if ns.json:
        print(orjson.dumps(report, option=orjson.OPT_NON_STR_KEYS).decode())
    else:
        print(report["text"])
    return 0


def start_cluster(ns: argparse.Namespace):
    from mooncake_lite.bench.chaos import Cluster
    args = ["--model", ns.model, "--prefill", str(ns.prefill), "--decode", str(ns.decode),
            "--block-size", str(ns.block_tokens)]
    conductor = ["--admission", ns.admission, "--ttft-slo-factor", str(ns.ttft_slo_factor),
                 "--tbt-slo-factor", str(ns.tbt_slo_factor)]
    conductor += ["--ttft-slo", f"{ns.ttft_slo}s"] if ns.ttft_slo else []
    conductor += ["--tbt-slo", f"{ns.tbt_slo}s"] if ns.tbt_slo else []
    args += ["--conductor-args", " ".join(conductor)]
    if ns.token:
        args += ["--cluster-token", ns.token]
    # Every role's log (mooncake up's stderr) beside the results: what the cluster did, for a
    # run read back later (its defaults move: a prefill borrows idle decode CPUs since a5d488c).
    Path(ns.output_dir).mkdir(parents=True, exist_ok=True)
    return Cluster(args, ready_timeout=ns.ready_timeout, log_path=str(Path(ns.output_dir) / "up.log"))


def run(ns: argparse.Namespace, api: str) -> dict:
    """Replay, export, simulate, compare: the report dict (``text``: the table)."""
    from mooncake_lite.common.auth import cluster_headers
    from mooncake_lite.sim.costs import load_profile
    out = Path(ns.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    status = conductor_config(api, ns.token)
    decodes = decode_urls(status)
    warm_up(api, ns.warmup)
    before = scrape_all(api, decodes)
    t0 = time.perf_counter()
    window, requests, records, served = asyncio.run(
        live_replay(replay_namespace(ns, api, str(out)), cluster_headers(None)))
    live_s = time.perf_counter() - t0
    after = scrape_all(api, decodes)
    profile = export_profile(api, ns.token, out / "costs.json")
    (out / "timelines.json").write_bytes(orjson.dumps(timelines(status, ns.token)))
    hw = load_profile(out / "costs.json")
    trace = sim_trace(window, requests, records, ns.block_tokens)
    if ns.ttft_slo and ns.tbt_slo:
        slos = {"ttft_slo_s": ns.ttft_slo, "tbt_slo_s": ns.tbt_slo, "how": "absolute on both sides"}
    else:
        slos = converted_slos([t.input_length for t in trace], hw, ns.ttft_slo_factor, ns.tbt_slo_factor)
    res = simulate(trace, hw, prefill=ns.prefill, decode=ns.decode, admission=ns.admission,
                   ttft_slo_s=slos["ttft_slo_s"], tbt_slo_s=slos["tbt_slo_s"], block=ns.block_tokens,
                   batch_tokens=ns.prefill_batch_tokens)
    live, sim = live_side(records), sim_side(res)
    report = compare(live, sim, len(records))
    for name, other in ablations(hw).items():   # the same slice without one modelled effect: what it moves
        res_other = simulate(trace, other, prefill=ns.prefill, decode=ns.decode, admission=ns.admission,
                             ttft_slo_s=slos["ttft_slo_s"], tbt_slo_s=slos["tbt_slo_s"], block=ns.block_tokens,
                             batch_tokens=ns.prefill_batch_tokens)
        report[f"sim_{name}"] = compare(live, sim_side(res_other), len(records))["rows"]
    report.update(slos=slos, gaps=measured_gaps(live, records, before, after, hw),
                  config={k: v for k, v in vars(ns).items() if k != "token"}, served=served,
                  live_wall_s=live_s, live_failed=live.failed, sim_rejected_by=_rejected_by(res),
                  prompt_tokens={"live": live.prompt_tokens, "sim": sim.prompt_tokens},
                  cost_model={"prefill": profile.get("prefill"), "decode": profile.get("decode"),
                              "decode_max_context_tokens": profile.get("decode_max_context_tokens"),
                              "decode_step_ratios": profile.get("decode_step_ratios"),
                              "decode_colocated_slowdown": profile.get("decode_colocated_slowdown"),
                              "decode_padding_s_per_token": profile.get("decode_padding_s_per_token"),
                              "decode_kv_write_s_per_token": profile.get("decode_kv_write_s_per_token"),
                              "colocation": profile.get("colocation")})
    report["per_request"] = per_request(records, res)
    plot = Path(ns.plot) if ns.plot else out / "fidelity_cdf.png"
    cdf_plot(plot, live, sim, f"{served['model']} · first {len(records)} requests · {ns.prefill}P+{ns.decode}D · "
                              f"{ns.speed:g}x · live vs sim (exported cost model)")
    report["plot"] = str(plot)
    report["text"] = _text(report)
    (out / "fidelity.json").write_bytes(orjson.dumps({k: v for k, v in report.items() if k != "text"},
                                                     option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    return report


def ablations(hw) -> dict:
    """The exported hardware without each one-box effect it models (only those it has), and
    without all of them: the simulator as it ran before they were measured."""
    out = {}
    if hw.decode_step_ratios:
        out["without_step_spread"] = replace(hw, decode_step_ratios=())
    if hw.decode_padding_s_per_token:
        out["without_padded_context"] = replace(hw, decode_padding_s_per_token=0.0)
    if hw.decode_colocated_slowdown != 1.0:
        out["without_colocated_slowdown"] = replace(hw, decode_colocated_slowdown=1.0)
    if hw.decode_kv_write_s_per_token:
        out["without_kv_writes"] = replace(hw, decode_kv_write_s_per_token=0.0)
    if len(out) > 1:
        out["without_any"] = replace(hw, decode_step_ratios=(), decode_padding_s_per_token=0.0,
                                     decode_colocated_slowdown=1.0, decode_kv_write_s_per_token=0.0)
    return out


def per_request(records: Sequence, res) -> list[dict]:
    """Each request's outcome on both sides (TTFT/TBT seconds, or its rejection), by id."""
    from mooncake_lite.bench.replay.metrics import ttft
    from mooncake_lite.common.tbt import paper_tbt
    sims = {r.request_id: r for r in res.requests}
    rows = []
    for rec in records:
        s = sims.get(rec.request_id)
        rows.append({"id": rec.request_id, "live_ttft": ttft(rec) if rec.is_ok else None,
                     "live_tbt": paper_tbt(token_gaps(rec)) if rec.is_ok else None, "live_status": rec.status,
                     "sim_ttft": s.ttft if s else None, "sim_tbt": s.tbt if s else None,
                     "sim_status": s.status if s else None, "input": s.input_length if s else None,
                     "live_send_s": rec.send_s, "live_chunk_s": list(rec.chunk_s)})   # for offline analysis
    return rows


def _rejected_by(res) -> dict[str, int]:
    from collections import Counter
    return dict(Counter(f"{r.reject_stage}:{r.reject_cause}" for r in res.requests if r.status == "rejected"))


def _text(report: Mapping) -> str:
    s = report["slos"]
    lines = [format_report(report),
             f"SLOs given the simulator: TTFT {s['ttft_slo_s'] * 1e3:.0f} ms, TBT {s['tbt_slo_s'] * 1e3:.1f} ms "
             f"({s['how']})",
             f"sim rejected by: {report['sim_rejected_by'] or 'none'}; live failed (not 429): {report['live_failed']}",
             "measured gaps: " + ", ".join(f"{k} {v:.4g}" for k, v in report["gaps"].items() if v is not None)]
    cm = report["cost_model"]
    if cm.get("decode_step_ratios"):
        lines.append("decode gap / model, exported deciles: " + " ".join(f"{r:.2f}" for r in cm["decode_step_ratios"]))
    for d, split in (cm.get("colocation") or {}).items():
        lines.append(f"{d}: {split['gaps_busy']} gaps beside a prefill forward, mean "
                     f"{_ms(split['gap_mean_busy_s'])}; {split['gaps_idle']} without, mean {_ms(split['gap_mean_idle_s'])};"
                     f" per model step {_num(split['slowdown'])}x; steps {split['step_share']:.1%} of the gaps")
    lines.append(f"exported: decode_colocated_slowdown {_num(cm.get('decode_colocated_slowdown'))}, "
                 f"decode_padding_s_per_token {_num(cm.get('decode_padding_s_per_token'))}, "
                 f"decode_kv_write_s_per_token {_num(cm.get('decode_kv_write_s_per_token'))}")
    for name in ("without_step_spread", "without_padded_context", "without_colocated_slowdown", "without_kv_writes",
                 "without_any"):
        rows = report.get(f"sim_{name}")
        if rows:
            lines.append(f"sim {name.replace('_', ' ')}: " + ", ".join(
                f"{k.removesuffix('_s')} {row['rel_error']:+.1%}" for k, row in rows.items()
                if k.startswith(("ttft_mean", "tbt_")) and row["rel_error"] is not None))
    lines.append(f"wrote {report['plot']}")
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"


