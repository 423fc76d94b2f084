"""Continuing a request whose decode failed mid-stream (issue #37), as values: what the new
attempt is asked, whether a failure may be continued, and the record each one leaves.

What a dead decode held is the prompt (its blocks are in the store already) plus the tokens the
conductor has relayed to the client. So a continuation is an ordinary attempt (``attempt.py``)
whose prompt is the original prompt + those tokens: a prefill reuses the cached prefix, computes
the rest, streams the KV to another decode, and samples the next token, and the flight's relay
goes on as if nothing happened (``flight.py``). ``Sampling.num_generated`` tells the instances
that the prompt's last tokens are output already (penalties, min/max_tokens, the grammar, the
seeded generator's position count them). The client's relay state (detokenizer, stop-string
holdback, reasoning split, tool-call parser) lives in the ``Relay`` above the flight and never
sees the seam.

Detection (docs/operations.md, "Decode failure: continuation"): a process that dies or a link that
drops breaks decode's token stream at once (``Failed`` decode-unreachable); a decode that hangs
(SIGSTOP) or is cut off stops heartbeating and the membership's reaper declares it dead after
``--dead-after`` (``Failed`` instance-dead through the attempt's death watch). No separate
inter-token silence bound: a decode's steps may legitimately pause for seconds (a long batch, a
KV intake), and heartbeats come from its event loop, not its model thread, so silence on the
stream alone would misjudge a busy instance. ``--upstream-timeout`` stays the backstop for an
instance that heartbeats but sends nothing (a read timeout, continued as decode-error).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from mooncake_lite.conductor.api.params import ApiRequest
from mooncake_lite.conductor.cluster.membership import Instance
from mooncake_lite.conductor.flight.events import SHUTDOWN, Failed


@dataclass(frozen=True)
class Continuation:
    """One decode failure of a request that had sent tokens, and what became of it: ``outcome``
    continued (on ``to_prefill`` + ``to_decode``), or the client got the error: limit (``--migration-limit``
    reached), refused (no instance could take it: ``detail`` says why)."""

    request_id: str
    cause: str            # the failure's reason (events.Failed.reason)
    from_decode: str
    num_tokens: int       # tokens the client had received
    number: int           # 1 for the request's first continuation
    outcome: str
    to_prefill: str | None = None
    to_decode: str | None = None
    detail: str | None = None
    at: float = dataclasses.field(default_factory=time.time)

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def is_continuable(failed: Failed) -> bool:
    """A failure another decode can recover from: anything but the conductor's own shutdown (its
    drain ends requests on purpose)."""
    return failed.reason != SHUTDOWN


def continued_request(req: ApiRequest, generated: Sequence[int], index: int) -> ApiRequest:
    """What choice ``index`` of ``req`` is continued as, having relayed ``generated``: the prompt
    and those tokens, counted as output (``num_generated``), one choice drawing from the seed that
    choice had (``seed + index``), no prompt logprobs or echo (the client has them)."""
    s = req.sampling
    sampling = dataclasses.replace(s, n=1, seed=None if s.seed is None else s.seed + index, prompt_logprobs=None,
                                   num_generated=len(generated))
    return dataclasses.replace(req, prompt_ids=req.prompt_ids + tuple(generated), sampling=sampling,
                               echo_text=None, more_prompts=())


def still_registered(failed_on: Iterable[Instance], current: Mapping[str, Instance]) -> set[str]:
    """The ids of the instances a request's failed attempts ran on (``failed_on``) that are still
    that registration in ``current`` (the membership's table): those it is not placed on again.
    Every registration is a new Instance (``Membership.register``; a live process never registers
    twice), so the only decode, restarted by its supervisor at the same address and id, may take
    the request's continuation; a hung one that heartbeats again may not (it was fenced off)."""
    return {i.instance_id for i in failed_on if current.get(i.instance_id) is i}
