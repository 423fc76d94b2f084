"""What an attempt's upstream calls tell its flight, one event each, on the attempt's queue.

The prefill call ends with :class:`FirstToken`, :class:`PrefillRefused` or :class:`Failed`; the
decode stream sends a :class:`Token` per token from the second on, then :class:`Finished` (or
:class:`Failed` when it breaks); an instance declared dead, or the conductor's drain, puts a
:class:`Failed` there too. The flight's relay matches them by type (``flight.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_lite.common.protocol import PrefillResult, TokenLogprob
from mooncake_lite.conductor.api.errors import ApiError, shutting_down, upstream_failed

SHUTDOWN = "shutdown"   # Failed.reason of a request the conductor's drain ended (a 503, not a 502)


@dataclass(frozen=True)
class FirstToken:
    """The prefill's answer: the first token, and what it reused and computed."""

    result: PrefillResult


@dataclass(frozen=True)
class Token:
    """One token of choice ``index`` (from the decode stream; also what the flight hands its
    relay, token 1 included), with its log-probabilities when asked for."""

    token: int
    index: int = 0
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class Finished:
    """Decode's end line of choice ``index``: ``finish_reason`` and, when it gave up, why."""

    finish_reason: str
    error: str | None
    index: int = 0


@dataclass(frozen=True)
class PrefillRefused:
    """The prefill instance answered 429 (its queue is full): the client's 429."""

    message: str


@dataclass(frozen=True)
class Failed:
    """Why an attempt failed upstream. ``instance_id``: the instance to leave out of a retry;
    ``reason``: the retries_total label; ``retry``: whether it may be retried elsewhere (a
    timeout is not: the request has waited long enough)."""

    message: str
    instance_id: str
    reason: str
    retry: bool = True


Event = FirstToken | Token | Finished | PrefillRefused | Failed


def client_error(failed: Failed) -> ApiError:
    """What the client is told of a failure that ends its request: the conductor's own shutdown
    (its drain ran out) is a 503 to retry, a failure upstream a 502 (the instance's fault)."""
    if failed.reason == SHUTDOWN:
        return shutting_down(failed.message)
    return upstream_failed(failed.message)
