"""RDMA detection through pyverbs (faked here: no pyverbs or device on CI machines)."""

from __future__ import annotations

import sys
import types

import pytest

from mooncake_lite.transfer import rdma


def fake_pyverbs(monkeypatch, names=None, error=None):
    device = types.ModuleType("pyverbs.device")

    def get_device_list():
        if error:
            raise error
        return [types.SimpleNamespace(name=n) for n in names]

    device.get_device_list = get_device_list
    pkg = types.ModuleType("pyverbs")
    pkg.device = device
    monkeypatch.setitem(sys.modules, "pyverbs", pkg)
    monkeypatch.setitem(sys.modules, "pyverbs.device", device)


def test_no_pyverbs_means_no_devices(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # import fails
    monkeypatch.setitem(sys.modules, "pyverbs.device", None)
    assert rdma.rdma_devices() == []
    assert rdma.select_transport("auto") == "tcp"


def test_devices_are_listed(monkeypatch):
    fake_pyverbs(monkeypatch, [b"mlx5_0", "mlx5_1"])
    assert rdma.rdma_devices() == ["mlx5_0", "mlx5_1"]


def test_broken_verbs_library_is_no_device(monkeypatch):
    fake_pyverbs(monkeypatch, error=RuntimeError("ibv_get_device_list failed"))
    assert rdma.rdma_devices() == []
    with pytest.raises(rdma.TransportError, match="no RDMA device"):
        rdma.select_transport("rdma")


def test_unknown_transport():
    with pytest.raises(rdma.TransportError, match="unknown transport"):
        rdma.select_transport("carrier-pigeon")
