"""How every benchmark hands back its result: one JSON object (``--json``) or its text, on stdout.

A command's runner returns a plain dict; its ``render`` turns that dict into text. The JSON is
orjson's (integer keys, as ``bench store`` has, become strings), one object on one line, so a
script reads any benchmark the same way.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import orjson

Render = Callable[[dict], str]


def machine(load_before: float) -> dict:
    """A report's ``machine``: its CPUs and the 1-minute load average before (``load_before``, read
    with ``os.getloadavg()[0]`` as the benchmark started) and now, at its end."""
    return {"cpus": os.cpu_count(), "load_avg_1m": load_before, "load_avg_1m_end": os.getloadavg()[0]}


def machine_text(m: dict) -> str:
    """A report's ``machine`` as its text says it."""
    return f"{m['cpus']} CPUs, load {m['load_avg_1m']:.2f} -> {m['load_avg_1m_end']:.2f}"


def emit(result: dict, render: Render, *, as_json: bool) -> None:
    """Print ``result`` as one JSON line, or as ``render(result)``."""
    text = orjson.dumps(result, option=orjson.OPT_NON_STR_KEYS).decode() if as_json else render(result)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def run_and_emit(prog: str, run: Callable[[], dict], render: Render, *, as_json: bool,
                 errors: tuple[type[Exception], ...] = (ValueError, OSError)) -> int:
    """``run()`` then :func:`emit`; one of ``errors`` (a missing model, a bad trace, a refused
    connection) is said on stderr as ``PROG: error: ...`` with exit code 2."""
    try:
        result = run()
    except errors as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return 2
    emit(result, render, as_json=as_json)
    return 0
