"""Config fields every role has. Role configs subclass :class:`RoleConfig`."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import ClassVar

from mooncake_lite.common.config import option, require
from mooncake_lite.common.etcd import parse_url
from mooncake_lite.common.hashing import DEFAULT_BLOCK_SIZE, DEFAULT_HASH_SEED
from mooncake_lite.common.units import parse_duration, parse_size

LOG_LEVELS = ("debug", "info", "warning", "error")


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means "every interface" (0.0.0.0, ::, [::], ::0, ...): bindable, but no
    address a peer can dial."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return not host


@dataclass(frozen=True)
class RoleConfig:
    host: str = option("127.0.0.1", "address to bind; loopback unless you mean to expose it")
    advertise_host: str | None = option(None, "address peers dial to reach this process (default: --host); "
                                        "set it when binding 0.0.0.0 or behind NAT / in a container")
    cluster_token: str | None = option(None, "shared secret every internal connection must present")
    block_size: int = option(DEFAULT_BLOCK_SIZE, "tokens per KV block (cluster-wide)")
    hash_seed: int = option(DEFAULT_HASH_SEED, "seed of the chained block hash (cluster-wide)")
    log_level: str = option("info", "log level", choices=LOG_LEVELS)
    log_json: bool = option(False, "write logs as one JSON object per line")
    discovery: str | None = option(None, "etcd://HOST:PORT: find the conductors (and, a conductor, the instances "
                                   "and stores) in etcd, each process announcing itself there under a lease")
    otlp_endpoint: str | None = option(None, "export request traces (OpenTelemetry) to this OTLP/HTTP collector, "
                                       "e.g. http://127.0.0.1:4318 (spans go to its /v1/traces); unset: no tracing")

    # Whether the role hands its own addresses to peers (registration, block events), which
    # they must be able to dial.
    ADVERTISES: ClassVar[bool] = False

    @property
    def peer_host(self) -> str:
        """The host part of the addresses this process gives its peers."""
        return self.advertise_host or self.host

    def __post_init__(self) -> None:
        require(self.advertise_host is None or (self.advertise_host == self.advertise_host.strip()
                                                 and not is_wildcard(self.advertise_host)),
                f"--advertise-host must be an address peers can dial, got {self.advertise_host!r}")
        require(not self.ADVERTISES or not is_wildcard(self.peer_host),
                f"--host {self.host} binds every interface but is no address a peer can dial: "
                "set --advertise-host to this node's cluster-network address")
        require(self.block_size > 0, f"--block-size must be positive, got {self.block_size}")
        require(self.hash_seed >= 0, f"--hash-seed must be non-negative, got {self.hash_seed}")
        require(bool(self.host), "--host must not be empty")
        if self.discovery is not None:
            try:
                parse_url(self.discovery)
            except ValueError as exc:
                require(False, str(exc))
        require(self.otlp_endpoint is None or self.otlp_endpoint.startswith(("http://", "https://")),
                f"--otlp-endpoint must be an http:// or https:// URL, got {self.otlp_endpoint!r}")


@dataclass(frozen=True)
class DataPortFlags:
    """The ``--data-*`` limits of a role that serves a binary data port (store, decode): what an
    unauthenticated, stalled or idle peer may cost. Mixed into the role's Config, whose
    ``__post_init__`` calls :meth:`check_data_flags`."""
    data_handshake_timeout: float = option(5.0, "a data connection that has not completed its HELLO (cluster "
                                           "token) within this long is closed", parse=parse_duration)
    data_stall_timeout: float = option(30.0, "a data connection is closed when a frame's header and meta take "
                                       "longer than this, or its payload stops moving for this long",
                                       parse=parse_duration)
    data_idle_timeout: float = option(0.0, "close data connections idle this long (0 = never; peers "
                                      "reconnect when they next need one)", parse=parse_duration)
    data_inflight: int = option(1 << 30, "most memory all data connections together may hold for frames "
                                "still arriving; a frame that would exceed it closes its connection",
                                parse=parse_size)

    def check_data_flags(self) -> None:
        require(self.data_handshake_timeout > 0, "--data-handshake-timeout must be positive")
        require(self.data_stall_timeout > 0, "--data-stall-timeout must be positive")
        require(self.data_idle_timeout >= 0, "--data-idle-timeout must be >= 0 (0 = never)")
        require(self.data_inflight > 0, "--data-inflight must be positive")
