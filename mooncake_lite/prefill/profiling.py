"""The start-up cost model, timed as the instance serves: chunks through its stage engine.

A prefill's served chunk is more than its forward: the layer-wise pass hands each layer to the
model thread from the event loop, gathers the layer's KV and stages it for the host. On two CPU
cores that is a few percent of a forward; on an H200 it was ~27x the forward of the default model
(docs/results/2026-11-30-h200-gpu-check.md), so a model fitted to ``runner.prefill`` timings
priced the first requests 3-23x short and admission refused three in four. So the points of
``instance/profile.QUICK_PREFILL`` are timed through :meth:`StageEngine.run_chunk`; a CPP head's
also through its other stages (``downstream``, FLUSH).

Their KV goes where a served chunk's goes: over a frame connection to a peer process that reads and
answers each layer (``profile_sink.py``; the caller starts it). On an Intel Xeon with 2 vCPU a
512-token chunk took 5-15% longer so than with its KV sent nowhere (``NullSender``, what the
profile did before), and the start-up price rose 6-11%. It did not measurably lower the error of
a replay's first burst, whose TTFTs ran 1.13-1.58x their predictions from run to run
(docs/results/2026-12-04-xeon-2vcpu.md, "The start-up price").
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from mooncake_lite.common.protocol import MAX_BUSY_SCALE
from mooncake_lite.instance.profile import QUICK_PREFILL, fit_prefill, fits
from mooncake_lite.prefill.engine import StageEngine
from mooncake_lite.prefill.job import PrefillAborted
from mooncake_lite.prefill.pipeline import NextStage, NullSender
from mooncake_lite.prefill.profile_sink import ProfileSink
from mooncake_lite.scheduler.costs import PrefillCostModel

log = logging.getLogger(__name__)


async def profile_served(stage: StageEngine, downstream: NextStage | None = None,
                         points=QUICK_PREFILL, repeats: int = 2,
                         sink: ProfileSink | None = None) -> tuple[PrefillCostModel, list]:
    """The cost model of ``stage`` (and of the CPP stages after it, ``downstream``), fit like
    ``instance/profile.profile_prefill``'s from the time a chunk of n new tokens on p cached ones
    takes, its KV sent to ``sink`` (None: nowhere); a shape the stage's cache cannot hold is left
    out. The profile's chunks leave nothing in the stage's timeline (what the conductor reads as
    this instance's forwards).

    Each shape's time is its best of ``repeats`` passes over all the shapes, not of ``repeats``
    timings in a row: a few seconds of other work (a decode starting beside it) then slows one
    pass of a shape, where back to back it slowed every timing of the one shape it fell on. With
    4 s of another process at a random moment of each profile, eight profiles back to back priced
    a 2,724-token prompt 1.00-1.57x what quiet ones did, interleaved 1.03-1.10x (§16 of
    docs/results/2026-12-01-zen3-admission.md)."""
    points = [(n, p) for n, p in points if fits(stage.runner, n + p)]
    downstream = downstream or _NoStages()
    for i, (n, p) in enumerate(points[:3]):      # warm-up: first calls pay one-off costs
        await _timed(stage, downstream, f"profile-warm-{i}", n, p, sink)
    best = [float("inf")] * len(points)
    for r in range(repeats):
        for i, (n, p) in enumerate(points):
            best[i] = min(best[i], await _timed(stage, downstream, f"profile-{i}-{r}", n, p, sink))
    stage.timeline.clear()
    samples = [(n + p, p, s) for (n, p), s in zip(points, best)]
    return fit_prefill(samples), samples


# A pack of short prompts, as a burst forms them, and the profile's shape they are alone.
PACK_JOBS, PACK_TOKENS = 4, 96


async def with_member_cost(stage: StageEngine, cost: PrefillCostModel, samples: list, repeats: int = 2,
                           sink: ProfileSink | None = None) -> PrefillCostModel:
    """``cost`` with its ``member_c0``: of ``c0``, what each job of a packed forward beyond the
    first still pays (its own frames, begin, sampling), ``c0`` less what a pack of ``PACK_JOBS``
    prompts of ``PACK_TOKENS`` saved over the same prompts alone (``samples``' time of that shape),
    per job beyond the first, within [0, c0]. ``cost`` as it was where the stage cannot hold the
    pack or the profile has no such shape. Live on a 2-vCPU Xeon, with the whole ``c0`` shared, packs
    of four ran 1.11x their price and forwards of one 0.955x (docs/results/2026-12-04-xeon-2vcpu.md)."""
    alone = [s for t, p, s in samples if (t, p) == (PACK_TOKENS, 0)]
    if not alone or not fits(stage.runner, PACK_JOBS * PACK_TOKENS):
        return cost
    packed = min([await _time_pack(stage, f"profile-pack-{r}", sink) for r in range(repeats)])
    stage.timeline.clear()
    saved = (PACK_JOBS * alone[0] - packed) / (PACK_JOBS - 1)
    return dataclasses.replace(cost, member_c0=min(max(cost.c0 - saved, 0.0), cost.c0))


async def _time_pack(stage: StageEngine, rid: str, sink: ProfileSink | None) -> float:
    """Seconds of one packed forward of ``PACK_JOBS`` prompts of ``PACK_TOKENS``, each its KV to
    ``sink`` (nowhere once it broke), as ``prefill/packs.py`` runs a pack."""
    parts, senders = [], []
    for j in range(PACK_JOBS):
        tokens = _prompt(stage, PACK_TOKENS, 7919 + j)
        sender = sink.sender(f"{rid}-{j}") if sink is not None and sink.broken is None else NullSender()
        senders.append(sender)
        parts.append((stage.begin(f"{rid}-{j}", tokens, [], 0, sender), 0, tokens))
    error = None
    try:
        t0 = time.perf_counter()
        _, failed = await stage.run_packed(parts)
        seconds = time.perf_counter() - t0
        for sender in senders:
            await sender.flush()
        broken = next((s.error for s in senders if s.error is not None), None)
        if broken is not None and sink is not None:
            sink.give_up(broken)      # timed with the frames refused: the next timing sends them nowhere
        elif any(failed):             # not the peer's doing: the profile fails, as a chunk's would
            raise PrefillAborted(next(filter(None, failed)))
        return seconds
    except BaseException as exc:
        error = str(exc) or type(exc).__name__
        raise
    finally:
        for job, *_ in parts:
            await stage.release(job, error)


# Timed on both thread counts: prompts of the sizes whose forwards a busy node slowed most.
BUSY_POINTS = ((192, 0), (512, 0))


async def busy_scale(stage: StageEngine, points=BUSY_POINTS, repeats: int = 2,
                     sink: ProfileSink | None = None) -> float:
    """How much longer ``stage``'s chunks take on its own threads than with the CPUs it borrows
    while the machine idles (``prefill/threads.py``; 1 when it borrows none): what a decode
    beside it, busy and so taking its CPUs back, costs its forwards. The conductor prices a busy
    node's forwards by it until it has measured some (``Corrections.seed_states``): the start-up
    profile ran with the CPUs borrowed, and a burst's first forwards beside a busy decode ran
    1.6-1.95x its price on Zen 5 (docs/results/2026-11-30-zen5.md §29). Fewer threads never run
    faster: a ratio under 1 is noise, and reads 1. Their KV goes to ``sink``, as the profile's."""
    borrower = getattr(stage.executor, "borrower", None)
    if borrower is None or borrower.borrow <= 0:
        return 1.0
    points = [(n, p) for n, p in points if fits(stage.runner, n + p)]
    seconds = []
    for threads in (borrower.own + borrower.borrow, borrower.own):
        total = 0.0
        with borrower.held(threads):
            for i, (n, p) in enumerate(points):
                total += await _best(stage, _NoStages(), f"profile-threads-{threads}-{i}", n, p, repeats, sink)
        seconds.append(total)
    stage.timeline.clear()
    lent, own = seconds
    return min(MAX_BUSY_SCALE, max(1.0, own / lent)) if lent > 0.0 else 1.0


class _NoStages:
    """What comes after a lone instance's stage in its profile: nothing (a CPP head's is a ``NextStage``)."""

    async def begin(self, *args) -> None: ...

    async def send_chunk(self, *args) -> None: ...

    async def flush(self, rid: str) -> None: ...

    async def end(self, rid: str) -> None: ...

    async def abort(self, rid: str, reason: str) -> None: ...


async def _best(stage: StageEngine, downstream: NextStage | _NoStages, rid: str, n: int, p: int,
                repeats: int, sink: ProfileSink | None) -> float:
    """The fastest of ``repeats`` timings of :func:`_timed` (other load only adds time)."""
    return min([await _timed(stage, downstream, f"{rid}-{r}", n, p, sink) for r in range(repeats)])


async def _timed(stage: StageEngine, downstream: NextStage | _NoStages, rid: str, n: int, p: int,
                 sink: ProfileSink | None) -> float:
    """:func:`_time_chunk`, its KV to ``sink``; to nowhere once the sink broke (a stream it
    refused, or left unanswered: the chunk is timed again without it)."""
    if sink is not None and sink.broken is None:
        sender = sink.sender(rid)
        try:
            return await _time_chunk(stage, downstream, rid, n, p, sender)
        except (PrefillAborted, ConnectionError):
            if sender.error is None:
                raise
            sink.give_up(sender.error)
    return await _time_chunk(stage, downstream, rid, n, p, NullSender())


async def _time_chunk(stage: StageEngine, downstream: NextStage | _NoStages, rid: str, n: int, p: int,
                      sender) -> float:
    """Seconds for tokens p..p+n-1 to go through the stage and those after it (the prefix first,
    untimed), each layer's KV to ``sender``; its frames answered before it returns, untimed as a
    served forward's time ends with its compute."""
    tokens = _prompt(stage, n + p, n + p)
    job = stage.begin(rid, tokens, [], 0, sender)    # no keys: nothing is written back
    error = None
    try:
        await downstream.begin(rid, "", tokens, None, {"max_tokens": 1}, [], 0)
        if p:
            await downstream.send_chunk(rid, 0, await stage.run_chunk(job, 0, token_ids=tokens[:p]))
            await downstream.flush(rid)
        t0 = time.perf_counter()
        await downstream.send_chunk(rid, p, await stage.run_chunk(job, p, token_ids=tokens[p:]))
        await downstream.flush(rid)
        seconds = time.perf_counter() - t0
        await sender.flush()
        if sender.error is not None:
            raise ConnectionError(sender.error)
        await downstream.end(rid)
        return seconds
    except BaseException as exc:
        error = str(exc) or type(exc).__name__
        await downstream.abort(rid, error)
        raise
    finally:
        await stage.release(job, error)


def _prompt(stage: StageEngine, n: int, seed: int) -> list[int]:
    """``n`` token ids drawn from ``seed``: a profile's prompt (the same shape, the same prompt)."""
    vocab = stage.runner.args.vocab_size
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
