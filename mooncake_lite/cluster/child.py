"""One supervised role process: start it, catch its ready line, relay its logs, stop it for sure.

A role prints exactly one JSON ready line on stdout (``common/service.py``); everything else it
writes (stderr logs, stray stdout) is relayed line by line through ``on_line`` with the child's
name, and the last lines are kept so a failure can be explained.

Children run in their own session so a terminal's Ctrl-C reaches only the supervisor, which
then stops them in a deliberate order. On Linux each child also gets SIGTERM if the supervisor
itself dies abruptly (``PR_SET_PDEATHSIG``), so even ``kill -9`` of ``mooncake up`` leaves no
orphan serving on a port.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

import orjson

log = logging.getLogger(__name__)

LineSink = Callable[[str, str], None]  # (child name, line without newline)
_PR_SET_PDEATHSIG = 1


class ChildFailed(RuntimeError):
    """A child exited (or never became ready) while the cluster needed it."""

    def __init__(self, name: str, message: str, tail: Sequence[str]):
        super().__init__(f"{name}: {message}")
        self.name, self.tail = name, list(tail)


def _die_with_parent() -> None:
    """Runs in the forked child before exec: ask the kernel for SIGTERM when the parent dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def parse_ready(line: str) -> dict[str, str] | None:
    """The addresses of a ready line (``{"event": "ready", ...}`` minus event/role), else None."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        msg = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(msg, dict) or msg.get("event") != "ready":
        return None
    return {k: str(v) for k, v in msg.items() if k not in ("event", "role")}


class Child:
    """A role process under supervision. ``argv`` is the full command line."""

    def __init__(self, name: str, role: str, argv: Sequence[str], *, on_line: LineSink,
                 env: dict[str, str] | None = None, tail_lines: int = 40):
        self.name, self.role, self.argv = name, role, list(argv)
        self.on_line, self.env = on_line, env
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.addresses: dict[str, str] | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self._ready: asyncio.Future[dict[str, str]] | None = None
        self._readers: list[asyncio.Task] = []

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc else None

    def url(self, key: str = "http") -> str:
        if not self.addresses or key not in self.addresses:
            raise KeyError(f"{self.name} reported no {key!r} address")
        return f"http://{self.addresses[key]}"

    async def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        self._ready = asyncio.get_running_loop().create_future()
        # a failure nobody waited for is still reported through stop()/tail; don't warn about it
        self._ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        log.debug("%s started, pid %d: %s", self.name, self.proc.pid, " ".join(self.argv))
        self._readers = [asyncio.create_task(self._read(self.proc.stdout, is_stdout=True)),
                         asyncio.create_task(self._read(self.proc.stderr, is_stdout=False))]

    async def _read(self, stream: asyncio.StreamReader, *, is_stdout: bool) -> None:
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line longer than the stream limit: relay what we have
                raw = await stream.read(1 << 16)
            if not raw:
                break
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if is_stdout and self.addresses is None:
                addresses = parse_ready(line)
                if addresses is not None:
                    self.addresses = addresses
                    if not self._ready.done():
                        self._ready.set_result(addresses)
                    continue
            self.tail.append(line)
            self.on_line(self.name, line)
        if is_stdout:
            await self.proc.wait()
            if not self._ready.done():
                self._ready.set_exception(ChildFailed(
                    self.name, f"exited with code {self.proc.returncode} before it was ready", self.tail))

    async def wait_ready(self, timeout: float) -> dict[str, str]:
        """The ready line's addresses; :class:`ChildFailed` if it exits or times out first."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except asyncio.TimeoutError:
            raise ChildFailed(self.name, f"not ready after {timeout:g}s", self.tail) from None

    async def wait_exit(self) -> int:
        rc = await self.proc.wait()
        await asyncio.gather(*self._readers, return_exceptions=True)  # flush the last log lines
        return rc

    def send(self, sig: signal.Signals) -> None:
        if self.proc and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    async def stop(self, timeout: float) -> int:
        """SIGTERM, wait up to ``timeout`` for the drain, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.returncode is None:
            self.send(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except asyncio.TimeoutError:
                self.on_line(self.name, f"(no exit {timeout:g}s after SIGTERM; sending SIGKILL)")
                self.send(signal.SIGKILL)
        return await self.wait_exit()
