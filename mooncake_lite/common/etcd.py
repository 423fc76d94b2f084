"""A small etcd v3 client over its JSON gateway (``/v3/...``, base64 keys and values), on aiohttp.

Why the gateway and not a client library: every role already runs aiohttp; the gateway ships in
the etcd server itself (3.4 in Debian, ``/v3/`` paths), so there is nothing more to install, no
gRPC stack and no generated code; the few calls the cluster needs (put under a lease, keep it
alive, read a prefix, watch it) are one POST each. ``/v3/watch`` answers a stream of JSON lines,
one per batch of events.

Every call raises :class:`EtcdError` when etcd is unreachable or answers an error, so callers
catch one type (their loops retry with backoff).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import orjson


class EtcdError(RuntimeError):
    pass


@dataclass(frozen=True)
class Event:
    """One change under a watched prefix: ``value`` is None for a delete (or an expired lease)."""
    key: str
    value: bytes | None
    revision: int


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(data: str) -> bytes:
    return base64.b64decode(data)


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that selects every key starting with ``prefix`` (its last byte + 1)."""
    raw = prefix.encode()
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


def parse_url(url: str) -> str:
    """``etcd://HOST:PORT`` (or http://) → the gateway's base URL; ValueError naming the form."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("etcd", "http") or not rest or "/" in rest.rstrip("/"):
        raise ValueError(f"--discovery must be etcd://HOST:PORT, got {url!r}")
    return "http://" + rest.rstrip("/")


class Etcd:
    """The calls the cluster makes, on the caller's session. ``timeout`` bounds each unary call."""

    def __init__(self, session: aiohttp.ClientSession, base: str, timeout: float = 3.0) -> None:
        self.session = session
        self.base = base.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def _call(self, path: str, body: dict) -> dict:
        try:
            async with self.session.post(self.base + path, data=orjson.dumps(body), timeout=self.timeout) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise EtcdError(f"etcd {path} answered {resp.status}: {raw[:200].decode(errors='replace')}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise EtcdError(f"etcd at {self.base} unreachable ({exc!r})") from None
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise EtcdError(f"etcd {path}: not JSON") from None
        if not isinstance(answer, dict) or "error" in answer:
            raise EtcdError(f"etcd {path}: {str(answer)[:200]}")
        return answer

    async def grant(self, ttl_s: int) -> int:
        answer = await self._call("/v3/lease/grant", {"TTL": ttl_s})
        return int(answer["ID"])

    async def keepalive(self, lease: int) -> bool:
        """Renew ``lease`` once; False when etcd no longer knows it (expired: grant a new one)."""
        answer = await self._call("/v3/lease/keepalive", {"ID": lease})
        return int(answer.get("result", {}).get("TTL", 0)) > 0

    async def revoke(self, lease: int) -> None:
        await self._call("/v3/lease/revoke", {"ID": lease})

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        body: dict = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            body["lease"] = lease
        await self._call("/v3/kv/put", body)

    async def create(self, key: str, value: bytes, lease: int | None = None) -> tuple[bool, bytes | None]:
        """Put ``key`` (under ``lease``, or for good) only if it does not exist (a transaction comparing
        its create revision with 0): (True, None) when this call created it, else (False, its value)."""
        k = _b64(key)
        put = {"key": k, "value": _b64(value), **({"lease": lease} if lease is not None else {})}
        answer = await self._call("/v3/kv/txn", {
            "compare": [{"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
            "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": k}}]})
        if answer.get("succeeded"):
            return True, None
        kvs = [kv for r in answer.get("responses", ()) for kv in r.get("response_range", {}).get("kvs", ())]
        return False, _unb64(kvs[0].get("value", "")) if kvs else None

    async def delete(self, key: str) -> None:
        await self._call("/v3/kv/deleterange", {"key": _b64(key)})

    async def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """Every key under ``prefix`` with its value, and the revision they were read at."""
        answer = await self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        kvs = {_unb64(kv["key"]).decode(errors="replace"): _unb64(kv.get("value", ""))
               for kv in answer.get("kvs", [])}
        return kvs, int(answer.get("header", {}).get("revision", 0))

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[Event]:
        """The changes under ``prefix`` from ``start_revision`` on, until the stream ends (etcd
        gone: :class:`EtcdError`). No total timeout: the stream is meant to stay open."""
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": start_revision}}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout.total)
        try:
            async with self.session.post(self.base + "/v3/watch", data=orjson.dumps(body), timeout=timeout) as resp:
                if resp.status != 200:
                    raise EtcdError(f"etcd watch answered {resp.status}")
                async for line in resp.content:
                    for event in _events(line):
                        yield event
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise EtcdError(f"etcd watch at {self.base} lost ({exc!r})") from None
        raise EtcdError(f"etcd watch at {self.base} ended")


def _events(line: bytes) -> list[Event]:
    """The events of one streamed watch answer (none for the created/progress notices)."""
    try:
        result = orjson.loads(line).get("result", {})
    except (orjson.JSONDecodeError, AttributeError):
        return []
    if result.get("canceled"):
        raise EtcdError(f"etcd cancelled the watch: {result.get('cancel_reason', '')}")
    out = []
    for ev in result.get("events", ()):
        kv = ev.get("kv", {})
        key = _unb64(kv.get("key", "")).decode(errors="replace")
        value = None if ev.get("type") == "DELETE" else _unb64(kv.get("value", ""))
        out.append(Event(key, value, int(kv.get("mod_revision", 0))))
    return out
