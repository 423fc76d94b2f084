"""``mooncake bench pd``: the prefill/decode data path on this machine.

All times are the best of ``--repeats`` runs (other load on the machine can only add time).

(a) **overlap**: TTFT of one prefill whose KV goes to a real decode process, three ways — compute
    only (KV discarded), compute then send (all KV sent after the last layer), and layer-wise
    streaming (the role's path). The transfer time is what compute-then-send spends after its
    last layer until decode has acknowledged everything; the exposed time is the same tail when
    streaming. Hidden share = 1 - exposed / transfer (target >= 0.8). Measuring the tails inside
    each run keeps the estimate out of the noise of whole-TTFT differences on a busy machine.
    The whole-TTFT share (then_send - streaming) / (then_send - compute_only) is reported too; on
    one machine it also charges streaming for the decode process's CPU use during compute.
(b) **prefix**: TTFT of the same prompt with 0..75% of it cached in the store, next to the share
    of tokens still computed (a prefix hit must cut TTFT in proportion).
(c) **cpp**: TTFT of a long prompt (``--cpp-prompt-factor`` x the prompt, fresh tokens each run) on a 2-stage CPP group (T/2 threads per stage) vs one instance
    with T threads, both as real processes driven over HTTP.
(d) **decode**: tokens/s against batch size, and each step's time vs the memory roof (every
    step reads all weights once).
(e) **burst**: ``--burst N`` prompts of ``--burst-len`` tokens arrive at one prefill instance at
    once (the role's service, its KV to a real decode process); TTFT of each, with prefill batching
    (``--burst-tokens``, the role's ``--prefill-batch-tokens``) against one prompt at a time, runs
    interleaved; the ratio batched/unbatched of the mean and of the last TTFT (best of the runs),
    and the conductor's predicted TTFTs for both (its scheduler, from a start-up profile).
``--profile FILE`` writes the fitted prefill/decode cost models in the scheduler's ``to_dict``
format (``mooncake sim --cost-model FILE`` reads it); ``--json`` prints every figure as one object.

``--models`` takes any model spec (preset, named model such as ``smollm2-135m``, .gguf file, HF
checkpoint directory); the default list runs the real default model beside the ``tiny`` preset
(skipped with a note where its package is not installed). Each model's entry says whether its
weights are seeded dummies or a checkpoint, and how long loading them took.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import orjson
import torch
import torch.nn.functional as F

from kernels.device import sync
from mooncake_lite.bench.model import copy_gbps, describe_model, matmul_gflops, usable_models, weight_bytes
from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.common.launch import RoleProcess
from mooncake_lite.model.llama import packed_prefill_attention
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.source import DEFAULT_MODEL, resolve
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.engine import StageEngine
from mooncake_lite.prefill.kv_sender import DecodeLinks, KVSender
from mooncake_lite.prefill.service import PrefillService
from mooncake_lite.common.protocol import PrefillRequest, Sampling
from mooncake_lite.instance.profile import profile_decode, profile_prefill, time_decode
from mooncake_lite.prefill.store_io import MemoryStore
from mooncake_lite.scheduler import (BlockIndex, ClusterState, CostModels, DecodeCostModel, DecodeInstanceState,
                                     PrefillCostModel, PrefillView, ScheduleRequest, Scheduler, SchedulerConfig)

BLOCK = 64
DEFAULT_MODELS = ("tiny", DEFAULT_MODEL)
# (a)/(b) prompt tokens per model; a 30-layer real model gets a shorter one so a default run stays short
DEFAULT_PROMPT_LENS = {"tiny": 1024, "small": 512, DEFAULT_MODEL: 256}
OTHER_PROMPT_LEN = 512
# (c) prompt = factor x the model's prompt; 2 for the real model (its 1024-token CPP runs, in three
# more processes that each load the checkpoint, would double a default run's time)
DEFAULT_CPP_FACTOR = 4
DEFAULT_CPP_FACTORS = {DEFAULT_MODEL: 2}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="mooncake bench pd", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None,
                    help=f"comma-separated model specs: presets, named models, .gguf files or HF checkpoint dirs "
                         f"(default: {','.join(DEFAULT_MODELS)})")
    ap.add_argument("--prompt-len", default=None,
                    help="prompt tokens per model (name=N,...) or one N (default: "
                         + ",".join(f"{k}={v}" for k, v in DEFAULT_PROMPT_LENS.items())
                         + f", {OTHER_PROMPT_LEN} for others)")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk tokens")
    ap.add_argument("--cpp-prompt-factor", type=int, default=None,
                    help=f"(c) prompt = this x the model's prompt length (default: {DEFAULT_CPP_FACTOR}; "
                         + ", ".join(f"{k}: {v}" for k, v in DEFAULT_CPP_FACTORS.items()) + ")")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per figure (the best is reported)")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="decode batch sizes")
    ap.add_argument("--context-len", type=int, default=256, help="cached tokens per decoding sequence")
    ap.add_argument("--threads", type=int, default=2, help="total torch threads (CPP: split across stages)")
    ap.add_argument("--device", default="cpu",
                    help="torch device of the model here and in every role process (cpu, cuda, cuda:1)")
    ap.add_argument("--burst", type=int, default=16, help="(e) prompts arriving at once (0: skip)")
    ap.add_argument("--burst-len", type=int, default=100, help="(e) tokens per burst prompt")
    ap.add_argument("--burst-tokens", type=int, default=512,
                    help="(e) prefill batching budget (--prefill-batch-tokens) of the batched runs")
    ap.add_argument("--no-cpp", dest="cpp", action="store_false", help="skip (c), which starts processes")
    ap.add_argument("--profile", metavar="FILE", help="write the fitted cost models of the first model here")
    ap.add_argument("--json", action="store_true", help="print all figures as one JSON object")
    ap.add_argument("--link", action="append", metavar="RATE",
                    help="instead of (a)-(e): prefill and decode on two nodes over a link shaped to RATE (e.g. "
                         "1gbit; repeat for more rates): hidden share and link share (needs root; bench/link_pd.py)")
    a = ap.parse_args(list(argv))
    a.default_models = a.models is None
    a.models = list(DEFAULT_MODELS) if a.models is None else [m for m in a.models.split(",") if m]
    try:
        a.batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
        a.prompt_lens = _prompt_lens(a.prompt_len, a.models)
    except ValueError:
        ap.error("--batch-sizes and --prompt-len must be integers (--prompt-len: N or name=N,...)")
    a.cpp_lens = {m: n * (a.cpp_prompt_factor or DEFAULT_CPP_FACTORS.get(m, DEFAULT_CPP_FACTOR))
                  for m, n in a.prompt_lens.items()}
    if not a.models or min(a.batch_sizes) <= 0 or a.chunk <= 0 or a.repeats <= 0 or a.threads <= 0 \
            or min(a.prompt_lens.values()) <= 0 or (a.cpp_prompt_factor is not None and a.cpp_prompt_factor <= 0) \
            or a.burst < 0 or a.burst_len <= 0 or a.burst_tokens <= 0:
        ap.error("need models and positive sizes")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (torch.cuda.is_available() is false)")
    return a


def _prompt_lens(value: str | None, models: Sequence[str]) -> dict[str, int]:
    """``N`` for every model, or ``name=N,...`` over the defaults (a model spec is split at its
    last ``=``, so a path may hold one)."""
    if value is not None and "=" not in value:
        return dict.fromkeys(models, int(value))
    lens = dict(DEFAULT_PROMPT_LENS)
    for item in (value or "").split(","):
        if item:
            name, _, n = item.rpartition("=")
            lens[name] = int(n)
    return {m: lens.get(m, OTHER_PROMPT_LEN) for m in models}


# --- processes --------------------------------------------------------------------------------------
def start_role(role: str, *args: str) -> RoleProcess:
    """A role process on 127.0.0.1 (however long its model takes to load)."""
    return RoleProcess.start(role, *args, "--host", "127.0.0.1", "--port", "0", timeout=None)


async def announce(session: aiohttp.ClientSession, decode: RoleProcess, tid: str, prompt_len: int) -> aiohttp.ClientResponse:
    """Reserve the request on decode (max_tokens 1: it finishes as soon as the KV is in)."""
    body = {"request_id": tid, "transfer_id": tid, "prompt_len": prompt_len, "sampling": {"max_tokens": 1}}
    resp = await session.post(f"{decode.url()}/v1/generate", json=body)
    if resp.status != 200:
        raise RuntimeError(f"decode refused: {await resp.text()}")
    return resp


# --- senders for the three overlap modes -------------------------------------------------------------
class NullSender:
    """Compute only: KV is dropped."""
    error = None
    num_frames = num_bytes = 0

    def send_layer(self, layer, start, kv) -> None:
        pass

    async def end(self, first_layer, end_layer, first_token) -> None:
        pass

    async def abort(self, reason) -> None:
        pass


class ThenSendSender(KVSender):
    """Compute, then send everything: KV frames are held until the last layer is done."""

    def __init__(self, client, transfer_id):
        super().__init__(client, transfer_id)
        self.held: list = []

    def send_layer(self, layer, start, kv) -> None:
        self.held.append((layer, start, kv))

    async def end(self, first_layer, end_layer, first_token) -> None:
        for layer, start, kv in self.held:
            super().send_layer(layer, start, kv)
        await super().end(first_layer, end_layer, first_token)


async def prefill_once(stage: StageEngine, sender, tokens: list[int], chunk: int, hit: int) -> dict[str, float]:
    """One prefill through the stage engine (the role's code path minus HTTP).
    ``ttft_s``: begin to KV acknowledged by decode; ``compute_s``: until the last layer ran;
    ``tail_s``: the rest — the transfer time that compute did not hide."""
    keys = prefix_hash(tokens, BLOCK)
    t0 = time.perf_counter()
    job = stage.begin(f"r{t0}", tokens, keys, hit, sender)
    try:
        out = None
        for start in range(hit * BLOCK, len(tokens), chunk):
            out = await stage.run_chunk(job, start, token_ids=tokens[start:start + chunk])
        t1 = time.perf_counter()
        await stage.finish(job, int(torch.argmax(out)))
        t2 = time.perf_counter()
        return {"ttft_s": t2 - t0, "compute_s": t1 - t0, "tail_s": t2 - t1}
    finally:
        await stage.release(job)


async def bench_overlap_and_prefix(name: str, a: argparse.Namespace, decode: RoleProcess) -> dict:
    n = a.prompt_lens[name]
    t0 = time.perf_counter()
    model = build_model(name, device=a.device)
    build_s = time.perf_counter() - t0
    longest = max(n, a.cpp_lens[name] if a.cpp else n)
    if longest > model.args.max_seq_len:
        raise ValueError(f"{name}: a {longest}-token prompt exceeds max_seq_len {model.args.max_seq_len}; "
                         f"pass a smaller --prompt-len or --cpp-prompt-factor")
    decode_blocks = max(a.batch_sizes) * -(-a.context_len // BLOCK)
    burst_blocks = a.burst * -(-a.burst_len // BLOCK)   # (e): a pack holds its members' blocks at once
    runner = ModelRunner(model, num_blocks=max(2 * (n // BLOCK + 2), decode_blocks, burst_blocks), block_size=BLOCK)
    layer_bytes = runner.cache.kv[0].numel() // runner.cache.num_blocks * runner.cache.kv.element_size()
    store = MemoryStore((0, model.args.num_layers), layer_bytes)
    stage = StageEngine(runner, store, ThreadPoolExecutor(1), write_back=False)
    links = DecodeLinks(None)
    tokens = torch.randint(0, model.args.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    ids = iter(range(10**9))
    async with aiohttp.ClientSession() as session:
        async def run(mode: str, hit: int = 0) -> dict[str, float]:
            if mode == "compute_only":
                return await prefill_once(stage, NullSender(), tokens, a.chunk, hit)
            tid = f"{name}-{mode}-{next(ids)}"
            resp = await announce(session, decode, tid, n)
            client = await links.get(decode.addresses["data"])
            sender = (ThenSendSender if mode == "then_send" else KVSender)(client, tid)
            try:
                return await prefill_once(stage, sender, tokens, a.chunk, hit)
            finally:
                await resp.read()
                resp.release()

        await run("streaming")  # warm-up
        runs = {m: [] for m in ("compute_only", "then_send", "streaming")}
        for _ in range(a.repeats):
            for mode in runs:   # interleaved, so load drifts hit every mode alike
                runs[mode].append(await run(mode))
        # best of: other load on the machine only adds time
        best = {m: {k: min(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
        transfer, exposed = best["then_send"]["tail_s"], best["streaming"]["tail_s"]
        kv_bytes = n * model.args.kv_bytes_per_token(runner.dtype)
        overlap = {**{f"ttft_{m}_s": b["ttft_s"] for m, b in best.items()},
                   **{f"compute_{m}_s": b["compute_s"] for m, b in best.items()},
                   "kv_bytes": kv_bytes, "transfer_s": transfer, "exposed_transfer_s": exposed,
                   "stream_gbps": kv_bytes / transfer / 1e9,
                   "hidden_share": 1.0 - exposed / transfer,
                   # whole-TTFT view: also charges streaming for the receiver's CPU use, which on
                   # one machine competes with prefill compute (on separate nodes it does not)
                   "ttft_hidden_share": _ttft_share(best, transfer),
                   "compute_slowdown_streaming": best["streaming"]["compute_s"] / best["compute_only"]["compute_s"]}

        # (b) cache the prompt's blocks, then prefill with growing cached prefixes
        full = len(tokens) // BLOCK
        packed = torch.randn(full, model.args.num_layers, layer_bytes // runner.cache.kv.element_size())
        await store.put_layers(prefix_hash(tokens, BLOCK), [memoryview(p.numpy()).cast("B") for p in packed],
                               0, model.args.num_layers)
        prefix = []
        for share in (0.0, 0.25, 0.5, 0.75):
            hit = min(int(n * share) // BLOCK, (n - 1) // BLOCK)
            times = [(await run("streaming", hit))["ttft_s"] for _ in range(a.repeats)]
            prefix.append({"cached_tokens": hit * BLOCK, "computed_share": 1 - hit * BLOCK / n,
                           "ttft_s": min(times)})
        for row in prefix:
            row["ttft_share"] = row["ttft_s"] / prefix[0]["ttft_s"]
    await links.close()
    return {"overlap": overlap, "prefix": prefix, "runner": runner, "build_s": build_s}


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


async def bench_burst(runner: ModelRunner, a: argparse.Namespace, decode: RoleProcess) -> dict:
    """(e): the same bursts with prefill batching and without, interleaved; best run of each.
    Beside them, the conductor's predicted TTFTs for each mode from the start-up profile a
    prefill role reports (``profile_prefill``' default shapes), the batched instance's queue
    priced packed (its ``pack_tokens``) and as one prompt at a time (a conductor told nothing)."""
    cost, _ = profile_prefill(runner)
    layer_bytes = runner.cache.kv[0].numel() // runner.cache.num_blocks * runner.cache.kv.element_size()
    stage = StageEngine(runner, MemoryStore((0, runner.args.num_layers), layer_bytes), ThreadPoolExecutor(1),
                        write_back=False)
    links = DecodeLinks(None)
    modes = {}
    for mode, budget in (("batched", a.burst_tokens), ("unbatched", 0)):
        # chunk = the budget, so a pack may hold it all (the role's defaults: both 512)
        modes[mode] = PrefillService(stage, links, block_size=BLOCK, hash_seed=0,
                                     chunk_size=max(a.burst_tokens, a.burst_len), batch_tokens=budget)
    runs = {m: [] for m in modes}
    for rep in range(a.repeats + 1):        # the first round warms up
        for mode, service in modes.items():
            ttfts = await burst_ttfts(service, decode, mode, a.burst, a.burst_len, runner.args.vocab_size, rep)
            if rep:
                runs[mode].append(ttfts)
    await links.close()
    out = {"prompts": a.burst, "prompt_len": a.burst_len, "batch_tokens": a.burst_tokens,
           "packed_forwards": modes["batched"].totals["packed_forwards_total"]}
    for mode, rs in runs.items():
        out[f"mean_ttft_{mode}_s"] = min(sum(r) / len(r) for r in rs)
        out[f"last_ttft_{mode}_s"] = min(max(r) for r in rs)
        out[f"first_ttft_{mode}_s"] = min(min(r) for r in rs)
    out["mean_ratio"] = out["mean_ttft_batched_s"] / out["mean_ttft_unbatched_s"]
    out["last_ratio"] = out["last_ttft_batched_s"] / out["last_ttft_unbatched_s"]
    for mode, limit in (("batched", modes["batched"].pack_limit), ("unbatched", 0)):
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
            return packed_prefill_attention(q, k_cache, v_cache, meta)

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
                sync(runner.device)
                t0 = time.perf_counter()
                fn()
                sync(runner.device)
                times[name] = min(times[name], time.perf_counter() - t0)
        return {**times, "padded_over_varlen": times["padded_s"] / times["varlen_s"]}
    finally:
        for t in tables:
            runner.allocator.free(t)


def _ttft_share(best: dict, transfer: float) -> float | None:
    """(then_send - streaming) / (then_send - compute_only), or None when that difference is
    smaller than half the measured transfer, i.e. lost in run-to-run noise."""
    extra = best["then_send"]["ttft_s"] - best["compute_only"]["ttft_s"]
    if extra < 0.5 * transfer:
        return None
    return (best["then_send"]["ttft_s"] - best["streaming"]["ttft_s"]) / extra


def bench_decode(runner: ModelRunner, a: argparse.Namespace, peak_gbps: float) -> list[dict]:
    floor = weight_bytes(runner.args, runner.dtype) / (peak_gbps * 1e9)
    rows = []
    for batch in a.batch_sizes:
        if not runner.allocator.can_allocate(batch * (-(-a.context_len // runner.block_size))):
            break
        t = time_decode(runner, batch, a.context_len, repeats=a.repeats)
        rows.append({"batch": batch, "step_s": t, "tokens_per_s": batch / t, "memory_roof_share": floor / t})
    return rows


async def cpp_ttft(prefill: RoleProcess, decode: RoleProcess, n: int, vocab: int, repeats: int) -> float:
    times = []
    async with aiohttp.ClientSession() as session:
        for i in range(repeats + 1):
            # a fresh prompt each time: a repeated one would be a prefix hit in the instance's store
            tokens = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(i)).tolist()
            tid = f"cpp-{prefill.proc.pid}-{i}"
            resp = await announce(session, decode, tid, n)
            body = {"request_id": tid, "transfer_id": tid, "token_ids": tokens,
                    "decode_data": decode.addresses["data"], "sampling": {"max_tokens": 1}}
            t0 = time.perf_counter()
            async with session.post(f"{prefill.url()}/v1/prefill", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"prefill failed: {await r.text()}")
            times.append(time.perf_counter() - t0)
            await resp.read()
            resp.release()
    return min(times[1:])   # the first run warms up


def bench_cpp(name: str, a: argparse.Namespace, decode: RoleProcess, n: int, vocab: int) -> dict:
    common = ("--model", name, "--block-size", str(BLOCK), "--no-profile", "--device", a.device,
              "--prefill-chunk", str(a.chunk), "--num-blocks", str(n // BLOCK + 2))
    out = {}
    for label, extra in (("one_instance", ("--threads", str(a.threads))),
                         ("cpp_2_stages", ("--threads", str(max(1, a.threads // 2)), "--pipeline-group", "2"))):
        prefill = start_role("prefill", *common, *extra)
        try:
            out[f"ttft_{label}_s"] = asyncio.run(cpp_ttft(prefill, decode, n, vocab, a.repeats))
        finally:
            prefill.stop()
    out["speedup"] = out["ttft_one_instance_s"] / out["ttft_cpp_2_stages_s"]
    out["prompt_len"] = n
    return out


def run(a: argparse.Namespace) -> dict:
    header_s, notes = usable_models(a.models, drop_missing=a.default_models)
    a.models = list(header_s)
    if not a.models:
        raise ValueError("no model to measure: " + "; ".join(notes))
    # (a), (b), (d) run here while a decode process receives: half the threads each, so torch's
    # spinning worker threads do not fight over the cores (that makes timings erratic).
    torch.set_num_threads(max(1, a.threads // 2))
    res = {"machine": {"threads": a.threads, "matmul_gflops": matmul_gflops(device=a.device),
                       "copy_gbps": copy_gbps(device=a.device), "device": a.device},
           "models": {}, "notes": notes}
    for name in a.models:
        n = a.prompt_lens[name]
        blocks = max(2 * (max(n, a.cpp_lens[name]) // BLOCK + 2), 2 * a.burst * -(-(a.burst_len + 1) // BLOCK))
        decode = start_role("decode", "--model", name, "--block-size", str(BLOCK), "--no-profile",
                            "--num-blocks", str(blocks), "--threads", "1", "--device", a.device)
        try:
            part = asyncio.run(bench_overlap_and_prefix(name, a, decode))
            runner = part.pop("runner")
            build_s = part.pop("build_s")
            part["source"] = {**describe_model(name), "build_s": build_s, "load_s": header_s[name] + build_s}
            part["decode"] = bench_decode(runner, a, res["machine"]["copy_gbps"])
            if a.burst:
                part["burst"] = asyncio.run(bench_burst(runner, a, decode))
            prefill_cost, _ = profile_prefill(runner, [(64, 0), (n // 2, 0), (n, 0), (n // 4, n // 2),
                                                       (n // 2, n // 4), (n // 8, n - n // 8)], repeats=a.repeats)
            decode_cost, _ = profile_decode(runner, [(b, c) for b in a.batch_sizes[:4] for c in (64, a.context_len)])
            part["cost"] = {"prefill": prefill_cost.to_dict(), "decode": decode_cost.to_dict(),
                            "kv_bytes_per_token": runner.args.kv_bytes_per_token(runner.dtype)}
            if a.cpp:
                part["cpp"] = bench_cpp(name, a, decode, a.cpp_lens[name], runner.args.vocab_size)
        finally:
            decode.stop()
        part["prompt_len"] = n
        res["models"][name] = part
    return res


def profile_dict(name: str, part: dict) -> dict:
    return {"name": f"{resolve(name).served_name}-cpu", **part["cost"], "block_size": BLOCK,
            "bandwidth_bytes_per_s": part["overlap"]["stream_gbps"] * 1e9}


def render(res: dict) -> str:
    m = res["machine"]
    lines = [f"machine: {m['threads']} threads, matmul {m['matmul_gflops']:.1f} GFLOP/s, copy {m['copy_gbps']:.1f} GB/s"]
    for name, p in res["models"].items():
        o = p["overlap"]
        lines += [f"\n{name} ({p['prompt_len']} tokens, {o['kv_bytes'] / 2**20:.1f} MiB of KV; "
                  f"{p['source']['description']}, loaded in {p['source']['load_s']:.2f} s)",
                  f"  (a) TTFT compute-only {o['ttft_compute_only_s'] * 1e3:.1f} ms, compute-then-send "
                  f"{o['ttft_then_send_s'] * 1e3:.1f} ms, layer-wise streaming {o['ttft_streaming_s'] * 1e3:.1f} ms",
                  f"      transfer {o['transfer_s'] * 1e3:.1f} ms ({o['stream_gbps']:.2f} GB/s), exposed when "
                  f"streaming {o['exposed_transfer_s'] * 1e3:.1f} ms -> hidden: {o['hidden_share']:.0%} (target >= 80%)",
                  f"      whole-TTFT view (then_send - streaming) / (then_send - compute_only): "
                  f"{'below noise' if o['ttft_hidden_share'] is None else format(o['ttft_hidden_share'], '.0%')}; compute ran {o['compute_slowdown_streaming']:.2f}x slower while "
                  f"streaming (decode shares this machine's cores)"]
        lines += [f"  (b) cached {r['cached_tokens']:>5} tokens: TTFT {r['ttft_s'] * 1e3:8.1f} ms = "
                  f"{r['ttft_share']:.2f} of uncached (computes {r['computed_share']:.2f} of the tokens)"
                  for r in p["prefix"]]
        if "cpp" in p:
            c = p["cpp"]
            lines.append(f"  (c) {c['prompt_len']} tokens: TTFT one instance {c['ttft_one_instance_s'] * 1e3:.1f} ms vs 2-stage CPP "
                         f"{c['ttft_cpp_2_stages_s'] * 1e3:.1f} ms (speedup {c['speedup']:.2f}x)")
        lines += [f"  (d) batch {r['batch']:>3}: {r['tokens_per_s']:8.1f} tokens/s, step {r['step_s'] * 1e3:.2f} ms "
                  f"({r['memory_roof_share']:.0%} of the memory roof)" for r in p["decode"]]
        if "burst" in p:
            b = p["burst"]
            lines.append(f"  (e) burst of {b['prompts']} x {b['prompt_len']} tokens: mean TTFT batched "
                         f"{b['mean_ttft_batched_s'] * 1e3:.1f} ms vs one at a time {b['mean_ttft_unbatched_s'] * 1e3:.1f} ms "
                         f"({b['mean_ratio']:.2f}x), last {b['last_ttft_batched_s'] * 1e3:.1f} vs "
                         f"{b['last_ttft_unbatched_s'] * 1e3:.1f} ms ({b['last_ratio']:.2f}x); budget {b['batch_tokens']} "
                         f"tokens, {b['packed_forwards']} packed forwards")
            if "predicted_mean_ttft_batched_s" in b:
                lines.append("      conductor's predicted TTFT (mean, last) over measured: batched "
                             f"{b['predicted_mean_ttft_batched_s'] / b['mean_ttft_batched_s']:.2f}x, "
                             f"{b['predicted_last_ttft_batched_s'] / b['last_ttft_batched_s']:.2f}x; one at a time "
                             f"{b['predicted_mean_ttft_unbatched_s'] / b['mean_ttft_unbatched_s']:.2f}x, "
                             f"{b['predicted_last_ttft_unbatched_s'] / b['last_ttft_unbatched_s']:.2f}x; batched "
                             "priced one at a time (a conductor told nothing) "
                             f"{b['predicted_mean_ttft_unbatched_s'] / b['mean_ttft_batched_s']:.2f}x, "
                             f"{b['predicted_last_ttft_unbatched_s'] / b['last_ttft_batched_s']:.2f}x")
            for label, key in (("equal lengths", "attention_equal"), ("lengths 0.5-1.5x", "attention_spread")):
                t = b[key]
                lines.append(f"      one layer's attention, {label}: varlen {t['varlen_s'] * 1e3:.2f} ms, padded batch "
                             f"{t['padded_s'] * 1e3:.2f} ms ({t['padded_over_varlen']:.2f}x)")
    lines += [f"note: {n}" for n in res.get("notes", [])]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    a = parse_args(argv)
    if a.link:
        from mooncake_lite.bench import link_pd
        return link_pd.pd_main(a)
    try:
        res = run(a)
    except (ValueError, FileNotFoundError) as exc:
        sys.stderr.write(f"mooncake bench pd: error: {exc}\n")
        return 2
    if a.profile:
        name = a.models[0]
        with open(a.profile, "wb") as fh:
            fh.write(orjson.dumps(profile_dict(name, res["models"][name]), option=orjson.OPT_INDENT_2))
    print(orjson.dumps(res).decode() if a.json else render(res))
    return 0
