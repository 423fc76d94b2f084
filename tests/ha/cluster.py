"""The HA tests' etcd and HAProxy (``mooncake_lite/bench/chaos/rig.py``), skipped with the reason
where their binaries are missing."""

from __future__ import annotations

import pytest

from mooncake_lite.bench.chaos import rig
from mooncake_lite.bench.chaos.rig import wait_http
from mooncake_lite.common.ports import free_port

__all__ = ["Etcd", "HAProxy", "free_port", "need", "wait_http"]


def need(binary: str, package: str) -> str:
    try:
        return rig.need(binary, package)
    except rig.Missing as exc:
        pytest.skip(str(exc))


def _skipping(cls):
    class Skipping(cls):
        def __init__(self, *args, **kwargs) -> None:
            try:
                super().__init__(*args, **kwargs)
            except rig.Missing as exc:
                pytest.skip(str(exc))
    Skipping.__name__ = cls.__name__
    return Skipping


Etcd, HAProxy = _skipping(rig.Etcd), _skipping(rig.HAProxy)
