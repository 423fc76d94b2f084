"""``bench pd`` (c): a long prompt's TTFT on a 2-stage CPP group against one instance with all the
threads, both real processes driven over HTTP."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import torch

from mooncake_lite.bench.harness import LOCAL, role
from mooncake_lite.bench.options import Options
from mooncake_lite.bench.pd.roles import BLOCK, announce
from mooncake_lite.common.launch import RoleProcess



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


def bench_cpp(name: str, a: Options, decode: RoleProcess, n: int, vocab: int) -> dict:
    common = ("--model", name, "--block-size", str(BLOCK), "--no-profile", "--device", a.device,
              "--prefill-chunk", str(a.chunk), "--num-blocks", str(n // BLOCK + 2))
    out = {}
    for label, extra in (("one_instance", ("--threads", str(a.threads))),
                         ("cpp_2_stages", ("--threads", str(max(1, a.threads // 2)), "--pipeline-group", "2"))):
        with role("prefill", *common, *extra, *LOCAL) as prefill:
            out[f"ttft_{label}_s"] = asyncio.run(cpp_ttft(prefill, decode, n, vocab, a.repeats))
    out["speedup"] = out["ttft_one_instance_s"] / out["ttft_cpp_2_stages_s"]
    out["prompt_len"] = n
    return out
