"""What a prefill request's serving needs on either path, one request (``service.py``) or a pack
(``packs.py``): its sampling parameters and token 1's logits under its grammar, and its result handed out (the first token as soon as it
is sampled, with the queue's part of its timings). Kept below both so neither imports the other.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from mooncake_lite.common.protocol import PrefillRequest, PrefillResult
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.sampling import SamplingParams
from mooncake_lite.prefill.turns import QueuedJob

log = logging.getLogger(__name__)


def annotate(result: PrefillResult, job: QueuedJob) -> PrefillResult:
    """The queue's part of a result's timings (and a hot-spot migration's, which the conductor
    learns the link's speed from)."""
    result.timings["queue_s"] = job.started_at - job.arrived_at
    if job.migrated is not None:
        result.timings["migrate_bytes"], result.timings["migrate_s"] = job.migrated
    return result


def tell_first(job: QueuedJob, result: PrefillResult) -> None:
    """Hand the caller its result as soon as the first token is known (see ``QueuedJob.on_first``)."""
    if job.on_first is not None:
        try:
            job.on_first(annotate(result, job))
        except Exception:   # the caller's problem must not fail the stream others wait for
            log.exception("on_first of %s failed", job.request_id)


def request_params(req: PrefillRequest) -> SamplingParams:
    return sampling_params(dataclasses.asdict(req.sampling))


def first_logits(runner: ModelRunner, logits: torch.Tensor, grammar: str | None) -> torch.Tensor:
    """Token 1's logits under the request's grammar, if it has one (``model/grammar.py``)."""
    if grammar is None:
        return logits
    if runner.grammars is None:
        raise ValueError("this instance was built without grammars; it cannot serve a structured output")
    return runner.grammars.first_logits(logits, grammar)


def sampling_params(s: dict) -> SamplingParams:
    """SamplingParams from the wire's Sampling fields (a dict); ValueError if out of range."""
    return SamplingParams(temperature=float(s.get("temperature", 0.0)), top_p=float(s.get("top_p", 1.0)),
                          seed=s.get("seed"), max_tokens=max(1, int(s.get("max_tokens", 1))),
                          stop_token_ids=tuple(s.get("stop_token_ids", ())))
