"""``bench pd`` (e): a burst of prompts at one prefill instance, with prefill batching and one prompt
at a time, interleaved; the conductor's predicted TTFTs for both; and the packed forward's
attention as run (varlen) against a padded batch."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import torch
import torch.nn.functional as F

from mooncake_kernels.timing import timed
from mooncake_lite.bench.options import Options
from mooncake_lite.bench.pd.roles import BLOCK, announce
from mooncake_lite.common.launch import RoleProcess
from mooncake_lite.common.protocol import PrefillRequest, Sampling
from mooncake_lite.instance.profile import profile_prefill
from mooncake_kernels import packed_prefill_attention
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.prefill.engine import StageEngine
from mooncake_lite.prefill.kv_sender import DecodeLinks
from mooncake_lite.prefill.service import PrefillService
from mooncake_lite.prefill.store_io import MemoryStore
from mooncake_lite.scheduler import (BlockIndex, ClusterState, CostModels, DecodeCostModel, DecodeInstanceState,
                                     PrefillCostModel, PrefillView, ScheduleRequest, Scheduler, SchedulerConfig)



async def burst_ttfts(service: PrefillService, decode: RoleProcess, tag: str, n: int, length: int,
                      vocab: int, seed: int) -> list[float]:
    """Each TTFT (prefill request in to first token out, KV acknowledged by decode) of ``n``
    fresh prompts sent to ``service`` at once; decode has reserved every one before."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]
    async with aiohttp.ClientSession() as session:
        tids = [f"burst-{tag}-{seed}-{i}" for i in range(n)]
        resps = [await announce(session, decode, tid, len(p)) for tid, p in zip(tids, prompts)]
        t0 = time.perf_counter()

        async def one(tid: str, tokens: list[int]) -> float:
            await service.prefill(PrefillRequest(tid, tid, tuple(tokens), decode.addresses["data"],
                                                 Sampling(max_tokens=1)))
            return time.perf_counter() - t0

        ttfts = await asyncio.gather(*(one(tid, p) for tid, p in zip(tids, prompts)))
        for resp in resps:
            await resp.read()
            resp.release()
    return list(ttfts)


def predicted_burst_ttfts(cost: PrefillCostModel, n: int, length: int, pack_tokens: int) -> list[float]:
    """The conductor's predicted TTFT of each prompt of a burst of ``n`` fresh ``length``-token
    prompts sent to one prefill instance at once, in arrival order: its scheduler deciding each
    with the ones before it queued (the first running since the burst began), the instance
    registered with ``cost`` and ``pack_tokens``, as membership shows it."""
    costs = CostModels(cost, DecodeCostModel(), kv_bytes_per_token=1)
    scheduler = Scheduler(SchedulerConfig(block_size=BLOCK, admission="none"), costs, BlockIndex())
    view, out = PrefillView("prefill", "store", None, cost, pack_tokens), []
    for i in range(n):
        cluster = ClusterState((view.state(),), (DecodeInstanceState("decode"),))
        out.append(scheduler.schedule(ScheduleRequest(f"b{i}", (), length, 1), cluster, 0.0).predicted_ttft_s)
        view.add(f"b{i}", length, 0, 0.0 if i == 0 else None)
    return out


async def bench_burst(runner: ModelRunner, a: Options, decode: RoleProcess) -> dict:
    """(e): the same bursts with prefill batching and without, interleaved; best run of each.
    Beside them, the conductor's predicted TTFTs for each mode from the start-up profile a
    prefill role reports (``profile_prefill``' default shapes), the batched instance's queue
    priced packed (its ``pack_tokens``) and as one prompt at a time (a conductor told nothing)."""
    cost, _ = profile_prefill(runner)
    runs, batched = await run_bursts(runner, a, decode)
    out = {"prompts": a.burst, "prompt_len": a.burst_len, "batch_tokens": a.burst_tokens,
           "packed_forwards": batched.totals["packed_forwards_total"]}
    for mode, rs in runs.items():
        out[f"mean_ttft_{mode}_s"] = min(sum(r) / len(r) for r in rs)
        out[f"last_ttft_{mode}_s"] = min(max(r) for r in rs)
        out[f"first_ttft_{mode}_s"] = min(min(r) for r in rs)
    out["mean_ratio"] = out["mean_ttft_batched_s"] / out["mean_ttft_unbatched_s"]
    out["last_ratio"] = out["last_ttft_batched_s"] / out["last_ttft_unbatched_s"]
    for mode, limit in (("batched", batched.pack_limit), ("unbatched", 0)):
        predicted = predicted_burst_ttfts(cost, a.burst, a.burst_len, limit)
        out[f"predicted_mean_ttft_{mode}_s"] = sum(predicted) / len(predicted)
        out[f"predicted_last_ttft_{mode}_s"] = predicted[-1]
    out["prefill_cost"] = cost.to_dict()
    # the packed forward's attention, as run (varlen) and as a padded batch would: equal prompts,
    # then lengths spread 0.5-1.5x (padding to the longest then costs more)
    spread = [max(1, a.burst_len * (2 + 4 * i // max(1, a.burst - 1)) // 4) for i in range(a.burst)]
    out["attention_equal"] = attention_varlen_vs_padded(runner, [a.burst_len] * a.burst, 5 * a.repeats)
    out["attention_spread"] = attention_varlen_vs_padded(runner, spread, 5 * a.repeats)
    return out


async def run_bursts(runner: ModelRunner, a: Options, decode: RoleProcess) -> tuple[dict[str, list[list[float]]],
                                                                                      PrefillService]:
    """Each measured burst's TTFTs by mode (``batched``, ``unbatched``), ``--repeats`` rounds after
    a warm-up round, and the batched service (its counters and pack limit)."""
    layer_bytes = runner.cache.kv[0].numel() // runner.cache.num_blocks * runner.cache.kv.element_size()
    stage = StageEngine(runner, MemoryStore((0, runner.args.num_layers), layer_bytes), ThreadPoolExecutor(1),
                        write_back=False)
    links = DecodeLinks(None)
    modes = {}
    for mode, budget in (("batched", a.burst_tokens), ("unbatched", 0)):
        # chunk = the budget, so a pack may hold it all (the role's defaults: both 512)
        modes[mode] = PrefillService(stage, links, block_size=BLOCK, hash_seed=0,
                                     chunk_size=max(a.burst_tokens, a.burst_len), batch_tokens=budget)
    runs: dict[str, list[list[float]]] = {m: [] for m in modes}
    for rep in range(a.repeats + 1):        # the first round warms up
        for mode, service in modes.items():
            ttfts = await burst_ttfts(service, decode, mode, a.burst, a.burst_len, runner.args.vocab_size, rep)
            if rep:
                runs[mode].append(ttfts)
    await links.close()
    return runs, modes["batched"]


def attention_varlen_vs_padded(runner: ModelRunner, lengths: list[int], repeats: int) -> dict:
    """One layer's prefill attention for prompts of ``lengths`` packed in one forward, two ways:
    varlen (each sequence's SDPA over its own context: what the model runs) and a padded batch
    (one SDPA over [batch, longest] with a causal and length mask). Seconds, best of ``repeats``."""
    args, bs = runner.args, runner.block_size
    tables = [runner.allocator.allocate(-(-n // bs)) for n in lengths]
    try:
        meta = runner.packed_prefill_meta([(t, 0, n) for t, n in zip(tables, lengths)])
        k_cache, v_cache = runner.cache.layer(runner.model.first_layer)
        q = torch.randn(sum(lengths), args.num_heads, args.head_dim, dtype=runner.dtype, device=runner.device)
        longest = max(lengths)
        pos = torch.arange(longest, device=runner.device)
        lens = torch.tensor(lengths, device=runner.device)
        mask = (pos[None, :] <= pos[:, None])[None] & (pos < lens[:, None])[:, None, :]

        def varlen():
            return packed_prefill_attention(q, k_cache, v_cache, meta.segments, meta.block_tables)

        def padded():
            qp = q.new_zeros(len(lengths), longest, args.num_heads, args.head_dim)
            kp = q.new_zeros(len(lengths), longest, args.num_kv_heads, args.head_dim)
            vp = torch.zeros_like(kp)
            for i, (off, n, _) in enumerate(meta.segments):
                slots = meta.slot_mapping[off:off + n]
                qp[i, :n] = q[off:off + n]
                kp[i, :n] = k_cache.view(-1, args.num_kv_heads, args.head_dim)[slots]
                vp[i, :n] = v_cache.view(-1, args.num_kv_heads, args.head_dim)[slots]
            out = F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                                                 attn_mask=mask[:, None], enable_gqa=True)
            return torch.cat([out[i, :, :n].transpose(0, 1) for i, n in enumerate(lengths)])

        torch.testing.assert_close(varlen(), padded(), atol=1e-3, rtol=1e-3)   # the same attention
        times = {"varlen_s": float("inf"), "padded_s": float("inf")}
        for _ in range(repeats):          # interleaved: a load drift hits both alike
            for name, fn in (("varlen_s", varlen), ("padded_s", padded)):
                times[name] = min(times[name], timed(fn, runner.device))
        return {**times, "padded_over_varlen": times["padded_s"] / times["varlen_s"]}
    finally:
        for t in tables:
            runner.allocator.free(t)
