"""Config fields every role has. Role configs subclass :class:`RoleConfig`."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import ClassVar

from mooncake_lite.common.config import option, require
from mooncake_lite.common.hashing import DEFAULT_BLOCK_SIZE, DEFAULT_HASH_SEED

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
