"""``mooncake bench chaos --conductors N --replay TRACE``: goodput and TTFT of 1, 2 and 3
conductors on a trace replay, live and simulated (issue #38 item 3).

    mooncake bench chaos --conductors 2 --prefill 2 --decode 2 --runs 3 \\
        --replay /work/shared/traces/conversation_trace.jsonl --replay-requests 24 --replay-speed 0.06

Each run replays the first ``--replay-requests`` requests of the trace through HAProxy in front
of the first 1, 2 or 3 conductors, with ``bench replay``'s own pieces (as ``bench fidelity``
sends them: trace blocks of 16 tokens, byte-level prompts, outputs capped at ``--max-tokens``);
each run draws its blocks' contents from its own seed, so no run hits the prefixes an earlier
one left in the stores, while the slice's own sharing stays. The rig has a store per prefill,
so placement has caches and loads to choose by. Once the runs are done: the cost models the
conductor learned are exported, the SLOs are the conductor's relative ones made absolute over
the slice (10x its prefill alone, 5x one step alone: ``bench fidelity``'s conversion), and each
run is judged by them: goodput (requests meeting both, per second of the run: first send to
last token), TTFT p50 and p90. ``sim/conductors.py`` then runs the same slice on the same shape
with the exported model, 1, 2 and 3 conductors with views a heartbeat (0.2 s) late.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from mooncake_lite.bench.chaos import rig
from mooncake_lite.bench.fidelity.live import export_profile, live_replay, replay_options, warm_up
from mooncake_lite.bench.fidelity.sim import ablations, converted_slos, live_overtakes, live_profile, sim_trace
from mooncake_lite.bench.options import Options
from mooncake_lite.bench.replay.metrics import token_gaps, ttft
from mooncake_lite.common.auth import cluster_headers
from mooncake_lite.common.tbt import paper_tbt
from mooncake_lite.trace.format import write_trace

BLOCK = 16                 # the rig's --block-size: one trace block is one KV block
HEARTBEAT_S = 0.2          # the rig's instances' --heartbeat-interval: how late a view of the others' work is
PREFILL_BATCH_TOKENS = 512  # the live prefills' default --prefill-batch-tokens
WARM_UP = 8                # short completions before the first run: its instances start warm


def replay_goodput(ports: dict[str, int], a: Options, token: str) -> dict:
    """The live runs judged by the exported model's SLOs, and the simulator on the same slice."""
    first = f"http://127.0.0.1:{next(iter(ports.values()))}"
    warm_up(first, WARM_UP)
    runs = rig.interleaved(ports, a.runs, lambda url, r, n: _replay(url, a, seed=1 + 10 * r + n))
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    export_profile(first, token, out / "costs.json")
    hw = live_profile(out / "costs.json", "")   # its prefills: the role's default chunk
    window, requests, records = runs[1][0]
    trace = sim_trace(window, requests, records, BLOCK)
    write_trace(trace, out / "sim_trace.jsonl")
    slos = converted_slos([t.input_length for t in trace], hw, a.ttft_slo_factor, a.tbt_slo_factor)
    live = {str(n): rig.spread([judged(recs, slos) for _, _, recs in rs]) for n, rs in runs.items()}
    errors = {str(n): sorted({f"{r.status}: {r.error}" for _, _, recs in rs for r in recs if not r.is_ok})[:5]
              for n, rs in runs.items()}
    return {"slice": {"requests": len(trace), "speed": a.replay_speed, "trace": a.replay}, "slos": slos,
            "live": live, "errors": errors, "sim": simulated(trace, hw, a, slos),
            "sim_without_one_box_effects": simulated(trace, ablations(hw).get("without_any", hw), a, slos)}


def _replay(url: str, a: Options, seed: int) -> tuple[list, list, list]:
    ns = SimpleNamespace(trace=a.replay, num_requests=a.replay_requests, speed=a.replay_speed, block_tokens=BLOCK,
                         output_scale=1.0, max_output_tokens=a.max_tokens, tokenizer="bytes", prompt_mode="text")
    rns = replace(replay_options(ns, url, tempfile.gettempdir()), seed=seed)   # nothing is written there
    window, requests, records, _ = asyncio.run(live_replay(rns, cluster_headers(None)))
    return window, requests, records


def judged(records, slos: dict) -> dict[str, float | None]:
    """One run's figures: goodput (requests meeting the TTFT and paper-TBT SLOs per second, first
    send to last token), the share meeting them, TTFT p50 and p90, failures."""
    ok = [r for r in records if r.is_ok]
    span = max((r.chunk_s[-1] for r in ok), default=0.0) - min((r.send_s for r in records), default=0.0)
    ttfts = sorted(ttft(r) for r in ok)
    good = sum(ttft(r) <= slos["ttft_slo_s"] and (paper_tbt(token_gaps(r)) or 0.0) <= slos["tbt_slo_s"] for r in ok)
    return {"goodput_rps": good / span if span > 0 else None, "slo_attainment": good / len(records) if records else None,
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
            "failed": float(len(records) - len(ok))}


def simulated(trace, hw, a: Options, slos: dict) -> dict[str, dict]:
    """The slice on the simulator: the rig's shape, the exported model, 1, 2 and 3 conductors."""
    from mooncake_lite.scheduler import SchedulerConfig
    from mooncake_lite.sim.conductors import compare
    from mooncake_lite.sim.config import SimConfig
    sched = SchedulerConfig(admission="none", ttft_slo_s=slos["ttft_slo_s"], tbt_slo_s=slos["tbt_slo_s"],
                            block_size=BLOCK)
    cfg = SimConfig(num_prefill=a.prefill, num_decode=a.decode, hardware=hw.name, scheduler=sched,
                    prefill_batch_tokens=PREFILL_BATCH_TOKENS, prefill_queue_overtakes=live_overtakes(""),
                    correct=True)
    return compare(cfg, trace, heartbeat_s=HEARTBEAT_S, hardware=replace(hw, block_size=BLOCK))


def render_replay(res: dict) -> list[str]:
    s = res["slos"]
    lines = ["", f"replay: first {res['slice']['requests']} requests of {res['slice']['trace']} at "
             f"{res['slice']['speed']:g}x; SLOs TTFT {s['ttft_slo_s']:.3f} s, TBT {s['tbt_slo_s'] * 1e3:.1f} ms",
             f"{'conductors':<11}{'live goodput req/s':>28}{'live TTFT p50 s':>26}{'sim goodput':>13}{'sim TTFT p50':>14}"]
    base = res["live"]["1"]
    for n, live in res["live"].items():
        sim = res["sim"][n]
        g, t = live["goodput_rps"], live["ttft_p50_s"]
        lines.append(f"{n:<11}{_mean_spread(g):>28}{_mean_spread(t):>26}{sim['goodput_rps']:>13.3f}"
                     f"{sim['ttft_p50_s'] or 0:>14.3f}")
        if n != "1" and base["goodput_rps"]["mean"]:
            lines.append(f"{'':<11}goodput {g['mean'] / base['goodput_rps']['mean']:.1%} of 1 conductor's, "
                         f"TTFT p50 {t['mean'] / base['ttft_p50_s']['mean']:.1%}")
    return lines


def _mean_spread(fig: dict) -> str:
    return "-" if fig["mean"] is None else f"{fig['mean']:.3f} ({min(fig['runs']):.3f}-{max(fig['runs']):.3f})"
