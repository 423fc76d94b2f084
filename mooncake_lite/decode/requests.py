"""What a decode instance keeps of each request it runs: a sampler per choice (with its grammar's
matcher as the mask, if it has one), the stream its token events go out on, how many of its
choices are still open, and its trace."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from mooncake_lite.common import tracing
from mooncake_lite.model.sampling import SequenceSampler

MAX_CHOICES = 128   # n a request may ask for (the conductor refuses more: api/controls.MAX_N)


@dataclass
class RequestState:
    samplers: list[SequenceSampler]    # one per choice
    events: asyncio.Queue
    num_open: int = 1              # choices not finished yet
    span: Any = None               # decode.request (tracing on): the parent of this request's spans
    steps_span: Any = None         # decode.steps: joined → finished, one span for all its steps
    num_steps: int = 0             # counted only while traced
    batch_total: int = 0           # the sum of the batch sizes of those steps

    @staticmethod
    def sampler_of(state: RequestState | None, index: int) -> SequenceSampler | None:
        """Choice ``index``'s sampler; None for a request gone meanwhile (its row is computed, dropped)."""
        return state.samplers[index] if state is not None else None

    def grammar_error(self, index: int) -> str | None:
        """Why choice ``index``'s grammar failed (a step out of fuel, a refused token), if it did."""
        return getattr(self.samplers[index].mask, "error", None)   # None too for no mask

    def end_steps(self, reason: str, error: str | None) -> None:
        """End a traced request's decode.steps span: how many steps, at what mean batch size."""
        if self.steps_span is not None:
            tracing.end_span(self.steps_span, error, num_steps=self.num_steps, finish_reason=reason,
                             mean_batch_size=self.batch_total / self.num_steps if self.num_steps else None)
