"""``bench pd`` (a) and (b): one prefill's KV to a real decode process three ways (compute only,
compute then send, layer-wise streaming) and the transfer time streaming hides; then the same
prompt with growing cached prefixes. The senders and the one-prefill timing serve ``bench pd
--link`` too."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import torch

from mooncake_lite.bench.options import Options
from mooncake_lite.bench.pd.roles import BLOCK, announce
from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.common.launch import RoleProcess
from mooncake_lite.instance.profile import time_prefill
from mooncake_lite.model.args import DTYPES, default_dtype
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.engine import StageEngine
from mooncake_lite.prefill.kv_sender import DecodeLinks, KVSender
from mooncake_lite.prefill.results import Firsts
from mooncake_lite.prefill.store_io import MemoryStore



class NullSender:
    """Compute only: KV is dropped."""
    error = None
    num_frames = num_bytes = 0

    def send_layer(self, layer, start, kv) -> None:
        pass

    async def end(self, first_layer, end_layer, first_token, resume=None) -> None:
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

    async def end(self, first_layer, end_layer, first_token, resume=None) -> None:
        for layer, start, kv in self.held:
            super().send_layer(layer, start, kv)
        await super().end(first_layer, end_layer, first_token, resume)


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
        await stage.finish(job, Firsts((int(torch.argmax(out)),)))
        t2 = time.perf_counter()
        return {"ttft_s": t2 - t0, "compute_s": t1 - t0, "tail_s": t2 - t1}
    finally:
        await stage.release(job)


class PrefillRig:
    """One model's prefill path (the stage engine on an in-memory store) with its KV going to a
    live decode process: the prompt, and one prefill of it in any of the three modes."""

    def __init__(self, name: str, model, a: Options, decode: RoleProcess, session: aiohttp.ClientSession):
        n = a.prompt_lens[name]
        decode_blocks = max(a.batch_sizes) * -(-a.context_len // BLOCK)
        burst_blocks = a.burst * -(-a.burst_len // BLOCK)   # (e): a pack holds its members' blocks at once
        self.runner = ModelRunner(model, num_blocks=max(2 * (n // BLOCK + 2), decode_blocks, burst_blocks),
                                  block_size=BLOCK)
        cache = self.runner.cache
        self.layer_bytes = cache.kv[0].numel() // cache.num_blocks * cache.kv.element_size()
        self.store = MemoryStore((0, model.args.num_layers), self.layer_bytes)
        self.stage = StageEngine(self.runner, self.store, ThreadPoolExecutor(1), write_back=False)
        self.links = DecodeLinks(None)
        self.tokens = torch.randint(0, model.args.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
        self.name, self.chunk, self.decode, self.session = name, a.chunk, decode, session
        self._ids = iter(range(10**9))

    async def run(self, mode: str, hit: int = 0) -> dict[str, float]:
        """One prefill: ``compute_only`` (KV dropped), ``then_send`` or ``streaming`` (the role's path)."""
        if mode == "compute_only":
            return await prefill_once(self.stage, NullSender(), self.tokens, self.chunk, hit)
        tid = f"{self.name}-{mode}-{next(self._ids)}"
        resp = await announce(self.session, self.decode, tid, len(self.tokens))
        client = await self.links.get(self.decode.addresses["data"])
        sender = (ThenSendSender if mode == "then_send" else KVSender)(client, tid)
        try:
            return await prefill_once(self.stage, sender, self.tokens, self.chunk, hit)
        finally:
            await resp.read()
            resp.release()


async def bench_overlap_and_prefix(name: str, a: Options, decode: RoleProcess) -> dict:
    """(a) and (b) for one model; also hands back its runner (for (d), (e) and the cost models)."""
    n = a.prompt_lens[name]
    t0 = time.perf_counter()
    # the roles' own default dtype on this device (bfloat16 on CUDA): the decode process it streams to uses it
    model = build_model(name, device=a.device, dtype=DTYPES[default_dtype(a.device)])
    build_s = time.perf_counter() - t0
    longest = max(n, a.cpp_lens[name] if a.cpp else n)
    if longest > model.args.max_seq_len:
        raise ValueError(f"{name}: a {longest}-token prompt exceeds max_seq_len {model.args.max_seq_len}; "
                         f"pass a smaller --prompt-len or --cpp-prompt-factor")
    async with aiohttp.ClientSession() as session:
        rig = PrefillRig(name, model, a, decode, session)
        overlap = await measure_overlap(rig, a.repeats)
        prefix = await measure_prefix(rig, a.repeats)
    await rig.links.close()
    return {"overlap": overlap, "prefix": prefix, "runner": rig.runner, "build_s": build_s}


async def measure_overlap(rig: PrefillRig, repeats: int) -> dict:
    """(a): the three modes interleaved ``repeats`` times (after a warm-up), best of each."""
    await rig.run("streaming")  # warm-up
    runs = {m: [] for m in ("compute_only", "then_send", "streaming")}
    for _ in range(repeats):
        for mode in runs:   # interleaved, so load drifts hit every mode alike
            runs[mode].append(await rig.run(mode))
    # best of: other load on the machine only adds time
    best = {m: {k: min(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    # the same prompt's plain forward (in the same chunks): what the served path adds to it is the
    # per-layer hop and KV staging (on an H200 ~20x the forward; on two CPU cores a few percent)
    forward = time_prefill(rig.runner, len(rig.tokens), 0, rig.chunk, repeats)
    transfer, exposed = best["then_send"]["tail_s"], best["streaming"]["tail_s"]
    kv_bytes = len(rig.tokens) * rig.runner.args.kv_bytes_per_token(rig.runner.dtype)
    return {**{f"ttft_{m}_s": b["ttft_s"] for m, b in best.items()},
            **{f"compute_{m}_s": b["compute_s"] for m, b in best.items()},
            "forward_s": forward, "served_over_forward": best["compute_only"]["compute_s"] / forward,
            "kv_bytes": kv_bytes, "transfer_s": transfer, "exposed_transfer_s": exposed,
            "stream_gbps": kv_bytes / transfer / 1e9,
            "hidden_share": 1.0 - exposed / transfer,
            # whole-TTFT view: also charges streaming for the receiver's CPU use, which on
            # one machine competes with prefill compute (on separate nodes it does not)
            "ttft_hidden_share": _ttft_share(best, transfer),
            "compute_slowdown_streaming": best["streaming"]["compute_s"] / best["compute_only"]["compute_s"]}


async def measure_prefix(rig: PrefillRig, repeats: int) -> list[dict]:
    """(b): cache the prompt's blocks, then prefill with growing cached prefixes."""
    tokens, n, num_layers = rig.tokens, len(rig.tokens), rig.runner.args.num_layers
    full = n // BLOCK
    kv = rig.runner.cache.kv   # the cache's dtype (bfloat16 on CUDA): a block's bytes are the store's
    packed = torch.randn(full, num_layers, rig.layer_bytes // kv.element_size()).to(kv.dtype).view(torch.uint8)
    await rig.store.put_layers(prefix_hash(tokens, BLOCK), [memoryview(p.numpy()).cast("B") for p in packed],
                               0, num_layers)
    prefix = []
    for share in (0.0, 0.25, 0.5, 0.75):
        hit = min(int(n * share) // BLOCK, (n - 1) // BLOCK)
        times = [(await rig.run("streaming", hit))["ttft_s"] for _ in range(repeats)]
        prefix.append({"cached_tokens": hit * BLOCK, "computed_share": 1 - hit * BLOCK / n, "ttft_s": min(times)})
    for row in prefix:
        row["ttft_share"] = row["ttft_s"] / prefix[0]["ttft_s"]
    return prefix


def _ttft_share(best: dict, transfer: float) -> float | None:
    """(then_send - streaming) / (then_send - compute_only), or None when that difference is
    smaller than half the measured transfer, i.e. lost in run-to-run noise."""
    extra = best["then_send"]["ttft_s"] - best["compute_only"]["ttft_s"]
    if extra < 0.5 * transfer:
        return None
    return (best["then_send"]["ttft_s"] - best["streaming"]["ttft_s"]) / extra
