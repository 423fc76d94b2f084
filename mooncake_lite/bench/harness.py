"""The one way a benchmark starts and stops the processes it measures, over ``common/launch.py``.

:func:`role` is a role process (``mooncake --role R ...``) for the length of a ``with`` block:
started, waited ready, stopped for sure (SIGTERM, a bounded drain, SIGKILL). :class:`UpCluster` is
a whole ``mooncake up`` (restarts on) run by the same :class:`RoleProcess`: its banner gives the
API URL and each child's pid and addresses, its ``[up]`` events tell when a killed child is back.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from mooncake_lite.common.launch import LAUNCHER, RoleProcess

LOCAL = ("--host", "127.0.0.1", "--port", "0")   # a role on loopback, on a free port


@contextmanager
def role(role_name: str, *args: str, stop_timeout: float = 15.0, **options) -> Iterator[RoleProcess]:
    """``mooncake --role ROLE ARGS`` while the block runs; ``options`` as :meth:`RoleProcess.start`
    takes them (``timeout`` defaults to None: however long its model takes to load)."""
    proc = RoleProcess.start(role_name, *args, **{"timeout": None, **options})
    try:
        yield proc
    finally:
        proc.stop(stop_timeout)


@contextmanager
def command(argv: list[str], *, name: str, stop_timeout: float = 15.0, **options) -> Iterator[RoleProcess]:
    """Any command that prints a ready line (a benchmark's own peer), while the block runs."""
    proc = RoleProcess.launch(argv, name=name, **options)
    try:
        yield proc
    finally:
        proc.stop(stop_timeout)


BANNER_END = "Ctrl-C stops every process"            # the last line of mooncake up's banner
API_LINE = re.compile(r"OpenAI-compatible API: (http://\S+)/v1")
CHILD_LINE = re.compile(r"^\s+(\S+)\s+pid (\d+)\s+(.*)$", re.M)


class UpCluster:
    """A ``mooncake up --restart`` process: ``api`` (its URL), ``children`` (name -> pid and
    addresses, from the banner) and ``events`` (its ``[up]`` lines, with when they came)."""

    def __init__(self, up_args: list[str], *, ready_timeout: float, log_path: str | None = None):
        argv = [*LAUNCHER, "up", "--port", "0", "--no-color", "--restart", "--ready-timeout", str(ready_timeout),
                *up_args]
        self.events: list[tuple[float, str]] = []      # (monotonic time, "[up] ..." line)
        self._banner: list[str] = []
        self._is_up = threading.Event()
        self._lock = threading.Lock()
        self._log = open(log_path, "w", encoding="utf-8") if log_path else None  # noqa: SIM115 - closed in stop()
        self.proc = RoleProcess("mooncake up", argv, on_line=self._on_line, tail_lines=60)
        self.api, self.children = self._read_banner(ready_timeout)

    def _on_line(self, name: str, line: str) -> None:
        """Every line up writes. Its children's lines and its own events start with ``[name]``
        (colour off); the banner's lines never do."""
        with self._lock:
            if self._log is not None and not self._log.closed:
                self._log.write(line + "\n")
            if line.startswith("[up] "):
                self.events.append((time.monotonic(), line))
            elif not line.startswith("[") and not self._is_up.is_set():
                self._banner.append(line)
                if BANNER_END in line:
                    self._is_up.set()

    def _read_banner(self, timeout: float) -> tuple[str, dict[str, dict]]:
        deadline = time.monotonic() + timeout
        while not self._is_up.wait(0.2) and self.proc.proc.poll() is None and time.monotonic() < deadline:
            pass
        with self._lock:
            text = "\n".join(self._banner)
        api = API_LINE.search(text)
        if api is None:
            self.stop()
            raise RuntimeError("mooncake up did not start; last lines:\n" + self.proc.logs().rstrip("\n"))
        children = {m.group(1): {"pid": int(m.group(2)), **dict(kv.split("=", 1) for kv in m.group(3).split())}
                    for m in CHILD_LINE.finditer(text)}
        return api.group(1), children

    def pid_of(self, name: str) -> int:
        """The child's current pid (a restart's, once one happened)."""
        pid = self.children[name]["pid"]
        with self._lock:
            for _, line in self.events:
                m = re.match(rf"\[up\] {re.escape(name)} is back: pid (\d+)", line)
                pid = int(m.group(1)) if m else pid
        return pid

    def wait_event(self, needle: str, since: float, timeout: float) -> float | None:
        """When an ``[up]`` event containing ``needle`` came at or after ``since`` (None: not in time)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                hit = next((t for t, line in self.events if t >= since and needle in line), None)
            if hit is not None:
                return hit
            time.sleep(0.05)
        return None

    def stop(self) -> int:
        """SIGTERM, up to a minute for every child's drain, then SIGKILL; its exit code."""
        try:
            return self.proc.stop(60)
        finally:
            self.proc.logs()          # the readers' last lines
            with self._lock:
                if self._log is not None:
                    self._log.close()

