"""Drive a prefill and a decode instance directly through their HTTP APIs (no conductor)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import aiohttp
import orjson

_ids = itertools.count()


@dataclass
class Outcome:
    status: int                      # decode's /v1/generate status
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    prefill_status: int | None = None
    prefill: dict | None = None


async def generate(session: aiohttp.ClientSession, prefill_url: str, decode_url: str, decode_data: str,
                   token_ids: list[int], max_tokens: int, *, prefix_keys: tuple[str, ...] = (),
                   kv_timeout_s: float = 30.0, request_id: str | None = None, sampling: dict | None = None) -> Outcome:
    """The conductor's job for one request: reserve on decode, prefill, collect all tokens
    (``sampling``: fields beside greedy and ``max_tokens``)."""
    rid = request_id or f"req-{next(_ids)}"
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, **(sampling or {})}
    gen = {"request_id": rid, "transfer_id": f"t-{rid}", "prompt_len": len(token_ids),
           "sampling": sampling, "kv_timeout_s": kv_timeout_s}
    resp = await session.post(f"{decode_url}/v1/generate", data=orjson.dumps(gen))
    if resp.status != 200:
        body = await resp.json()
        resp.release()
        return Outcome(resp.status, error=body.get("error"))
    try:
        pre = {"request_id": rid, "transfer_id": f"t-{rid}", "token_ids": list(token_ids),
               "decode_data": decode_data, "sampling": sampling, "prefix_keys": list(prefix_keys)}
        try:
            async with session.post(f"{prefill_url}/v1/prefill", data=orjson.dumps(pre)) as presp:
                body = await presp.json()
            out = Outcome(200, prefill_status=presp.status, prefill=body)
        except aiohttp.ClientError as exc:   # the prefill instance died
            out = Outcome(200, prefill={"error": str(exc)})
        if out.prefill_status == 200:
            out.tokens.append(body["first_token"])
        try:
            async for line in resp.content:
                event = orjson.loads(line)
                if "token" in event:
                    out.tokens.append(event["token"])
                if "finish_reason" in event:
                    out.finish_reason = event["finish_reason"]
                    out.error = event.get("error")
                    break
        except aiohttp.ClientError as exc:   # the decode instance died
            out.error = f"decode stream lost: {exc}"
        return out
    finally:
        resp.release()
