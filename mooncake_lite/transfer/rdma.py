"""Choosing the bulk-data transport: RDMA when pyverbs finds a device, TCP otherwise.

``--transport auto`` probes for an RDMA device and falls back to TCP with one log line;
``--transport rdma`` without a device is a startup error (a clear message, exit code 2);
``--transport tcp`` never probes.

This build detects RDMA devices but moves bulk bytes over the framed TCP protocol on every
machine: the RDMA read/write data path is not implemented yet, so ``rdma`` on a machine *with*
a device is also refused with a clear message rather than silently using TCP.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "tcp", "rdma")


class TransportError(RuntimeError):
    """The requested transport cannot be used on this machine."""


def rdma_devices() -> list[str]:
    """Names of the RDMA devices pyverbs can see ([] without pyverbs or without devices)."""
    try:
        import pyverbs.device as device  # optional; part of rdma-core
    except ImportError:
        return []
    try:
        return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in device.get_device_list()]
    except Exception as exc:  # pyverbs raises its own errors when the verbs library is unusable
        log.debug("pyverbs could not list devices: %s", exc)
        return []


def select_transport(requested: str, devices: list[str] | None = None) -> str:
    """The transport to use ("tcp" today) for the ``--transport`` value, or TransportError."""
    if requested not in TRANSPORTS:
        raise TransportError(f"unknown transport {requested!r}; choose one of {', '.join(TRANSPORTS)}")
    if requested == "tcp":
        return "tcp"
    found = rdma_devices() if devices is None else devices
    if requested == "rdma":
        if not found:
            raise TransportError("--transport rdma: no RDMA device found (pyverbs missing or no "
                                 "device); use --transport tcp or auto")
        raise TransportError(f"--transport rdma: device(s) {', '.join(found)} found, but this build "
                             "has no RDMA data path yet; use --transport auto or tcp")
    if found:
        log.info("transport auto: RDMA device(s) %s found, but the RDMA data path is not built; "
                 "using TCP", ", ".join(found))
    else:
        log.info("transport auto: no RDMA device found; using TCP")
    return "tcp"
