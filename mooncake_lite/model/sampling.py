"""Next-token selection: the raw log-probabilities, the logits processors, then greedy or
temperature + top-p with a seeded generator.

One step of one sequence (:meth:`SequenceSampler.next`), in vLLM's order:

1. log-probabilities of the raw logits (log-softmax in float32, before anything below: what the
   API's ``logprobs`` report, as vLLM's default ``raw_logprobs``);
2. ``logit_bias``, then ``min_tokens`` (stop ids masked while fewer tokens were generated);
3. penalties: ``repetition_penalty`` over prompt and output tokens (``transformers``' rule: a
   positive logit divided by it, a negative one multiplied), then OpenAI's
   ``frequency_penalty × count + presence_penalty × (count > 0)`` subtracted, over output tokens;
4. the sequence's :class:`LogitsMask` if it has one (a grammar: disallowed ids to −inf);
5. greedy, or temperature and top-p drawn from the sequence's own generator.

With a ``seed``, the draw at output position ``p`` of choice ``i`` comes from a generator seeded
:func:`draw_seed` ``(seed + i, p)``, not from one stream advanced per draw: a draw depends only on
where it is in the output, so token 1 drawn by the prefill, the decode's tokens after it, and a
continuation that resumes at position ``k`` (issue #37) all draw what one uninterrupted run would.

A continued request (``Sampling.num_generated`` = k > 0: its prompt ends with the choice's first k
output tokens, already sent) counts those k tokens as output, through :meth:`SequenceSampler.resume`:
for the penalties (``frequency``/``presence`` count them; ``repetition_penalty`` takes prompt and
output ids alike, so they count once either way), for ``min_tokens``, for its grammar (advanced over
them) and for the draw's position. ``max_tokens`` and ``min_tokens`` are the request's originals,
counting the k tokens (the decode reserves room for ``max_tokens - k`` more).

Numerically safe for every value the API accepts (issue #15): a temperature below
:data:`GREEDY_BELOW` is greedy (dividing logits by less overflows float32), the softmax is taken
of logits shifted so their top entry is exactly 0 (its sum is then at least 1: never inf or nan),
and top-p always keeps the top token, however small ``top_p`` is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mooncake_lite.common.protocol import Sampling, TokenLogprob

GREEDY_BELOW = 1e-5   # temperatures under this are greedy (vLLM's cut-off too)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (the API refuses more)
_FLOAT32_MAX = torch.finfo(torch.float32).max
_NO_LOGPROB = -9999.0  # what -inf is reported as (JSON has no infinity; vLLM's value too)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None        # top alternatives reported per token (0: the token's alone)
    penalty_ids: tuple[int, ...] = ()  # the prompt's ids the repetition penalty counts

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def is_plain(self) -> bool:
        """Greedy with nothing to process or report: a batched argmax is this sequence's token."""
        return self.is_greedy and self.logprobs is None and not self.processes

    @property
    def processes(self) -> bool:
        """Whether any logits processor of step 2 or 3 applies."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias)


def reports_logprobs(s: Sampling) -> bool:
    """Whether a request reports log-probabilities (its tokens' or its prompt's): its forwards
    then keep float activations (``LayerwisePass(exact=True)``), its values being the checkpoint's."""
    return s.logprobs is not None or s.prompt_logprobs is not None


def params_from_wire(s: Sampling) -> SamplingParams:
    """The SamplingParams a wire ``Sampling`` asks for; ValueError when a value is out of range."""
    if len(s.logit_bias_ids) != len(s.logit_bias_values):
        raise ValueError("logit_bias_ids and logit_bias_values must have the same length")
    if not 0 <= s.num_generated < max(1, s.max_tokens):
        raise ValueError(f"num_generated must be in [0, max_tokens = {s.max_tokens}), got {s.num_generated}")
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, seed=s.seed, max_tokens=max(1, s.max_tokens),
                          stop_token_ids=tuple(s.stop_token_ids), presence_penalty=s.presence_penalty,
                          frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty,
                          min_tokens=s.min_tokens, logit_bias=tuple(zip(s.logit_bias_ids, s.logit_bias_values)),
                          logprobs=s.logprobs, penalty_ids=s.penalty_ids)


class LogitsMask(Protocol):
    """A per-sequence constraint (a grammar's): ``apply`` sets the ids it does not allow next to
    −inf in a ``[vocab]`` float32 row, in place; ``advance`` is told the token chosen."""

    def apply(self, logits: torch.Tensor) -> None: ...

    def advance(self, token: int) -> None: ...


_M64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit values whose outputs look independent."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def draw_seed(stream: int, position: int) -> int:
    """The seed of the draw at output ``position`` of a choice whose stream is ``stream`` (its
    ``seed + index``): both mixed, so neighbouring streams and positions seed unrelated draws."""
    return _mix64((_mix64(stream & _M64) + position * 0x9E3779B97F4A7C15) & _M64)


class Draws:
    """One choice's random draws: the one at output position ``p`` from the generator reseeded
    ``draw_seed(stream, p)`` (``manual_seed`` of a 64-bit value: no state carried between draws)."""

    def __init__(self, stream: int, device: str | torch.device = "cpu") -> None:
        self.stream = stream
        self.generator = torch.Generator(device=device)

    def at(self, position: int) -> torch.Generator:
        self.generator.manual_seed(draw_seed(self.stream, position))
        return self.generator


def make_draws(params: SamplingParams, device: str | torch.device = "cpu", index: int = 0) -> Draws | None:
    """Choice ``index``'s draws: stream ``seed + index``, so the n choices of one request draw
    apart and a ``seed`` reproduces all of them (without a seed, a random stream); None if greedy."""
    if params.is_greedy:
        return None
    return Draws(params.seed + index if params.seed is not None else torch.seed(), device)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from a ``[vocab]`` logits row (already processed)."""
    if params.is_greedy:
        return int(torch.argmax(logits))
    # A broken row (nan, ±inf) still gives a finite one; shifted so the top entry is exactly 0.
    x = torch.nan_to_num(logits.float(), nan=-_FLOAT32_MAX, posinf=_FLOAT32_MAX, neginf=-_FLOAT32_MAX)
    probs = torch.softmax((x - x.max()) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
        keep[0] = True   # a top_p that rounds to 0 in float32 (1e-300) still keeps the top token
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def process(logits: torch.Tensor, params: SamplingParams, counts: Counter[int], num_generated: int) -> torch.Tensor:
    """Steps 2 and 3 of the module docstring on a float32 ``[vocab]`` row, in place; ``counts``:
    how often each id was generated so far, ``num_generated`` how many tokens that was."""
    if params.logit_bias:
        ids, values = zip(*params.logit_bias)
        logits[list(ids)] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
    if num_generated < params.min_tokens and params.stop_token_ids:
        logits[list(params.stop_token_ids)] = -torch.inf
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*params.penalty_ids, *counts}), dtype=torch.long, device=logits.device)
        if len(seen):
            x = logits[seen]
            logits[seen] = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and counts:
        ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
        n = torch.tensor(list(counts.values()), dtype=logits.dtype, device=logits.device)
        logits[ids] -= params.frequency_penalty * n + params.presence_penalty
    return logits


def token_logprob(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """The chosen ``token``'s log-probability and the ``k`` likeliest ids', from a log-softmax row."""
    value = float(logprobs[token])
    if k == 0:
        return TokenLogprob(_finite(value))
    top = torch.topk(logprobs, k)
    return TokenLogprob(_finite(value), tuple(top.indices.tolist()), tuple(map(_finite, top.values.tolist())))


def _finite(value: float) -> float:
    return value if value > _NO_LOGPROB else _NO_LOGPROB


class SequenceSampler:
    """One sequence's sampling state: its parameters, its own draws (stream ``seed + index``),
    the counts of what it generated (for the penalties, ``min_tokens`` and the draw's position),
    and an optional
    :attr:`mask`, the hook a grammar plugs in (applied after the log-probabilities are taken,
    after the penalties, before the draw; told every token through ``advance``)."""

    def __init__(self, params: SamplingParams, index: int = 0, device: str | torch.device = "cpu",
                 mask: LogitsMask | None = None) -> None:
        self.params = params
        self.index = index
        self.draws = make_draws(params, device, index)
        self.counts: Counter[int] = Counter()
        self.num_generated = 0
        self.mask = mask

    @property
    def is_plain(self) -> bool:
        """A batched argmax gives this sequence's next token (see :meth:`observe`)."""
        return self.params.is_plain and self.mask is None

    def next(self, logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """The next token from a ``[vocab]`` row of raw logits, and its log-probabilities when
        asked for; the token is observed."""
        x = logits.float()
        logprobs = torch.log_softmax(x, dim=-1) if self.params.logprobs is not None else None
        if self.params.processes or self.mask is not None:
            x = process(x.clone(), self.params, self.counts, self.num_generated)
            if self.mask is not None:
                self.mask.apply(x)
        token = sample(x, self.params, None if self.draws is None else self.draws.at(self.num_generated))
        self.observe(token)
        return token, None if logprobs is None else token_logprob(logprobs, token, self.params.logprobs)

    def observe(self, token: int) -> None:
        """``token`` was generated for this sequence (by this sampler, a batched argmax, or the
        prefill instance for token 1)."""
        self.counts[token] += 1
        self.num_generated += 1
        if self.mask is not None:
            self.mask.advance(token)

    def resume(self, tokens: Sequence[int]) -> None:
        """``tokens`` were generated for this sequence elsewhere, in order: a continued request's
        output so far, the prefill's token 1 on the decode. Each is observed as if drawn here
        (counted, its grammar advanced), so the next draw is at the position after them."""
        for token in tokens:
            self.observe(token)


def sample_rows(logits: torch.Tensor, samplers: list[SequenceSampler | None]) -> list[tuple[int, TokenLogprob | None]]:
    """A batch step's token for each ``[batch, vocab]`` row (and its logprobs when asked for):
    one batched argmax serves the plain greedy rows (and those of no sampler: a request gone)."""
    greedy = torch.argmax(logits, dim=-1).tolist()
    out: list[tuple[int, TokenLogprob | None]] = []
    for i, sampler in enumerate(samplers):
        if sampler is None or sampler.is_plain:
            out.append((greedy[i], None))
            if sampler is not None:
                sampler.observe(greedy[i])
        else:
            out.append(sampler.next(logits[i]))
    return out


def prompt_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, k: int) -> list[TokenLogprob]:
    """Each prompt position's log-probability of the token after it: ``logits`` ``[n, vocab]``
    (position i's), ``next_ids`` ``[n]`` (the prompt's token at i + 1)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, next_ids.view(-1, 1).to(logprobs.device))[:, 0].tolist()
    if k == 0:
        return [TokenLogprob(_finite(v)) for v in chosen]
    top = torch.topk(logprobs, k, dim=-1)
    return [TokenLogprob(_finite(v), tuple(ids), tuple(map(_finite, vals)))
            for v, ids, vals in zip(chosen, top.indices.tolist(), top.values.tolist())]


def chunk_logprobs(rows: torch.Tensor, token_ids: Sequence[int], start: int,
                   k: int) -> tuple[torch.Tensor, list[TokenLogprob]]:
    """A prompt chunk's every-position logits ``rows`` (its first at ``start`` of ``token_ids``):
    the last row (token 1's, on the last chunk) and each row's :func:`prompt_logprobs` of the
    prompt's next token (the last chunk's last row has none: it predicts token 1)."""
    following = torch.as_tensor(list(token_ids[start + 1:start + 1 + rows.shape[0]]), dtype=torch.long)
    return rows[-1], prompt_logprobs(rows[:len(following)], following, k)
