"""The wide decode table: the decode pick (scheduler/rules.py) over rows of arrays, for wide
clusters (scheduler/wide.py says why and how the rows stay exact: the same IEEE-754 operations
in the same order as ``admission.choose_decode``'s loop, ties to the earliest row)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from mooncake_lite.scheduler import rules
from mooncake_lite.scheduler.costs import DecodeCostModel
from mooncake_lite.scheduler.snapshot import Shown, Snapshot
from mooncake_lite.scheduler.state import DecodeInstanceState, ScheduleRequest
from mooncake_lite.scheduler.view import DecodeView
from mooncake_lite.scheduler.wide import changed_rows

_INF = float("inf")
_new = tuple.__new__   # a NamedTuple without its constructor's Python frame (estimate.py)
_NO_VIEWS: list[Shown] = []


class DecodeTable:
    """Per decode instance: the parts of its predicted TBT with one more request that do not
    depend on the request (``c0 + c1·(batch + 1)``), its context and context coefficient,
    whether its batch has room, and its context room (+inf where unlimited)."""

    def __init__(self) -> None:
        self.decodes: Sequence[DecodeInstanceState] = ()
        self.default: DecodeCostModel | None = None
        self._resize(0)

    def _resize(self, n: int) -> None:
        # batch, a copy of context and the context room are Python lists: read for the chosen
        # row, or only when a request may not fit (an array's item costs more to write)
        self.batch: list[int] = [0] * n
        self.context = np.zeros(n, dtype=np.int64)
        self.context_list: list[int] = [0] * n
        self.base, self.c2 = np.zeros(n), np.zeros(n)
        self.context_room: list[float] = [0.0] * n
        self.batch_room = np.zeros(n, dtype=bool)
        # c2 and batch_room as last written, as Python values: most writes change neither
        self._row_c2: list[float | None] = [None] * n
        self._row_room: list[bool | None] = [None] * n
        # what each row was last written from: a request joining its batch (its KV arrived)
        # moves it from incoming to running, a new state with the same load, so nothing to write
        self._row_from: list[tuple | None] = [None] * n
        # rows whose TBT may come out <= 0 (base <= 0, c2 < 0 or a negative context): without
        # any, the clamp at 0 changes nothing and is skipped
        self.may_clamp: set[int] = set()
        self.full: set[int] = set()     # rows whose batch has no room
        # at most the smallest context room (lowered as rows are written, made exact again only
        # when a request needs more): a request within it fits every row without a min over them
        self.room_floor = _INF

    def update(self, decodes: Sequence[DecodeInstanceState], default: DecodeCostModel,
               load: Callable[[DecodeInstanceState], tuple[int, int]], snapshot: Snapshot | None = None) -> None:
        """Rewrite the rows of the instances whose state changed (``load(d)``: its load now,
        through the cache; a snapshot's own view's load, kept at its events, where it is of
        this very state; ``snapshot``: the one ``decodes`` may be the states of)."""
        rows: Sequence[int] | None = None if default is not self.default \
            else changed_rows(decodes, self.decodes, snapshot)
        if rows is None:
            self._resize(len(decodes))
            rows, self.default = range(len(decodes)), default
        views = snapshot.views if snapshot is not None and snapshot.states is decodes else _NO_VIEWS
        for i in rows:
            d = decodes[i]
            view = views[i] if views else None
            shown = view.load if isinstance(view, DecodeView) else None
            if shown is not None and shown.state is d:
                batch, context = shown.batch_size, shown.context_tokens
            else:
                batch, context = load(d)
            model = d.cost or default
            written = (batch, context, model, d.max_batch_size, d.max_context_tokens)
            if written != self._row_from[i]:
                self._row_from[i] = written
                self._write(i, d, batch, context, model)
        self.decodes = decodes

    def _write(self, i: int, d: DecodeInstanceState, batch: int, context: int, model: DecodeCostModel) -> None:
        """Row i from instance ``d`` holding ``batch`` sequences of ``context`` tokens now."""
        self.batch[i], self.context[i], self.context_list[i] = batch, context, context
        self.base[i] = base = model.c0 + model.c1 * (batch + 1)     # DecodeCostModel.predict's first terms
        c2 = model.c2
        if self._row_c2[i] != c2:      # the row's model changed (rare): else c2 is written
            self._row_c2[i] = self.c2[i] = c2
        if not (base > 0.0 and c2 >= 0.0 and context >= 0):
            self.may_clamp.add(i)
        elif self.may_clamp:
            self.may_clamp.discard(i)
        room = rules.decode_has_room(d.max_batch_size, None, batch, context, 0)
        if room is not self._row_room[i]:
            self._row_room[i] = self.batch_room[i] = room
            if room:
                self.full.discard(i)
            else:
                self.full.add(i)
        if d.max_context_tokens is not None:
            self.context_room[i] = left = d.max_context_tokens - context
            self.room_floor = left if left < self.room_floor else self.room_floor
        else:
            self.context_room[i] = _INF

    def choose_now(self, req: ScheduleRequest) -> DecodeRow | None:
        """The decode pick (scheduler/rules.py: the smallest TBT of the rows with room) on the
        loads now, or None when the loop must decide (no row with room, or only infinite TBTs,
        where the loop's first-eligible rule applies). The TBT is ``DecodeCostModel.predict`` with the request
        added, its request-free part (``base``) kept per row; the room is
        :func:`rules.decode_has_room` with ``context + need <= max_context`` asked as
        ``need <= max_context - context`` (integers: exact either way)."""
        tbt = self.c2 * (self.context + req.num_tokens)
        tbt += self.base                  # in place: base + x is x + base
        if self.may_clamp or req.num_tokens < 0:   # else each TBT is base > 0 plus c2 >= 0 times a count >= 0
            tbt = np.where(tbt > 0.0, tbt, 0.0)
        key = tbt
        need = req.num_tokens + req.max_output_tokens
        if need > self.room_floor:
            self.room_floor = min(self.context_room)
        if self.full or need > self.room_floor:     # else every row has room (the usual case)
            key = np.where(self.batch_room & (need <= np.array(self.context_room, dtype=np.float64)), key, _INF)
        i = int(key.argmin())
        if not float(key[i]) < _INF:
            return None
        return _new(DecodeRow, (i, float(tbt[i]), self.batch[i] + 1, self.context_list[i] + req.num_tokens))


class DecodeRow(NamedTuple):
    """The decode pick over a table's rows: the row, its predicted TBT with the request added,
    and its batch size and context tokens including the request."""

    row: int
    tbt_s: float
    batch_size: int
    context_tokens: int
