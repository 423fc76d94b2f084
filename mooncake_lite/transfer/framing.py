"""The binary frame: fixed header + small orjson meta + raw payload bytes.

Wire layout (little-endian), one frame::

    magic   4s   b"MCKL"
    version u8   1
    op      u8   operation code (0 = HELLO handshake; others are defined by the user of the layer)
    flags   u16  FLAG_REPLY | FLAG_ERROR
    req_id  u64  request id chosen by the requester, echoed by the reply
    meta    u32  length of the orjson meta (a JSON object; 0 = empty)
    payload u64  length of the raw payload that follows the meta

The payload is opaque bytes, usually several blocks back to back; the meta says how to split it
(e.g. ``"sizes": [...]``). No pickle, no JSON for bulk bytes. Senders pass the header, the meta
and the payload buffers to one ``transport.writelines`` call (scatter/gather, no concatenation).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

MAGIC = b"MCKL"
VERSION = 1
HEADER = struct.Struct("<4sBBHQIQ")
HEADER_BYTES = HEADER.size  # 28

OP_HELLO = 0  # handshake: client -> server {"token": ..., "client": ...}; reply {"ok": true}

FLAG_REPLY = 0x1
FLAG_ERROR = 0x2  # reply carries {"error": code, "message": text}

Buffer = bytes | bytearray | memoryview


class FrameError(ValueError):
    """A frame violates the protocol (bad magic/version, too large, undecodable meta)."""


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts and how long it waits. A frame over a size limit closes the
    connection when its header arrives, before any memory is allocated for it.

    Sizes: ``max_meta_bytes``/``max_payload_bytes`` after the handshake (a server passes the
    most its protocol can legitimately carry); before it, a meta of at most ``hello_meta_bytes``
    and no payload at all. ``max_inflight_bytes``: the receive memory (payloads without a
    ``payload_sink`` buffer, metas too big for the staging buffer) all connections of one server
    may hold for frames still arriving; the connection whose frame would go over it is closed.
    Timeouts (seconds, None = off; servers only): ``handshake_timeout`` from accept to a
    completed HELLO, ``stall_timeout`` for a half-received frame (its header and meta must arrive
    within it, its payload must keep moving), ``idle_timeout`` for an authenticated connection
    with nothing half-received."""
    max_meta_bytes: int = 4 << 20
    max_payload_bytes: int = 1 << 34  # 16 GiB: a batch of many large blocks
    hello_meta_bytes: int = 4 << 10
    handshake_timeout: float | None = 5.0
    stall_timeout: float | None = 30.0
    idle_timeout: float | None = None
    max_inflight_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        for name in ("max_meta_bytes", "max_payload_bytes", "hello_meta_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"Limits.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_inflight_bytes <= 0:
            raise ValueError(f"Limits.max_inflight_bytes must be positive, got {self.max_inflight_bytes}")
        for name in ("handshake_timeout", "stall_timeout", "idle_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"Limits.{name} must be positive or None, got {value}")


class Header(NamedTuple):
    """A frame's fixed part, decoded (a tuple: built once per frame received, on the hot path)."""
    op: int
    flags: int
    request_id: int
    meta_len: int
    payload_len: int

    @property
    def is_reply(self) -> bool:
        return bool(self.flags & FLAG_REPLY)

    @property
    def is_error(self) -> bool:
        return bool(self.flags & FLAG_ERROR)


@dataclass(slots=True)
class Frame:
    """A received frame. ``payload`` is the list of buffers the payload was received into."""
    header: Header
    meta: dict[str, Any]
    payload: list[memoryview]

    @property
    def op(self) -> int:
        return self.header.op

    @property
    def request_id(self) -> int:
        return self.header.request_id

    def payload_bytes(self) -> bytes:
        """The whole payload as one bytes object (a copy; for small payloads and tests)."""
        return b"".join(self.payload)


def decode_header(data: Buffer, limits: Limits, authenticated: bool = True) -> Header:
    """Parse and validate ``HEADER_BYTES`` bytes. Raises FrameError with a readable reason.
    Before the handshake (``authenticated`` false) only a small meta and no payload pass."""
    magic, version, op, flags, request_id, meta_len, payload_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r} (not a mooncake-lite peer?)")
    if version != VERSION:
        raise FrameError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    if not authenticated:
        if payload_len:
            raise FrameError(f"payload sent before the handshake ({payload_len} bytes announced)")
        if meta_len > limits.hello_meta_bytes:
            raise FrameError(f"meta of {meta_len} bytes before the handshake exceeds the limit of "
                             f"{limits.hello_meta_bytes}")
    if meta_len > limits.max_meta_bytes:
        raise FrameError(f"meta of {meta_len} bytes exceeds the limit of {limits.max_meta_bytes}")
    if payload_len > limits.max_payload_bytes:
        raise FrameError(f"payload of {payload_len} bytes exceeds the limit of {limits.max_payload_bytes}")
    return Header(op, flags, request_id, meta_len, payload_len)


def decode_meta(data: Buffer) -> dict[str, Any]:
    if not len(data):
        return {}
    try:
        meta = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise FrameError(f"meta is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise FrameError(f"meta must be a JSON object, got {type(meta).__name__}")
    return meta


def as_bytes_view(buf: Buffer) -> memoryview:
    """A flat unsigned-byte view of any contiguous buffer (numpy/torch arrays included)."""
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def encode_frame(op: int, request_id: int, meta: dict[str, Any] | None = None,
                 payload: Sequence[Buffer] = (), flags: int = 0) -> list[Buffer]:
    """The buffers of one frame, ready for ``transport.writelines`` (payload is not copied)."""
    meta_bytes = orjson.dumps(meta) if meta else b""
    payload_len = 0
    for buf in payload:
        payload_len += buf.nbytes if isinstance(buf, memoryview) else len(buf)
    header = HEADER.pack(MAGIC, VERSION, op, flags, request_id, len(meta_bytes), payload_len)
    parts: list[Buffer] = [header + meta_bytes] if meta_bytes else [header]
    parts.extend(payload)
    return parts
