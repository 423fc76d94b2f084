"""Self-profiling: time a few model runs and fit the scheduler's cost models.

Prefill instances report the fitted :class:`PrefillCostModel` in ``Register.cost``, decode
instances the :class:`DecodeCostModel` (the conductor predicts TTFT and TBT with them);
``mooncake bench pd --profile`` runs the same timings with more points. KV contents do not
matter for timing, so the cache is used as is (whatever it holds). The start-up model is only
where an instance begins: while it serves, a refiner (``refine.py``) keeps it current from the
chunks and steps it really runs, and its heartbeats carry the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mooncake_kernels.timing import best_seconds
from mooncake_lite.instance.refine import DecodeRefiner, PrefillRefiner, nonneg_fit, relative_fit
from mooncake_lite.model.kv_cache import blocks_needed
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.scheduler.costs import DecodeCostModel, PrefillCostModel

# The last shape is the one where attention weighs (64 queries over 1,088 keys: on Zen 5 half the
# forward): without it c2 rested on shapes where it is a tenth of the time, and five start-up
# profiles of one idle box put it at 0.96-1.67e-6 (a 512-token chunk on 3,000 cached tokens priced
# 2.2-3.4 s, measured 2.0 s); with it 0.78-0.96e-6 (1.9-2.2 s), for 2 s more start-up.
QUICK_PREFILL = ((32, 0), (96, 0), (192, 0), (64, 128), (32, 192), (128, 64), (64, 1024))
QUICK_DECODE = ((1, 64), (4, 64), (8, 64), (1, 512), (4, 256), (8, 256))


def served_points(chunk: int) -> tuple[tuple[int, int], ...]:
    """A prefill's start-up shapes where it computes ``chunk`` tokens a forward: the quick ones, and
    a full chunk alone and after two: what a long prompt runs as. Fitted to the quick ones alone (at
    most 192 new tokens) the growth of a chunk's time with its prefix came out at 1.2x to 3.2x over
    2,048 tokens of prefix, where SmolLM2 measured 1.5x and, beside a busy decode, flat; with them,
    1.7x (docs/results/2026-12-01-zen3.md §11)."""
    return QUICK_PREFILL + ((chunk, 0), (chunk, 2 * chunk)) if chunk > 0 else QUICK_PREFILL
# Shapes where a refiner keeps the start-up model's shape until it measures them (refine.py):
# the profiled ones and a few larger, so long prompts and big batches extrapolate from it.
PRIOR_PREFILL = QUICK_PREFILL + ((512, 0), (512, 512), (2048, 0), (512, 1536))
PRIOR_DECODE = QUICK_DECODE + ((16, 512), (32, 1024), (64, 256))


def _tokens(n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def time_prefill(runner: ModelRunner, num_new: int, num_prefix: int, chunk: int | None = None,
                 repeats: int = 1) -> float:
    """Seconds to compute ``num_new`` tokens on top of ``num_prefix`` cached ones (best of repeats)."""
    total = num_new + num_prefix
    table = runner.allocator.allocate(blocks_needed(total, runner.block_size))
    try:
        toks = _tokens(total, runner.args.vocab_size)
        if num_prefix:
            runner.prefill(toks[:num_prefix], table, 0, chunk)
        return best_seconds(lambda: runner.prefill(toks[num_prefix:], table, num_prefix, chunk),
                            runner.device, repeats)
    finally:
        runner.allocator.free(table)


def time_decode(runner: ModelRunner, batch: int, context: int, repeats: int = 3, step=None) -> float:
    """Seconds of one decode step for ``batch`` sequences of ``context`` tokens (best of repeats),
    by ``step`` (``ModelRunner.decode``'s contract; default: the runner's eager step)."""
    per_seq = blocks_needed(context, runner.block_size)
    tables = [runner.allocator.allocate(per_seq) for _ in range(batch)]
    step = step or runner.decode
    try:
        tokens, positions = [1] * batch, [context - 1] * batch
        return best_seconds(lambda: step(tokens, tables, positions), runner.device, repeats)
    finally:
        for t in tables:
            runner.allocator.free(t)


def fit_prefill(samples: list[tuple[int, int, float]]) -> PrefillCostModel:
    """``PrefillCostModel`` (t = c0 + c1·n + c2·n·(p+n) + c3·p) from (num_tokens, prefix, s), each
    timing's error weighed relative to it, as the refiner fits (``refine.py``). Fitted in plain
    seconds, the two full chunks (0.9 and 1.2 s on Zen 3, the seven short shapes 0.13-0.36 s)
    decided it: one of them timed 1.8x slow took c1 to 0.36x and priced 192 tokens at 0.82x, and
    a start-up's fit came out at c1 0.00034 s and c2 2.69e-6 where the next one's was 0.00166 and
    0.99e-6 (docs/results/2026-12-01-zen3-admission.md §16). Relative, the short shapes hold c0
    and c1, and the full chunks c2."""
    if len(samples) < 4:
        raise ValueError(f"need at least 4 prefill timings, got {len(samples)}")
    rows = [[1.0, t - p, (t - p) * t, p] for t, p, _ in samples]
    return PrefillCostModel(*relative_fit(rows, [max(s, 1e-9) for *_, s in samples]))


def fit_decode(samples: list[tuple[int, int, float]]) -> DecodeCostModel:
    """``DecodeCostModel`` (t = c0 + c1·batch + c2·context) from (batch, context tokens, s)."""
    if len(samples) < 3:
        raise ValueError(f"need at least 3 decode timings, got {len(samples)}")
    return DecodeCostModel(*nonneg_fit([[1.0, b, c] for b, c, _ in samples], [s for *_, s in samples]))


def prefill_refiner(cost: PrefillCostModel | None) -> PrefillRefiner:
    """A refiner of the start-up prefill model ``cost`` (its samples: num_tokens, prefix, s)."""
    return PrefillRefiner(cost, [(n + p, p) for n, p in PRIOR_PREFILL])


def decode_refiner(cost: DecodeCostModel | None) -> DecodeRefiner:
    """A refiner of the start-up decode model ``cost`` (its samples: batch, context tokens, s)."""
    return DecodeRefiner(cost, [(b, b * c) for b, c in PRIOR_DECODE])


def fits(runner: ModelRunner, tokens: int) -> bool:
    return runner.allocator.can_allocate(blocks_needed(tokens, runner.block_size))


def profile_prefill(runner: ModelRunner, points: Sequence[tuple[int, int]] = QUICK_PREFILL,
                    repeats: int = 2) -> tuple[PrefillCostModel, list[tuple[int, int, float]]]:
    """Fit ``PrefillCostModel`` from ``(new, prefix)`` points; samples are (num_tokens, prefix, s)."""
    for n, p in points[:3]:  # warm-up: first calls pay one-off allocation and dispatch costs
        if fits(runner, n + p):
            time_prefill(runner, n, p)
    samples = [(n + p, p, time_prefill(runner, n, p, repeats=repeats)) for n, p in points if fits(runner, n + p)]
    return fit_prefill(samples), samples


def profile_decode(runner: ModelRunner, points: Sequence[tuple[int, int]] = QUICK_DECODE,
                   repeats: int = 3, step=None) -> tuple[DecodeCostModel, list[tuple[int, int, float]]]:
    """Fit ``DecodeCostModel`` from ``(batch, context)`` points; samples are (batch, context tokens, s).
    ``step``: the step the instance serves with, where it is not the runner's eager one (CUDA
    graphs: on an H200 the default model's graph step took 3.2 ms, its eager one 15.3 ms)."""
    for batch, context in points[:3]:
        if fits(runner, batch * runner.block_size * blocks_needed(context, runner.block_size)):
            time_decode(runner, batch, context, 1, step)
    samples = []
    for batch, context in points:
        if fits(runner, batch * runner.block_size * blocks_needed(context, runner.block_size)):
            samples.append((batch, batch * context, time_decode(runner, batch, context, repeats, step)))
    return fit_decode(samples), samples
