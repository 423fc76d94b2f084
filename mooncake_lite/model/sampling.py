"""Next-token selection: greedy, or temperature + top-p with a seeded generator.

Numerically safe for every value the API accepts (issue #15): a temperature below
:data:`GREEDY_BELOW` is greedy (dividing logits by less overflows float32), the softmax is taken
of logits shifted so their top entry is exactly 0 (its sum is then at least 1: never inf or nan),
and top-p always keeps the top token, however small ``top_p`` is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5   # temperatures under this are greedy (vLLM's cut-off too)
_FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def make_generator(params: SamplingParams, device: str | torch.device = "cpu") -> torch.Generator | None:
    if params.is_greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from a ``[vocab]`` logits row."""
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


def skip_draw(generator: torch.Generator, vocab_size: int) -> None:
    """Advance ``generator`` exactly as one :func:`sample` call over ``vocab_size`` logits does
    (with or without top-p: each is one multinomial draw, which consumes one random number per
    vocabulary entry) — for a decode instance continuing a seeded request whose first token
    the prefill instance drew from a generator seeded alike."""
    torch.multinomial(torch.ones(vocab_size, device=generator.device), 1, generator=generator)
