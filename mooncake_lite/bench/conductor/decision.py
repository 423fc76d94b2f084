"""``bench conductor``'s ``decision`` part: the scheduler timed on a synthetic cluster (16 prefill +
16 decode instances, a million indexed block keys, a 64-block request), in three cases —
``conductor`` (the live conductor's snapshot plus decision in a steady state, ``steady.py``),
``warm`` (the core alone, unchanged snapshot) and ``fresh`` (the core alone, nothing cached)."""

from __future__ import annotations

import argparse
import math
import os
import random
import time

import numpy as np

from mooncake_lite.bench.conductor import steady as conductor_steady
from mooncake_lite.bench.options import Options, flag
from mooncake_lite.scheduler import (BlockIndex, ClusterState, CostModels, DecodeCostModel,
                                     DecodeInstanceState, DecodingRequest, FromScratch, IncomingRequest,
                                     PrefillCostModel, PrefillInstanceState, QueuedPrefill,
                                     ScheduleRequest, Scheduler, SchedulerConfig,
                                     kv_bytes_per_token)

CASES = ("conductor", "warm", "fresh")
MEDIAN_TARGET_US = 200.0
P99_TARGET_US = 1000.0
BLOCK_SIZE = 512


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


FLAGS = (
    flag("--num-prefill", type=_positive, default=16, help="prefill instances (one store each)"),
    flag("--num-decode", type=_positive, default=16, help="decode instances"),
    flag("--num-blocks", type=_positive, default=1_000_000, help="indexed block keys"),
    flag("--request-blocks", type=_positive, default=64, help="blocks per request"),
    flag("--iterations", type=_positive, default=20_000, help="decisions timed per case"),
    flag("--seed", type=int, default=0, help="seed of the synthetic cluster"),
    flag("--uniform-decode", type=_positive_seconds, default=None, metavar="SECONDS",
         help="t_d for predictive admission, as the conductor's --uniform-decode (default: "
              "none, like the conductor: max_tokens × current TBT per request)"),
    flag("--tokens-per-decision", type=_positive, default=2,
         help="conductor case: tokens each running request generates between two "
              "decisions (≈ arrival interval / decode step time)"),
)


PREFILL_COST = PrefillCostModel(c0=0.02, c1=1.2e-4, c2=1.5e-9)
DECODE_COST = DecodeCostModel(c0=0.02, c1=2e-4, c2=1e-7)


def _jittered(model: PrefillCostModel | DecodeCostModel, rng: random.Random):
    return type(model).from_dict({k: v * rng.uniform(0.95, 1.05) for k, v in model.to_dict().items()})


def build_cluster(num_prefill: int, num_decode: int, num_blocks: int, request_blocks: int,
                  seed: int) -> tuple[BlockIndex, ClusterState, list[ScheduleRequest]]:
    """A busy synthetic cluster: every store holds ~num_blocks/num_prefill of the keys (some
    replicated), each prefill has queued work bound for decode instances, each decode runs a
    batch; requests share prefixes of varying depth with several stores."""
    rng = random.Random(seed)
    stores = [f"store-{i}" for i in range(num_prefill)]
    index, requests = _index_and_requests(rng, stores, num_blocks, request_blocks)
    return index, _busy_instances(rng, stores, num_decode), requests


def _index_and_requests(rng: random.Random, stores: list[str], num_blocks: int,
                        request_blocks: int) -> tuple[BlockIndex, list[ScheduleRequest]]:
    """Each store's keys indexed, and 64 requests: a prefix held by one store, partly replicated
    to two others, then new blocks."""
    index = BlockIndex()
    per_store = num_blocks // len(stores)
    chains: list[list[bytes]] = []
    for store in stores:
        keys = [rng.randbytes(16) for _ in range(per_store)]
        index.add(store, keys)
        chains.append(keys[:request_blocks])
    requests = []
    for r in range(64):
        home = rng.randrange(len(stores))
        depth = rng.randint(request_blocks // 4, request_blocks)
        prefix = chains[home][:depth]
        keys = prefix + [rng.randbytes(16) for _ in range(request_blocks - len(prefix))]
        for other in rng.sample(range(len(stores)), 2):
            index.add(stores[other], keys[:rng.randint(0, depth)])
        requests.append(ScheduleRequest(f"r{r}", tuple(keys), request_blocks * BLOCK_SIZE, 256))
    return index, requests


def _busy_instances(rng: random.Random, stores: list[str], num_decode: int) -> ClusterState:
    """Prefill queues, each queued prefill committed to a decode instance (it appears there as
    incoming), and decode batches; every instance with its own cost model, as live instances
    have (each profiles itself at startup): the same hardware, fitted a few percent apart."""
    num_prefill = len(stores)
    incoming: list[list[IncomingRequest]] = [[] for _ in range(num_decode)]
    queues = []
    for i in range(num_prefill):
        queue = []
        for j in range(rng.randint(0, 6)):
            job = QueuedPrefill(f"q{i}-{j}", rng.randint(1000, 30000), rng.randint(0, 8000),
                                started_at=-0.1 if j == 0 else None)
            incoming[rng.randrange(num_decode)].append(IncomingRequest(job.request_id, job.num_tokens, 256))
            queue.append(job)
        queues.append(tuple(queue))
    prefills = tuple(PrefillInstanceState(f"prefill-{i}", stores[i], queues[i],
                                          cost=_jittered(PREFILL_COST, rng)) for i in range(num_prefill))
    decodes = tuple(
        DecodeInstanceState(f"decode-{i}", tuple(
            DecodingRequest(f"d{i}-{j}", rng.randint(1000, 40000), -rng.uniform(0, 60), 512)
            for j in range(rng.randint(8, 48))), cost=_jittered(DECODE_COST, rng), incoming=tuple(incoming[i]))
        for i in range(num_decode))
    return ClusterState(prefills, decodes)


def _time_decisions(sched: Scheduler, cluster: ClusterState, requests: list[ScheduleRequest],
                    iterations: int) -> tuple[np.ndarray, np.ndarray]:
    """(wall µs, thread-CPU µs) per decision on a fixed cluster: "warm" with an estimate cache
    (every instance unchanged, as a conductor sees the ones that did not change), "fresh" with a
    FromScratch one (nothing derived is reused — the worst case)."""
    return conductor_steady.time_each(
        iterations, lambda i: sched.schedule(requests[i % len(requests)], cluster, 0.0))


def run(args: Options) -> dict:
    t0 = time.perf_counter()
    index, cluster, requests = build_cluster(args.num_prefill, args.num_decode, args.num_blocks,
                                             args.request_blocks, args.seed)
    figures: dict = {"num_prefill": args.num_prefill, "num_decode": args.num_decode,
                     "indexed_blocks": len(index), "request_blocks": args.request_blocks,
                     "setup_s": round(time.perf_counter() - t0, 2),
                     "load_average_1m": round(os.getloadavg()[0], 2), "num_cpus": os.cpu_count()}
    costs = CostModels(PREFILL_COST, DECODE_COST, kv_bytes_per_token(80, 8, 128, 2), bandwidth_bytes_per_s=20e9)
    for admission in ("early", "predictive"):
        # The conductor's default SLOs: relative to each instance's own cost model.
        config = SchedulerConfig(strategy="kvcache-centric", admission=admission, ttft_slo_s=None,
                                 tbt_slo_s=None, block_size=BLOCK_SIZE, uniform_decode_s=args.uniform_decode)
        for snapshot in CASES:
            sched = Scheduler(config, costs, index, cache=FromScratch() if snapshot == "fresh" else None)
            if snapshot == "conductor":
                wall, cpu = conductor_steady.time_steady_decisions(
                    cluster, sched, requests, args.iterations, args.tokens_per_decision, BLOCK_SIZE, args.seed)
            else:
                wall, cpu = _time_decisions(sched, cluster, requests, args.iterations)
            for clock, us in (("", wall), ("cpu_", cpu)):
                median, p99 = float(np.median(us)), float(np.percentile(us, 99))
                name = f"{admission}_{snapshot}_{clock}"
                figures[f"{name}median_us"] = round(median, 1)
                figures[f"{name}p99_us"] = round(p99, 1)
                figures[f"{name}median_vs_target"] = round(median / MEDIAN_TARGET_US, 3)
                figures[f"{name}p99_vs_target"] = round(p99 / P99_TARGET_US, 3)
    match_us = np.empty(min(args.iterations, 5000))
    for i in range(len(match_us)):
        keys = requests[i % len(requests)].block_keys
        start = time.thread_time_ns()
        index.match(keys)
        match_us[i] = (time.thread_time_ns() - start) / 1e3
    figures["tokens_per_decision"] = args.tokens_per_decision
    figures["uniform_decode_s"] = args.uniform_decode
    figures["match_cpu_median_us"] = round(float(np.median(match_us)), 1)
    figures["decision_median_target_us"] = MEDIAN_TARGET_US
    figures["decision_p99_target_us"] = P99_TARGET_US
    return figures


def render(f: dict) -> str:
    lines = [f"decision: {f['num_prefill']}P+{f['num_decode']}D, {f['indexed_blocks']:,} indexed blocks, "
             f"{f['request_blocks']}-block request (setup {f['setup_s']} s, load average "
             f"{f['load_average_1m']} on {f['num_cpus']} CPUs; predictive t_d: "
             f"{f['uniform_decode_s'] or 'max_tokens × TBT'})",
             f"  targets: median ≤ {MEDIAN_TARGET_US:.0f} µs, p99 ≤ {P99_TARGET_US:.0f} µs; "
             "ratios are measured/target (≤ 1 meets it)"]
    for adm in ("early", "predictive"):
        for snap in CASES:
            for clock in ("", "cpu_"):
                k = f"{adm}_{snap}_{clock}"
                lines.append(f"  {adm:<10} {snap:<9} {clock[:-1] or 'wall':<4} median "
                             f"{f[k + 'median_us']:7.1f} µs ({f[k + 'median_vs_target']:.2f}×)   "
                             f"p99 {f[k + 'p99_us']:7.1f} µs ({f[k + 'p99_vs_target']:.2f}×)")
    lines += [f"  conductor: the live conductor's snapshot + decision in a steady state "
              f"({f['tokens_per_decision']} tokens per running request between decisions) — the targeted figure",
              "  warm: scheduler core alone, unchanged snapshot; fresh: core alone, nothing cached (worst case)",
              "  wall: perf_counter; cpu: this thread's CPU time (excludes preemption by other processes)",
              f"  FindBestPrefixMatch alone: median {f['match_cpu_median_us']} µs CPU"]
    return "\n".join(lines)
