"""A request whose KV is streaming into a decode instance: what has arrived and been written,
its choices' first tokens, its timer and trace; and the error a KV frame is refused with."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from mooncake_lite.decode.batcher import DecodeSequence


@dataclass(frozen=True)
class ResumePoint:
    """What the END frame with token 1 says the request continues from (the prefill's
    ``StageEngine.resume_point``): a continued request's ``output`` so far, which its samplers
    resume over, and the prompt's chain, ``key`` (its last full block's; None: none) and ``tail``
    (the ids after that block), from which generated blocks are keyed for write-back. ``tail``
    None: the sender did not say (a prefill older than #37), so nothing is written back."""
    output: tuple[int, ...] = ()
    key: bytes | None = None
    tail: tuple[int, ...] | None = None


class KVError(ValueError):
    """A KV frame cannot be accepted; ``code`` goes back to the sender in the error frame."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class PendingKV:
    """A request whose KV is streaming in."""
    request_id: str
    transfer_id: str
    seq: DecodeSequence
    # tokens received per layer and KV head: frames may carry a head sub-range (one TP prefill
    # rank's slice, transfer/tp_heads.py), so a layer is whole once every head has every token
    layer_tokens: list[list[int]]
    first_tokens: list[int] | None = None   # every choice's token 1, from the END frame
    num_output: int = 0            # a continued request's output so far (Sampling.num_generated)
    resume: ResumePoint = ResumePoint()     # from the END frame, with the first tokens
    timeout_s: float = 30.0
    timer: asyncio.TimerHandle | None = None
    last_progress: float = 0.0
    senders: set[int] = field(default_factory=set)   # ids of connections that have not sent END
    num_writes: int = 0            # layer frames received but not yet written into the cache
    drained: asyncio.Future | None = None   # END arrived with writes outstanding: set when they are done
    write_s: float = 0.0           # seconds its KV writes took in the model thread (timeline)
    admission_span: Any = None     # decode.admission: reserved → joined the batch (tracing on)
    receive_span: Any = None       # decode.kv_receive: a child of prefill's kv_stream span (frame meta "tp")

    def is_complete(self) -> bool:
        """Every layer's tokens received and written, and the first token known."""
        return self.first_tokens is not None and self.num_writes == 0 and self._layers_done() == len(self.layer_tokens)

    def _layers_done(self) -> int:
        return sum(1 for heads in self.layer_tokens if all(n == self.seq.prompt_len for n in heads))

    def progress(self) -> str:
        return f"{self._layers_done()} of {len(self.layer_tokens)} layers complete"
