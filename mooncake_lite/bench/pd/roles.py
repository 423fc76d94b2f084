"""What ``bench pd``'s parts share: the KV block size they run at, and reserving a request on the
decode before its prefill runs (``bench pd --link`` too)."""

from __future__ import annotations

import aiohttp

from mooncake_lite.common.launch import RoleProcess

BLOCK = 64


async def announce(session: aiohttp.ClientSession, decode: RoleProcess, tid: str, prompt_len: int) -> aiohttp.ClientResponse:
    """Reserve the request on decode (max_tokens 1: it finishes as soon as the KV is in)."""
    body = {"request_id": tid, "transfer_id": tid, "prompt_len": prompt_len, "sampling": {"max_tokens": 1}}
    resp = await session.post(f"{decode.url()}/v1/generate", json=body)
    if resp.status != 200:
        raise RuntimeError(f"decode refused: {await resp.text()}")
    return resp
