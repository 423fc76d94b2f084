"""The ``mooncake`` executable: ``mooncake --role ROLE [flags]`` or ``mooncake TOOL ...``.

Each role reads the same way: ``mooncake_lite/<role>/config.py`` exports ``Config`` (a frozen
dataclass built with :mod:`mooncake_lite.common.config`) and ``DESCRIPTION``, ``app.py`` builds the
role, and ``main.py`` exports ``run(cfg) -> int``. Tools export ``main(argv) -> int``. Everything is
imported lazily: parsing a role's flags (``--help`` included) imports only its ``config.py``, and
only the tool asked for is imported, so torch is loaded by the roles and tools that need it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from mooncake_lite.common import tracing
from mooncake_lite.common.config import ConfigError, ListenError, load_config
from mooncake_lite.common.logs import setup_logging

ROLES = ("conductor", "prefill", "decode", "store")   # packages mooncake_lite.<role>
TOOLS = {
    "up": ("mooncake_lite.cluster.up", "start a one-machine cluster (conductor, store, prefill, decode)"),
    "status": ("mooncake_lite.cluster.status", "live view of a running cluster (--once, --json for scripts)"),
    "netns": ("mooncake_lite.cluster.netns_cli", "nodes on one box: network namespaces, shaped links (root)"),
    "bench": ("mooncake_lite.bench.cli", "benchmarks (mooncake bench lists every one): model, store, pd, replay, chaos, ..."),
    "sim": ("mooncake_lite.sim.cli", "trace-driven cluster simulator and paper reproductions"),
    "trace": ("mooncake_lite.trace.cli", "trace tools: stats, synth"),
    "tenants": ("mooncake_lite.conductor.tenants_push", "tenants push: replace the tenant table shared in etcd"),
    "generate": ("mooncake_lite.model.generate", "run the model in one process (monolithic reference)"),
}

USAGE = """usage: mooncake --role {conductor,prefill,decode,store} [flags]   (add --help for the role's flags)
       mooncake TOOL [args]                                          (add --help for the tool's args)

roles:
  conductor   global KVCache-centric scheduler and the OpenAI-compatible API
  prefill     prefill instance: prefix reuse, chunked and layer-wise prefill, KV streamed to decode
  decode      decode instance: receives KV, continuous batching, streams tokens
  store       KV block pool: DRAM slab + SSD tier, binary transfer protocol

tools:
%s
""" % "\n".join(f"  {name:<10}  {text}" for name, (_, text) in TOOLS.items())


def run_role(role: str, argv: Sequence[str]) -> int:
    config = importlib.import_module(f"mooncake_lite.{role}.config")
    try:
        cfg = load_config(config.Config, argv, prog=f"mooncake --role {role}", section=role,
                          description=config.DESCRIPTION)
    except ConfigError as exc:
        sys.stderr.write(f"mooncake --role {role}: error: {exc}\n")
        return 2
    setup_logging(role, cfg.log_level, cfg.log_json)
    tracing.setup(role, cfg.otlp_endpoint)
    try:
        return int(importlib.import_module(f"mooncake_lite.{role}.main").run(cfg) or 0)
    except ListenError as exc:
        sys.stderr.write(f"mooncake --role {role}: error: {exc}\n")
        return 2


def _split_role(argv: list[str]) -> tuple[str | None, list[str]]:
    for i, arg in enumerate(argv):
        if arg == "--role" and i + 1 < len(argv):
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if arg.startswith("--role="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return None, argv


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:
        module, _ = TOOLS[argv[0]]
        return int(importlib.import_module(module).main(argv[1:]) or 0)
    role, rest = _split_role(argv)
    if role is None:
        sys.stdout.write(USAGE) if (not argv or argv[0] in ("-h", "--help")) else sys.stderr.write(USAGE)
        return 0 if (not argv or argv[0] in ("-h", "--help")) else 2
    if role not in ROLES:
        sys.stderr.write(f"mooncake: unknown role {role!r}; choose one of {', '.join(ROLES)}\n")
        return 2
    return run_role(role, rest)


if __name__ == "__main__":
    sys.exit(main())
