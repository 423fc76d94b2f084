"""The decode instance's flags (``mooncake --role decode --help``): one frozen dataclass, validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mooncake_lite.common.config import option, require
from mooncake_lite.common.roles import DataPortFlags
from mooncake_lite.instance.config import ModelRoleConfig, optional_duration

DESCRIPTION = ("Decode instance: receives each request's KV stream from prefill into its paged cache, "
               "runs continuous batching, streams tokens; refuses requests that would break the TBT SLO.")


def _optional_float(value):
    return None if value in (None, "", "none", "off") else float(value)


@dataclass(frozen=True)
class Config(ModelRoleConfig, DataPortFlags):
    ADVERTISES: ClassVar[bool] = True   # registers its HTTP and KV data addresses
    data_port: int = option(0, "KV data socket port prefill streams into (0 = pick a free one)")
    tbt_slo: float | None = option(None, "refuse requests whose predicted TBT exceeds this (seconds, 200ms); "
                                   "replaces --tbt-slo-factor", parse=optional_duration)
    # On by default with the conductor's own default SLO (its --tbt-slo-factor), so the double
    # check judges by the rule admission used; set the same --tbt-slo on both to use an absolute one.
    tbt_slo_factor: float | None = option(5.0, "refuse requests whose predicted TBT exceeds this many times "
                                          "one decode step of the request alone, as the conductor's default "
                                          "relative SLO does ('none': no TBT check)", parse=_optional_float)
    max_batch_size: int | None = option(None, "most sequences decoding at once")
    store: str | None = option(None, "store data address HOST:PORT this instance writes its generated tokens' full "
                               "blocks to, so a continued request and the next chat turn reuse them (none: not written)")
    cuda_graphs: bool = option(True, "on CUDA: replay each decode step from a CUDA graph captured per batch-size "
                               "bucket, eager above the largest (model/cuda_graphs.py)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.data_port < 65536, f"--data-port out of range: {self.data_port}")
        require(self.tbt_slo is None or self.tbt_slo > 0, "--tbt-slo must be positive")
        require(self.tbt_slo_factor is None or self.tbt_slo_factor >= 1, "--tbt-slo-factor must be >= 1")
        require(self.max_batch_size is None or self.max_batch_size > 0, "--max-batch-size must be positive")
        require(self.store is None or ":" in self.store, f"--store must be HOST:PORT, got {self.store!r}")
        self.check_data_flags()
