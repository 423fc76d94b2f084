"""Decode token gaps while a prefill on the same host computes (co-location), read from the
roles' timelines for the cost export.

On one box prefill and decode share the CPU: a decode step run beside a prefill's forward is
slower than one run alone, and a single spread for every step (ratio_quantiles) cannot say
when the slow ones come. Each role keeps its recent work on the host's monotonic clock
(``GET /v1/timeline``); :func:`colocation_split` joins a decode's steps with the forwards of
the prefills on its host, which the conductor's cost export does for the simulator.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence

import numpy as np

from mooncake_lite.instance.refine import RATIO_QUANTILES, DecodeRefiner
from mooncake_lite.scheduler.costs import DecodeCostModel

TIMELINE_LEN = 4096          # steps (decode) or forwards (prefill) a role keeps, newest
BUSY_SHARE = 0.5             # a gap is "beside a prefill" when a forward covers this much of it
MIN_SPLIT_GAPS = 20          # gaps on each side before a slowdown is reported


def covered_share(start: float, end: float, intervals: Sequence[tuple[float, float]]) -> float:
    """The share of ``[start, end]`` covered by the union of ``intervals`` (sorted by start,
    not overlapping: :func:`merge_intervals`)."""
    if end <= start:
        return 0.0
    covered = 0.0
    for a, b in intervals[bisect_right(intervals, start, key=_end):]:   # the first that ends after start
        if a >= end:
            break
        if b > start:
            covered += min(b, end) - max(a, start)
    return covered / (end - start)


def _end(interval: tuple[float, float]) -> float:
    return interval[1]


def merge_intervals(intervals: Sequence[Sequence[float]]) -> list[tuple[float, float]]:
    """``(start, end)`` intervals sorted and merged where they overlap (several prefills, packed
    forwards, a CPP group's stages)."""
    out: list[tuple[float, float]] = []
    for a, b in sorted((float(a), float(b)) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def step_gaps(steps: Sequence[Sequence[float]]) -> list[tuple[float, float, int, int, float, int]]:
    """A decode's token gaps from its step timeline (``(start, seconds, batch, context,
    waited, longest context)`` per step, in order): a step's tokens go out when it ends, so the
    gap before step i's tokens is ``end_i − end_{i−1}`` — the step plus the loop's work between
    the two (KV writes, HTTP) — when step i followed step i−1 at once (``waited`` 0: the batch
    was never empty between). ``(gap start, gap end, batch, context, step seconds, longest
    context)`` of step i."""
    out = []
    for prev, cur in zip(steps, steps[1:]):
        if cur[4]:
            continue
        a, b = prev[0] + prev[1], cur[0] + cur[1]
        if b > a:
            longest = int(cur[5]) if len(cur) > 5 else int(cur[3])
            out.append((a, b, int(cur[2]), int(cur[3]), float(cur[1]), longest))
    return out


def padded_step(model: DecodeCostModel, batch: int, context: int, longest: int, per_token: float) -> float:
    """A step's time when attention runs every sequence to the batch's longest context (the
    CPU's reference kernel): the model's, plus ``per_token`` seconds for each padding token."""
    return model.predict(batch, context) + per_token * max(0, batch * longest - context)


def padding_cost(gaps: Sequence[tuple], busy: Sequence[bool], model: DecodeCostModel,
                 slowdown: float) -> float | None:
    """Seconds per padding token (batch × longest − context) that best explain what the gaps
    of padded batches take beyond the model, once a gap beside a prefill is divided by the
    ``slowdown`` measured on unpadded ones (least squares through 0, at least 0): measured
    rather than the model's per-context-token cost, which a padded token does not cost (it is
    gathered and masked, not attended). None below ``MIN_SPLIT_GAPS`` padded gaps."""
    rows = [(g[2] * g[5] - g[3], (g[1] - g[0]) / (slowdown if beside else 1.0) - model.predict(g[2], g[3]))
            for g, beside in zip(gaps, busy) if g[2] * g[5] > g[3]]
    if len(rows) < MIN_SPLIT_GAPS:
        return None
    return max(0.0, sum(p * r for p, r in rows) / sum(p * p for p, _ in rows))


def kv_write_cost(intake: Sequence[Sequence[float]]) -> float | None:
    """Seconds a decode's model thread spends writing one received prompt token's KV (all
    layers), over its joins ``(time, prompt tokens, write seconds)``; None below 5 joins."""
    if len(intake) < 5 or not sum(n for _, n, _ in intake):
        return None
    return sum(s for _, _, s in intake) / sum(n for _, n, _ in intake)


def write_spans(intake: Sequence[Sequence[float]],
                forwards: Sequence[Sequence[float]]) -> list[tuple[float, float, float]]:
    """Each join's KV writes as ``(from, to, seconds)``: its frames come as the prefill computes
    each layer and are written as they come, so from the start of the forward whose end the join
    follows (packed prompts share one) to the join; a prompt cut into chunks is counted in its
    last. A join before any forward is left out."""
    ordered = sorted((float(a), float(b)) for a, b in forwards)
    ends = [b for _, b in ordered]
    out = []
    for join in intake:
        t, k = float(join[0]), bisect_right(ends, float(join[0]))
        if k and ordered[k - 1][0] < t:
            out.append((ordered[k - 1][0], t, float(join[2])))
    return out


def _without_writes(gaps: list[tuple], spans: Sequence[tuple[float, float, float]],
                    model: DecodeCostModel) -> list[tuple]:
    """``gaps`` with each join's KV write seconds taken out of the gaps they were written in:
    spread evenly in time over its span (:func:`write_spans`), a gap gives its overlap's share,
    at most what it took beyond the model's step; what fell while the decode waited delayed no
    step. Not where the join falls: most joins find the decode idle, their writes long done
    (the simulator charges them over the prefill the same way: ``sim/cluster.py``)."""
    starts, ends = [g[0] for g in gaps], [g[1] for g in gaps]
    out = [list(g) for g in gaps]
    for a, b, seconds in spans:
        for k in range(bisect_right(ends, a), bisect_left(starts, b)):
            g, overlap = out[k], min(ends[k], b) - max(starts[k], a)
            g[0] += min(seconds * overlap / (b - a), max(0.0, (g[1] - g[0]) - model.predict(g[2], g[3])))
    return [tuple(g) for g in out]


def colocation_split(steps: Sequence[Sequence[float]], forwards: Sequence[Sequence[float]],
                     model: DecodeCostModel, padded: bool = False,
                     quantiles: Sequence[float] = RATIO_QUANTILES,
                     intake: Sequence[Sequence[float]] = ()) -> dict | None:
    """A decode's token gaps (:func:`step_gaps`) split by whether a prefill on its host was
    computing through most of the gap (``forwards``: their ``(start, end)`` on the same clock):
    how many on each side and their mean gap; ``slowdown``, the mean gap / model beside a
    prefill over the mean alone, shape by shape (:func:`_matched_slowdown`), from the gaps of
    unpadded batches when ``padded`` (the decode runs a batch to its longest context); then
    ``padding_s_per_token`` (:func:`padding_cost`, 0 unless ``padded``), and the quantiles of
    gap / :func:`padded_step` on each side (``idle_ratios``, ``busy_ratios``) — the step the
    simulator runs. ``step_share`` = the steps' own seconds over the gaps' (the rest is between
    steps); each side's ratios are :func:`bin_means`, ``len(quantiles)`` of them. With the
    decode's joins (``intake``): ``kv_write_s_per_token`` (:func:`kv_write_cost`), and the
    gaps are taken without those writes (:func:`_without_writes`). None without gaps."""
    gaps = [g for g in step_gaps(steps) if model.predict(g[2], g[3]) > 0]
    if not gaps:
        return None
    write_cost = kv_write_cost(intake)
    if write_cost is not None:
        gaps = _without_writes(gaps, write_spans(intake, forwards), model)
    busy_at = merge_intervals(forwards)
    busy = [covered_share(g[0], g[1], busy_at) >= BUSY_SHARE for g in gaps]
    plain = [((g[1] - g[0]) / model.predict(g[2], g[3]), DecodeRefiner._bucket(g[2], g[5]), beside)
             for g, beside in zip(gaps, busy) if not padded or g[2] * g[5] <= g[3]]
    slowdown = _matched_slowdown([r[:2] for r in plain if r[2]], [r[:2] for r in plain if not r[2]])
    per_token = (padding_cost(gaps, busy, model, slowdown or 1.0) or 0.0) if padded else 0.0
    out: dict = {"step_share": sum(g[4] for g in gaps) / sum(g[1] - g[0] for g in gaps),
                 "padding_s_per_token": per_token, "slowdown": slowdown, "kv_write_s_per_token": write_cost}
    for name, side in (("busy", True), ("idle", False)):
        vals = [(g[1] - g[0], (g[1] - g[0]) / padded_step(model, g[2], g[3], g[5], per_token))
                for g, beside in zip(gaps, busy) if beside == side]
        out[f"gaps_{name}"] = len(vals)
        out[f"gap_mean_{name}_s"] = float(np.mean([v[0] for v in vals])) if vals else None
        out[f"{name}_ratios"] = bin_means([v[1] for v in vals], len(quantiles)) if vals else None
    return out


def bin_means(values: Sequence[float], bins: int) -> list[float]:
    """``values`` sorted and cut into ``bins`` equal-mass bins, each bin's mean, ascending: a
    draw of one at random has the values' mean, and the top bin keeps its spikes' weight — a
    quantile at the bin's middle drops them (a step stalled 1.1 s by KV writes, one in 170,
    is all but gone from a q95 of 1.26, yet it is what the slowest gaps of a request's TBT are)."""
    cut = np.array_split(np.sort(np.asarray(values, dtype=np.float64)), min(bins, len(values)))
    return [float(part.mean()) for part in cut]


def _matched_slowdown(busy: list, idle: list) -> float | None:
    """Mean ratio beside a prefill over the mean ratio alone, compared shape by shape (batch
    and longest context, by power of two) and averaged over the busy gaps: while a prefill runs
    the batches are larger and hold the long prompts, so comparing all busy gaps with all idle
    ones would charge co-location with what the model gets wrong about those shapes. None below
    ``MIN_SPLIT_GAPS`` matched gaps on either side."""
    by_shape: dict[tuple[int, int], tuple[list[float], list[float]]] = {}
    for side, vals in ((0, busy), (1, idle)):
        for ratio, shape in vals:
            by_shape.setdefault(shape, ([], []))[side].append(ratio)
    matched = [(len(b), float(np.mean(b)) / float(np.mean(i))) for b, i in by_shape.values() if b and i]
    if sum(n for n, _ in matched) < MIN_SPLIT_GAPS or \
            sum(len(i) for b, i in by_shape.values() if b and i) < MIN_SPLIT_GAPS:
        return None
    return sum(n * r for n, r in matched) / sum(n for n, _ in matched)
