"""Shared fixtures: start real role processes on 127.0.0.1 and always stop them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mooncake_lite.common.launch import RoleProcess

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


def start_role(role: str, *args: str, timeout: float = 120.0, env: dict | None = None) -> RoleProcess:
    """Start ``mooncake --role ROLE ARGS`` on 127.0.0.1 and wait for its ready line on stdout."""
    return RoleProcess.start(role, "--host", "127.0.0.1", *args, timeout=timeout, env=env, cwd=REPO)


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
