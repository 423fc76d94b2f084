"""The decode step eager against its CUDA-graph replay (model/cuda_graphs.py), per batch size,
beside the HBM-roof time of reading the weights once.

    python -m mooncake_lite.bench.gpucheck.graphs --model smollm2-135m --device cuda --batch-sizes 1,16,64

Each step is timed as the decode engine runs it: inputs in, forward, greedy tokens read back
(the one synchronisation). The cache holds placeholder KV (a step's cost depends on the context's
length, not its values). On a CPU nothing is captured: the bucketed path runs eagerly on the
static buffers, so the figures there only show that the path runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from mooncake_kernels.device import gpu_peaks
from mooncake_kernels.timing import best_seconds
from mooncake_lite.bench.model.flops import weight_bytes
from mooncake_lite.model.args import DTYPES
from mooncake_lite.model.cuda_graphs import DecodeGraphs, graph_buckets
from mooncake_lite.model.kv_cache import blocks_needed
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model

BLOCK_SIZE = 64


def measure(model: str, device: str, dtype: str, batch_sizes: Sequence[int], context_len: int,
            repeats: int = 10, warmup: int = 2) -> dict:
    net = build_model(model, device=device, dtype=DTYPES[dtype])
    per_seq = blocks_needed(context_len + 1, BLOCK_SIZE)
    runner = ModelRunner(net, num_blocks=per_seq * max(batch_sizes) + 1, block_size=BLOCK_SIZE)
    graphs = DecodeGraphs(runner, graph_buckets(max(batch_sizes)), capture=runner.device.type == "cuda")
    tables = [runner.allocator.allocate(per_seq) for _ in range(max(batch_sizes))]
    hbm = gpu_peaks(device).hbm_gbps if runner.device.type == "cuda" else None
    roof_ms = weight_bytes(net.args, runner.dtype) / (hbm * 1e9) * 1e3 if hbm else None
    rows = {}
    for batch in batch_sizes:
        step = ([1] * batch, tables[:batch], [context_len] * batch)
        eager = best_seconds(lambda: runner.decode(*step).argmax(-1).tolist(), device, repeats, warmup=warmup)
        graph = best_seconds(lambda: graphs.decode(*step).argmax(-1).tolist(), device, repeats, warmup=warmup)
        rows[str(batch)] = {"eager_ms": eager * 1e3, "graph_ms": graph * 1e3, "speedup": eager / graph,
                            "roof_ms": roof_ms, "graph_over_roof": graph * 1e3 / roof_ms if roof_ms else None}
    return {"model": model, "dtype": dtype, "context_len": context_len, "captured": runner.device.type == "cuda",
            "buckets": list(graphs.buckets), "batches": rows}


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="gpucheck.graphs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", required=True, help="comma-separated model specs")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--context-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10, help="timed steps per figure (the best is kept)")
    ns = ap.parse_args(list(argv))
    batches = [int(b) for b in ns.batch_sizes.split(",")]
    out = {m: measure(m, ns.device, ns.dtype, batches, ns.context_len, ns.repeats, warmup=min(2, ns.repeats))
           for m in ns.models.split(",")}
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
