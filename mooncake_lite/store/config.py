"""The store's flags (``mooncake --role store --help``): one frozen dataclass, validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mooncake_lite.common.config import option, require
from mooncake_lite.common.membership import Conductor, conductor_urls
from mooncake_lite.common.roles import DataPortFlags, RoleConfig
from mooncake_lite.common.units import parse_duration, parse_size
from mooncake_lite.store.eviction import POLICY_NAMES
from mooncake_lite.transfer.rdma import TRANSPORTS

DESCRIPTION = ("Store: the KVCache pool. Keeps KV blocks in a preallocated DRAM slab (pinned when CUDA "
               "is present) and an SSD tier, serves put/get/get-layers/match/exists/delete/replicate "
               "over a binary framed protocol, and publishes block events to the conductor.")

MAX_SLOT_BYTES = 1 << 30
# kernels/kv_codec.CODEC_NAMES, spelled out: the store never decodes a block, so it needs no torch.
KV_CODECS = ("none", "int8", "fp8")


@dataclass(frozen=True)
class Config(RoleConfig, DataPortFlags):
    ADVERTISES: ClassVar[bool] = True   # its data address goes to the conductor and prefills
    port: int = option(8100, "HTTP port of /health, /metrics, /blocks (0 = any free port)")
    data_port: int = option(8101, "TCP port of the binary data protocol (0 = any free port)")
    dram: int = option(1 << 30, "DRAM tier size (e.g. 8GiB); one slab allocated at start", parse=parse_size)
    slot_bytes: int = option(4 << 20, "bytes per DRAM slot = largest block accepted (e.g. 4MiB); must hold one "
                             "KV block of the served model (prefills check it at startup)", parse=parse_size)
    eviction: str = option("lru", "DRAM eviction policy", choices=POLICY_NAMES)
    ssd_dir: str | None = option(None, "directory of the SSD tier (None = DRAM only)")
    ssd: int = option(16 << 30, "SSD tier capacity (e.g. 100GiB)", parse=parse_size)
    ssd_fsync: bool = option(True, "fsync each SSD block before counting it as written")
    ssd_queue: int = option(256 << 20, "most bytes of evicted blocks waiting for the SSD writer; beyond "
                            "this an evicted block is dropped", parse=parse_size)
    persist_on_exit: bool = option(True, "on SIGTERM, write DRAM-only blocks to the SSD tier (if any)")
    lease_ttl: float = option(30.0, "longest a block stays pinned for one transfer; then the transfer's "
                              "connection is closed", parse=parse_duration)
    transport: str = option("auto", "bulk transport: auto (RDMA if a device is found, else TCP), tcp, rdma",
                            choices=TRANSPORTS)
    conductor: str | None = option(None, "conductor base URL (http://HOST:PORT) to send block events to; several "
                                   "conductors: their URLs separated by commas (each gets every event)")
    event_interval: float = option(0.2, "how often block events are sent", parse=parse_duration)
    max_frame: int = option(4 << 30, "largest frame payload accepted on the data port", parse=parse_size)
    data_inflight: int = option(256 << 20, "most memory all data connections together may hold for frames "
                                "still arriving (large metas; put payloads land in the slab); a frame that "
                                "would exceed it closes its connection", parse=parse_size)
    drain_timeout: float = option(10.0, "graceful-shutdown budget for in-flight work", parse=parse_duration)
    pin_memory: bool | None = option(None, "page-lock the slab (None = when CUDA is present)")
    shm: str = option("auto", "same-node fast path: auto (the slab in shared memory, offered to clients on "
                      "this node, which fall back to TCP when they cannot use it), off (TCP only); a "
                      "page-locked slab is never shared", choices=("auto", "off"))
    kv_compression: str = option("none", "how the cluster's prefills encode the KV blocks kept here (none, int8, "
                                 "fp8); told to clients at HELLO: a prefill set otherwise refuses to start",
                                 choices=KV_CODECS)
    shm_staging: int = option(64 << 20, "per-connection shared staging area for same-node puts (allocated as "
                              "the client writes it; 0 = same-node puts go over TCP)", parse=parse_size)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.port < 65536, f"--port must be in [0, 65535], got {self.port}")
        require(0 <= self.data_port < 65536, f"--data-port must be in [0, 65535], got {self.data_port}")
        require(0 < self.slot_bytes <= MAX_SLOT_BYTES,
                f"--slot-bytes must be in (0, 1GiB], got {self.slot_bytes}")
        require(self.dram >= self.slot_bytes,
                f"--dram ({self.dram} bytes) must hold at least one slot of --slot-bytes ({self.slot_bytes})")
        require(self.ssd > 0, f"--ssd must be positive, got {self.ssd}")
        require(self.ssd_queue >= self.slot_bytes, "--ssd-queue must hold at least one slot")
        require(self.lease_ttl > 0, f"--lease-ttl must be positive, got {self.lease_ttl}")
        require(self.event_interval > 0, f"--event-interval must be positive, got {self.event_interval}")
        require(self.max_frame >= self.slot_bytes, "--max-frame must be at least --slot-bytes")
        self.check_data_flags()
        try:
            conductor_urls(self.conductor)
        except ValueError as exc:
            require(False, str(exc))
        require(self.drain_timeout >= 0, "--drain-timeout must be >= 0")
        require(self.shm_staging >= 0, "--shm-staging must be >= 0")

    def joins(self) -> Conductor | None:
        """The conductors this store sends block events to (None: none), and what one found in
        etcd must use to be ours."""
        if self.conductor is None and self.discovery is None:
            return None
        return Conductor(self.conductor or "", self.cluster_token, discovery=self.discovery,
                         expects=(("block_size", self.block_size), ("hash_seed", self.hash_seed)))
