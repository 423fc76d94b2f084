"""``mooncake bench conductor`` live part: the latency the conductor adds to one request.

Three processes on this machine: a real conductor (``mooncake --role conductor``), one process
serving a zero-work prefill instance and a zero-work decode instance (they answer at once: the
prefill hands its first token to the decode over an in-process dict instead of KV frames), and
this client. Requests go one at a time, alternating between

* **through the conductor**: ``POST /v1/completions`` (streamed), and
* **direct**: the client itself makes the calls the conductor would make — ``/v1/generate`` on
  decode, ``/v1/prefill`` on prefill, then reads decode's token stream to the end —

so the difference of the two is the conductor's own cost (parsing, tokenizing, hashing,
scheduling, bookkeeping, relaying, SSE), with the same HTTP hops to the instances on both
sides. Target: added latency ≤ 2 ms median. Figures are ms; ``*_vs_target`` = measured/target.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
import uuid

import aiohttp
from aiohttp import web

from mooncake_lite.bench.harness import command, role
from mooncake_lite.bench.options import Options, flag
from mooncake_lite.common.protocol import (GenerateRequest, Heartbeat, PrefillRequest, PrefillResult, Register,
                                           Sampling, TokenEvent, dumps, loads)
from mooncake_lite.common.service import announce_ready

TARGET_MS = 2.0
BLOCK_SIZE = 16
PROMPT = "The conductor places each request by where its KV cache lives. " * 4


FLAGS = (
    flag("--live-requests", type=int, default=300, help="requests per side (conductor / direct)"),
    flag("--live-max-tokens", type=int, default=16, help="tokens per request"),
    flag("--live-warmup", type=int, default=30, help="untimed requests per side first"),
)


# ---- the zero-work instances (run in their own process) -----------------------------------
def _instances_app(max_tokens_cap: int) -> web.Application:
    wire: dict[str, asyncio.Future] = {}

    def fut(tid: str) -> asyncio.Future:
        return wire.setdefault(tid, asyncio.get_running_loop().create_future())

    async def prefill(request: web.Request) -> web.Response:
        req = loads(PrefillRequest, await request.read())
        fut(req.transfer_id).set_result(None)
        return web.Response(body=dumps(PrefillResult(req.request_id, 65, 0, len(req.token_ids))),
                            content_type="application/json")

    async def generate(request: web.Request) -> web.StreamResponse:
        req = loads(GenerateRequest, await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await fut(req.transfer_id)
        wire.pop(req.transfer_id, None)
        n = min(req.sampling.max_tokens, max_tokens_cap)
        lines = [dumps(TokenEvent(token=66)) + b"\n" for _ in range(n - 1)]
        await resp.write(b"".join(lines) + dumps(TokenEvent(finish_reason="length")) + b"\n")
        await resp.write_eof()
        return resp

    async def abort(request: web.Request) -> web.Response:
        return web.json_response({"aborted": False})

    app = web.Application()
    app.router.add_post("/v1/prefill", prefill)
    app.router.add_post("/v1/generate", generate)
    app.router.add_post("/v1/abort", abort)
    return app


async def _serve_instances(conductor: str) -> None:
    runner = web.AppRunner(_instances_app(1 << 20))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    http = f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    regs = [Register(role, f"bench-{role}", http, http if role == "decode" else None, None, "tiny", BLOCK_SIZE, 0,
                     512, 4096) for role in ("prefill", "decode")]
    async with aiohttp.ClientSession() as s:
        for reg in regs:
            async with s.post(conductor + "/internal/v1/register", data=dumps(reg)) as r:
                if r.status != 200:
                    raise SystemExit(f"registration refused: {await r.text()}")
        announce_ready("bench-instances", http=http)
        while True:
            for reg in regs:
                async with s.post(conductor + "/internal/v1/heartbeat",
                                  data=dumps(Heartbeat(reg.instance_id))) as r:
                    await r.read()
            await asyncio.sleep(0.5)


# ---- the client ---------------------------------------------------------------------------
async def _through_conductor(s: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[float, float]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft = None
    async with s.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"conductor answered {r.status}: {await r.text()}")
        async for line in r.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - t0
    return ttft, time.perf_counter() - t0


async def _direct(s: aiohttp.ClientSession, instances: str, token_ids: tuple[int, ...],
                  max_tokens: int) -> tuple[float, float]:
    rid, tid = uuid.uuid4().hex, uuid.uuid4().hex
    sampling = Sampling(max_tokens=max_tokens)
    t0 = time.perf_counter()
    dec = await s.post(f"http://{instances}/v1/generate",
                       data=dumps(GenerateRequest(rid, tid, len(token_ids), sampling)))
    async with s.post(f"http://{instances}/v1/prefill",
                      data=dumps(PrefillRequest(rid, tid, token_ids, instances, sampling))) as r:
        loads(PrefillResult, await r.read())
    ttft = time.perf_counter() - t0
    async for _ in dec.content:
        pass
    dec.release()
    return ttft, time.perf_counter() - t0


async def _measure(args: Options, url: str, instances: str) -> dict:
    from mooncake_lite.model.tokenizer import ByteTokenizer
    token_ids = tuple(ByteTokenizer(320).encode(PROMPT))
    n, k = args.live_requests, args.live_max_tokens
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        for _ in range(args.live_warmup):
            await _through_conductor(s, url, k)
            await _direct(s, instances, token_ids, k)
        via, direct = [], []
        for _ in range(n):   # interleaved, so drift in machine load hits both sides alike
            via.append(await _through_conductor(s, url, k))
            direct.append(await _direct(s, instances, token_ids, k))
    return _figures(via, direct, n, k, len(token_ids))


def _figures(via: list, direct: list, n: int, k: int, prompt_len: int) -> dict:
    def ms(xs):
        return [x * 1000 for x in xs]

    def pct(xs, q):
        return round(statistics.quantiles(xs, n=100)[q - 1], 3)

    f: dict = {"requests": n, "max_tokens": k, "prompt_tokens": prompt_len}
    for name, i in (("ttft", 0), ("e2e", 1)):
        a, b = ms([v[i] for v in via]), ms([d[i] for d in direct])
        added = [x - y for x, y in zip(a, b)]
        f[f"{name}_conductor_median_ms"] = round(statistics.median(a), 3)
        f[f"{name}_direct_median_ms"] = round(statistics.median(b), 3)
        f[f"{name}_added_median_ms"] = round(statistics.median(a) - statistics.median(b), 3)
        f[f"{name}_added_p90_ms"] = pct(added, 90)
    f["added_target_ms"] = TARGET_MS
    f["e2e_added_median_vs_target"] = round(f["e2e_added_median_ms"] / TARGET_MS, 3)
    f["ttft_added_median_vs_target"] = round(f["ttft_added_median_ms"] / TARGET_MS, 3)
    f["load_average_1m"] = round(os.getloadavg()[0], 2)
    f["num_cpus"] = os.cpu_count()
    return f


def run(args: Options) -> dict:
    with role("conductor", "--port", "0", "--model", "tiny", "--block-size", str(BLOCK_SIZE), "--admission", "none",
              "--log-level", "warning", timeout=120.0, stop_timeout=10) as conductor, \
            command([sys.executable, "-m", "mooncake_lite.bench.conductor.live", "serve-instances", conductor.url()],
                    name="bench instances", stop_timeout=10) as instances:
        return asyncio.run(_measure(args, conductor.url(), instances.addresses["http"]))


def render(f: dict) -> str:
    lines = [f"live: conductor's added latency, {f['requests']} streamed requests of {f['prompt_tokens']} prompt "
             f"+ {f['max_tokens']} output tokens vs the same calls made directly (zero-work instances; load "
             f"average {f['load_average_1m']} on {f['num_cpus']} CPUs)"]
    for name in ("ttft", "e2e"):
        lines.append(f"  {name:<4} through conductor {f[name + '_conductor_median_ms']:7.3f} ms   direct "
                     f"{f[name + '_direct_median_ms']:7.3f} ms   added median {f[name + '_added_median_ms']:6.3f} ms "
                     f"({f[name + '_added_median_vs_target']:.2f}× the {TARGET_MS:g} ms target)   "
                     f"added p90 {f[name + '_added_p90_ms']:6.3f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve-instances":
        try:
            import uvloop
            uvloop.run(_serve_instances(sys.argv[2]))
        except ImportError:
            asyncio.run(_serve_instances(sys.argv[2]))
    else:
        sys.stderr.write("usage: python -m mooncake_lite.bench.conductor.live serve-instances CONDUCTOR_URL\n")
        sys.exit(2)
