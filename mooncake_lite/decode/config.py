"""The decode instance's flags (``mooncake --role decode --help``): one frozen dataclass, validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mooncake_lite.common.config import option, require
from mooncake_lite.common.units import parse_duration, parse_size
from mooncake_lite.instance.config import ModelRoleConfig, optional_duration

DESCRIPTION = ("Decode instance: receives each request's KV stream from prefill into its paged cache, "
               "runs continuous batching, streams tokens; refuses requests that would break the TBT SLO.")


@dataclass(frozen=True)
class Config(ModelRoleConfig):
    ADVERTISES: ClassVar[bool] = True   # registers its HTTP and KV data addresses
    data_port: int = option(0, "KV data socket port prefill streams into (0 = pick a free one)")
    tbt_slo: float | None = option(None, "refuse requests whose predicted TBT exceeds this (seconds, 200ms); "
                                   "replaces --tbt-slo-factor", parse=optional_duration)
    tbt_slo_factor: float | None = option(None, "refuse requests whose predicted TBT exceeds this many times "
                                          "one decode step of the request alone (e.g. 5; default: off)")
    max_batch_size: int | None = option(None, "most sequences decoding at once")
    data_handshake_timeout: float = option(5.0, "a KV data connection that has not completed its HELLO "
                                           "(cluster token) within this long is closed", parse=parse_duration)
    data_stall_timeout: float = option(30.0, "a KV data connection is closed when a frame's header and meta "
                                       "take longer than this, or its payload stops moving for this long",
                                       parse=parse_duration)
    data_idle_timeout: float = option(0.0, "close KV data connections idle this long (0 = never; prefills "
                                      "reconnect when they next need one)", parse=parse_duration)
    data_inflight: int = option(1 << 30, "most memory all KV data connections together may hold for frames "
                                "still arriving; a frame that would exceed it closes its connection "
                                "(raised to one layer of the largest prompt the cache holds)", parse=parse_size)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.data_port < 65536, f"--data-port out of range: {self.data_port}")
        require(self.tbt_slo is None or self.tbt_slo > 0, "--tbt-slo must be positive")
        require(self.tbt_slo_factor is None or self.tbt_slo_factor >= 1, "--tbt-slo-factor must be >= 1")
        require(self.max_batch_size is None or self.max_batch_size > 0, "--max-batch-size must be positive")
        require(self.data_handshake_timeout > 0, "--data-handshake-timeout must be positive")
        require(self.data_stall_timeout > 0, "--data-stall-timeout must be positive")
        require(self.data_idle_timeout >= 0, "--data-idle-timeout must be >= 0 (0 = never)")
        require(self.data_inflight > 0, "--data-inflight must be positive")
