"""Snapshots of a fixed list of instance views: their states as one tuple, rebuilt only at the
views that went stale, and what changed since the snapshot before.

A view (``view.PrefillView``, ``view.DecodeView``) marks its row stale at each event; a
:class:`StateTuple` rebuilds just those rows at the next :meth:`StateTuple.states`, so a
snapshot of N instances of which k changed costs O(k) Python calls and one tuple copy. It keeps
the latest :class:`Snapshot`: the states, the views they are of and the rows that hold another
object than the snapshot before — what the estimate cache's wide tables read (when it follows
the tuple: ``EstimateCache.follow``) to rewrite just those rows, instead of comparing every
entry (``wide.changed_rows``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from mooncake_lite.scheduler.state import DecodeInstanceState, PrefillInstanceState

# The state a view builds. A type parameter, not a union narrowed in each view: the compiled
# build (mypyc) wants one declared type for an attribute across a class and its subclasses.
S = TypeVar("S", PrefillInstanceState, DecodeInstanceState)


class Shown(Generic[S]):
    """What both views share: the state last built (None: build it at the next ``state()``)
    and the :class:`StateTuple` row to mark when it goes stale."""

    _state: S | None = None
    _watch: tuple[set[int], int] | None = None
    # admission's bound on the instance's prediction error (state.py's queue_spread / tbt_spread)
    spread: float = 1.0

    def state(self) -> S:
        raise NotImplementedError

    def set_spread(self, spread: float) -> None:
        """What the owner's online correction measured of this instance's prediction error
        (``Corrections.spread``): its states show it from now on."""
        if spread != self.spread:
            self.spread = spread
            self._stale()

    def _stale(self) -> None:
        self._state = None
        watch = self._watch
        if watch is not None:
            watch[0].add(watch[1])


class Snapshot:
    """The states of a :class:`StateTuple`'s views at one time (``states``: what a
    ``ClusterState`` holds), the views, and the rows whose state is another object than in
    ``previous`` (the states of the snapshot before; None for the first). Not changed once made."""

    __slots__ = ("states", "views", "previous", "changed")

    def __init__(self, states: tuple, views: list[Shown], previous: tuple | None, changed: list[int]) -> None:
        self.states = states
        self.views = views
        self.previous = previous
        self.changed = changed


class StateTuple(Generic[S]):
    """The states of a fixed list of views as one tuple (module doc). A view belongs to one
    StateTuple."""

    def __init__(self, views: Iterable[Shown[S]]) -> None:
        self._views: list[Shown] = list(views)
        self._stale: set[int] = set()
        for i, view in enumerate(self._views):
            view._watch = (self._stale, i)
        self._states = [view.state() for view in self._views]
        self.last = Snapshot(tuple(self._states), self._views, None, [])

    def states(self) -> tuple[S, ...]:
        if self._stale:
            states, views = self._states, self._views
            changed = list(self._stale)       # a stale view builds a new state object
            for i in changed:
                states[i] = views[i].state()
            self._stale.clear()
            self.last = Snapshot(tuple(states), views, self.last.states, changed)
        return self.last.states
