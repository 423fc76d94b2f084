"""Small helpers for the store tests: keys, deterministic block bytes, metrics parsing, waiting for a log line."""

from __future__ import annotations

import asyncio
import random
import urllib.request

from mooncake_lite.common.hashing import prefix_hash


def chain(num_blocks: int, seed: int = 0, block_size: int = 4) -> list[bytes]:
    """Chained keys of ``num_blocks`` blocks (distinct per seed)."""
    rng = random.Random(seed)
    return prefix_hash([rng.randrange(50_000) for _ in range(num_blocks * block_size)], block_size)


def block(key: bytes, size: int) -> bytes:
    """Deterministic pseudo-random bytes for a key (so byte-exact checks mean something)."""
    return random.Random(key).randbytes(size)


def http_get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample from /metrics, e.g. metric(url, "mooncake_store_hits_total", 'tier="ssd"')."""
    _, body = http_get(url + "/metrics")
    want = f"{name}{{{labels}}}" if labels else name
    for line in body.decode().splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    raise KeyError(f"{want} not in /metrics")


async def wait_log(proc, text: str, timeout: float = 10.0) -> None:
    """The store counts before it logs, and its lines reach us through a pipe: wait for the line."""
    for _ in range(int(timeout / 0.05)):
        if text in proc.logs():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{text!r} never logged: {proc.logs()[-2000:]}")
