"""``mooncake sim [run] TRACE ...``, ``mooncake sim reproduce``, ``mooncake sim hitrate TRACE``,
``mooncake sim export-costs --conductor URL -o FILE``."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import orjson

from mooncake_lite.common.units import parse_duration
from mooncake_lite.scheduler import ADMISSIONS, STRATEGIES, SchedulerConfig
from mooncake_lite.scheduler.queue_order import DEFAULT_OVERTAKES
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.colocated import ColocatedSim
from mooncake_lite.sim.config import ColocatedConfig, SimConfig
from mooncake_lite.sim.costs import PRESETS, Hardware, get_hardware
from mooncake_lite.sim.metrics import format_summary, summarize
from mooncake_lite.store.eviction import POLICY_NAMES
from mooncake_lite.sim.recorder import SimResult
from mooncake_lite.trace.format import TraceError, TraceRequest, read_trace, spread_arrivals

SUBCOMMANDS = ("run", "reproduce", "hitrate", "export-costs")


def _run_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mooncake sim", description=(
        "Simulate a Mooncake cluster on a trace with the conductor's own scheduler. "
        "Other subcommands: `mooncake sim reproduce --help`, `mooncake sim hitrate --help`, "
        "`mooncake sim export-costs --help`."))
    _cluster_options(ap)
    _policy_options(ap)
    _run_options(ap)
    return ap


def _cluster_options(ap: argparse.ArgumentParser) -> None:
    """The trace and the simulated cluster: shape, queues, hardware, stores, network."""
    ap.add_argument("trace", help="Mooncake JSONL trace")
    ap.add_argument("--prefill", type=int, default=8, help="prefill instances")
    ap.add_argument("--decode", type=int, default=8, help="decode instances")
    ap.add_argument("--cpp", type=int, default=1, help="nodes per prefill instance (CPP group size)")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk tokens (CPP)")
    ap.add_argument("--chunked", action="store_true",
                    help="run and price a prompt over --chunk chunk by chunk, as the live prefill (a cost "
                         "model fitted per chunk, as live-exported ones are); default: one pass")
    ap.add_argument("--prefill-batch-tokens", type=int, default=0,
                    help="prefill batching as the live role's flag: pack queued prompts up to this many "
                         "uncached tokens a forward (capped at --chunk; 0: one prompt at a time, the paper's)")
    ap.add_argument("--prefill-queue-overtakes", type=int, default=0, metavar="K",
                    help="the prefill queue's order, as the live role's --queue-order shortest --queue-overtakes "
                         "K: shortest uncached prompt first, at most K later arrivals passing any one "
                         f"(0: FIFO, the paper's; `mooncake up` serves shortest first with K={DEFAULT_OVERTAKES})")
    ap.add_argument("--correct", action="store_true",
                    help="the live conductor's online correction, fed by the simulated requests: prefill "
                         "compute factors and overtake shares, decode factors and tails (docs/scheduler.md, "
                         "predictions checked)")
    ap.add_argument("--cost-model", default="llama2-70b-a800",
                    help=f"preset ({', '.join(PRESETS)}) or a profile JSON from `mooncake bench pd --profile` "
                         "or `mooncake sim export-costs`")
    ap.add_argument("--eviction", choices=POLICY_NAMES, default=None,
                    help="the store's policy (default: the cost model's live store's, else lru)")
    ap.add_argument("--store-blocks", type=int, default=None,
                    help="blocks per node store (default: the cost model's live store's, else from DRAM)")
    ap.add_argument("--ssd-blocks", type=int, default=None,
                    help="SSD tier blocks per node (0 = none; default: the cost model's live store's, else 0)")
    ap.add_argument("--kv-compression", choices=("none", "int8", "fp8"), default="none",
                    help="store blocks as 1-byte codes (the live --kv-compression): more blocks in the "
                         "same DRAM, smaller prefix loads and fetches")
    ap.add_argument("--network-gbps", type=float, default=None,
                    help="effective network bandwidth between nodes (default: the cost model's)")


def _policy_options(ap: argparse.ArgumentParser) -> None:
    """The conductor's scheduling policy and the SLOs it admits by."""
    ap.add_argument("--strategy", choices=STRATEGIES, default="kvcache-centric")
    ap.add_argument("--admission", choices=ADMISSIONS, default="early")
    ap.add_argument("--local-ttft-check", action="store_true",
                    help="with --admission none, prefill instances refuse requests predicted over the TTFT SLO")
    ap.add_argument("--ttft-slo", type=float, default=None, help="seconds (default 30, or relative by the factor)")
    ap.add_argument("--tbt-slo", type=float, default=None, help="seconds (default 0.1, or relative by the factor)")
    ap.add_argument("--ttft-slo-factor", type=float, default=None,
                    help="without --ttft-slo: TTFT <= this many times the prompt's prefill alone (the conductor's)")
    ap.add_argument("--tbt-slo-factor", type=float, default=None,
                    help="without --tbt-slo: TBT <= this many times one step of the request alone (the conductor's)")
    ap.add_argument("--ttft-admit-margin", type=float, default=0.0,
                    help="refuse on TTFT only this share over its SLO (0: the paper's rule, the conductor's default)")
    ap.add_argument("--threshold", type=float, default=1.5, help="kvcache_balancing_threshold")
    ap.add_argument("--max-tokens-policy", default="output", metavar="output|cap:N",
                    help="what clients send as max_tokens: the true output length, or a fixed cap "
                         "(`mooncake bench replay --max-tokens-policy` sends the same)")
    ap.add_argument("--predict-output", action="store_true",
                    help="size decode times with predicted output lengths (scheduler/predict.py), not max_tokens")
    ap.add_argument("--decode-check", choices=("reserve", "arrival"), default="reserve",
                    help="the decode's own TBT check: at reservation, before prefill (as live), or when the KV "
                         "arrives (the paper's; a refusal wastes the prefill)")


def _run_options(ap: argparse.ArgumentParser) -> None:
    """How the trace is replayed and what the run writes."""
    ap.add_argument("--speed", type=float, default=1.0, help="replay speed factor")
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--arrival-spread", type=parse_duration, default=0.0, metavar="DURATION",
                    help="the trace's timestamps are rounded to this (3s for the conversation trace): each "
                         "request at a random point of its interval (seeded by --seed), as `bench replay "
                         "--arrival-spread`; default 0: as recorded, a burst per timestamp")
    ap.add_argument("--burst-window", type=parse_duration, default=0.0, metavar="DURATION",
                    help="requests arriving this close while every prefill is busy are placed together, "
                         "shortest first, as the conductor's --burst-window (default 0: each as it comes)")
    ap.add_argument("--baseline", action="store_true",
                    help="also run the colocated vLLM-style baseline on the same number of nodes")
    ap.add_argument("--baseline-chunk", type=int, default=None,
                    help="baseline with chunked prefill of this many tokens per step (default: vLLM v0, "
                         "whole prompts that stall decode)")
    ap.add_argument("--tenants", default=None, metavar="FILE",
                    help="[tenants.NAME] tables as the conductor reads them, each with a `share` of the "
                         "trace's requests: per-tenant limits, SLOs and priority shedding (sim/tenants.py)")
    ap.add_argument("--tenants-without", default=None, metavar="NAME",
                    help="with --tenants: also run without NAME's requests, and compare each tenant's p90 TTFT")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for results.json and plots")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--compiled", action="store_true",
                    help="run the simulator's hot modules compiled with mypyc (built once into a cache; needs "
                         "mypy and a C compiler: pip install 'mooncake-lite[compiled]'); the same decisions, faster")


def run_main(argv: list[str]) -> int:
    args = _run_parser().parse_args(argv)
    if args.compiled:
        from mooncake_lite.sim.compiled import run_on_build
        # TenantSim would be an interpreted subclass of the compiled MooncakeSim
        refusal = "--compiled does not run --tenants (run it without --compiled)" if args.tenants else None
        if not run_on_build("mooncake sim", ["sim", "run", *argv], refusal):   # re-executes on the build
            return 2
    try:
        hw, cfg = _run_config(args)
        trace = read_trace(args.trace, speed=args.speed, limit=args.limit, block_size=hw.block_size)
        trace = spread_arrivals(trace, args.arrival_spread * 1e3 / args.speed, args.seed)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"mooncake sim: error: {exc}\n")
        return 2
    if not trace:
        sys.stderr.write("mooncake sim: error: the trace is empty\n")
        return 2
    try:
        runs, tenant_table = _simulate(args, cfg, hw, trace)
    except (ValueError, OSError) as exc:
        if not args.tenants:
            raise
        sys.stderr.write(f"mooncake sim: error: --tenants: {exc}\n")    # its file, its tenants
        return 2
    summaries, limits = [], MooncakeSim(cfg, hw).slo_limits   # per request where relative
    for label, res in runs.items():
        s = summarize(res, args.ttft_slo, args.tbt_slo, limits)
        s["label"] = label
        if "tenants" in res.extra:
            s["tenants"] = res.extra["tenants"]
        summaries.append(s)
    if args.out:
        _write_out(Path(args.out), runs, summaries, args)
    if args.json:
        print(orjson.dumps(summaries if len(summaries) > 1 else summaries[0], option=orjson.OPT_NON_STR_KEYS).decode())
        return 0
    _print_summaries(summaries, len(trace), args, tenant_table)
    return 0


def _run_config(args: argparse.Namespace) -> tuple[Hardware, SimConfig]:
    """The hardware and the simulated cluster the options ask for (ValueError naming a bad one);
    sets ``args.ttft_slo/tbt_slo``: an absolute SLO wins, a factor alone makes it relative (None),
    neither: the paper's defaults."""
    args.ttft_slo = args.ttft_slo if args.ttft_slo is not None or args.ttft_slo_factor else 30.0
    args.tbt_slo = args.tbt_slo if args.tbt_slo is not None or args.tbt_slo_factor else 0.1
    hw = get_hardware(args.cost_model).with_kv_compression(args.kv_compression)
    if args.network_gbps is not None:
        if not math.isfinite(args.network_gbps) or args.network_gbps <= 0:
            raise ValueError(f"--network-gbps must be a positive number, got {args.network_gbps}")
        hw = replace(hw, network_bytes_per_s=args.network_gbps * 1e9 / 8)
    if args.baseline and (args.ttft_slo is None or args.tbt_slo is None):
        raise ValueError("--baseline needs absolute SLOs (--ttft-slo and --tbt-slo), not factors")
    factors = {k: v for k, v in (("ttft_slo_factor", args.ttft_slo_factor), ("tbt_slo_factor", args.tbt_slo_factor)) if v}
    sched = SchedulerConfig(strategy=args.strategy, admission=args.admission, ttft_slo_s=args.ttft_slo,
                            tbt_slo_s=args.tbt_slo, kvcache_balancing_threshold=args.threshold,
                            block_size=hw.block_size, ttft_admit_margin=args.ttft_admit_margin, **factors)
    return hw, SimConfig(num_prefill=args.prefill, num_decode=args.decode, cpp_group_size=args.cpp,
                         prefill_chunk=args.chunk, prefill_chunked=args.chunked, hardware=args.cost_model,
                         eviction=args.eviction,
                         store_blocks_per_node=args.store_blocks, ssd_blocks_per_node=args.ssd_blocks,
                         scheduler=sched,
                         local_ttft_check=args.local_ttft_check, seed=args.seed,
                         max_tokens_policy=args.max_tokens_policy, predict_output=args.predict_output,
                         decode_check=args.decode_check, prefill_batch_tokens=args.prefill_batch_tokens,
                         prefill_queue_overtakes=args.prefill_queue_overtakes, correct=args.correct,
                         burst_window_s=args.burst_window)


def _simulate(args: argparse.Namespace, cfg: SimConfig, hw: Hardware, trace: list[TraceRequest]
              ) -> tuple[dict[str, SimResult], str | None]:
    """Each run the options ask for, by label (Mooncake, or one per tenant mix; the colocated
    baseline), and the tenants' table when there are tenants."""
    from mooncake_lite.sim.runner import run_with_progress
    show = not args.no_progress and not args.json
    tenant_table = None
    if args.tenants:   # issue #18: tenants, priorities and a flood's cost to the others
        from mooncake_lite.sim.tenants import tenant_runs
        runs, tenant_table = tenant_runs(cfg, hw, trace, args.tenants, args.tenants_without, args.seed, show)
    else:
        runs = {f"mooncake {args.prefill * args.cpp}P+{args.decode}D": run_with_progress(MooncakeSim(cfg, hw), trace, "mooncake", show)}
    if args.baseline:
        base = ColocatedConfig(num_instances=args.prefill * args.cpp + args.decode, hardware=args.cost_model,
                               eviction=args.eviction or hw.eviction or "lru",
                               ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo,
                               chunked_prefill_tokens=args.baseline_chunk, seed=args.seed)
        runs[f"colocated {base.num_instances}x"] = run_with_progress(ColocatedSim(base, hw, hw.block_size), trace,
                                                                     "colocated", show)
    return runs, tenant_table


def _write_out(out: Path, runs: dict[str, SimResult], summaries: list[dict], args: argparse.Namespace) -> None:
    """--out: results.json and the plots."""
    from mooncake_lite.sim import plots
    out.mkdir(parents=True, exist_ok=True)
    plots.cdf_plot(runs, out / "cdf.png", args.ttft_slo, args.tbt_slo)
    plots.load_plot(runs, out / "load.png")
    (out / "results.json").write_bytes(orjson.dumps(
        {"summaries": summaries, "config": runs[next(iter(runs))].config},
        option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))


def _print_summaries(summaries: list[dict], num_requests: int, args: argparse.Namespace,
                     tenant_table: str | None) -> None:
    ttft = f"{args.ttft_slo:g}s" if args.ttft_slo is not None else f"{args.ttft_slo_factor:g}x prefill alone"
    tbt = f"{args.tbt_slo * 1e3:g}ms" if args.tbt_slo is not None else f"{args.tbt_slo_factor:g}x a step alone"
    print(format_summary(summaries, f"{num_requests:,} requests, {args.speed:g}x, TTFT SLO {ttft}, TBT SLO {tbt}"))
    for s in summaries:
        print(f"{s['label']}: rejected {s['rejected_by'] or 'none'}; reused {s['reused_token_share']:.1%} of input "
              f"tokens; goodput {s['goodput_rps']:.2f} req/s; {s['requests_per_wall_s']:,.0f} simulated req per "
              f"wall-second ({s['wall_s']:.1f} s wall, {s['cpu_s']:.1f} s CPU)")
    if tenant_table is not None:
        print(tenant_table)
    if args.out:
        print(f"wrote {Path(args.out) / 'results.json'}, cdf.png, load.png")


def hitrate_main(argv: list[str]) -> int:
    from mooncake_lite.sim.hitrate import PAPER_POLICIES, hit_rate_table
    ap = argparse.ArgumentParser(prog="mooncake sim hitrate", description="Block hit rate by policy and capacity.")
    ap.add_argument("trace")
    ap.add_argument("--policies", default=",".join(PAPER_POLICIES))
    ap.add_argument("--capacities", default="inf,100000,50000,30000,10000,1000", help="blocks; inf = unbounded")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        caps = [None if c.strip().lower() == "inf" else int(c) for c in args.capacities.split(",")]
        table = hit_rate_table(read_trace(args.trace), [p.strip() for p in args.policies.split(",")], caps)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"mooncake sim hitrate: error: {exc}\n")
        return 2
    if args.json:
        print(orjson.dumps([h.__dict__ for h in table]).decode())
        return 0
    print(f"{'policy':<14}{'capacity':>10}{'block hit':>11}{'token hit':>11}")
    for h in table:
        print(f"{h.policy:<14}{'inf' if h.capacity_blocks is None else h.capacity_blocks:>10}"
              f"{h.block_hit_rate:>11.3f}{h.token_hit_rate:>11.3f}")
    return 0


def export_costs_main(argv: list[str]) -> int:
    """Write a running cluster's own cost models (its conductor's ``/internal/v1/cost_model``) as
    a ``--cost-model`` file, checked by loading it back the way ``mooncake sim`` will."""
    import os
    import urllib.error
    import urllib.request

    from mooncake_lite.common.auth import cluster_headers
    from mooncake_lite.sim.costs import load_profile
    ap = argparse.ArgumentParser(prog="mooncake sim export-costs", description=(
        "Export the cost models a running cluster's instances report (start-up profiles, refined "
        "while serving) as a `mooncake sim --cost-model` file."))
    ap.add_argument("--conductor", required=True, help="conductor URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--token", default=os.environ.get("MOONCAKE_CLUSTER_TOKEN"),
                    help="the cluster token (default: $MOONCAKE_CLUSTER_TOKEN)")
    ap.add_argument("-o", "--out", required=True, help="profile JSON to write")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds")
    args = ap.parse_args(argv)
    url = args.conductor.rstrip("/") + "/internal/v1/cost_model"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=cluster_headers(args.token)),
                                    timeout=args.timeout) as resp:
            profile = orjson.loads(resp.read())
        Path(args.out).write_bytes(orjson.dumps(profile, option=orjson.OPT_INDENT_2))
        hw = load_profile(args.out)
    except urllib.error.HTTPError as exc:
        sys.stderr.write(f"mooncake sim export-costs: error: {url} answered {exc.code}: "
                         f"{exc.read()[:300].decode('utf-8', 'replace')}\n")
        return 2
    except (urllib.error.URLError, OSError, ValueError) as exc:
        sys.stderr.write(f"mooncake sim export-costs: error: {url}: {exc}\n")
        return 2
    measured = "measured" if profile.get("network_bytes_per_s_measured") else "the conductor's prior"
    print(f"wrote {args.out}: {hw.name} from {len(profile.get('instances', []))} live instance(s); "
          f"prefill {hw.prefill.predict(512) * 1e3:.1f} ms per 512 tokens, decode step "
          f"{hw.decode.predict(1, 512) * 1e3:.1f} ms at batch 1; network {hw.network_bytes_per_s / 1e9:.2f} GB/s "
          f"({measured})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "reproduce":
        from mooncake_lite.sim.reproduce import main as reproduce_main
        return reproduce_main(argv[1:])
    if argv and argv[0] == "hitrate":
        return hitrate_main(argv[1:])
    if argv and argv[0] == "export-costs":
        return export_costs_main(argv[1:])
    if argv and argv[0] == "run":
        argv = argv[1:]
    try:
        return run_main(argv)
    except TraceError as exc:
        sys.stderr.write(f"mooncake sim: error: {exc}\n")
        return 2
