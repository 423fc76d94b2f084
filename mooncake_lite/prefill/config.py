"""The prefill instance's flags (``mooncake --role prefill --help``): one frozen dataclass, validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mooncake_lite.common.config import ConfigError, option, require
from mooncake_lite.common.units import parse_duration
from mooncake_lite.instance.config import ModelRoleConfig
from mooncake_lite.model.checkpoint_config import model_args
from mooncake_lite.scheduler.queue_order import DEFAULT_OVERTAKES, ORDERS, bound_of

DESCRIPTION = ("Prefill instance: loads the cached prefix KV layer by layer from its store, computes the "
               "new tokens in chunks, streams each layer's KV to the decode instance as soon as it is "
               "done, writes new blocks back to the store. --pipeline-group X runs X processes as one "
               "Chunked Pipeline Parallel group.")


@dataclass(frozen=True)
class Config(ModelRoleConfig):
    ADVERTISES: ClassVar[bool] = True   # registers its HTTP address with the conductor
    AUTO_WEIGHTS: ClassVar[str] = "hybrid"    # wide forwards: the blocks and a float copy (instance/config.py)
    prefill_chunk: int = option(512, "tokens per prefill chunk")
    prefill_batch_tokens: int = option(512, "prefill batching: pack queued prompts into one forward while their "
                                       "uncached tokens together fit this many (and each fits a chunk); 0: "
                                       "one prompt at a time. A CPP group never packs")
    queue_order: str = option("fifo", "the order queued prompts are served in: fifo, or shortest (fewest tokens "
                              "to compute first; a prompt lets at most --queue-overtakes later ones pass it). "
                              "`mooncake up` starts its prefills with shortest")
    queue_overtakes: int = option(DEFAULT_OVERTAKES, "with --queue-order shortest: how many later, shorter "
                                  "prompts may be served before any one prompt")
    borrow_threads: int = option(0, "run on up to this many torch threads more than --threads while the rest of "
                                 "the machine leaves that many CPUs idle (read between pieces of model work; "
                                 "`mooncake up` lends a prefill the decodes' CPUs this way); 0: never")
    pack_weights: str = option("auto", "run the model's products on oneDNN-packed weights (CPU float32): on, "
                               "off, or auto: where a start-up measurement on this CPU finds them at least "
                               "1.1x faster at this instance's chunk size (the log line says what it chose)",
                               choices=("auto", "on", "off"))
    store: str | None = option(None, "store data address HOST:PORT (default: a private in-process store)")
    local_store_blocks: int = option(4096, "blocks the private in-process store keeps when --store is not given")
    write_back: bool = option(True, "write new full blocks to the store")
    pipeline_group: int = option(1, "stages of the Chunked Pipeline Parallel group this process is part of")
    pipeline_stage: int = option(0, "this process's stage in its CPP group: 0 is the head (HTTP, registers), "
                                 "k > 0 runs layer slice k behind a stage socket (--data-port)")
    next_stage: str | None = option(None, "HOST:PORT of the next stage's socket, for a stage k < X-1 started "
                                    "on its own (dialled until --stage-connect-timeout)")
    stages: str | None = option(None, "the head of a CPP group whose stages run apart (own units, other "
                                "nodes): HOST:PORT of stages 1..X-1, comma-separated; dialled until "
                                "--stage-connect-timeout. Without it the head starts them as its children")
    layers: str | None = option(None, "layers A:B this process runs in its CPP group (default: slice k of X "
                                "near-equal slices); the group's slices must be contiguous from 0 to the last")
    stage_connect_timeout: float = option(60.0, "how long a CPP head or stage keeps dialling its next stage "
                                          "at start-up before it gives up", parse=parse_duration)
    data_port: int = option(0, "stage socket port of a CPP stage > 0 (0 = pick a free one)")
    head_pid: int | None = option(None, "internal: the pid of the head that started this stage as its child "
                                  "(it exits with it)")
    kv_keepalive: float = option(1.0, "while a request waits in the queue, tell its decode instance it is "
                                 "alive this often (keep it below the conductor's kv_timeout_s)",
                                 parse=parse_duration)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.prefill_chunk > 0, f"--prefill-chunk must be positive, got {self.prefill_chunk}")
        require(self.prefill_batch_tokens >= 0, f"--prefill-batch-tokens must be >= 0, got {self.prefill_batch_tokens}")
        require(self.queue_order in ORDERS, f"--queue-order must be one of {', '.join(ORDERS)}, got {self.queue_order!r}")
        require(self.queue_overtakes >= 0, f"--queue-overtakes must be >= 0, got {self.queue_overtakes}")
        require(self.borrow_threads >= 0, f"--borrow-threads must be >= 0, got {self.borrow_threads}")
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
        require(self.stage_connect_timeout > 0, "--stage-connect-timeout must be positive")
        addresses = self.stage_addresses
        require(not addresses or (self.pipeline_stage == 0 and len(addresses) == self.pipeline_group - 1),
                f"--stages names {len(addresses)} stage(s); a head of --pipeline-group {self.pipeline_group} "
                f"needs {self.pipeline_group - 1} (stages 1..{self.pipeline_group - 1}, in order)")
        for address in addresses + ([self.next_stage] if self.next_stage else []):
            require(":" in address, f"--stages and --next-stage take HOST:PORT addresses, got {address!r}")
        require(self.next_stage is None or self.pipeline_stage > 0, "--next-stage is for a stage k > 0 "
                "(the head is given its stages with --stages)")
        if self.layers is not None:
            require(self.pipeline_group > 1 and (self.pipeline_stage > 0 or bool(addresses)),
                    "--layers is for the processes of a CPP group started apart (a stage, or a head with --stages)")
            first, end = parse_layers(self.layers)
            require(0 <= first < end <= num_layers,
                    f"--layers {self.layers}: not a layer range of the model's {num_layers} layers")

    @property
    def overtake_bound(self) -> int:
        """The queue order's bound the service serves by and registers (0: FIFO)."""
        return bound_of(self.queue_order, self.queue_overtakes)

    @property
    def stage_addresses(self) -> list[str]:
        """``--stages`` as a list (stage 1 first); empty when the head spawns its stages."""
        return [a.strip() for a in (self.stages or "").split(",") if a.strip()]

    @property
    def layer_range(self) -> tuple[int, int]:
        """The layers this process runs: ``--layers``, else slice k of the group's near-equal ones."""
        if self.layers is not None:
            return parse_layers(self.layers)
        return layer_slices(model_args(self.model).num_layers, self.pipeline_group)[self.pipeline_stage]


def parse_layers(text: str) -> tuple[int, int]:
    """``"A:B"`` -> (A, B): layers A..B-1."""
    first, _, end = str(text).partition(":")
    try:
        return int(first), int(end)
    except ValueError:
        raise ConfigError(f"--layers must be A:B (first layer, end layer), got {text!r}") from None


def layer_slices(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal layer ranges, one per stage."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    bounds = [round(i * num_layers / num_stages) for i in range(num_stages + 1)]
    return list(zip(bounds[:-1], bounds[1:]))
