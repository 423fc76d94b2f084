"""``mooncake bench tp-prefix``: a tensor-parallel prefill whose ranks load their own KV heads of
a cached prefix and write their own heads of new blocks, against rank 0 reading and writing every
head (docs/store.md §2f), in one run.

A TP=N prefill (rank 0 in this process, ranks 1..N-1 spawned with their own store connections, as
an instance runs them) prefills ``--prefix-blocks`` cached blocks plus a ``--tail`` of new tokens
(a different tail each time, so its full blocks are written back) to a live TP=1 decode process,
from and to a live store process, alternately each way (``TPLeaderRunner.ranks_store`` on and
off), after a warm-up of each. Per prefill: the time from its start to the decode's answer to
END, and the KV bytes through rank 0: what it read from the store, what it wrote to it, and what
crossed its collectives (KV it broadcast for its ranks to write, ``gathered_bytes["handed"]``,
and theirs it gathered to write back, ``["pack_kv"]``).
"""

from __future__ import annotations

import asyncio
import os
import statistics
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import torch

from mooncake_lite.bench.harness import role
from mooncake_lite.bench.options import Options, build_parser, flag, freeze
from mooncake_lite.bench.pd.overlap import prefill_once
from mooncake_lite.bench.pd.roles import BLOCK, announce
from mooncake_lite.bench.report import emit, machine, machine_text
from mooncake_lite.common.launch import to_stderr
from mooncake_lite.instance.tp_ranks import RankPlan, TPGroup
from mooncake_lite.common.ports import free_port
from mooncake_lite.model.tp_comms import GroupAddress
from mooncake_lite.model.weights import model_args
from mooncake_lite.prefill.engine import StageEngine
from mooncake_lite.prefill.kv_sender import DecodeLinks, KVSender
from mooncake_lite.prefill.rank_store import follower_stores, remote_prefix_store

FLAGS = (
    flag("--model", default="small", help="a preset or checkpoint whose KV heads N divides"),
    flag("--tp", type=int, default=2, help="the prefill's degree"),
    flag("--prefix-blocks", type=int, default=8, help=f"cached prefix blocks ({BLOCK} tokens each)"),
    flag("--tail", type=int, default=2 * BLOCK, help="new tokens after the prefix (full blocks are written back)"),
    flag("--repeats", type=int, default=5, help="prefills each way (the median is reported)"),
    flag("--json", action="store_true", help="print all figures as one JSON object"),
)
MODES = ("ranks load and write", "rank 0 does all")
COUNTED = ("store_read", "store_written", "handed", "gathered")


def main(argv: Sequence[str]) -> int:
    a = freeze(build_parser("mooncake bench tp-prefix", __doc__.split("\n\n")[0], FLAGS).parse_args(list(argv)),
               "TPPrefixOptions")
    load = os.getloadavg()[0]
    blocks = 2 * (a.prefix_blocks + -(-a.tail // BLOCK)) + 2
    block_bytes = model_args(a.model).kv_block_bytes(BLOCK, torch.float32)
    with role("store", "--port", "0", "--data-port", "0", "--dram", str(4 * blocks * a.repeats * block_bytes),
              "--slot-bytes", str(block_bytes), "--log-level", "warning", on_line=to_stderr) as store, \
            role("decode", "--model", a.model, "--dtype", "float32", "--block-size", str(BLOCK), "--port", "0",
                 "--num-blocks", str(blocks), "--no-profile", "--threads", "1", "--log-level", "warning",
                 on_line=to_stderr) as decode:
        address = store.addresses["data"]
        group = TPGroup(RankPlan(a.model, "float32", 0, ("cpu",) * a.tp, 1, None, blocks, BLOCK,
                                 GroupAddress("127.0.0.1", free_port(), a.tp, 120.0, "gloo"),
                                 rank_store=follower_stores(address, None, None, a.tp)))
        try:
            runs = asyncio.run(_runs(group.runner, address, decode, a))
        finally:
            group.stop()
    report = {"machine": machine(load),
              "model": a.model, "tp": a.tp, "prefix_tokens": a.prefix_blocks * BLOCK, "tail": a.tail,
              "repeats": a.repeats,
              "modes": {mode: {k: statistics.median(r[k] for r in rs) for k in ("ttft_ms", *COUNTED)}
                        for mode, rs in runs.items()}}
    emit(report, render, as_json=a.json)
    return 0


def _engine(runner, address: str, ranks: bool, counts: dict[str, int]) -> StageEngine:
    """The stage engine of one mode: rank 0's store of its own heads (the ranks load and write
    theirs) or of every head (written as one slice per writing rank); its bytes counted."""
    runner.ranks_store = ranks
    store = remote_prefix_store(address, None, None, runner.args, BLOCK, runner.dtype,
                                runner.layout.kv_heads if ranks else None, None if ranks else runner.kv_senders)
    get_layers, put_layers = store.get_layers, store.put_layers

    async def counted_get(*args, **kwargs):
        views = await get_layers(*args, **kwargs)
        counts["store_read"] += sum(v.nbytes for v in views)
        return views

    async def counted_put(keys, values, *args, **kwargs):
        counts["store_written"] += sum(v.nbytes for v in values)
        return await put_layers(keys, values, *args, **kwargs)
    store.get_layers, store.put_layers = counted_get, counted_put
    return StageEngine(runner, store, ThreadPoolExecutor(1))


async def _runs(runner, address: str, decode, a: Options) -> dict[str, list[dict]]:
    vocab, gen = runner.args.vocab_size, torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (a.prefix_blocks * BLOCK,), generator=gen).tolist()
    counts = dict.fromkeys(COUNTED, 0)
    engines = {mode: _engine(runner, address, mode == MODES[0], counts) for mode in MODES}
    links, runs = DecodeLinks(None), {mode: [] for mode in MODES}
    async with aiohttp.ClientSession() as session:
        for i in range(-1, a.repeats + 1):   # -1: writes the prefix; 0: a warm-up of each way
            for mode in MODES if i >= 0 else MODES[1:]:
                runner.ranks_store = mode == MODES[0]
                tokens = prefix + torch.randint(0, vocab, (a.tail,), generator=gen).tolist()
                tid = f"tp-prefix-{i}-{runner.ranks_store}"
                resp = await announce(session, decode, tid, len(tokens))
                sender = KVSender.for_runner(await links.get(decode.addresses["data"]), tid, runner,
                                             decode.addresses["data"])
                before = counts | {"handed": runner.gathered_bytes["handed"],
                                   "gathered": runner.gathered_bytes["pack_kv"] + runner.gathered_bytes["gather_kv"]}
                out = await prefill_once(engines[mode], sender, tokens, a.tail, a.prefix_blocks if i >= 0 else 0)
                await engines[mode].drain_puts()
                await resp.read()
                resp.release()
                after = counts | {"handed": runner.gathered_bytes["handed"],
                                  "gathered": runner.gathered_bytes["pack_kv"] + runner.gathered_bytes["gather_kv"]}
                if i > 0:
                    runs[mode].append({"ttft_ms": out["ttft_s"] * 1e3} | {k: after[k] - before[k] for k in COUNTED})
    await links.close()
    for engine in engines.values():
        await engine.store.close()
    return runs


def render(r: dict) -> str:
    mib = 2 ** 20
    ranks, rank0 = (r["modes"][mode] for mode in MODES)
    return "\n".join([
        f"mooncake bench tp-prefix: {r['model']} at TP={r['tp']}, {r['prefix_tokens']} cached + {r['tail']} new "
        f"tokens to a TP=1 decode, {machine_text(r['machine'])}, "
        f"median of {r['repeats']}",
        f"  {'':<21} {'to END ms':>10} {'store read':>11} {'written':>9} {'handed':>9} {'gathered':>9}  (MiB through rank 0)",
        *(f"  {mode:<21} {f['ttft_ms']:10.1f} {f['store_read'] / mib:11.2f} {f['store_written'] / mib:9.2f} "
          f"{f['handed'] / mib:9.2f} {f['gathered'] / mib:9.2f}" for mode, f in r["modes"].items()),
        f"  ranks / rank 0: {ranks['ttft_ms'] / rank0['ttft_ms']:.2f}x the time, "
        f"{sum(ranks[k] for k in COUNTED) / max(1, sum(rank0[k] for k in COUNTED)):.2f}x the bytes through rank 0"])
