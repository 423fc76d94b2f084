"""``mooncake sim reproduce``: run the paper reproductions, print them next to the paper's
numbers, write ``results.json`` and PNG plots into ``--out``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from tqdm import tqdm

from mooncake_lite.sim import experiments
from mooncake_lite.trace.format import read_trace

EXPERIMENTS = ("table1", "table3", "strategies", "capacity")
NOTES = {
    "table1": "Different trace: the paper's Table 1 uses its arXiv-summarization trace (51% reuse with an "
              "infinite cache); the only trace available here is the conversation trace (36.6%). "
              "From 100k down to 10k blocks the ordering LRU > LFU > length-aware matches the paper and "
              "the fall with capacity is steeper (multi-turn reuse here is spread over the hour, not "
              "clustered). At 1k blocks little more than the block every request shares survives "
              "(hash id 0 alone is 4.2% of references), so all policies give ~5% instead of 30%.",
    "table3": "Paper SLOs are not given for Table 3; TTFT 30 s / TBT 100 ms are the FAST'25 real-workload "
              "ones. 'none' = each stage checks only its own SLO when the request reaches it. The "
              "conductor counts requests it dispatched to a decode whose KV has not arrived yet "
              "(DecodeInstanceState.incoming, docs/scheduler.md), so a prefill window's requests "
              "spread over the decodes instead of herding onto the one least loaded now. With 8 decode "
              "instances this trace never overloads the decode pool: all three policies reject only for "
              "TTFT (early, counting every in-flight request as already decoding, also some for TBT). "
              "With 8P+4D the decode pool is overloaded: 'none' wastes prefills at the decodes' double "
              "check, early (which counts every in-flight request as if it were decoding already) "
              "wastes almost none, and predictive rejects more than early here, unlike the paper: its "
              "forecast for one instant t still lets decodes be refilled past the SLO (wasted "
              "prefills), e.g. by requests admitted later on shorter prefill queues that reach the "
              "decode first. The paper's trace is a different, longer 23k-request sample.",
    "strategies": "Our prefill cost model (FLOPs shape fitted to A100 TP8 measurements) makes 8 prefill "
                  "instances too few for the 1x trace without prefix reuse: random and load-balance "
                  "saturate and their TTFT grows for the whole hour, while the paper's cluster had "
                  "headroom (hence the 0.5x rows). The ordering random > load-balance > cache-aware > "
                  "kvcache-centric matches; global reuse (migrating hot prefixes) is what keeps "
                  "kvcache-centric out of saturation.",
    "capacity": "Capacity = highest replay speed at which >= 90% of all requests meet TTFT <= 30 s and "
                "TBT <= X (rejections count as misses): doubling from 1x, then bisection (within 9%). "
                "Same trend as the paper (the gain shrinks as the TBT SLO loosens), larger gains: with "
                "this trace a 16-node colocated cluster stalls every running decode for a whole "
                "prompt's prefill (seconds; vLLM v0) or for a 2k-token chunk per step (chunked), and "
                "TBT is the mean of the slowest 10% of gaps, so even lightly loaded colocated "
                "instances miss 100-300 ms for many requests. Mooncake is TTFT-bound at 200/300 ms.",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="mooncake sim reproduce",
                                 description="Reproduce the paper's Table 1, Table 3, TTFT by strategy and "
                                             "effective capacity vs a colocated baseline.")
    ap.add_argument("--trace", default=str(Path(__file__).resolve().parents[3] / "shared/traces/conversation_trace.jsonl"))
    ap.add_argument("--out", default="sim-results", help="directory for results.json and PNG plots")
    ap.add_argument("--only", default=",".join(EXPERIMENTS), help=f"comma list of {', '.join(EXPERIMENTS)}")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N requests (quick runs)")
    ap.add_argument("--capacity-iterations", type=int, default=3, help="bisection steps after bracketing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    return ap.parse_args(argv)


def reproduce(args: argparse.Namespace) -> dict[str, Any]:
    only = [e.strip() for e in args.only.split(",") if e.strip()]
    unknown = sorted(set(only) - set(EXPERIMENTS))
    if unknown:
        raise ValueError(f"unknown experiment(s) {unknown}; choose from {', '.join(EXPERIMENTS)}")
    trace = read_trace(args.trace, limit=args.limit)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bar = tqdm(desc="reproduce", unit="step", file=sys.stderr, disable=not sys.stderr.isatty(), leave=False)

    def tick(what: str) -> None:
        bar.set_postfix_str(what, refresh=False)
        bar.update(1)

    results: dict[str, Any] = {"trace": args.trace, "num_requests": len(trace), "seed": args.seed}
    started = time.perf_counter()
    for name in only:
        t0 = time.perf_counter()
        if name == "table1":
            res = experiments.table1(trace, out, tick)
        elif name == "table3":
            res = experiments.table3(trace, out, tick, args.seed)
        elif name == "strategies":
            res = experiments.strategies(trace, out, tick, args.seed)
        else:
            res = experiments.capacity(trace, out, tick, args.seed, iterations=args.capacity_iterations)
        res["notes"] = NOTES[name]
        res["wall_s"] = time.perf_counter() - t0
        results[name] = res
        if not args.json:
            bar.clear()
            print(f"\n{res['table']}\n  note: {res['notes']}\n  ({res['wall_s']:.0f} s; plots: "
                  f"{', '.join(res['plots'])})", flush=True)
    bar.close()
    results["wall_s"] = time.perf_counter() - started
    (out / "results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    return results


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        results = reproduce(args)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"mooncake sim reproduce: error: {exc}\n")
        return 2
    if args.json:
        print(orjson.dumps(results, option=orjson.OPT_NON_STR_KEYS).decode())
    else:
        print(f"\nresults: {Path(args.out) / 'results.json'}  (total {results['wall_s']:.0f} s)")
    return 0
