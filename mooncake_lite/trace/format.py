"""The standard Mooncake trace format (JSON lines, as released with the FAST'25 paper).

One request per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}

``timestamp`` is milliseconds from the start of the trace, ``hash_ids`` holds one id per
block of ``block_size`` (512) input tokens, the last one possibly partial, so
``len(hash_ids) == ceil(input_length / block_size)``. Equal ids mean equal block *and* equal
prefix, exactly like the chained keys of :mod:`mooncake_lite.common.hashing`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import repeat
from pathlib import Path

import orjson

TRACE_BLOCK_SIZE = 512


class TraceError(ValueError):
    """A trace line that is not a valid Mooncake request (message names file and line)."""


@dataclass(slots=True, unsafe_hash=True)
class TraceRequest:
    """One request of a trace. ``request_id`` is the 0-based line order after sorting by time.
    Read-only by contract, not ``frozen``: a frozen dataclass sets each field through
    ``object.__setattr__``, and a simulation builds one per line of a million-line trace."""
    request_id: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def arrival_s(self) -> float:
        return self.timestamp_ms / 1000.0

    def to_json(self) -> dict:
        ts = self.timestamp_ms
        return {"timestamp": int(ts) if float(ts).is_integer() else ts, "input_length": self.input_length,
                "output_length": self.output_length, "hash_ids": list(self.hash_ids)}


def _parse_line(raw: bytes, path: object, lineno: int, block_size: int,
                strict_blocks: bool) -> tuple[float, int, int, tuple]:
    """One line's fields, checked. ``path:lineno`` is formatted only into an error's message
    (a million-line trace is read per line)."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise TraceError(f"{path}:{lineno}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
    try:
        ts, n_in, n_out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
    except KeyError as exc:
        raise TraceError(f"{path}:{lineno}: missing field {exc.args[0]!r}") from None
    if not isinstance(ts, (int, float)) or ts < 0:
        raise TraceError(f"{path}:{lineno}: timestamp must be a non-negative number of ms, got {ts!r}")
    if not isinstance(n_in, int) or n_in < 1 or not isinstance(n_out, int) or n_out < 1:
        raise TraceError(f"{path}:{lineno}: input_length and output_length must be positive integers")
    if not isinstance(ids, list) or not all(map(isinstance, ids, repeat(int))):
        raise TraceError(f"{path}:{lineno}: hash_ids must be a list of integers")
    if strict_blocks and len(ids) != math.ceil(n_in / block_size):
        raise TraceError(f"{path}:{lineno}: {len(ids)} hash_ids for {n_in} tokens; expected "
                         f"ceil({n_in}/{block_size}) = {math.ceil(n_in / block_size)}")
    return float(ts), n_in, n_out, tuple(ids)


def read_trace(path: str | Path, *, speed: float = 1.0, limit: int | None = None,
               block_size: int = TRACE_BLOCK_SIZE, strict_blocks: bool = True) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace, sorted by arrival, with timestamps divided by ``speed``.

    Blank lines are skipped; any malformed line raises :class:`TraceError` naming the line.
    ``limit`` keeps the first N requests (by time). ``strict_blocks=False`` accepts traces whose
    ``hash_ids`` do not cover the input exactly (some third-party traces).
    """
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    rows = []
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if raw.strip():
                rows.append(_parse_line(raw, path, lineno, block_size, strict_blocks))
    rows.sort(key=lambda r: r[0])  # stable: equal timestamps keep file order
    if limit is not None:
        rows = rows[:limit]
    return [TraceRequest(i, ts / speed, n_in, n_out, ids) for i, (ts, n_in, n_out, ids) in enumerate(rows)]


def iter_trace(path: str | Path, *, speed: float = 1.0, limit: int | None = None,
               block_size: int = TRACE_BLOCK_SIZE, strict_blocks: bool = True) -> Iterator[TraceRequest]:
    """:func:`read_trace`'s requests one at a time, holding one line: for traces larger than
    memory (a simulation reads it as it goes). The file must already be in time order, as the
    FAST'25 release files and ``trace synth`` output are: a timestamp earlier than the one
    before raises :class:`TraceError` naming the line (sort it with ``read_trace``/``write_trace``)."""
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    count, last = 0, 0.0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if limit is not None and count >= limit:
                return
            if raw.isspace():     # blank (bytes.strip's whitespace), without a stripped copy per line
                continue
            ts, n_in, n_out, ids = _parse_line(raw, path, lineno, block_size, strict_blocks)
            if ts < last:
                raise TraceError(f"{path}:{lineno}: timestamp {ts:g} ms is earlier than the line before "
                                 f"({last:g} ms); streaming needs a trace in time order")
            last = ts
            yield TraceRequest(count, ts / speed, n_in, n_out, ids)
            count += 1


def scale_time(requests: Sequence[TraceRequest], speed: float) -> list[TraceRequest]:
    """The same requests replayed ``speed`` times faster (``speed=2`` halves every timestamp)."""
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    return [replace(r, timestamp_ms=r.timestamp_ms / speed) for r in requests]


def spread_arrivals(requests: Sequence[TraceRequest], resolution_ms: float, seed: int = 0) -> list[TraceRequest]:
    """The requests of a trace whose timestamps were rounded down to ``resolution_ms``, each moved
    to a uniform random point of its interval (seeded), in the new time order and numbered in it.

    The FAST'25 conversation trace's timestamps are multiples of about 3 s (0, 3000, 5999, 9000 ...):
    replayed as recorded, the ten requests of a 3-second interval leave at the same instant, a
    burst nobody sent. That is a real case too (an agent fanning out), and it is the one where
    a prediction made at arrival can know least (which of the burst lands first is chance), so a
    replay says which it ran: ``bench replay --arrival-spread``. ``resolution_ms`` 0: unchanged."""
    if resolution_ms < 0 or resolution_ms != resolution_ms:
        raise ValueError(f"the arrival spread must be a duration >= 0, got {resolution_ms!r}")
    if resolution_ms == 0:
        return list(requests)
    rng = random.Random(seed)
    moved = sorted(((r.timestamp_ms + rng.random() * resolution_ms, r) for r in requests), key=lambda p: p[0])
    return [replace(r, request_id=i, timestamp_ms=t) for i, (t, r) in enumerate(moved)]


def write_trace(requests: Iterable[TraceRequest], path: str | Path) -> int:
    """Write requests in the standard format; returns how many were written."""
    count = 0
    with open(path, "wb") as fh:
        for req in requests:
            fh.write(orjson.dumps(req.to_json()) + b"\n")
            count += 1
    return count
