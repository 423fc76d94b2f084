"""``mooncake bench store-slices``: what N store round trips per block cost, N being the ranks
of a tensor-parallel instance that each write or read only their KV heads (docs/store.md §2f).

A real store process (slots of one block of ``--model``'s KV) is driven over loopback TCP by this
process, with one client per rank as the ranks' own processes would have. Per batch size (1
block: one write-back; ``--blocks``: a prefix) and per degree N (every divisor of the model's KV
heads unless ``--tp`` names them), in the same rounds, alternating so load changes hit each alike:

* ``put``: the blocks as one whole-block PUT (N=1) or N head-slice PUTs at once, one per rank
  client; the store assembles each block (``store/assembly.py``) and shows it once every slice
  is in. Timed until the last answer.
* ``get``: ``get_layers`` of every layer, whole (N=1) or N head ranges at once, one per rank
  client. The store sends each rank only its heads of every layer (one run per layer), so
  the N reads move one block's bytes in all.

Medians over ``--repeat`` rounds, and each figure against N=1's in the same round.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import Sequence

from mooncake_lite.bench.harness import role
from mooncake_lite.bench.options import Options, build_parser, flag, freeze
from mooncake_lite.bench.report import emit, machine, machine_text
from mooncake_lite.common.launch import to_stderr
from mooncake_lite.common.units import format_size
from mooncake_lite.model.checkpoint_config import model_args
from mooncake_lite.store.client import StoreClient
from mooncake_lite.transfer.kv_layout import BlockLayout
from mooncake_lite.transfer.tp_heads import rank_heads

FLAGS = (
    flag("--model", default="small", help="whose KV block shape (a preset or checkpoint)"),
    flag("--block-size", type=int, default=16, help="tokens per block"),
    flag("--dtype-bytes", type=int, default=2, help="bytes per KV element (2: bf16)"),
    flag("--blocks", type=int, default=32, help="blocks of the larger batch (a prefix)"),
    flag("--tp", default=None, help="degrees to compare, e.g. 1,2,4 (default: every divisor of the KV heads)"),
    flag("--repeat", type=int, default=9, help="rounds (the median is reported)"),
    flag("--json", action="store_true", help="print all figures as one JSON object"),
)


def parse_args(argv: Sequence[str]) -> Options:
    return freeze(build_parser("mooncake bench store-slices", __doc__.split("\n\n")[0], FLAGS)
                  .parse_args(list(argv)), "SliceOptions")


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    shape = model_args(args.model)
    heads = shape.num_kv_heads
    degrees = [int(d) for d in args.tp.split(",")] if args.tp else [d for d in range(1, heads + 1) if heads % d == 0]
    if args.repeat < 1 or args.blocks < 1 or 1 not in degrees or any(d < 1 or heads % d for d in degrees):
        sys.stderr.write(f"mooncake bench store-slices: --tp must include 1 and divide {heads} KV heads; "
                         "--repeat and --blocks must be >= 1\n")
        return 2
    layout = BlockLayout(shape.num_layers, heads, 2 * args.block_size * shape.head_dim * args.dtype_bytes)
    emit(measure(args, layout, degrees), render, as_json=args.json)
    return 0


def measure(args: Options, layout: BlockLayout, degrees: list[int]) -> dict:
    load = os.getloadavg()[0]
    dram = 4 * args.blocks * layout.block_bytes
    with role("store", "--port", "0", "--data-port", "0", "--dram", str(dram), "--slot-bytes",
              str(layout.block_bytes), "--log-level", "warning", on_line=to_stderr, stop_timeout=30) as store:
        rounds = asyncio.run(_rounds(store.addresses["data"], args, layout, degrees))
    figures = {}
    for batch in (1, args.blocks):
        for op in ("put", "get"):
            for n in degrees:
                ms = [r[(batch, op, n)] for r in rounds]
                ratio = [r[(batch, op, n)] / r[(batch, op, 1)] for r in rounds]
                figures[f"{op} {batch} {n}"] = {"op": op, "blocks": batch, "tp": n, "ms": statistics.median(ms),
                                                "vs_tp1": statistics.median(ratio), "requests_per_block": n,
                                                "bytes_moved": batch * layout.block_bytes}
    return {"machine": machine(load),
            "model": args.model, "block_bytes": layout.block_bytes, "heads": layout.num_heads,
            "layers": layout.num_layers, "repeat": args.repeat, "figures": figures}


async def _rounds(address: str, args: Options, layout: BlockLayout, degrees: list[int]) -> list[dict]:
    clients = [await StoreClient.connect(address, name=f"rank-{r}", shm=False) for r in range(max(degrees))]
    block = memoryview(os.urandom(layout.block_bytes))
    rounds, serial = [], 0
    try:
        for _ in range(args.repeat):
            times: dict[tuple[int, str, int], float] = {}
            for batch in (1, args.blocks):
                for n in degrees:
                    serial += 1
                    keys = [serial.to_bytes(8, "big") + i.to_bytes(8, "big") for i in range(batch)]
                    times[(batch, "put", n)] = await _timed(_put(clients[:n], keys, block, layout))
                    times[(batch, "get", n)] = await _timed(_get(clients[:n], keys, layout))
                    await clients[0].delete(keys)
            rounds.append(times)
    finally:
        for c in clients:
            await c.close()
    return rounds


async def _timed(coro) -> float:
    t0 = time.perf_counter()
    await coro
    return (time.perf_counter() - t0) * 1e3


async def _put(clients: list[StoreClient], keys: list[bytes], block: memoryview, layout: BlockLayout) -> None:
    n = len(clients)
    if n == 1:
        await clients[0].put(keys, [block] * len(keys), layout.num_layers, layout=layout)
        return
    slices = [layout.cut(block, 0, layout.num_layers, rank_heads(layout.num_heads, n, r)) for r in range(n)]
    await asyncio.gather(*(c.put(keys, [slices[r]] * len(keys), layout.num_layers, layout=layout,
                                 heads=rank_heads(layout.num_heads, n, r)) for r, c in enumerate(clients)))


async def _get(clients: list[StoreClient], keys: list[bytes], layout: BlockLayout) -> None:
    n = len(clients)
    if n == 1:
        got = await clients[0].get_layers(keys, 0, layout.num_layers)
    else:
        parts = await asyncio.gather(*(c.get_layers(keys, 0, layout.num_layers, layout=layout,
                                                    heads=rank_heads(layout.num_heads, n, r)) for r, c in enumerate(clients)))
        got = [v for part in parts for v in part]
    if any(v is None for v in got):
        raise RuntimeError("a block just put was not found: the store is too small for the batch")


def render(report: dict) -> str:
    lines = [f"mooncake bench store-slices: {report['model']} blocks of {format_size(report['block_bytes'])} "
             f"({report['layers']} layers x {report['heads']} KV heads), loopback TCP, "
             f"{machine_text(report['machine'])}, median of {report['repeat']} rounds",
             f"  {'op':<4} {'blocks':>6} {'TP':>3} {'ms':>9} {'x TP=1':>7} {'req/block':>9} {'bytes moved':>12}"]
    for f in report["figures"].values():
        lines.append(f"  {f['op']:<4} {f['blocks']:>6} {f['tp']:>3} {f['ms']:>9.3f} {f['vs_tp1']:>7.2f} "
                     f"{f['requests_per_block']:>9} {format_size(f['bytes_moved']):>12}")
    return "\n".join(lines)
