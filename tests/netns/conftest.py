"""Nodes on one box for the tests here: skipped, saying why, where namespaces cannot be made;
one 3-node cluster from the systemd units shared by every test module that asks for it."""

from __future__ import annotations

import pytest

from mooncake_lite.cluster.netns import Link, Nodes, unavailable_reason
from tests.netns import systemd_cluster

REASON = unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"nodes on one box unavailable: {REASON}")
LINK = Link.parse("1gbit")     # a delay too needs sch_netem, which not every kernel has


@pytest.fixture(scope="package")
def cluster(tmp_path_factory):
    """Started once (~15 s of model loads and registrations); a test that cuts a link restores it."""
    with Nodes.create(3, LINK) as nodes:
        cluster = systemd_cluster.start(nodes, tmp_path_factory.mktemp("nodes"))
        yield cluster
        systemd_cluster.stop(cluster)
