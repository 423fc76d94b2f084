"""A request's prefill on one stage (:class:`StageJob`), what ends it early
(:class:`PrefillAborted`) and how its KV frames are queued to decode: shared by the stage's
compute (``engine.py``) and its prefix loading (``prefix_load.py``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from mooncake_kernels.copies import Staged
from mooncake_lite.model.runner import LayerwisePass
from mooncake_lite.prefill.kv_sender import KVSender


def send_frame(sender: KVSender, layer: int, start: int, kv: Staged) -> None:
    """Queue one layer frame: a pass-through copy (CPU) as the tensor it is, a copy still in
    flight from the device as such (the sender waits for it off the loop)."""
    sender.send_layer(layer, start, kv.tensor if kv.is_plain else kv)


class PrefillAborted(RuntimeError):
    """The request was aborted or its KV stream broke; the message says why."""


@dataclass


class StageJob:
    request_id: str
    token_ids: tuple[int, ...]
    keys: list[bytes]                  # keys of the prompt's full blocks
    num_prefix_blocks: int
    block_ids: list[int]
    sender: KVSender
    loads: dict[int, asyncio.Task] = field(default_factory=dict)
    prefix_done: bool = False
    num_stored_blocks: int = 0         # full blocks already handed to the store (incl. the prefix)
    num_prefix_tokens: int = 0
    abort_reason: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # Set when a prefix load failed: passes recomputing the prefix, one layer at a time.
    recompute: list[LayerwisePass] | None = None
    load_span: Any = None              # prefill.prefix_load, open until the prefix is in (tracing on)
    prefix_handed_back: bool = False   # the store was told its loads are over (prefix_loaded)
    exact: bool = False                # float activations: it reports logprobs (LayerwisePass)

    @property
    def is_prefix_recomputed(self) -> bool:
        """The prefix was computed after all (its load failed): nothing was really reused."""
        return self.recompute is not None
