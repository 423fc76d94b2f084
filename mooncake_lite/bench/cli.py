"""Dispatch ``mooncake bench NAME`` to ``mooncake_lite.bench.NAME.main(argv)`` (a benchmark that
is a package, like ``replay/``, to its ``cli.main``).

Every benchmark accepts ``--json`` to print all of its figures as one JSON object on stdout.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

BENCHES = {
    "model": "prefill tokens/s and decode step time vs this CPU's matmul peak",
    "store": "store put/get GB/s and latency vs memcpy and blocking-socket loopback; --link RATE: "
             "between two nodes over a shaped link, its share used",
    "pd": "layer-wise overlap, prefix-hit TTFT, CPP, decode tokens/s; --profile for cost models; "
          "--link RATE: prefill and decode on two nodes, share of the transfer hidden",
    "conductor": "scheduling decision time and the conductor's added latency",
    "replay": "replay a Mooncake trace against a live OpenAI-compatible server",
    "sim-scale": "the simulator on a million-request trace at 128P+128D: wall time, peak memory",
    "fidelity": "one trace slice live and simulated with the cluster's own cost model: errors, CDFs",
    "chaos": "kill -9 prefill, decode and store in turn under streaming load: hangs, failures, recovery, leaks",
    "prefix-load": "a prefill's prefix load from a store (shm or TCP): every layer, no compute",
    "kv-compression": "int8/fp8 KV blocks: token agreement, logit error, bytes, store capacity, sim hit rate/TTFT",
}
PACKAGES = {"replay"}


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        out = sys.stdout if (not argv or argv[0] in ("-h", "--help")) else sys.stderr
        out.write("usage: mooncake bench NAME [--json] [args]\n\n")
        out.write("\n".join(f"  {k:<10} {v}" for k, v in BENCHES.items()) + "\n")
        return 0 if out is sys.stdout else 2
    module = f"mooncake_lite.bench.{argv[0].replace('-', '_')}" + (".cli" if argv[0] in PACKAGES else "")
    return int(importlib.import_module(module).main(argv[1:]) or 0)
