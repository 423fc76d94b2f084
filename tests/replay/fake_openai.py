"""A small OpenAI-compatible streaming server for replay tests, run on 127.0.0.1 in a thread.

It streams ``max_tokens`` one-token chunks, rejects every ``reject_every``-th request with a
429, keeps a prefix cache over ``block_chars``-element blocks of the prompt (characters of a text
prompt, ids of a token-id prompt; chained, like the real cluster), exposes the same hit counters
as the conductor on ``/metrics`` and, like the conductor, reports the prompt tokens it reused as
``usage.prompt_tokens_details.cached_tokens`` (unless ``report_cached`` is off).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import orjson
from aiohttp import web

MODEL = "fake-model"


@dataclass
class FakeState:
    block_chars: int = 16
    reject_every: int | None = None
    max_model_len: int = 2048
    api_key: str | None = None
    report_cached: bool = True
    model: str = MODEL
    seen_blocks: set = field(default_factory=set)
    reused_blocks: int = 0
    prompt_blocks: int = 0
    received: list = field(default_factory=list)   # (arrival time, body)

    def cache(self, prompt: str | tuple) -> tuple[int, int]:
        blocks = [prompt[: i + self.block_chars] for i in range(0, len(prompt) - self.block_chars + 1,
                                                                self.block_chars)]
        hits = 0
        for b in blocks:          # chained: a block counts only while the whole prefix is cached
            if b not in self.seen_blocks:
                break
            hits += 1
        self.seen_blocks.update(blocks)
        self.reused_blocks += hits
        self.prompt_blocks += len(blocks)
        return hits, len(blocks)


def make_app(st: FakeState) -> web.Application:
    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": st.model, "max_model_len": st.max_model_len}]})

    async def metrics(request):
        text = (f"# TYPE mooncake_conductor_reused_prefix_blocks_total counter\n"
                f"mooncake_conductor_reused_prefix_blocks_total {st.reused_blocks}\n"
                f"mooncake_conductor_prompt_blocks_total {st.prompt_blocks}\n")
        return web.Response(text=text)

    async def completions(request):
        if st.api_key and request.headers.get("Authorization") != f"Bearer {st.api_key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        body = await request.json()
        st.received.append((time.monotonic(), body))
        if st.reject_every and len(st.received) % st.reject_every == 0:
            return web.json_response({"error": {"message": "overloaded", "code": "rate_limit_exceeded"}},
                                     status=429, headers={"Retry-After": "1"})
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt = tuple(prompt)
        elif not isinstance(prompt, str) or not prompt.isprintable():
            return web.json_response({"error": {"message": "prompt must be printable text or token ids"}},
                                     status=400)
        hits, _ = st.cache(prompt)
        number = len(st.received)    # the completion's id and its place in the order, as the conductor's
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Mooncake-Reused-Blocks": str(hits),
                                           "X-Mooncake-Placed": str(number), "X-Request-Id": f"cmpl-{number}"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for i in range(n):
            await asyncio.sleep(0.001)
            chunk = {"id": f"cmpl-{number}", "object": "text_completion", "model": st.model,
                     "choices": [{"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
            if st.report_cached:
                usage["prompt_tokens_details"] = {"cached_tokens": hits * st.block_chars}
            await resp.write(b"data: " + orjson.dumps({"id": f"cmpl-{number}", "choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    return app


class ThreadServer:
    """Serve the fake app on 127.0.0.1:free-port from a background thread (with its own loop)."""

    def __init__(self, st: FakeState):
        self.st = st
        self.loop = asyncio.new_event_loop()
        self.url: str | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(make_app(self.st))
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def __enter__(self) -> "ThreadServer":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
