"""numpy forms of a decision's per-instance loops, for wide clusters.

A decision reads every instance. At 128 prefill + 128 decode instances the Python loops of
:func:`~mooncake_lite.scheduler.estimate.queues_at`,
:func:`~mooncake_lite.scheduler.prefill_select.choose_prefill` and the decode choice cost about
a microsecond per instance each, so the decision grows with the cluster. Here each instance's
inputs are a row of a few arrays that the estimate cache keeps in step with the snapshots (only
the rows of instances whose state object changed are rewritten: a C-level identity scan finds
them), and a decision is a few dozen array operations whatever the width.

Exact, not approximate: every array expression performs the same IEEE-754 double operations in
the same order as the Python code it stands for (numpy's elementwise ``+ - * /`` round exactly as
Python floats do, and the int64 → float64 conversions of the token and block counts here are
exact), and ties go to the earliest instance (``argmin`` returns the first minimum), so the
decision is the same either way — tests/scheduler/test_wide.py drives both on random histories.
Below :data:`WIDE_MIN_INSTANCES` instances numpy's fixed cost per call is more than the loops
cost, and the loops run.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from itertools import compress, count
from operator import is_not

import numpy as np

from mooncake_lite.scheduler import rules
from mooncake_lite.scheduler.block_index import PrefixMatch
from mooncake_lite.scheduler.config import SchedulerConfig
from mooncake_lite.scheduler.costs import CostModels, PrefillCostModel, transfer_seconds
from mooncake_lite.scheduler.estimate import Backlog
from mooncake_lite.scheduler.state import PrefillInstanceState, ScheduleRequest
from mooncake_lite.scheduler.snapshot import Shown, Snapshot
from mooncake_lite.scheduler.prefill_view import PrefillView

# Instances of one role from which a decision uses the arrays (measured: at 16 the loops win,
# at 48 the arrays do; tests set it to 1).
WIDE_MIN_INSTANCES = 48

_INF = float("inf")
_NO_HEAD = (0.0, _INF)      # a queue with no started job (or several: costed in Python)
_NO_VIEWS: list[Shown] = []
# What a row holds between a resize and its write (update writes every row right after a
# resize, so no decision reads it): an empty queue, so the list is of Backlogs only.
_UNWRITTEN = Backlog((), PrefillCostModel(), [], [], (), ())


def changed_rows(new: Sequence, old: Sequence, snapshot: Snapshot | None = None) -> list[int] | None:
    """Positions whose entry is another object (None: the two differ in length). The
    ``snapshot`` of ``new`` taken right after ``old`` says which itself (the simulator's
    snapshots); any other pair is compared entry by entry (the live conductor's)."""
    if new is old:
        return []
    if snapshot is not None and snapshot.states is new and snapshot.previous is old:
        return snapshot.changed
    if len(new) != len(old):
        return None
    return list(compress(count(), map(is_not, new, old)))


def _same_ids(new: Sequence, old: Sequence, rows: Sequence[int]) -> bool:
    """Whether each of ``rows`` is the same instance in both (a loop: a generator per decision
    costs more than the two rows it usually checks)."""
    for i in rows:
        if new[i].instance_id != old[i].instance_id:
            return False
    return True


class PrefillTable:
    """Per prefill instance: its backlog's total predicted work, its started head job
    (duration, start; start +inf when none has started), its fetch bandwidth and which of the
    distinct cost models it has. Instances with more than one started job (rare) are costed
    in Python. A snapshot's row whose view priced its own queue (``PrefillView.row``: its
    total and started head, kept as jobs came and went) is written from that, its backlog
    derived only if a decision reads it (:meth:`row_backlogs`)."""

    def __init__(self) -> None:
        self.prefills: Sequence[PrefillInstanceState] = ()   # what the rows were written from
        self.costs: CostModels | None = None
        self._backlog: Callable[[PrefillInstanceState, PrefillCostModel], Backlog] | None = None
        self._resize(0)

    def _resize(self, n: int) -> None:
        self.backlogs: list[Backlog] = [_UNWRITTEN] * n
        self._unbuilt: set[int] = set()    # rows written from a view's row: backlog not derived yet
        self.total, self.head_d, self.head_s, self.bw = (np.zeros(n) for _ in range(4))
        self.model_of = np.zeros(n, dtype=np.intp)     # row -> position in self.models
        self._row_model: list[PrefillCostModel | None] = [None] * n   # the model each row was written with
        # each row's (head duration, start) and bandwidth as last written: most rewrites change neither
        self._row_head: list[tuple[float, float] | None] = [None] * n
        self._row_bw: list[float | None] = [None] * n
        self.models: list[PrefillCostModel] = []
        self._model_pos: dict[int, int] = {}           # id(model) -> position in self.models
        self.multi: set[int] = set()
        self.packing: set[int] = set()   # rows whose instance packs its queue (prefill batching)
        self.positions: dict[Hashable, list[int]] = {}   # store id -> its rows
        self.odd_bw: set[int] = set()    # rows whose fetch bandwidth is not the cluster default
        self.queue_scale = np.ones(n)    # each row's PrefillInstanceState.queue_scale
        self.odd_scale: set[int] = set()     # the rows whose queue_scale is not 1
        # id(list of stores of a PrefixMatch run) -> (that list, its stores' rows): a hot prefix's
        # holders are the same list on every request for it (block_index.PrefixMatch.runs)
        self._run_rows: dict[int, tuple[list[Hashable], np.ndarray]] = {}

    def update(self, prefills: Sequence[PrefillInstanceState], costs: CostModels,
               backlog: Callable[[PrefillInstanceState, PrefillCostModel], Backlog],
               snapshot: Snapshot | None = None) -> None:
        """Rewrite the rows of the instances whose state changed since the last call
        (``backlog(p, model)`` derives one instance's backlog, through the cache; ``snapshot``:
        the one ``prefills`` may be the states of, naming the rows that changed and the views)."""
        rows: Sequence[int] | None = None if costs is not self.costs \
            else changed_rows(prefills, self.prefills, snapshot)
        old, moved = self.prefills, False
        if rows is None or not _same_ids(prefills, old, rows) \
                or len(self.models) > 2 * len(prefills) + 8:     # models nobody uses any more
            self._resize(len(prefills))
            rows, moved, self.costs = range(len(prefills)), True, costs
        self._backlog = backlog
        views = snapshot.views if snapshot is not None and snapshot.states is prefills else _NO_VIEWS
        for i in rows:
            p = prefills[i]
            moved = moved or old[i].store_id != p.store_id
            view = views[i] if views else None
            self._write(i, p, costs, backlog, view if isinstance(view, PrefillView) else None)
        if moved:
            self._run_rows = {}
            self.positions = {}
            for i, p in enumerate(prefills):
                self.positions.setdefault(p.store_id, []).append(i)
        self.prefills = prefills

    def _write(self, i: int, p: PrefillInstanceState, costs: CostModels,
               backlog: Callable[[PrefillInstanceState, PrefillCostModel], Backlog], view: PrefillView | None) -> None:
        model = p.cost or costs.prefill
        pack, head = self._write_work(i, p, model, costs, backlog, view)
        if pack:     # packed, or shortest-first order: priced where it lands, in the loop
            self.packing.add(i)
        elif self.packing:
            self.packing.discard(i)
        if head != self._row_head[i]:     # a queue's head runs on while jobs join behind it
            self._row_head[i] = head
            self.head_d[i], self.head_s[i] = head
        if self._row_model[i] is not model:     # else its model's position stands
            self._row_model[i] = model
            pos = self._model_pos.get(id(model))
            if pos is None or self.models[pos] is not model:
                pos = self._model_pos[id(model)] = len(self.models)
                self.models.append(model)
            self.model_of[i] = pos
        q = p.queue_scale if p.queue else 1.0      # (as its backlog's: estimate.Backlog)
        if q != self.queue_scale[i]:
            self.queue_scale[i] = q
            if q == 1.0:
                self.odd_scale.discard(i)
            else:
                self.odd_scale.add(i)
        bw = p.bandwidth_bytes_per_s or costs.bandwidth_bytes_per_s
        if bw != self._row_bw[i]:
            self._row_bw[i] = self.bw[i] = bw
            if bw == costs.bandwidth_bytes_per_s:
                self.odd_bw.discard(i)
            else:
                self.odd_bw.add(i)

    def _write_work(self, i: int, p: PrefillInstanceState, model: PrefillCostModel, costs: CostModels,
                    backlog: Callable[[PrefillInstanceState, PrefillCostModel], Backlog],
                    view: PrefillView | None) -> tuple[int, tuple[float, float]]:
        """Row i's queued work (its total, and whether more than one job started): from its view's
        own pricing of this very state, else from its backlog. Returns (whether the instance
        packs or serves shortest first, its started head's (duration, start))."""
        row = None
        if view is not None:
            row = view.row
            if row is None or row.model is not model:
                view.price_with(costs.prefill)    # (once: it then prices its jobs as they come)
                row = view.row
        if row is not None and row.state is p and row.model is model:   # its view priced this very state
            self.total[i] = row.total_s
            self._unbuilt.add(i)
            if self.multi:
                self.multi.discard(i)
            # (a view prices only one job a forward)
            return p.overtakes, _NO_HEAD if row.started_head is None else row.started_head
        b = self.backlogs[i] = backlog(p, model)
        if self._unbuilt:
            self._unbuilt.discard(i)
        self.total[i] = b.cumulative_s[-1] if b.cumulative_s else 0.0
        started = b.started
        num_started = len(started)
        if num_started > 1:
            self.multi.add(i)
        elif self.multi:                     # (the sets are empty on most clusters: no call)
            self.multi.discard(i)
        return b.pack_tokens or p.overtakes, started[0] if num_started == 1 else _NO_HEAD

    def row_backlogs(self) -> list[Backlog]:
        """Every row's backlog, those of rows written from a view's row derived now (through the
        estimate cache, as the other rows were)."""
        if self._unbuilt:
            costs, backlog, prefills = self.costs, self._backlog, self.prefills
            assert costs is not None and backlog is not None, "rows are written before they are read"
            for i in self._unbuilt:
                p = prefills[i]
                self.backlogs[i] = backlog(p, p.cost or costs.prefill)
            self._unbuilt.clear()
        return self.backlogs

    def run_rows(self, stores: list[Hashable]) -> np.ndarray:
        """The rows of ``stores`` (a list from a PrefixMatch's ``runs``), found once per list."""
        kept = self._run_rows.get(id(stores))
        if kept is not None:
            return kept[1]
        if len(self._run_rows) >= 1 << 12:
            self._run_rows.clear()
        positions = self.positions
        rows = np.array([row for store in stores for row in positions.get(store, ())], dtype=np.intp)
        self._run_rows[id(stores)] = (stores, rows)    # the list is kept alive: its id stays its own
        return rows

    def queues_at(self, now: float) -> RowQueues:
        """:func:`~mooncake_lite.scheduler.estimate.queues_at` of the rows. A started job counts as done for its elapsed time, never more than its
        duration; an empty queue has no started job and a total of 0; a row's work left is waited
        for its ``queue_scale`` times."""
        done = now - self.head_s          # then clamped in place: no temporaries (the same values)
        np.maximum(done, 0.0, out=done)
        np.minimum(done, self.head_d, out=done)
        queue = self.total - done
        for i in self.multi:
            b, d = self.backlogs[i], 0.0
            for duration, started_at in b.started:
                elapsed = now - started_at
                if elapsed > 0.0:
                    d += duration if elapsed > duration else elapsed
            done[i], queue[i] = d, b.cumulative_s[-1] - d
        if self.odd_scale:
            queue *= self.queue_scale
        return RowQueues(self, done, queue)

    def predict(self, num_tokens: int, num_prefix_tokens: int, rows: np.ndarray | None = None) -> float | np.ndarray:
        """Each row's model's prediction for one prompt (of ``rows`` only, when given): one call
        of the formula (:meth:`PrefillCostModel.predict`) per distinct model, spread over the
        rows; one float when every row has the same model (instances of the same hardware share
        one). A cluster of per-instance models (live instances profile themselves) pays a call
        per row: asked for a few held rows, only theirs."""
        models = self.models
        if len(models) == 1:
            return models[0].predict(num_tokens, num_prefix_tokens)
        if rows is not None and len(rows) < len(models):
            return np.array([models[m].predict(num_tokens, num_prefix_tokens) for m in self.model_of[rows].tolist()])
        predicted = np.array([m.predict(num_tokens, num_prefix_tokens) for m in models])[self.model_of]
        return predicted if rows is None else predicted[rows]


class RowQueues:
    """:class:`~mooncake_lite.scheduler.estimate.QueuesAt` of a table's rows at one ``now``, its
    two lists made from the arrays only when read: a wide decision on the kvcache-centric path
    reads only the chosen row's queue time (from the array), and building 2 × 128 floats on
    every request cost more than the choice itself. The backlogs too are copied from the
    table only when read (and those of rows written from a view's own row derived then): it
    holds within the decision that made this (the table's rows are rewritten only at the next
    decision's start)."""

    __slots__ = ("_table", "_backlogs", "_done", "_queue", "_done_s", "_queue_s")

    def __init__(self, table: PrefillTable, done: np.ndarray, queue: np.ndarray) -> None:
        self._table = table
        self._backlogs: list[Backlog] | None = None
        self._done, self._queue = done, queue
        self._done_s: list[float] | None = None
        self._queue_s: list[float] | None = None

    @property
    def backlogs(self) -> list[Backlog]:
        if self._backlogs is None:
            self._backlogs = list(self._table.row_backlogs())
        return self._backlogs

    @property
    def done_s(self) -> list[float]:
        if self._done_s is None:
            self._done_s = self._done.tolist()
        return self._done_s

    @property
    def queue_s(self) -> list[float]:
        if self._queue_s is None:
            self._queue_s = self._queue.tolist()
        return self._queue_s

    @property
    def scaled(self) -> bool:
        return bool(self._table.odd_scale)

    @property
    def packing(self) -> bool:
        """Whether an instance packs its queue or serves it shortest first (either is priced
        where the request lands, by the loop)."""
        return bool(self._table.packing)

    def queue_at(self, i: int) -> float:
        return float(self._queue[i])

    def kvcache_row(self, req: ScheduleRequest, match: PrefixMatch, cfg: SchedulerConfig,
                    costs: CostModels) -> tuple[int, int, bool] | None:
        """Algorithm 1 over the rows (:func:`choose_prefill_row`)."""
        return choose_prefill_row(req, self._table, self._queue, match, cfg, costs)


def choose_prefill_row(req: ScheduleRequest, table: PrefillTable, queue: np.ndarray,
                       match: PrefixMatch, cfg: SchedulerConfig, costs: CostModels) -> tuple[int, int, bool] | None:
    """Algorithm 1 over the rows, by its rules (scheduler/rules.py): (row, its local prefix
    blocks, whether it fetches the best prefix), or None when no key is below infinity (the
    loop then decides). Every row is first keyed as holding none of the prefix (fetch it all,
    or compute it all when nothing is cached), then the rows whose store holds some of it are
    keyed again, a run of stores with the same length at a time (one branch of the rule each;
    a hot prefix may be on most stores). A prediction the same for all rows (one model) and the
    default bandwidth (none measured, none of an instance's own) are one Python float each (the
    double the arrays would hold)."""
    best_len, block_size, num_tokens = match.best_len, cfg.block_size, req.num_tokens
    latency_s, block_bytes, key_of = costs.transfer_latency_s, block_size * costs.kv_bytes_per_token, rules.prefill_cost_key
    if not best_len:
        key = key_of(0.0, queue, table.predict(num_tokens, 0))
    else:
        fetched = table.predict(num_tokens, best_len * block_size)
        bw: float | np.ndarray = costs.bandwidth_bytes_per_s if not table.odd_bw \
            and not (costs.links is not None and costs.links.from_source(match.best_store_id)) \
            else _measured_bw(table, costs, match.best_store_id)
        key = key_of(transfer_seconds(best_len * block_bytes, bw, latency_s), queue, fetched)
        for local, rows in _held_runs(table, match):
            if rules.fetches_best_prefix(local, best_len, cfg.kvcache_balancing_threshold):
                transfer = transfer_seconds((best_len - local) * block_bytes, _at(bw, rows), latency_s)
                key[rows] = key_of(transfer, queue[rows], _at(fetched, rows))
            else:
                key[rows] = key_of(0.0, queue[rows], table.predict(num_tokens, local * block_size, rows))
    i = int(key.argmin())           # the method: np.argmin adds two Python frames per call
    if not float(key[i]) < _INF:     # all infinite, or a NaN the loop would have skipped
        return None
    local_i = match.length_at(table.prefills[i].store_id)
    return i, local_i, rules.fetches_best_prefix(local_i, best_len, cfg.kvcache_balancing_threshold)


def _at(value: float | np.ndarray, rows: np.ndarray) -> float | np.ndarray:
    """A per-row value's ``rows``; one for every row (a float) as it is."""
    return value[rows] if isinstance(value, np.ndarray) else value


def _measured_bw(table: PrefillTable, costs: CostModels, source: Hashable) -> np.ndarray:
    """The rows' fetch bandwidths, with the measured speed from ``source`` to a row's store in
    place of its instance's or the default one (costs.links; the table itself never holds
    these: they change without any instance's state changing)."""
    measured = costs.links.from_source(source) if costs.links is not None else None
    if not measured:
        return table.bw
    bw, positions = table.bw.copy(), table.positions
    for dest, speed in measured.items():
        rows = positions.get(dest)
        if rows and speed:
            bw[rows] = speed
    return bw


def _held_runs(table: PrefillTable, match: PrefixMatch) -> list[tuple[int, np.ndarray]]:
    """(blocks held, the rows of the stores holding that many) for each length of the prefix
    some store holds: the match's runs (their rows found once per run's list), or its lengths
    grouped (a match made without runs). A list, not a generator: compiled, a generator's
    object and resumptions cost more than the few runs it yields."""
    held_runs = []
    if match.runs or not match.lengths:
        for local, stores in match.runs:
            rows = table.run_rows(stores)
            if rows.size:
                held_runs.append((local, rows))
        return held_runs
    by_length: dict[int, list[int]] = {}
    positions = table.positions
    for store_id, length in match.lengths.items():
        by_length.setdefault(length, []).extend(positions.get(store_id, ()))
    for local, held in by_length.items():
        if held:
            held_runs.append((local, np.array(held, dtype=np.intp)))
    return held_runs
