"""What ``mooncake up`` starts, in which order, with which flags (pure: no processes here).

Start order follows the data dependencies of the ready lines:

1. conductor (needs nothing; everyone else reports to it),
2. stores (post block events to the conductor),
3. prefill and decode instances (register with the conductor, read/write their store's
   *data* address), all at once.

Stop order is the drain order: the conductor first (it stops taking requests and finishes
the ones in flight, which still need prefill/decode), then the instances, then the stores.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

ROLES = ("conductor", "store", "prefill", "decode")


@dataclass(frozen=True)
class UpOptions:
    """Everything ``mooncake up`` was asked for (see ``up.py`` for the flags)."""
    num_prefill: int = 1
    num_decode: int = 1
    num_stores: int = 1
    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 8000                      # the conductor's public API port; 0 picks a free one
    api_key: str | None = None
    cluster_token: str | None = None
    config: str | None = None             # TOML file every role reads ([cluster] + its section)
    common: tuple[str, ...] = ()          # flags passed to every role (--block-size 16 ...)
    role_args: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # extra flags per role
    launcher: tuple[str, ...] = ()        # command prefix that runs a role: python -m mooncake_lite
    # Config field names per role, when known: wiring flags a role lacks (decode has no --store)
    # are left out. None passes every wiring flag (custom launchers).
    role_fields: Mapping[str, frozenset[str]] | None = None

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode", "num_stores"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.removeprefix('num_').replace('_', '-')} must be at least 1")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        unknown = set(self.role_args) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown role(s) in role_args: {sorted(unknown)}")
        if not self.launcher:
            raise ValueError("launcher must name the command that runs a role")


@dataclass(frozen=True)
class ChildSpec:
    name: str          # "prefill-0": the log prefix
    role: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


def split_args(text: str | None) -> tuple[str, ...]:
    """``--prefill-args "--chunk-size 256"`` → ('--chunk-size', '256')."""
    return tuple(shlex.split(text)) if text else ()


def _base(opts: UpOptions, role: str, port: int) -> list[str]:
    argv = [*opts.launcher, "--role", role, "--host", opts.host, "--port", str(port)]
    if opts.config:
        argv += ["--config", opts.config]
    return argv + list(opts.common)


def secret_env(opts: UpOptions, role: str) -> dict[str, str]:
    """Secrets travel in the environment, not argv, so ``ps`` does not show them."""
    env = {"MOONCAKE_CLUSTER_TOKEN": opts.cluster_token} if opts.cluster_token else {}
    if role == "conductor" and opts.api_key:
        env["MOONCAKE_API_KEY"] = opts.api_key
    return env


def _wire(opts: UpOptions, role: str, argv: list[str], flag: str, value: str) -> None:
    """Append a wiring flag if the role has that option (or when we cannot tell)."""
    fields = (opts.role_fields or {}).get(role)
    if fields is None or flag.removeprefix("--").replace("-", "_") in fields:
        argv += [flag, value]


def _finish(argv: list[str], opts: UpOptions, role: str) -> tuple[str, ...]:
    return tuple(argv + list(opts.role_args.get(role, ())))


def conductor_spec(opts: UpOptions) -> ChildSpec:
    argv = _base(opts, "conductor", opts.port)
    _wire(opts, "conductor", argv, "--model", opts.model)
    return ChildSpec("conductor", "conductor", _finish(argv, opts, "conductor"), secret_env(opts, "conductor"))


def store_specs(opts: UpOptions, conductor_url: str) -> list[ChildSpec]:
    specs = []
    for i in range(opts.num_stores):
        argv = _base(opts, "store", 0)
        _wire(opts, "store", argv, "--data-port", "0")
        _wire(opts, "store", argv, "--conductor", conductor_url)
        specs.append(ChildSpec(f"store-{i}", "store", _finish(argv, opts, "store"), secret_env(opts, "store")))
    return specs


def instance_specs(opts: UpOptions, conductor_url: str, store_data: Sequence[str]) -> list[ChildSpec]:
    """Prefill and decode instances; instance i of each role uses store ``i % num_stores``."""
    if not store_data:
        raise ValueError("instances need at least one store data address")
    specs = []
    for role, count in (("prefill", opts.num_prefill), ("decode", opts.num_decode)):
        for i in range(count):
            argv = _base(opts, role, 0)
            if role == "decode":
                _wire(opts, role, argv, "--data-port", "0")
            _wire(opts, role, argv, "--conductor", conductor_url)
            _wire(opts, role, argv, "--store", store_data[i % len(store_data)])
            _wire(opts, role, argv, "--model", opts.model)
            specs.append(ChildSpec(f"{role}-{i}", role, _finish(argv, opts, role), secret_env(opts, role)))
    return specs


def stop_order(names: Sequence[str]) -> list[list[str]]:
    """Groups of child names to stop one group after the other: conductor, instances, stores."""
    groups: list[list[str]] = [[], [], []]
    for name in names:
        role = name.rsplit("-", 1)[0] if name != "conductor" else name
        groups[{"conductor": 0, "prefill": 1, "decode": 1}.get(role, 2)].append(name)
    return [g for g in groups if g]
