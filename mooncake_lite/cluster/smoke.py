"""``mooncake up --smoke``: one real chat question through the public API, streamed like a client would."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
import orjson

from mooncake_lite.common.auth import api_key_headers

SMOKE_PROMPT = "What is the capital of France?"


class SmokeError(RuntimeError):
    pass


REJECTED_HINT = ("the conductor's admission control refused the request (429) although the cluster is idle. "
                 "By default its SLOs are relative to each instance's own profiled latency, which an idle "
                 "instance meets; an absolute --tbt-slo/--ttft-slo may be beyond this machine (the conductor "
                 "logs an error naming the numbers). Drop it, raise the factors (--conductor-args "
                 "'--tbt-slo-factor 10'), or turn admission off (--conductor-args '--admission none').")
MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class SmokeResult:
    model: str
    prompt: str
    text: str
    num_chunks: int
    finish_reason: str | None
    ttft_s: float
    total_s: float


async def served_model(session: aiohttp.ClientSession, api_url: str, fallback: str) -> str:
    """The first model id from ``GET /v1/models`` (the conductor may name a checkpoint differently)."""
    try:
        async with session.get(f"{api_url}/v1/models") as resp:
            if resp.status == 200:
                data = (await resp.json()).get("data") or []
                if data and isinstance(data[0], dict) and data[0].get("id"):
                    return str(data[0]["id"])
    except (aiohttp.ClientError, ValueError):
        pass
    return fallback


async def smoke_request(api_url: str, model: str, *, api_key: str | None = None, prompt: str = SMOKE_PROMPT,
                        max_tokens: int = 48, timeout_s: float = 120.0) -> SmokeResult:
    """Stream one chat completion (the prompt as the user's message); raise :class:`SmokeError` with the server's message on any failure.

    A 429 is retried after its ``Retry-After`` (at most 5 s, :data:`MAX_ATTEMPTS` tries): load
    reported by heartbeats can lag just after start-up."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, headers=api_key_headers(api_key)) as session:
        model = await served_model(session, api_url, model)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                return await _stream(session, api_url, model, prompt, max_tokens)
            except _Rejected as exc:
                if attempt == MAX_ATTEMPTS:
                    raise SmokeError(f"{exc.message}\n  {REJECTED_HINT}") from None
                await asyncio.sleep(min(5.0, exc.retry_after_s))
    raise AssertionError("unreachable")


class _Rejected(Exception):
    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.message, self.retry_after_s = message, retry_after_s


async def _stream(session: aiohttp.ClientSession, api_url: str, model: str, prompt: str,
                  max_tokens: int) -> SmokeResult:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True}
    start = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    finish, num_chunks, done = None, 0, False
    async with session.post(f"{api_url}/v1/chat/completions", json=body) as resp:
        if resp.status == 429:
            retry = resp.headers.get("Retry-After", "1")
            raise _Rejected(f"POST /v1/chat/completions -> HTTP 429: {(await resp.text())[:300]}",
                            float(retry) if retry.replace(".", "", 1).isdigit() else 1.0)
        if resp.status != 200:
            raise SmokeError(f"POST /v1/chat/completions -> HTTP {resp.status}: {(await resp.text())[:500]}")
        async for raw in resp.content:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            chunk = orjson.loads(payload)
            if "error" in chunk:
                raise SmokeError(f"the stream reported an error: {chunk['error']}")
            choice = (chunk.get("choices") or [{}])[0]
            if first is None:
                first = time.perf_counter()
            num_chunks += 1
            parts.append((choice.get("delta") or {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    if not done:
        raise SmokeError("the stream ended without 'data: [DONE]'")
    if num_chunks == 0:
        raise SmokeError("the stream carried no completion chunks")
    end = time.perf_counter()
    return SmokeResult(model, prompt, "".join(parts), num_chunks, finish, (first or end) - start, end - start)
