"""What an instance's correction shows the scheduler's view of it (``correction.py``), live and
simulated alike: each figure once it moved by more than ``SHOW_TOLERANCE``, since a new state makes
the scheduler derive that instance's estimates afresh."""

from __future__ import annotations

import math

from mooncake_lite.scheduler.correction import SHOW_TOLERANCE, Corrections, InstanceCorrection
from mooncake_lite.scheduler.snapshot import Shown


def show_queue_bound(c: Corrections, instance_id: str, view: Shown) -> None:
    """``view`` (a prefill's, live or simulated) shows what admission multiplies its queue by
    (``Corrections.queue_bound``) once it moved by more than ``SHOW_TOLERANCE``: a new state makes
    the scheduler derive the instance's estimates afresh."""
    spread = c.queue_bound(instance_id)
    if abs(math.log(spread / view.spread)) >= SHOW_TOLERANCE:
        view.set_spread(spread)


def show_tail(c: Corrections, instance_id: str, view) -> None:
    """``view`` (a ``DecodeView``, live or simulated) shows its tail once it moved by more than
    ``SHOW_TOLERANCE``."""
    tail = c.tail(instance_id)
    if abs(math.log(tail / view.tail)) >= SHOW_TOLERANCE:
        view.set_tail(tail)


def show_start(view) -> None:
    """A prefill view (live or simulated) that this correction will feed shows its start, not the
    worst case: no job measured, the overtake and join shares 0 (the queue as it stands), learned
    from there. Started at the worst case (1), the simulator on a replayed trace refused up to
    23% of requests that would have met their TTFT SLO, all before the share was learned
    (docs/results/2026-11-29-burst-window.md)."""
    start = InstanceCorrection()
    view.set_overtake_share(start.overtake_share, start.join_share)


def show_shares(c: Corrections, instance_id: str, view) -> None:
    """``view`` (a ``PrefillView``, live or simulated) shows the overtake and join shares once
    either moved by more than ``SHOW_TOLERANCE``: a new state derives the estimates afresh."""
    share, join = c.overtake_share(instance_id), c.join_share(instance_id)
    if abs(share - view.overtake_share) >= SHOW_TOLERANCE or abs(join - view.join_share) >= SHOW_TOLERANCE:
        view.set_overtake_share(share, join)


def show_queue_scale(c: Corrections, instance_id: str, view) -> None:
    """``view`` (a ``PrefillView``, live or simulated) shows the scale of its wait for the work
    queued ahead (``Corrections.queue_scale``) once it moved by more than ``SHOW_TOLERANCE``."""
    scale = c.queue_scale(instance_id)
    if abs(math.log(scale / view.queue_scale)) >= SHOW_TOLERANCE:
        view.set_queue_scale(scale)


def model_moved(scale: float, offset: float, shown_scale: float, shown_offset: float, c0: float) -> bool:
    """Whether an instance's model is to be shown anew: its scale moved past ``SHOW_TOLERANCE`` in
    log, or its offset (a prefill's line, ``forward_fit.py``; 0 elsewhere) by that share of the
    fixed cost it adds to (``c0`` + the offset shown)."""
    return abs(math.log(scale / shown_scale)) >= SHOW_TOLERANCE or \
        abs(offset - shown_offset) > SHOW_TOLERANCE * (c0 + shown_offset)
