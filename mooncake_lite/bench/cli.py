"""Dispatch ``mooncake bench NAME`` to the ``main(argv)`` of that command's module.

Each command family is one subpackage (``model/``, ``store/``, ``pd/``, ``conductor/``,
``replay/``, ``sim/``, ``fidelity/``, ``chaos/``; ``link/`` serves ``store --link`` and
``pd --link``); what they share sits beside them: ``harness.py`` starts and stops role processes
(over ``common/launch.py``), ``report.py`` prints a result as text or ``--json``, ``options.py``
freezes parsed flags, ``host.py`` names the CPU.

Every benchmark accepts ``--json`` to print all of its figures as one JSON object on stdout.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# command -> (module with main(argv), one line for the usage)
BENCHES = {
    "model": ("model.cli", "prefill tokens/s and decode step time vs this CPU's matmul peak"),
    "store": ("store.cli", "store put/get GB/s and latency vs memcpy and blocking-socket loopback; --link RATE: "
                           "between two nodes over a shaped link, its share used"),
    "pd": ("pd.cli", "layer-wise overlap, prefix-hit TTFT, CPP, decode tokens/s; --profile for cost models; "
                     "--link RATE: prefill and decode on two nodes, share of the transfer hidden"),
    "conductor": ("conductor.cli", "scheduling decision time and the conductor's added latency"),
    "replay": ("replay.cli", "replay a Mooncake trace against a live OpenAI-compatible server"),
    "sim-scale": ("sim.scale", "the simulator on a million-request trace at 128P+128D: wall time, peak memory"),
    "fidelity": ("fidelity.cli", "one trace slice live and simulated with the cluster's own cost model: errors, CDFs"),
    "chaos": ("chaos.cli", "kill -9 prefill, decode and store in turn under streaming load: hangs, failures, "
                           "recovery, leaks"),
    "store-slices": ("store.head_slices", "N store round trips per block: a TP instance's ranks writing and reading "
                                          "their own KV heads, against one whole-block request"),
    "tp-send": ("pd.tp_send", "a TP prefill's ranks sending their own KV heads vs rank 0 gathering them: time, "
                              "bytes through rank 0"),
    "tp-prefix": ("pd.tp_prefix", "a TP prefill's ranks loading and writing back their own KV heads vs rank 0 doing "
                                  "all: time, bytes through rank 0"),
    "prefix-load": ("pd.prefix_load", "a prefill's prefix load from a store (shm or TCP): every layer, no compute"),
    "moe": ("model.moe", "MLA's KV bytes and transfer time vs dense attention; MoE routing vs a dense MLP of the "
                         "active width"),
    "structured": ("model.structured", "constrained decoding: grammar work per token vs the decode step at "
                                       "batch 1 and 16, a 20-field schema's compile"),
    "kv-compression": ("model.kv_compression", "int8/fp8 KV blocks: token agreement, logit error, bytes, store "
                                               "capacity, sim hit rate/TTFT"),
}


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        out = sys.stdout if (not argv or argv[0] in ("-h", "--help")) else sys.stderr
        out.write("usage: mooncake bench NAME [--json] [args]\n\n")
        out.write("\n".join(f"  {k:<10} {text}" for k, (_, text) in BENCHES.items()) + "\n")
        return 0 if out is sys.stdout else 2
    module, _ = BENCHES[argv[0]]
    return int(importlib.import_module(f"mooncake_lite.bench.{module}").main(argv[1:]) or 0)
