"""The HTTP side of a replay: stream one completion and record when each chunk arrived.

Speaks plain OpenAI ``/v1/completions`` with ``stream: true`` (SSE ``data:`` lines ending with
``data: [DONE]``), so it works against mooncake-lite, vLLM, SGLang or anything compatible.
The clock is injectable so tests can record a stream on a fake clock.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import orjson

from mooncake_lite.bench.replay.metrics import RequestRecord
from mooncake_lite.bench.replay.workload import SynthRequest

Clock = Callable[[], float]


def request_body(req: SynthRequest, model: str, *, ignore_eos: bool) -> dict:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM extension: produce exactly max_tokens, as the trace says
    return body


def _error_text(raw: str) -> str:
    try:
        err = orjson.loads(raw).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
    except (orjson.JSONDecodeError, AttributeError):
        pass
    return raw[:300]


def _seconds(header: str | None) -> float | None:
    """A predicted time from a response header; None when absent or not a finite number >= 0."""
    try:
        value = float(header) if header else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def _count(obj: dict, key: str, default: int | None) -> int | None:
    """A token count from a usage object (a non-integer is ignored, not trusted)."""
    value = obj.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


async def stream_one(session: aiohttp.ClientSession, url: str, req: SynthRequest, body: dict, *,
                     scheduled_s: float, clock: Clock = time.perf_counter) -> RequestRecord:
    """Send one streamed completion; never raises for server or network trouble (it is recorded)."""
    send = clock()
    stream = Stream(req.stop_after)
    base = dict(request_id=req.request_id, scheduled_s=scheduled_s, send_s=send,
                prompt_tokens=req.num_prompt_tokens, num_prompt_blocks=req.num_full_blocks)
    reused = None
    try:
        async with session.post(url, json=body) as resp:
            reused_hdr = resp.headers.get("X-Mooncake-Reused-Blocks")
            reused = int(reused_hdr) if reused_hdr and reused_hdr.isdigit() else None
            base.update(predicted_ttft_s=_seconds(resp.headers.get("X-Mooncake-Predicted-TTFT")),
                        predicted_tbt_s=_seconds(resp.headers.get("X-Mooncake-Predicted-TBT")),
                        bound_ttft_s=_seconds(resp.headers.get("X-Mooncake-Bound-TTFT")),
                        slo_s=(_seconds(resp.headers.get("X-Mooncake-SLO-TTFT")),
                               _seconds(resp.headers.get("X-Mooncake-SLO-TBT"))),
                        num_placed=_count_header(resp.headers.get("X-Mooncake-Placed")),
                        completion_id=resp.headers.get("X-Request-Id"))
            if resp.status != 200:
                return RequestRecord(**base, status=resp.status, error=_error_text(await resp.text()))
            async for raw in resp.content:
                line = raw.strip()
                if line.startswith(b"data:") and stream.take(line[5:].strip(), clock):
                    break
            if stream.error is None and not stream.done:
                stream.error = "stream ended without data: [DONE]"
            return RequestRecord(**base, chunk_s=tuple(stream.chunks), output_tokens=stream.output_tokens,
                                 status=resp.status, error=stream.error, cached_tokens=stream.cached_tokens,
                                 server_prompt_tokens=stream.prompt_tokens, reused_blocks=reused)
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, ValueError) as exc:
        return RequestRecord(**base, chunk_s=tuple(stream.chunks), error=f"{type(exc).__name__}: {exc}"[:300],
                             reused_blocks=reused)


def _count_header(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


@dataclass
class Stream:
    """What one SSE stream has told so far: when each content chunk came, the usage counts the
    server reported, an error event, and whether it ended (``[DONE]``, or the trace's answer
    complete under a ``max_tokens`` cap)."""
    stop_after: int | None
    chunks: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    done: bool = False

    def take(self, payload: bytes, clock: Clock) -> bool:
        """One ``data:`` payload; True when the client stops reading."""
        if payload == b"[DONE]":
            self.done = True
            return True
        now = clock()
        data = orjson.loads(payload)
        if data.get("error"):
            self.error = _error_text(payload.decode())
            return False
        if data.get("choices"):
            self.chunks.append(now)
            if self.stop_after is not None and len(self.chunks) >= self.stop_after:
                # the trace's answer is complete: a client that sent a max_tokens cap
                # stops reading here (closing the stream ends the request upstream)
                self.output_tokens, self.done = len(self.chunks), True
                return True
        usage = data.get("usage")
        if isinstance(usage, dict):
            self.output_tokens = _count(usage, "completion_tokens", self.output_tokens)
            self.prompt_tokens = _count(usage, "prompt_tokens", self.prompt_tokens)
            details = usage.get("prompt_tokens_details")
            self.cached_tokens = _count(details, "cached_tokens", self.cached_tokens) if isinstance(details, dict) \
                else self.cached_tokens
        return False


async def served_model_info(session: aiohttp.ClientSession, base_url: str) -> tuple[str | None, int | None]:
    """(first model id, its max_model_len) from ``GET /v1/models``; Nones when not offered."""
    try:
        async with session.get(f"{base_url}/v1/models") as resp:
            if resp.status != 200:
                return None, None
            data = (await resp.json(content_type=None)).get("data") or []
    except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
        return None, None
    if not data or not isinstance(data[0], dict):
        return None, None
    ctx = data[0].get("max_model_len")
    return data[0].get("id"), ctx if isinstance(ctx, int) else None


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfaINFA]+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of every sample per metric name (labels folded) from Prometheus text format."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            try:
                totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                continue
    return totals


async def scrape_metrics(session: aiohttp.ClientSession, base_url: str) -> dict[str, float] | None:
    try:
        async with session.get(f"{base_url}/metrics") as resp:
            return parse_prometheus(await resp.text()) if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


HIT_METRICS = ("mooncake_conductor_reused_prefix_blocks_total", "mooncake_conductor_prompt_blocks_total")


def cache_hit_rate(before: dict[str, float] | None, after: dict[str, float] | None) -> tuple[float | None, str | None]:
    """Prefix blocks reused / prompt blocks scheduled during the run, from the conductor's
    counters, or (None, why not)."""
    if not before or not after or not all(k in after for k in HIT_METRICS):
        return None, ("the server's /metrics has no mooncake_conductor_reused_prefix_blocks_total / "
                      "_prompt_blocks_total counters")
    reused = after[HIT_METRICS[0]] - before.get(HIT_METRICS[0], 0.0)
    total = after[HIT_METRICS[1]] - before.get(HIT_METRICS[1], 0.0)
    if total <= 0:
        return None, "the conductor scheduled no full prompt block during the run"
    return reused / total, None
