"""The etcd the in-process HA tests share: one per test module (its keys are the module's own)."""

from __future__ import annotations

import pytest

from tests.ha.cluster import Etcd


@pytest.fixture(scope="module")
def etcd():
    server = Etcd()
    server.start()
    yield server
    server.close()
