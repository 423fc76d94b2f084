"""A public request's body: read up to the model's bound (413 past it), decoded when gzip- or
deflate-compressed (capped as it decodes: a zip bomb is a 413), parsed as JSON (400)."""

from __future__ import annotations

import asyncio
import zlib

import orjson
from aiohttp import web

from mooncake_lite.conductor.api.errors import ApiError, bad_request, short
from mooncake_lite.model.tokenizer import Tokenizer

MAX_BODY_BYTES = 64 * 2**20   # what the HTTP parser reads at most; each model's own limit is lower
# A request body's room, from the model's context (max_body_bytes): a text character takes at most
# 6 bytes in JSON (a \u escape), a token id with its comma and spacing 16; then the other fields.
JSON_BYTES_PER_TEXT_BYTE = 6
JSON_BYTES_PER_TOKEN_ID = 16
OTHER_FIELDS_BYTES = 2**20
FALLBACK_TOKEN_BYTES = 256    # bytes per token assumed for a tokenizer with no bound of its own
OFF_LOOP_BYTES = 4096         # bodies over this many bytes are parsed (tokenized) in a thread


def max_body_bytes(max_context: int, tokenizer: Tokenizer) -> int:
    """The largest request body, once decoded, that a request fitting the model's context can
    need: a prompt of at most context × the longest token's bytes of text, each written in at most
    6 bytes of JSON, or a context of token ids; plus the other fields. A bigger body can only be
    refused, so it is, before its text is decoded, parsed or tokenized (a gzip bomb of 25 MiB
    took the conductor's event loop for 36 s)."""
    per_token = getattr(tokenizer, "max_token_bytes", None) or FALLBACK_TOKEN_BYTES
    prompt = max_context * max(per_token * JSON_BYTES_PER_TEXT_BYTE, JSON_BYTES_PER_TOKEN_ID)
    return min(MAX_BODY_BYTES, prompt + OTHER_FIELDS_BYTES)


async def read_json(request: web.Request, limit: int) -> tuple[object, int]:
    """The body as JSON, and its size once decoded; 413 past ``limit`` (the model's ``body_limit``)."""
    raw = await _read_body(request, limit)
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding in ("gzip", "deflate"):
        # Compressed bodies are decoded here, not by aiohttp (auto_decompress is off, app.py), so
        # the decoded size is capped exactly and a zip bomb is a 413, off the event loop.
        raw = await asyncio.to_thread(decode_body, raw, encoding, limit)
    try:
        return orjson.loads(raw), len(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The raw body, refused (413) once past ``limit``: at once when its length says so, or as
    soon as a chunked body's bytes do."""
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    try:
        if request.content_length is not None:
            return await request.read()
        raw = bytearray()
        async for chunk in request.content.iter_any():
            raw += chunk
            if len(raw) > limit:
                raise _too_large(limit)
        return bytes(raw)
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(limit) from None
    except web.RequestPayloadError as exc:   # broken chunked framing
        raise ApiError(400, f"the request body could not be read ({short(' '.join(str(exc).split()), 200)})",
                       code="invalid_body") from None


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes (after decoding its Content-Encoding), "
                         f"more than any request that fits this model's context needs", code="request_too_large")


def decode_body(raw: bytes, encoding: str, limit: int) -> bytes:
    """A gzip (concatenated members too) or deflate (zlib-wrapped or raw) body, decoded; 413 past
    ``limit`` decoded bytes, 400 when it is not what its Content-Encoding says."""
    out = bytearray()
    rest = raw
    while rest:
        wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else \
            (zlib.MAX_WBITS if rest[0] & 0x0F == 8 else -zlib.MAX_WBITS)
        d = zlib.decompressobj(wbits)
        try:
            out += d.decompress(rest, limit + 1 - len(out))
        except zlib.error as exc:
            raise ApiError(400, f"the request body is not valid {encoding} data, as its Content-Encoding "
                                f"says ({exc})", code="invalid_body") from None
        if len(out) > limit or d.unconsumed_tail:
            raise _too_large(limit)
        if not d.eof:
            raise ApiError(400, f"the request body's {encoding} data is truncated", code="invalid_body")
        rest = d.unused_data   # gzip: the next member; deflate: one stream only
        if encoding == "deflate" and rest:
            raise ApiError(400, "the request body has bytes after its deflate data", code="invalid_body")
    return bytes(out)
