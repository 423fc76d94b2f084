"""``mooncake bench tp-send``: a tensor-parallel prefill's ranks sending their own KV heads
against rank 0 gathering and sending every head (docs/store.md §2f), in one run.

A TP=N prefill (rank 0 in this process, ranks 1..N-1 spawned, as an instance runs them) streams
one prompt's KV to a live TP=1 decode process, alternately each way (``TPLeaderRunner.ranks_send``
on and off), after a warm-up of each: the time from the prefill's start to the decode's answer
to END (the TTFT the prefill adds), and the bytes of the other ranks' KV that came through rank 0
(``gathered_bytes``), per prefill. The prompt is computed whole (no prefix: nothing loaded, and
no store write-back: ``bench tp-prefix`` measures those), so every frame is of a computed layer.
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
from mooncake_lite.prefill.engine import StageEngine
from mooncake_lite.prefill.kv_sender import DecodeLinks, KVSender
from mooncake_lite.prefill.store_io import MemoryStore

FLAGS = (
    flag("--model", default="small", help="a preset or checkpoint whose KV heads N divides"),
    flag("--tp", type=int, default=2, help="the prefill's degree"),
    flag("--prompt-len", type=int, default=512, help="prompt tokens"),
    flag("--chunk", type=int, default=256, help="prefill chunk tokens"),
    flag("--repeats", type=int, default=5, help="prefills each way (the median is reported)"),
    flag("--json", action="store_true", help="print all figures as one JSON object"),
)


def main(argv: Sequence[str]) -> int:
    a = freeze(build_parser("mooncake bench tp-send", __doc__.split("\n\n")[0], FLAGS).parse_args(list(argv)),
               "TPSendOptions")
    load = os.getloadavg()[0]
    blocks = 2 * -(-a.prompt_len // BLOCK) + 2
    group = TPGroup(RankPlan(a.model, "float32", 0, ("cpu",) * a.tp, 1, None, blocks, BLOCK,
                             GroupAddress("127.0.0.1", free_port(), a.tp, 120.0, "gloo")))
    try:
        with role("decode", "--model", a.model, "--dtype", "float32", "--block-size", str(BLOCK), "--port", "0",
                  "--num-blocks", str(blocks), "--no-profile", "--threads", "1", "--log-level", "warning",
                  on_line=to_stderr) as decode:
            runs = asyncio.run(_runs(group.runner, decode, a))
    finally:
        group.stop()
    report = {"machine": machine(load),
              "model": a.model, "tp": a.tp, "prompt_len": a.prompt_len, "repeats": a.repeats,
              "modes": {mode: {"ttft_ms": statistics.median(r["ms"] for r in rs),
                               "bytes_through_rank0": statistics.median(r["bytes"] for r in rs)}
                        for mode, rs in runs.items()}}
    emit(report, render, as_json=a.json)
    return 0


async def _runs(runner, decode, a: Options) -> dict[str, list[dict]]:
    layer_bytes = runner.args.kv_block_bytes(BLOCK, runner.dtype) // runner.args.num_layers
    stage = StageEngine(runner, MemoryStore((0, runner.args.num_layers), layer_bytes), ThreadPoolExecutor(1),
                        write_back=False)
    links = DecodeLinks(None)
    tokens = torch.randint(0, runner.args.vocab_size, (a.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    runs: dict[str, list[dict]] = {"ranks send": [], "rank 0 gathers": []}
    async with aiohttp.ClientSession() as session:
        for i in range(a.repeats + 1):   # the first of each way: a warm-up
            for mode in runs:
                runner.ranks_send = mode == "ranks send"
                tid = f"tp-send-{i}-{runner.ranks_send}"
                resp = await announce(session, decode, tid, len(tokens))
                address = decode.addresses["data"]
                sender = KVSender.for_runner(await links.get(address), tid, runner, address)
                before = runner.gathered_bytes["gather_kv"]
                out = await prefill_once(stage, sender, tokens, a.chunk, 0)
                await resp.read()
                resp.release()
                if i:
                    runs[mode].append({"ms": out["ttft_s"] * 1e3, "bytes": runner.gathered_bytes["gather_kv"] - before})
    runner.ranks_send = True
    await links.close()
    return runs


def render(r: dict) -> str:
    send, gather = r["modes"]["ranks send"], r["modes"]["rank 0 gathers"]
    return "\n".join([
        f"mooncake bench tp-send: {r['model']} at TP={r['tp']}, {r['prompt_len']}-token prompt to a TP=1 decode, "
        f"{machine_text(r['machine'])}, median of {r['repeats']}",
        *(f"  {mode:<15} prefill to END answered {f['ttft_ms']:9.1f} ms   other ranks' KV through rank 0 "
          f"{f['bytes_through_rank0'] / 2**20:8.2f} MiB" for mode, f in r["modes"].items()),
        f"  ranks send / rank 0 gathers: {send['ttft_ms'] / gather['ttft_ms']:.2f}x the time"])
