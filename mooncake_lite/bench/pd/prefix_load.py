"""Time a prefill's prefix load from a store role: every layer of an N-token prefix, no compute.

Run old and new code interleaved to compare:

    mooncake bench prefix-load --tokens 2048 --transport shm
    mooncake bench prefix-load --tokens 2048 --transport tcp

It starts a store on 127.0.0.1, puts the prefix's blocks (random bytes of the model's block
size), then per round: MATCH (on the store's node it pins the prefix), ``begin`` the request and
load its layers one by one through ``StageEngine`` (each layer unpacked into the paged cache and
its KV handed to a sender that drops it), exactly as a prefill with a prefix hit does, minus the
forward passes. Prints the best and median round (wall clock, and this process's CPU time:
on a shared box the CPU time is the steadier figure), and the best round per layer.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from mooncake_lite.bench.harness import LOCAL, role
from mooncake_lite.bench.options import build_parser, flag, freeze
from mooncake_lite.bench.pd.overlap import NullSender
from mooncake_lite.bench.report import emit
from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.common.launch import RoleProcess
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.engine import StageEngine
from mooncake_lite.prefill.remote_store import RemoteStore


async def bench(args, store: RoleProcess) -> dict:
    torch.set_num_threads(args.threads)
    model = build_model(args.model)
    a = model.args
    bs = args.block_size
    layer_bytes = 2 * bs * a.num_kv_heads * a.head_dim * 4
    runner = ModelRunner(model, num_blocks=2 * (args.tokens // bs + 1), block_size=bs)
    address = store.addresses["data"]
    remote = RemoteStore(address, None, a.num_layers, layer_bytes, shm=args.transport != "tcp")
    client = await remote.client()
    assert client.transport == args.transport, client.transport
    tokens = torch.randint(0, a.vocab_size, (args.tokens + 1,), generator=torch.Generator().manual_seed(1)).tolist()
    keys = prefix_hash(tokens, bs)
    blocks = [torch.randn(a.num_layers * layer_bytes // 4).numpy().tobytes() for _ in keys]
    await client.put(keys, blocks, num_layers=a.num_layers)
    stage = StageEngine(runner, remote, ThreadPoolExecutor(1), write_back=False)
    rounds, cpu = [], []
    for r in range(args.rounds):
        hit = await remote.match(keys)
        assert hit == len(keys), hit
        t0, c0 = time.perf_counter(), time.process_time()
        job = stage.begin(f"r{r}", tokens, keys, hit, NullSender())
        try:
            for layer in range(a.num_layers):
                await stage._load_prefix_layer(job, layer)
            stage._prefix_in(job)
            rounds.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        finally:
            await stage.release(job)
    await remote.close()
    best, median = min(rounds), statistics.median(rounds)
    return {"transport": args.transport, "tokens": len(keys) * bs, "layers": a.num_layers,
            "layer_bytes": len(keys) * layer_bytes, "best_ms": round(best * 1e3, 2),
            "median_ms": round(median * 1e3, 2), "best_per_layer_us": round(best / a.num_layers * 1e6, 1),
            "cpu_best_ms": round(min(cpu) * 1e3, 2), "cpu_median_ms": round(statistics.median(cpu) * 1e3, 2)}


FLAGS = (
    flag("--model", default="smollm2-135m"),
    flag("--tokens", type=int, default=2048),
    flag("--block-size", type=int, default=64),
    flag("--transport", choices=("shm", "tcp"), default="shm"),
    flag("--rounds", type=int, default=15),
    flag("--threads", type=int, default=1),
    flag("--json", action="store_true", help="accepted for uniformity: the output is always one JSON object"),
)


def main(argv: Sequence[str] | None = None) -> int:
    args = freeze(build_parser("mooncake bench prefix-load", __doc__.splitlines()[0], FLAGS).parse_args(argv),
                  "PrefixLoadOptions")
    with role("store", *LOCAL, "--data-port", "0", "--dram", "512MiB", "--slot-bytes", "8MiB",
              timeout=120.0) as store:
        emit(asyncio.run(bench(args, store)), render=str, as_json=True)
    return 0
