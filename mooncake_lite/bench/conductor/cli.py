"""``mooncake bench conductor``: how long the conductor takes to decide, and (live part) what it
adds to a request's latency.

Parts are registered in :data:`PARTS` (name -> its module: ``FLAGS``, ``run``, ``render``); each
``run(options)`` returns a flat dict of figures. ``--parts`` picks some; ``--json`` prints all figures as one object.
The ``decision`` part times the scheduler on a synthetic cluster: 16 prefill + 16 decode
instances, one million indexed 16-byte block keys, a 64-block request (targets: median
≤ 200 µs, p99 ≤ 1 ms), in three cases: ``conductor`` — the live conductor's own path (its
Membership snapshot plus the decision, in a steady state where every decision is dispatched and
prefills end, requests finish and tokens are generated between decisions; see
:mod:`steady`), the figure the targets are for; ``warm`` — the core alone on an
unchanged snapshot (the best case); ``fresh`` — the core alone with a ``FromScratch``
estimate cache (the worst case: nothing derived is reused). The live-API part (conductor's
added latency) plugs in the same way.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from mooncake_lite.bench.conductor import decision, live
from mooncake_lite.bench.options import add_flags, freeze
from mooncake_lite.bench.report import emit

# name -> its module: FLAGS (its own argument group), run(options) -> flat figures, render(figures)
PARTS = {"decision": decision, "live": live}


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mooncake bench conductor",
        description="Scheduling decision time (and, where available, the live API's added latency).")
    parser.add_argument("--json", action="store_true", help="print all figures as one JSON object")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run (available: {', '.join(PARTS)})")
    for name, part in PARTS.items():
        add_flags(parser.add_argument_group(name), part.FLAGS)
    args = freeze(parser.parse_args(list(argv)), "ConductorOptions")
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; available: {', '.join(PARTS)}")
    figures: dict = {}
    for name in names:
        part = PARTS[name].run(args)
        figures.update({f"{name}.{k}": v for k, v in part.items()})
        if not args.json:
            emit(part, PARTS[name].render, as_json=False)
    if args.json:
        emit(figures, str, as_json=True)
    return 0
