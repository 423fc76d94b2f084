"""The prefill instance's flags (``mooncake --role prefill --help``): one frozen dataclass, validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mooncake_lite.common.config import option, require
from mooncake_lite.common.units import parse_duration
from mooncake_lite.instance.config import ModelRoleConfig
from mooncake_lite.model.checkpoint_config import model_args

DESCRIPTION = ("Prefill instance: loads the cached prefix KV layer by layer from its store, computes the "
               "new tokens in chunks, streams each layer's KV to the decode instance as soon as it is "
               "done, writes new blocks back to the store. --pipeline-group X runs X processes as one "
               "Chunked Pipeline Parallel group.")


@dataclass(frozen=True)
class Config(ModelRoleConfig):
    ADVERTISES: ClassVar[bool] = True   # registers its HTTP address with the conductor
    prefill_chunk: int = option(512, "tokens per prefill chunk")
    prefill_batch_tokens: int = option(512, "prefill batching: pack queued prompts into one forward while their "
                                       "uncached tokens together fit this many (and each fits a chunk); 0: "
                                       "one prompt at a time. A CPP group never packs")
    store: str | None = option(None, "store data address HOST:PORT (default: a private in-process store)")
    local_store_blocks: int = option(4096, "blocks the private in-process store keeps when --store is not given")
    write_back: bool = option(True, "write new full blocks to the store")
    pipeline_group: int = option(1, "stages of the Chunked Pipeline Parallel group this process leads")
    pipeline_stage: int = option(0, "internal: this process's stage in a group (set by the group head)")
    next_stage: str | None = option(None, "internal: HOST:PORT of the next stage's socket")
    data_port: int = option(0, "stage socket port of a CPP stage > 0 (0 = pick a free one)")
    kv_keepalive: float = option(1.0, "while a request waits in the queue, tell its decode instance it is "
                                 "alive this often (keep it below the conductor's kv_timeout_s)",
                                 parse=parse_duration)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.prefill_chunk > 0, f"--prefill-chunk must be positive, got {self.prefill_chunk}")
        require(self.prefill_batch_tokens >= 0, f"--prefill-batch-tokens must be >= 0, got {self.prefill_batch_tokens}")
        require(self.local_store_blocks > 0, "--local-store-blocks must be positive")
        require(self.pipeline_group >= 1, f"--pipeline-group must be >= 1, got {self.pipeline_group}")
        require(0 <= self.pipeline_stage < self.pipeline_group,
                f"--pipeline-stage must be in [0, {self.pipeline_group})")
        require(self.store is None or ":" in self.store, f"--store must be HOST:PORT, got {self.store!r}")
        require(0 <= self.data_port < 65536, f"--data-port out of range: {self.data_port}")
        require(self.kv_keepalive > 0, "--kv-keepalive must be positive")
        num_layers = model_args(self.model).num_layers
        require(self.pipeline_group <= num_layers,
                f"--pipeline-group {self.pipeline_group} exceeds the model's {num_layers} layers")
