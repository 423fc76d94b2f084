"""Run ``mooncake up`` as a real subprocess and find every process it left behind."""

from __future__ import annotations

import collections
import contextlib
import os
import random
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAKE_ROLE = Path(__file__).with_name("fake_role.py")


def marker() -> str:
    """A unique model name: every child's command line carries it, so leftovers can be found."""
    return f"marker-{uuid.uuid4().hex[:12]}"


def processes_with(text: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose command line contains ``text``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry))
    return found


def wait_gone(text: str, timeout: float = 10.0) -> list[int]:
    """Leftover PIDs after giving the kernel ``timeout`` seconds to deliver death signals."""
    deadline = time.monotonic() + timeout
    while (left := processes_with(text)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def up_command(*args: str, fake: bool = True) -> list[str]:
    cmd = [sys.executable, "-m", "mooncake_lite", "up", "--port", "0", "--no-color", *args]
    if fake:
        cmd += ["--launcher", f"{sys.executable} {FAKE_ROLE}"]
    return cmd


def start_up(*args: str, env: dict | None = None, fake: bool = True) -> subprocess.Popen:
    return subprocess.Popen(up_command(*args, fake=fake), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


@contextlib.contextmanager
def real_cluster(*args: str, ready_timeout: float = 400.0):
    """``mooncake up`` on real roles with ``args`` (``--hash-seed``, set here, tags every child's
    command line): yields the OpenAI base URL once the cluster is ready; on exit Ctrl-C, and
    every child must be gone."""
    tag = str(random.randrange(10**8, 10**9))
    proc = start_up("--hash-seed", tag, *args, fake=False)
    logs: collections.deque[str] = collections.deque(maxlen=40)   # the roles' last words, for a failed start
    threading.Thread(target=lambda: logs.extend(proc.stderr), daemon=True).start()   # never block on logs
    try:
        try:
            banner = read_until(proc, "Ctrl-C stops every process", timeout=ready_timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nlast lines of its stderr:\n{''.join(logs)}") from None
        yield re.search(r"OpenAI-compatible API: (http://\S+/v1)", banner).group(1)
    finally:
        proc.send_signal(2)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert wait_gone(tag) == []


def _read_lines_until(stream, name: str, needle: str, timeout: float) -> str:
    """Read lines of ``stream`` until one contains ``needle`` (or the stream ends / time runs out)."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"never saw {needle!r} on {name}; got:\n{''.join(seen)[-3000:]}")


def read_until(proc: subprocess.Popen, needle: str, timeout: float = 60.0) -> str:
    """Read stdout lines until one contains ``needle``: what was read, up to that line."""
    return _read_lines_until(proc.stdout, "stdout", needle, timeout)


def read_err_until(proc: subprocess.Popen, needle: str, timeout: float = 60.0) -> str:
    """Read stderr lines until one contains ``needle``: what was read, up to that line."""
    return _read_lines_until(proc.stderr, "stderr", needle, timeout)


def wait_until(cond, what: str, timeout: float = 30.0):
    """Poll ``cond`` until it returns something truthy (returned), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value
