"""Shared fixtures: start real role processes on 127.0.0.1 and always stop them."""

from __future__ import annotations

import contextlib
import os
import signal
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
    _run_shared_cluster_tests_together(items)
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- one default-model cluster for the session ---------------------------------------------------
SHARED = "smollm_api"


@pytest.fixture(scope="session")
def smollm_api():
    """The OpenAI base URL of ``mooncake up`` on the default model at its default settings, shared
    by every test that asks (tests/real_model.SharedCluster): started at the first, stopped after
    the last (``pytest_runtest_teardown`` below; at the session's end at the latest). Its tests
    run one after another (never two at once), so each still sees the cluster to itself."""
    from tests.real_model import SHARED_CLUSTER
    try:
        yield SHARED_CLUSTER.url()
    finally:
        SHARED_CLUSTER.stop()


def _run_shared_cluster_tests_together(items: list) -> None:
    """Move the tests that use the shared cluster next to the first of them (their own order
    kept), so it is up for one stretch of the run, not through the unrelated tests between."""
    users = [item for item in items if SHARED in getattr(item, "fixturenames", ())]
    if not users:
        return
    _check_shared_modules(users)
    first = items.index(users[0])
    chosen = set(map(id, users))
    rest = [item for item in items if id(item) not in chosen]
    items[:] = rest[:first] + users + rest[first:]


# The modules whose tests use the shared cluster: under pytest-xdist they run on one worker, so it
# starts once (checked against the collection: a module missing here fails the run, naming it).
SHARED_MODULES = ("tests/pd/test_api_sampling.py", "tests/pd/test_real_model.py", "tests/pd/test_structured_up.py")


def _check_shared_modules(users: list) -> None:
    missing = sorted({item.nodeid.split("::")[0] for item in users} - set(SHARED_MODULES))
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: add {', '.join(missing)} to SHARED_MODULES (they use {SHARED})")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """bin/test's two workers (pytest-xdist) take whole modules, in order, so a cluster a module
    shares (``module_role_procs``) starts once, and the modules of the shared default-model
    cluster as one. (Its ``loadgroup`` marks do not group under pytest 9.2, whose items keep
    their id where xdist 3.8 rewrites ``_nodeid``.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return SHARED if module in SHARED_MODULES else module
    return ByModule(config, log)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the shared cluster as soon as no test left in the run uses it: its processes and
    their memory are not kept through the rest of the suite."""
    if SHARED not in getattr(item, "fixturenames", ()):
        return
    from tests.real_model import SHARED_CLUSTER
    items = item.session.items
    later = items[items.index(item) + 1:]
    if SHARED_CLUSTER.is_running and not any(SHARED in getattr(i, "fixturenames", ()) for i in later):
        SHARED_CLUSTER.stop()


def start_role(role: str, *args: str, timeout: float = 120.0, env: dict | None = None) -> RoleProcess:
    """Start ``mooncake --role ROLE ARGS`` on 127.0.0.1 and wait for its ready line on stdout."""
    return RoleProcess.start(role, "--host", "127.0.0.1", *args, timeout=timeout, env=env, cwd=REPO)


@contextlib.contextmanager
def _roles():
    started: list[RoleProcess] = []

    def _start(role: str, *args: str, **kwargs) -> RoleProcess:
        rp = start_role(role, *args, **kwargs)
        started.append(rp)
        return rp

    try:
        yield _start
    finally:
        for rp in reversed(started):   # all told at once, so their drains and exits overlap
            rp.send(signal.SIGTERM)
        for rp in reversed(started):
            rp.stop()


@pytest.fixture
def role_procs():
    """Start roles with ``role_procs(role, *args)``; all are stopped at teardown."""
    with _roles() as start:
        yield start


@pytest.fixture(scope="module")
def module_role_procs():
    """:func:`role_procs` for a cluster the tests of one module share: stopped after the last."""
    with _roles() as start:
        yield start
