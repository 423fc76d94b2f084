"""Work the other conductors sent to an instance, learned from its heartbeats (several conductors).

A conductor counts its own dispatches at once (``membership.py``), but with several conductors
an instance also runs what the others sent it. Its heartbeat says its whole load: a prefill its
queued tokens, a decode its running and waiting requests and their context. What exceeds the
conductor's own record is the others' work, shown in the instance's scheduler view as stand-in
jobs named ``(other conductors)``: one queued prefill of those tokens at the end of the queue, or
that many requests in the decode batch, each with its share of the extra context. They are
replaced at each heartbeat, so they trail the others' dispatches by a heartbeat at most (the tie
order of ``membership.py`` spreads what lands between two heartbeats). Off with one conductor:
there the difference is only heartbeat timing, which would perturb decisions for nothing.
"""

from __future__ import annotations

from mooncake_lite.conductor.cluster.membership import Instance
from mooncake_lite.scheduler import DecodeView, PrefillView

OTHERS = "(other conductors)"
MAX_STAND_INS = 1024   # a decode's stand-ins at most (a heartbeat claiming more is still bounded)


def show(inst: Instance, now: float) -> None:
    """Replace ``inst``'s stand-in jobs by what its last heartbeat says the others sent it."""
    if isinstance(inst.view, PrefillView):
        _show_prefill(inst.view, inst.load.queued_tokens, now)
    elif isinstance(inst.view, DecodeView):
        load = inst.load
        _show_decode(inst.view, (load.num_running or 0) + (load.num_waiting or 0), load.context_tokens or 0, now)


def _show_prefill(view: PrefillView, reported_tokens: float | None, now: float) -> None:
    view.remove(OTHERS)
    queue = view.state().queue
    extra = int(reported_tokens or 0) - sum(j.num_tokens for j in queue)
    if extra > 0:
        view.add(OTHERS, extra)
        queue = view.state().queue
    if queue and queue[0].started_at is None:
        view.start(queue[0].request_id, now)   # a removed stand-in may have been the head


def _show_decode(view: DecodeView, reported: float, reported_context: float, now: float) -> None:
    state = view.state()
    for job in state.running:
        if job.request_id.startswith(OTHERS):
            view.leave(job.request_id)
    state = view.state()
    extra = min(int(reported) - len(state.running) - len(state.incoming), MAX_STAND_INS)
    if extra <= 0:
        return
    own_context = sum(r.context_tokens for r in state.running)
    each = max(1, int(reported_context - own_context) // extra)
    for k in range(extra):
        view.join(f"{OTHERS} {k}", each, now)
