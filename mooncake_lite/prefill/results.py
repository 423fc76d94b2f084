"""What a prefill request's serving needs on either path, one request (``service.py``) or a pack
(``packs.py``): its sampling parameters, each choice's token 1 (under its grammar), and its result
handed out (the first token as soon as it is sampled, with the queue's part of its timings).
Kept below both so neither imports the other.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mooncake_lite.common.protocol import PrefillRequest, PrefillResult, Sampling, TokenLogprob
from mooncake_lite.model.grammar import GrammarError, Grammars, choice_masks
from mooncake_lite.model.sampling import SamplingParams, SequenceSampler, params_from_wire
from mooncake_lite.prefill.turns import QueuedJob

log = logging.getLogger(__name__)


def annotate(result: PrefillResult, job: QueuedJob) -> PrefillResult:
    """The queue's part of a result's timings: its wait, and how many later arrivals were served
    before it (the conductor learns its queue's speed from the waits of jobs nobody passed); and a
    hot-spot migration's, which the conductor learns the link's speed from."""
    result.timings["queue_s"] = job.started_at - job.arrived_at
    result.timings["passed"] = float(job.passed)
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
    """The request's SamplingParams; ValueError if a value is out of range (a continuation's
    output so far must leave at least one prompt token before it)."""
    if req.sampling.num_generated >= len(req.token_ids):
        raise ValueError(f"num_generated ({req.sampling.num_generated}) must be less than the prompt's "
                         f"{len(req.token_ids)} tokens")
    return params_from_wire(req.sampling)


@dataclass(frozen=True)
class Firsts:
    """Token 1 of each of a request's ``n`` choices, drawn from the prompt's last logits, and
    their log-probabilities when asked for. ``output``: a continued request's output so far (the
    prompt's last ``num_generated`` ids), which the decode's samplers resume from too."""
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    output: tuple[int, ...] = ()

    @property
    def wire(self) -> int | list[int]:
        """What the KV stream's END frame carries: the token, or every choice's (n > 1)."""
        return self.tokens[0] if len(self.tokens) == 1 else list(self.tokens)

    def result_fields(self) -> dict:
        """The PrefillResult fields they fill."""
        return {"first_tokens": self.tokens if len(self.tokens) > 1 else (), "first_logprobs": self.logprobs}


def sample_firsts(logits: torch.Tensor, sampling: Sampling, token_ids: Sequence[int],
                  grammars: Grammars | None = None) -> Firsts:
    """Every choice's next token after the prompt ``token_ids`` (choice i drawing from stream
    ``seed + i``, under its own matcher of the request's grammar): token 1, or for a continued
    request token k + 1, its samplers first resumed over the k tokens the prompt ends with. The
    decode resumes its samplers alike (``SequenceSampler.resume``); GrammarError if the grammar fails."""
    params = params_from_wire(sampling)
    k = sampling.num_generated
    output = tuple(token_ids[len(token_ids) - k:]) if k else ()
    drawn = []
    for i, mask in enumerate(choice_masks(grammars, sampling.grammar, sampling.n)):
        sampler = SequenceSampler(params, i, logits.device, mask=mask)
        sampler.resume(output)
        if mask is None or mask.error is None:
            drawn.append(sampler.next(logits))
        if mask is not None and mask.error is not None:
            raise GrammarError(mask.error)
    return Firsts(tuple(t for t, _ in drawn), tuple(lp for _, lp in drawn if lp is not None), output)
