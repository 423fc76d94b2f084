"""The start-up profile's KV peer: a child process answering every frame (``transfer/sink.py``),
so the chunks the profile times send their KV as served chunks do (``profiling.py``).

Any failure to start it, or a peer that breaks midway, leaves the profile to send its KV nowhere,
as it did before, with a log line saying so: a start-up never fails for its profile's peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import sys
from collections.abc import AsyncIterator

import orjson

from mooncake_lite.prefill.kv_sender import KVSender
from mooncake_lite.transfer.client import FrameClient, split_address
from mooncake_lite.transfer.sink import TOKEN_ENV

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
ANSWER_TIMEOUT_S = 10.0   # a frame unanswered this long: the peer is stuck, the profile goes on without it


class ProfileSink:
    """The child process and this process's connection to it. ``broken``: why the profile stopped
    sending to it (None: it has not)."""

    def __init__(self, proc: asyncio.subprocess.Process, client: FrameClient) -> None:
        self.proc, self.client = proc, client
        self.broken: str | None = None

    @classmethod
    async def start(cls, timeout: float = START_TIMEOUT_S) -> ProfileSink | None:
        """The peer started and dialled, or None (logged) where it could not be."""
        token = secrets.token_hex(16)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mooncake_lite.transfer.sink", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, env={**os.environ, TOKEN_ENV: token})
        except OSError as exc:
            log.warning("start-up profile: no KV peer (%s); its chunks send their KV nowhere", exc)
            return None
        try:
            ready = orjson.loads(await asyncio.wait_for(proc.stdout.readline(), timeout))
            host, port = split_address(ready.get("data") if isinstance(ready, dict) else None)
            client = await FrameClient.connect(host, port, token=token, name="prefill profile", timeout=timeout)
        except Exception as exc:   # no line, a bad one, a refused dial: the profile goes on without it
            log.warning("start-up profile: its KV peer did not start (%s); its chunks send their KV nowhere",
                        str(exc) or type(exc).__name__)
            await _end(proc)
            return None
        client.request_timeout = ANSWER_TIMEOUT_S
        return cls(proc, client)

    def sender(self, request_id: str) -> KVSender:
        return KVSender(self.client, request_id)

    def give_up(self, reason: str) -> None:
        if self.broken is None:
            log.warning("start-up profile: its KV peer broke (%s); the chunks left send their KV nowhere", reason)
        self.broken = reason

    async def close(self) -> None:
        await self.client.close()
        await _end(self.proc)


async def _end(proc: asyncio.subprocess.Process, timeout: float = 5.0) -> None:
    """Close the child's stdin (it exits on that) and reap it; killed if it does not go in time."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()


@contextlib.asynccontextmanager
async def profile_sink() -> AsyncIterator[ProfileSink | None]:
    """A :class:`ProfileSink` for the span of a profile (None where it could not start)."""
    sink = await ProfileSink.start()
    try:
        yield sink
    finally:
        if sink is not None:
            await sink.close()
