"""The steady load of ``mooncake bench chaos``: threads streaming chat completions through the
official ``openai`` client, each request's fate recorded.

A request ends ``ok`` (a finish reason arrived), ``failed_streaming`` (it failed after content had
reached the client), ``failed_before_tokens``, ``rejected_429`` or ``hung`` (no byte for
``hang_s``); each also keeps the longest gap the client saw between two content chunks (a
continued stream's seam shows there: issue #37). The load can be paused, which waits until nothing is in flight, so the cluster's
gauges can be read idle.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import dataclass

from mooncake_lite.bench.options import Flag, flag

# Shared by every request, so prompts share their first blocks: prefill loads them from the store,
# which is what a store kill disturbs.
SYSTEM = ("You are a concise assistant for a lunar observatory. Answer in one short sentence, use plain "
          "words, and never repeat the question. The observatory logs every answer with its request "
          "number, so keep the number out of the reply. ") * 3
QUESTIONS = ("What is the Moon made of?", "Why does the Moon have phases?", "How far away is the Moon?",
             "What causes tides?", "Who first walked on the Moon?", "Why do we see one side of the Moon?")
RETRY_PAUSE_S = 0.1        # after a failure, so an outage is not a busy loop of instant errors
PROBE_LANES = 4            # probes in flight at most: one is sent every probe_every_s while TTFT is short


@dataclass(frozen=True)
class Outcome:
    start: float                 # time.monotonic()
    end: float
    first_token: float | None    # first content chunk
    kind: str                    # ok | failed_streaming | failed_before_tokens | rejected_429 | hung
    error: str = ""
    longest_gap_s: float = 0.0   # between two content chunks


class Load:
    """``concurrency`` threads, each sending one streamed chat completion after the other, and
    probes: a one-token request every ``probe_every_s`` from staggered lanes, so one does not wait
    for the last (their own list: how soon a new request is served again does not depend on when
    a long one of the load happens to end)."""

    def __init__(self, base_url: str, model: str, *, concurrency: int, max_tokens: int, hang_s: float,
                 probe_every_s: float = 0.5, api_key: str | None = None):
        import openai
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", max_retries=0, timeout=hang_s)
        self.model, self.max_tokens, self.concurrency = model, max_tokens, concurrency
        self.probe_every_s = probe_every_s
        self.outcomes: list[Outcome] = []
        self.probes: list[Outcome] = []
        self._running = threading.Event()
        self._cond = threading.Condition()
        self._in_flight = 0
        self._is_closed = False
        self._epoch = time.monotonic()
        self._threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(concurrency)]
        self._threads += [threading.Thread(target=self._worker, args=(concurrency + lane,),
                                           kwargs={"probe_lane": lane}, daemon=True) for lane in range(PROBE_LANES)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._is_closed = True
        self._running.set()
        for t in self._threads:
            t.join(60)

    def resume(self) -> None:
        self._running.set()

    def pause(self) -> None:
        """Stop starting requests and wait until every one in flight has ended (a hung one ends
        at the client's ``hang_s`` read timeout)."""
        with self._cond:
            self._running.clear()
            self._cond.wait_for(lambda: self._in_flight == 0)

    def _worker(self, index: int, probe_lane: int | None = None) -> None:
        is_probe = probe_lane is not None
        num, results = 0, self.probes if is_probe else self.outcomes
        while not self._is_closed:
            if not self._running.wait(0.2):
                continue
            if is_probe:
                time.sleep(self._until_slot(probe_lane))
            with self._cond:
                if not self._running.is_set() or self._is_closed:
                    continue
                self._in_flight += 1
            outcome = self._one(index, num, 1 if is_probe else self.max_tokens)
            with self._cond:
                results.append(outcome)
                self._in_flight -= 1
                self._cond.notify_all()
            num += 1
            if not is_probe and outcome.kind != "ok":
                time.sleep(RETRY_PAUSE_S)

    def _until_slot(self, lane: int) -> float:
        """Seconds to this lane's next turn: probes keep to one grid of ``probe_every_s`` steps,
        dealt to the lanes in turn, across pauses too."""
        step = math.ceil((time.monotonic() - self._epoch) / self.probe_every_s)
        step += (lane - step) % PROBE_LANES
        return max(0.0, self._epoch + step * self.probe_every_s - time.monotonic())

    def _one(self, index: int, num: int, max_tokens: int) -> Outcome:
        import openai
        start, chunks, finish = time.monotonic(), _Chunks(), None
        question = QUESTIONS[(index + num) % len(QUESTIONS)]
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"#{index}-{num}: {question}"}]
        try:
            stream = self.client.chat.completions.create(model=self.model, messages=messages, stream=True,
                                                         max_tokens=max_tokens, temperature=0)
            with stream:
                for chunk in stream:
                    for choice in chunk.choices:
                        if choice.delta.content:
                            chunks.came(time.monotonic())
                        finish = choice.finish_reason or finish
        except openai.RateLimitError as exc:
            return chunks.outcome(start, "rejected_429", _text(exc))
        except Exception as exc:  # noqa: BLE001 - the HTTP library's own errors escape a stream too
            return chunks.outcome(start, _failure(exc, chunks.first), _text(exc))
        if finish is None:
            return chunks.outcome(start, _failure(None, chunks.first), "stream ended without a finish reason")
        return chunks.outcome(start, "ok")


class _Chunks:
    """When a stream's content chunks came: the first, the last, the longest gap between two."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.longest_gap_s = 0.0

    def came(self, now: float) -> None:
        if self.last is not None:
            self.longest_gap_s = max(self.longest_gap_s, now - self.last)
        self.first = self.first if self.first is not None else now
        self.last = now

    def outcome(self, start: float, kind: str, error: str = "") -> Outcome:
        return Outcome(start, time.monotonic(), self.first, kind, error, round(self.longest_gap_s, 3))


def _failure(exc: BaseException | None, first_token: float | None) -> str:
    """How a request failed: silent too long (the client's read timeout) is a hang."""
    if exc is not None and "timeout" in type(exc).__name__.lower():
        return "hung"
    return "failed_streaming" if first_token is not None else "failed_before_tokens"


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:200]


def load_flags(probe_every_s: float, lead_s: float, window_s: float, window_help: str) -> tuple[Flag, ...]:
    """The flags of the load :class:`Load` puts on, for each chaos bench (its own defaults)."""
    return (flag("--concurrency", type=int, default=4, help="requests streaming at once"),
            flag("--max-tokens", type=int, default=32),
            flag("--probe-every-s", type=float, default=probe_every_s, help="a one-token request this often"),
            flag("--lead-s", type=float, default=lead_s, help="load before the kill lands"),
            flag("--window-s", type=float, default=window_s, help=window_help),
            flag("--hang-s", type=float, default=30.0, help="a request silent this long is hung"))


def phase_figures(outcomes: list[Outcome], probes: list[Outcome], t0: float, baseline: list[Outcome]) -> dict:
    """What one kill (at ``t0``) did to the load's ``outcomes`` and to the ``probes`` around it
    (``baseline``: the probes of the settled load before). ``service_restored_s``: to the first
    token of the first probe sent after the last probe that did not succeed; the probes' TTFT
    medians before and after say how much of that is the cluster's ordinary TTFT.
    ``longest_gap_s``: the longest gap between two chunks of a stream in flight at ``t0`` (what
    a client saw across the failure: a continuation's seam, or a hang that healed; token 1 may
    come after ``t0``, from the prefill, and the rest from a stopped decode or its successor)."""
    counts = {kind: sum(o.kind == kind for o in outcomes)
              for kind in ("ok", "hung", "failed_streaming", "failed_before_tokens", "rejected_429")}
    bad = [o for o in probes if o.kind != "ok" and o.end >= t0]
    since = max([t0, *(o.start for o in bad)])
    after = [o.first_token for o in probes if o.kind == "ok" and o.start >= since and o.first_token]
    restored = round(min(after) - t0, 2) if after else None
    errors = sorted({o.error for o in [*outcomes, *probes] if o.kind != "ok" and o.error})[:5]
    across = [o.longest_gap_s for o in outcomes if o.start <= t0 < o.end]
    return {"requests": len(outcomes), **counts, "longest_gap_s": max(across, default=None), "probes": len(probes),
            "probes_failed": sum(o.kind != "ok" for o in probes), "service_restored_s": restored,
            "ttft_p50_before_s": _ttft_p50(baseline),
            "ttft_p50_after_s": _ttft_p50([o for o in probes if o.start >= t0]), "errors": errors}


def _ttft_p50(outcomes: list[Outcome]) -> float | None:
    ttfts = [o.first_token - o.start for o in outcomes if o.kind == "ok" and o.first_token]
    return round(statistics.median(ttfts), 2) if ttfts else None
