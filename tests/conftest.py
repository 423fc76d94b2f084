"""Shared fixtures: start real role processes on 127.0.0.1 and always stop them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
# The real Mooncake trace is source material kept beside the checkout (../shared), not in it;
# MOONCAKE_TRACE points elsewhere. Tests that replay it are skipped, saying why, without it.
TRACE = Path(os.environ.get("MOONCAKE_TRACE") or SHARED / "traces" / "conversation_trace.jsonl")
needs_trace = pytest.mark.skipif(not TRACE.is_file(), reason=f"the Mooncake trace is not at {TRACE} "
                                 "(../shared/traces beside the checkout, or set MOONCAKE_TRACE)")


def has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@dataclass
class RoleProcess:
    """A running ``mooncake --role ...`` process and the addresses from its ready line."""
    role: str
    proc: subprocess.Popen
    addresses: dict[str, str]
    stderr_lines: list[str] = field(default_factory=list)

    def url(self, key: str = "http") -> str:
        return f"http://{self.addresses[key]}"

    def hostport(self, key: str) -> tuple[str, int]:
        host, port = self.addresses[key].rsplit(":", 1)
        return host, int(port)

    def logs(self) -> str:
        return "".join(self.stderr_lines)

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def _drain(stream, sink: list[str]) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)


def start_role(role: str, *args: str, timeout: float = 120.0, env: dict | None = None) -> RoleProcess:
    """Start ``mooncake --role ROLE ARGS`` and wait for its ready line on stdout."""
    cmd = [sys.executable, "-m", "mooncake_lite", "--role", role, "--host", "127.0.0.1", *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env=full_env)
    rp = RoleProcess(role, proc, {})
    threading.Thread(target=_drain, args=(proc.stderr, rp.stderr_lines), daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        try:
            msg = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(msg, dict) and msg.get("event") == "ready":
            rp.addresses = {k: v for k, v in msg.items() if k not in ("event", "role")}
            threading.Thread(target=_drain, args=(proc.stdout, []), daemon=True).start()
            return rp
    rp.stop()
    time.sleep(0.2)
    raise RuntimeError(f"{role} did not become ready (rc={proc.returncode}):\n{rp.logs()[-4000:]}")


@pytest.fixture
def role_procs():
    """Start roles with ``role_procs(role, *args)``; all are stopped at teardown."""
    started: list[RoleProcess] = []

    def _start(role: str, *args: str, **kwargs) -> RoleProcess:
        rp = start_role(role, *args, **kwargs)
        started.append(rp)
        return rp

    yield _start
    for rp in reversed(started):
        rp.stop()
