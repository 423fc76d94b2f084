"""``bench fidelity``'s delivery jitter: what the path from a decode's step to the client (the
decode's HTTP stream, the conductor's relay, the client, all on the box's shared CPUs) adds to or
takes from a token gap, measured from the client's chunk times against the decodes' step
timelines (``GET /v1/timeline``, the host's monotonic clock, the client's too).

The simulated decode hands a token over when its step ends. Live, a relay that the CPUs hold back
delivers a token late: its gap is longer, the next one shorter, the mean the same — and TBT, the
slowest tenth of a request's gaps, reads the longer one. On the 135M one-box run of session 24
that was 15% of the live TBT, while the gaps between step ends gave a TBT within 1.2% of the
simulator's. The simulated side draws one of these per gap (``sim/batch.Batch.deliver_with``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Mapping, Sequence

from mooncake_lite.instance.colocation import bin_means

# Fewer gaps than this measured: no jitter (the simulated side ends gaps at its steps' ends).
MIN_GAPS = 50
# Equal-mass bins drawn from: a request's TBT reads its slowest ~10% of gaps, which these keep
# at ten levels (10 bins, one level, took 4% off the run's TBT: a spike's spread is its height).
BINS = 100


def step_ends(timeline: Mapping) -> list[float]:
    """When each step of a decode's timeline ended (its tokens were handed over), in order."""
    return sorted(float(s[0]) + float(s[1]) for s in timeline.get("steps", ()))


def first_step(tokens: Sequence[float], ends: Sequence[float]) -> int | None:
    """The index in ``ends`` of the step that produced a request's second token (arrival times
    ``tokens``): every running sequence gets a token a step, so token k + 1 came from that step
    + k. Each arrival after the first votes for the last step ending before it, less its place;
    the most votes win where they are at least half (a token a relay held past the next step's
    end votes wrong). None when no arrival falls in the timeline or the votes split."""
    votes = Counter(bisect_right(ends, t) - k for k, t in enumerate(tokens[1:]) if t > ends[0])
    if not votes:
        return None
    step, count = votes.most_common(1)[0]
    return step - 1 if 2 * count >= len(tokens) - 1 else None


def request_jitter(tokens: Sequence[float], ends: Sequence[float]) -> list[float] | None:
    """Each gap after the first as the client saw it less the gap between the step ends that
    produced its tokens; None when the tokens do not map onto the timeline (:func:`first_step`)
    or one arrived before its step ended (another decode's)."""
    j = first_step(tokens, ends) if len(tokens) > 2 and ends else None
    if j is None or j < 0 or j + len(tokens) - 1 > len(ends):
        return None
    produced = ends[j:j + len(tokens) - 1]   # tokens 2.. of the request
    if any(t < e for t, e in zip(tokens[1:], produced)):
        return None
    lags = [t - e for t, e in zip(tokens[1:], produced)]
    return [b - a for a, b in zip(lags, lags[1:])]


def delivery_jitter(records: Sequence, timelines: Mapping[str, Mapping],
                    until: float | None = None) -> tuple[float, ...]:
    """The jitter of the completed ``records``' gaps (their tokens: the chunks less the one that
    only finishes), each against the decode timeline its tokens map onto, as :data:`BINS`
    equal-mass bin means; only requests done by ``until`` (the monotonic clock) when given — what
    an export at ``until`` could know. Empty below :data:`MIN_GAPS` gaps."""
    decodes = [ends for t in timelines.values() if (ends := step_ends(t))]
    jitter: list[float] = []
    for r in records:
        tokens = r.chunk_s[: r.output_tokens] if r.output_tokens else r.chunk_s
        if not r.is_ok or (until is not None and r.chunk_s[-1] > until):
            continue
        found = next((j for ends in decodes if (j := request_jitter(tokens, ends)) is not None), None)
        jitter += found or []
    return tuple(bin_means(jitter, BINS)) if len(jitter) >= MIN_GAPS else ()
