"""The views' snapshot tuple, in a module of its own: the compiled build (``sim/compiled.py``)
compiles ``view.py``, and mypyc cannot compile a subclass of a builtin such as ``tuple``, so
this one class stays interpreted (``view.py`` re-exports it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:     # (view.py builds snapshots: no import at run time, no cycle)
    from mooncake_lite.scheduler.view import DecodeView, PrefillView


class Snapshot(tuple):
    """A tuple of states that knows which positions hold another object than the snapshot
    before it (``previous``; one link only, so older snapshots are freed): a reader that kept the
    previous snapshot rewrites what it derived from just those rows instead of comparing every
    entry (``wide._changed_rows``)."""

    previous: tuple | None = None
    changed: list[int] = []
    # the views the states are of, in order: what a view keeps at its events besides its state
    # (DecodeView.load) is read from it directly by the wide tables
    views: list[PrefillView | DecodeView] = []
