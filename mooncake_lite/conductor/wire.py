"""Encoding and decoding of the conductor's hot-path messages.

The generic decoder in ``common/protocol.py`` resolves type hints on every call (~0.5 ms a
message) and ``protocol.dumps`` deep-copies every prompt token id through
``dataclasses.asdict``; a streamed request decodes one line per token, so the conductor uses
these equivalents (tests/conductor/test_wire.py checks they accept, refuse and produce exactly
what the protocol module does).
"""

from __future__ import annotations

from typing import Any

import orjson

from mooncake_lite.common.protocol import PrefillResult, ProtocolError, TokenEvent, from_dict

_TOKEN_EVENT_FIELDS = frozenset(("token", "finish_reason", "error"))


def parse_token_event(line: bytes) -> TokenEvent:
    """``protocol.loads(TokenEvent, line)`` with the same checks, on the per-token hot path
    (the generic decoder resolves type hints on every call: ~0.5 ms a line)."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"TokenEvent: invalid JSON: {exc}") from None
    if not isinstance(data, dict) or not data.keys() <= _TOKEN_EVENT_FIELDS:
        return from_dict(TokenEvent, data)   # the slow path names exactly what is wrong
    token, reason, error = data.get("token"), data.get("finish_reason"), data.get("error")
    if (token is not None and (type(token) is not int)) or (reason is not None and type(reason) is not str) \
            or (error is not None and type(error) is not str):
        return from_dict(TokenEvent, data)
    return TokenEvent(token, reason, error)


_RESULT_INTS = ("first_token", "num_prefix_tokens", "num_computed_tokens")


def parse_prefill_result(body: bytes) -> PrefillResult:
    """``protocol.loads(PrefillResult, body)`` with the same checks, once per request."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"PrefillResult: invalid JSON: {exc}") from None
    if isinstance(data, dict) and data.keys() <= {"request_id", "timings", *_RESULT_INTS} \
            and type(data.get("request_id")) is str and all(type(data.get(k)) is int for k in _RESULT_INTS) \
            and isinstance(data.get("timings", {}), dict):
        return PrefillResult(data["request_id"], data["first_token"], data["num_prefix_tokens"],
                             data["num_computed_tokens"], data.get("timings", {}))
    return from_dict(PrefillResult, data)


def encode(msg: Any) -> bytes:
    """Same bytes as ``protocol.dumps`` (orjson serializes dataclasses natively), without
    ``dataclasses.asdict`` deep-copying every prompt token id."""
    return orjson.dumps(msg)


def error_text(body: bytes) -> str:
    """The message of an OpenAI-style or plain error body, shortened."""
    try:
        data = orjson.loads(body)
        if isinstance(data, dict):
            err = data.get("error", data)
            if isinstance(err, dict):
                return str(err.get("message", err))[:500]
            return str(err)[:500]
    except orjson.JSONDecodeError:
        pass
    return body[:500].decode("utf-8", "replace") or "(empty body)"
