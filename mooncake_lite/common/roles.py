"""Config fields every role has. Role configs subclass :class:`RoleConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_lite.common.config import option, require
from mooncake_lite.common.hashing import DEFAULT_BLOCK_SIZE, DEFAULT_HASH_SEED

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class RoleConfig:
    host: str = option("127.0.0.1", "address to bind; loopback unless you mean to expose it")
    cluster_token: str | None = option(None, "shared secret every internal connection must present")
    block_size: int = option(DEFAULT_BLOCK_SIZE, "tokens per KV block (cluster-wide)")
    hash_seed: int = option(DEFAULT_HASH_SEED, "seed of the chained block hash (cluster-wide)")
    log_level: str = option("info", "log level", choices=LOG_LEVELS)
    log_json: bool = option(False, "write logs as one JSON object per line")

    def __post_init__(self) -> None:
        require(self.block_size > 0, f"--block-size must be positive, got {self.block_size}")
        require(self.hash_seed >= 0, f"--hash-seed must be non-negative, got {self.hash_seed}")
        require(bool(self.host), "--host must not be empty")
