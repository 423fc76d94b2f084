"""Start a role process, read its ready line, relay its output, stop it for sure: the one way.

A role (``python -m mooncake_lite --role R ...``) prints exactly one JSON ready line on stdout
(``common/service.py``); every other line it writes (stderr logs, stray stdout) goes to an
optional ``on_line(name, line)`` sink and a bounded tail, so a failure can be explained. Stopping
is SIGTERM, a bounded wait for the drain, then SIGKILL.

:class:`RoleProcess` is the blocking flavour (tests, benchmarks, a CPP group's head);
:class:`AsyncRoleProcess` is the asyncio one ``mooncake up`` supervises. The latter runs each
child in its own session, so a terminal's Ctrl-C reaches only the supervisor, which then stops
the children in a deliberate order; on Linux it also asks the kernel to SIGTERM the child if the
supervisor dies abruptly (``PR_SET_PDEATHSIG``), so even ``kill -9`` leaves no orphan on a port.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Sequence

import orjson

log = logging.getLogger(__name__)

LAUNCHER = (sys.executable, "-m", "mooncake_lite")  # the command prefix that runs a role
LineSink = Callable[[str, str], None]               # (process name, line without newline)
_PR_SET_PDEATHSIG = 1


class RoleFailed(RuntimeError):
    """A role process exited (or never became ready) while it was needed."""

    def __init__(self, name: str, message: str, tail: Sequence[str]):
        super().__init__(f"{name}: {message}")
        self.name, self.tail = name, list(tail)


def role_argv(role: str, *args: str, launcher: Sequence[str] = LAUNCHER) -> list[str]:
    """The command line of ``mooncake --role ROLE ARGS``."""
    return [*launcher, "--role", role, *args]


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


def to_stderr(name: str, line: str) -> None:
    """A sink that passes a child's lines on to our own stderr, as if we had written them."""
    sys.stderr.write(line + "\n")


def _child_env(env: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}


def _die_with_parent() -> None:
    """Runs in the forked child before exec: ask the kernel for SIGTERM when the parent dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class _Output:
    """Everything a role process writes: the ready line's addresses, the rest to a sink and a tail."""

    def __init__(self, name: str, on_line: LineSink | None, tail_lines: int):
        self.name, self.on_line = name, on_line
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.addresses: dict[str, str] | None = None

    def feed(self, line: str, *, is_stdout: bool) -> bool:
        """Take one line (no newline); True when it is the ready line."""
        if is_stdout and self.addresses is None:
            addresses = parse_ready(line)
            if addresses is not None:
                self.addresses = addresses
                return True
        self.tail.append(line)
        if self.on_line is not None:
            self.on_line(self.name, line)
        return False

    def url(self, key: str) -> str:
        if not self.addresses or key not in self.addresses:
            raise KeyError(f"{self.name} reported no {key!r} address")
        return f"http://{self.addresses[key]}"


def _last_lines(tail: Iterable[str], n: int = 40) -> str:
    lines = list(tail)[-n:]
    return "; last lines:\n" + "\n".join(lines) if lines else ""


class RoleProcess:
    """A running role process (blocking flavour): ``RoleProcess.start("store", "--port", "0")``.

    Reader threads drain stdout and stderr for the whole life of the process, so it never blocks
    on a full pipe (``on_line`` runs on those threads); ``logs()`` is what it wrote besides the
    ready line (the last ``tail_lines``). It does not die with its parent: a parent *thread* ending
    would trigger ``PR_SET_PDEATHSIG``, and tests start roles from worker threads.
    """

    def __init__(self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
                 cwd: str | os.PathLike | None = None, on_line: LineSink | None = None,
                 tail_lines: int = 10_000):
        self.name, self.argv = name, list(argv)
        self.out = _Output(name, on_line, tail_lines)
        self._ready = threading.Event()
        self._is_terminating = False  # SIGTERM sent: a second one could cut its drain short
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, encoding="utf-8", errors="replace",
                                     env=_child_env(env), cwd=cwd)
        self._readers = [threading.Thread(target=self._read, args=(s, s is self.proc.stdout), daemon=True)
                         for s in (self.proc.stdout, self.proc.stderr)]
        for reader in self._readers:
            reader.start()

    @classmethod
    def start(cls, role: str, *args: str, name: str | None = None, timeout: float | None = 120.0,
              launcher: Sequence[str] = LAUNCHER, **options) -> RoleProcess:
        """Start ``mooncake --role ROLE ARGS`` and wait for its ready line (see :meth:`launch`)."""
        return cls.launch(role_argv(role, *args, launcher=launcher), name=name or role, timeout=timeout, **options)

    @classmethod
    def launch(cls, argv: Sequence[str], *, name: str, timeout: float | None = 120.0, **options) -> RoleProcess:
        """Run any command that prints a ready line and wait for it; :class:`RoleFailed` (with
        its last output lines) if it exits or ``timeout`` passes first, after stopping it.
        ``options``: ``env``, ``cwd``, ``on_line``, ``tail_lines`` of the constructor."""
        rp = cls(name, argv, **options)
        rp.wait_ready(timeout)
        return rp

    def _read(self, stream, is_stdout: bool) -> None:
        for line in iter(stream.readline, ""):
            if self.out.feed(line.rstrip("\r\n"), is_stdout=is_stdout):
                self._ready.set()
        if is_stdout:
            self._ready.set()  # EOF: wait_ready sees no addresses

    def wait_ready(self, timeout: float | None) -> dict[str, str]:
        """The ready line's addresses (``timeout`` None: as long as the process lives)."""
        if not self._ready.wait(timeout):
            self.stop()
            raise RoleFailed(self.name, f"not ready after {timeout:g}s{_last_lines(self.out.tail)}", self.out.tail)
        if self.out.addresses is None:
            rc = self.stop()
            raise RoleFailed(self.name, f"exited with code {rc} before it was ready{_last_lines(self.out.tail)}",
                             self.out.tail)
        return self.out.addresses

    @property
    def addresses(self) -> dict[str, str]:
        return self.out.addresses or {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def url(self, key: str = "http") -> str:
        return self.out.url(key)

    def hostport(self, key: str) -> tuple[str, int]:
        host, port = self.addresses[key].rsplit(":", 1)
        return host, int(port)

    def logs(self) -> str:
        if self.proc.poll() is not None:  # exited: let the readers take its last lines first
            for reader in self._readers:
                reader.join(5)
        return "".join(line + "\n" for line in list(self.out.tail))

    def send(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
                self._is_terminating = self._is_terminating or sig == signal.SIGTERM

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (unless sent already), wait up to ``timeout`` for the drain, then SIGKILL.
        Returns the exit code."""
        if not self._is_terminating:
            self.send(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s: no exit %gs after SIGTERM; sending SIGKILL", self.name, timeout)
            self.proc.kill()
            return self.proc.wait()


class AsyncRoleProcess:
    """A role process under an asyncio supervisor. ``argv`` is the full command line; call
    :meth:`start`, then :meth:`wait_ready`."""

    def __init__(self, name: str, role: str, argv: Sequence[str], *, on_line: LineSink,
                 env: dict[str, str] | None = None, tail_lines: int = 40):
        self.name, self.role, self.argv, self.env = name, role, list(argv), env
        self.out = _Output(name, on_line, tail_lines)
        self.proc: asyncio.subprocess.Process | None = None
        self._ready: asyncio.Future[dict[str, str]] | None = None
        self._readers: list[asyncio.Task] = []

    @property
    def addresses(self) -> dict[str, str] | None:
        return self.out.addresses

    @property
    def tail(self) -> collections.deque[str]:
        return self.out.tail

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc else None

    def url(self, key: str = "http") -> str:
        return self.out.url(key)

    async def start(self) -> None:
        self._ready = asyncio.get_running_loop().create_future()
        # a failure nobody waited for is still reported through stop()/tail; don't warn about it
        self._ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=_child_env(self.env), start_new_session=True,
            preexec_fn=_die_with_parent)
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
            if self.out.feed(raw.decode("utf-8", errors="replace").rstrip("\r\n"), is_stdout=is_stdout) \
                    and not self._ready.done():
                self._ready.set_result(self.out.addresses)
        if is_stdout:
            await self.proc.wait()
            if not self._ready.done():
                self._ready.set_exception(RoleFailed(
                    self.name, f"exited with code {self.proc.returncode} before it was ready", self.tail))

    async def wait_ready(self, timeout: float) -> dict[str, str]:
        """The ready line's addresses; :class:`RoleFailed` if it exits or times out first."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except asyncio.TimeoutError:
            raise RoleFailed(self.name, f"not ready after {timeout:g}s", self.tail) from None

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
                self.out.on_line(self.name, f"(no exit {timeout:g}s after SIGTERM; sending SIGKILL)")
                self.send(signal.SIGKILL)
        return await self.wait_exit()
