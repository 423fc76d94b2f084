"""What ``mooncake up`` starts, in which order, with which flags (pure: no processes here).

Start order follows the data dependencies of the ready lines:

1. conductor (needs nothing; everyone else reports to it),
2. stores (post block events to the conductor),
3. prefill and decode instances (register with the conductor, read/write their store's
   *data* address), all at once.

Stop order is the drain order: the conductor first (it stops taking requests and finishes
the ones in flight, which still need prefill/decode), then the instances, then the stores.

Stores are sized for the served model: one KV block (``kv_block_bytes`` at the prefill's block
size and dtype, worked out by ``up.py``) must fit a slot, or every write-back is refused, so
stores get ``--slot-bytes`` (rounded up to 64 KiB) and a ``--dram`` of at least 64 such slots,
unless the user set those options (flags, config file or environment) themselves.

On one box the roles share the machine (``UpOptions.share``, divided by ``cluster/shares.py``: :func:`core_shares`,
:func:`lent_cpus` and :func:`memory_shares`): each prefill and decode instance gets its own slice
of the CPUs as torch intra-op threads (and, with ``--pin``, as its affinity), since instances that
each ask for every core spin against each other; unpinned, a prefill may also borrow the decodes'
CPUs while the machine leaves them idle (``--borrow-threads``); and a fraction of the memory available at start, after every instance's weights, is split
into the instances' KV caches and the stores' DRAM, so the default cluster can hold the load the
machine can. Anything the user set (``--threads``, ``--cpus``, ``--kv-memory``, ``--num-blocks``,
``--dram``) wins.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mooncake_lite.common.hashing import DEFAULT_BLOCK_SIZE
from mooncake_lite.cluster.gpus import DEFAULT_GPU_MEMORY_FRACTION, gpu_placement
from mooncake_lite.cluster.shares import (STORE_DRAM, MachineShare, MemoryShares, core_shares, lent_cpus,
                                          memory_shares)
from mooncake_lite.common.launch import role_argv
from mooncake_lite.model.args import default_dtype
from mooncake_lite.model.source import DEFAULT_MODEL

ROLES = ("conductor", "store", "prefill", "decode")

SLOT_ALIGN = 64 << 10                   # --slot-bytes is rounded up to this
MIN_STORE_BLOCKS = 64                   # --dram holds at least this many slots (and STORE_DRAM)
STORE_SSD_QUEUE = 256 << 20             # the store's default --ssd-queue (must hold one slot)
MAX_SLOT_BYTES = 1 << 30                # the store's largest --slot-bytes
# Options the store sizing reads (prefill) or sets (store); see UpOptions.preset.
SIZING_OPTIONS = ("block_size", "dtype", "slot_bytes", "dram", "ssd_queue", "threads", "cpus", "kv_memory",
                  "num_blocks", "kv_compression", "borrow_threads")


@dataclass(frozen=True)
class UpOptions:
    """Everything ``mooncake up`` was asked for (see ``up.py`` for the flags)."""
    num_prefill: int = 1
    num_decode: int = 1
    num_stores: int = 1
    model: str = DEFAULT_MODEL
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
    # Bytes of one KV block of the served model at the prefill's block size and dtype (None:
    # unknown, stores keep their defaults); see kv_layout and store_sizing.
    kv_block_bytes: int | None = None
    # Values of SIZING_OPTIONS each role gets from the config file and environment, by role and
    # field name ({"store": {"slot_bytes": "8MiB"}}): set there, they are neither read from
    # defaults nor overridden by flags of ours.
    preset: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # The machine to divide among the roles (None: every role takes its own defaults, all cores).
    share: MachineShare | None = None
    # CUDA devices the instances are dealt over (None: their own --device, the CPU by default) and
    # the share of each GPU they hold together (cluster/gpus.py)
    gpus: tuple[int, ...] | None = None
    gpu_memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION

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
        if self.gpus is not None and (not self.gpus or min(self.gpus) < 0 or len(set(self.gpus)) != len(self.gpus)):
            raise ValueError(f"--gpus must list distinct device indices, got {self.gpus}")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {self.gpu_memory_fraction}")


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
    argv = role_argv(role, "--host", opts.host, "--port", str(port), launcher=opts.launcher)
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


def _tune(opts: UpOptions, role: str, argv: list[str], flag: str, value: str) -> None:
    """Append a tuning flag only where the role is known to have it: unlike wiring, a machine
    share is optional, so a custom launcher's roles (fields unknown) run without it."""
    fields = (opts.role_fields or {}).get(role)
    if fields is not None and flag.removeprefix("--").replace("-", "_") in fields:
        argv += [flag, value]


def _finish(argv: list[str], opts: UpOptions, role: str) -> tuple[str, ...]:
    return tuple(argv + list(opts.role_args.get(role, ())))


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value the last ``flag V`` / ``flag=V`` in ``argv`` gives (argparse: the last one wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def role_setting(opts: UpOptions, role: str, name: str) -> Any | None:
    """What the user set for option ``name`` of ``role``: its flags (role args after the common
    ones), else the config file / environment (``opts.preset``); None when left to the default."""
    value = flag_value([*opts.common, *opts.role_args.get(role, ())], "--" + name.replace("_", "-"))
    return value if value is not None else opts.preset.get(role, {}).get(name)


def kv_layout(opts: UpOptions) -> tuple[int, str]:
    """(block size, dtype) of the KV blocks the prefill instances will write to the stores."""
    block_size = role_setting(opts, "prefill", "block_size")
    dtype = role_setting(opts, "prefill", "dtype")
    if dtype in (None, "auto"):   # as the prefill's own --dtype auto resolves it (model/args.py: dtype_choice)
        model = role_setting(opts, "prefill", "model") or opts.model
        dtype = default_dtype("cuda" if on_gpu(opts, "prefill") else "cpu", model)
    return int(block_size) if block_size is not None else DEFAULT_BLOCK_SIZE, str(dtype)


def on_gpu(opts: UpOptions, role: str) -> bool:
    """Whether ``role``'s instances compute on CUDA: their own --device, else ``opts.gpus``."""
    device = role_setting(opts, role, "device")
    return str(device).startswith("cuda") if device is not None else opts.gpus is not None


def gpu_flags(opts: UpOptions, role: str, name: str) -> list[tuple[str, str]]:
    """``--device cuda:N`` and ``--gpu-memory-fraction`` for instance ``name`` from its placement
    (``cluster/gpus.py``), leaving out what the user set for the role."""
    placed = gpu_placement(opts.gpus, opts.num_prefill, opts.num_decode, opts.gpu_memory_fraction).get(name) \
        if opts.gpus is not None else None
    if placed is None:
        return []
    flags = [("--device", f"cuda:{placed[0]}"), ("--gpu-memory-fraction", f"{placed[1]:.4f}")]
    return [(flag, value) for flag, value in flags if role_setting(opts, role, flag[2:].replace("-", "_")) is None]


def slot_bytes_for(block_bytes: int) -> int:
    """A store slot for blocks of ``block_bytes``: rounded up to a multiple of 64 KiB."""
    return -(-block_bytes // SLOT_ALIGN) * SLOT_ALIGN


def store_sizing(opts: UpOptions) -> list[tuple[str, str]]:
    """The ``--slot-bytes`` / ``--dram`` / ``--ssd-queue`` flags that let a store hold the served
    model's blocks, leaving out whatever the user set. ``--dram`` is sized from the slot size in
    effect (the user's, if set)."""
    if opts.kv_block_bytes is None:
        return []
    from mooncake_lite.common.units import parse_size
    flags: list[tuple[str, str]] = []
    user_slot = role_setting(opts, "store", "slot_bytes")
    if user_slot is None:
        slot = slot_bytes_for(opts.kv_block_bytes)
        flags.append(("--slot-bytes", str(slot)))
    else:
        try:
            slot = int(parse_size(user_slot))
        except (TypeError, ValueError):
            return flags          # the store will say what is wrong with it
    dram = STORE_DRAM
    if opts.share is not None:
        dram = planned_memory(opts, opts.share).store_dram
    if role_setting(opts, "store", "dram") is None and max(MIN_STORE_BLOCKS * slot, dram) > STORE_DRAM:
        flags.append(("--dram", str(max(MIN_STORE_BLOCKS * slot, dram))))
    if role_setting(opts, "store", "ssd_queue") is None and slot > STORE_SSD_QUEUE:
        flags.append(("--ssd-queue", str(2 * slot)))
    return flags


def role_tp(opts: UpOptions, role: str) -> int:
    """The tensor-parallel degree of ``role``'s instances: the last ``--tensor-parallel``/``--tp``
    of its flags (role args after the common ones), else the config file / environment, else 1."""
    value = None
    for i, arg in enumerate(argv := [*opts.common, *opts.role_args.get(role, ())]):
        name, _, inline = arg.partition("=")
        if name in ("--tensor-parallel", "--tp"):
            value = inline if inline else (argv[i + 1] if i + 1 < len(argv) else None)
    value = value if value is not None else opts.preset.get(role, {}).get("tensor_parallel")
    try:
        return max(1, int(value)) if value is not None else 1
    except ValueError:
        return 1   # the role itself refuses it, naming the flag


def planned_memory(opts: UpOptions, share: MachineShare) -> MemoryShares:
    return memory_shares(share, opts.num_prefill, opts.num_decode, opts.num_stores,
                         prefill_tp=role_tp(opts, "prefill"), decode_tp=role_tp(opts, "decode"))


def instance_share_flags(opts: UpOptions, role: str, name: str) -> list[tuple[str, str]]:
    """``--threads``/``--cpus``/``--borrow-threads``/``--kv-memory`` for instance ``name`` from ``opts.share``, leaving out
    whatever the user set for the role (a user's ``--num-blocks`` also rules out ``--kv-memory``)."""
    share = opts.share
    if share is None:
        return []
    flags: list[tuple[str, str]] = []
    user = {n: role_setting(opts, role, n) is not None for n in ("threads", "cpus", "kv_memory", "num_blocks")}
    tp = role_tp(opts, role)   # a TP instance's --threads are each rank's: its CPUs split among them
    if share.threads is not None:
        if not user["threads"]:
            flags.append(("--threads", str(max(1, share.threads // tp))))
    elif not (user["threads"] or user["cpus"]):
        cpus = core_shares(share.cpus, opts.num_prefill, opts.num_decode)[name]
        flags.append(("--threads", str(max(1, len(cpus) // tp))))
        if share.pin:
            flags.append(("--cpus", ",".join(map(str, cpus))))
        elif role_setting(opts, role, "borrow_threads") is None:   # unpinned: the decodes' idle CPUs too
            if lent := lent_cpus(share.cpus, opts.num_prefill, opts.num_decode).get(name, 0):
                flags.append(("--borrow-threads", str(lent)))
    if not (user["kv_memory"] or user["num_blocks"] or on_gpu(opts, role)):   # on a GPU: its own share
        mem = planned_memory(opts, share)
        flags.append(("--kv-memory", str(mem.prefill_kv if role == "prefill" else mem.decode_kv)))
    return flags


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
        for flag, value in store_sizing(opts):
            _wire(opts, "store", argv, flag, value)
        specs.append(ChildSpec(f"store-{i}", "store", _finish(argv, opts, "store"), secret_env(opts, "store")))
    return specs


# The prefill queue order `mooncake up` starts its prefills with (the role's own default stays
# fifo): a one-box cluster's prefill is what a burst waits for, and serving its shorter prompts
# first halves the replay's median TTFT (docs/operations.md §1, the queue order).
UP_QUEUE_ORDER = "shortest"


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
            for flag, value in gpu_flags(opts, role, f"{role}-{i}"):
                _wire(opts, role, argv, flag, value)
            for flag, value in instance_share_flags(opts, role, f"{role}-{i}"):
                _tune(opts, role, argv, flag, value)
            if role == "prefill" and role_setting(opts, role, "queue_order") is None:
                _tune(opts, role, argv, "--queue-order", UP_QUEUE_ORDER)
            specs.append(ChildSpec(f"{role}-{i}", role, _finish(argv, opts, role), secret_env(opts, role)))
    return specs


def stop_order(names: Sequence[str]) -> list[list[str]]:
    """Groups of child names to stop one group after the other: conductor, instances, stores."""
    groups: list[list[str]] = [[], [], []]
    for name in names:
        role = name.rsplit("-", 1)[0] if name != "conductor" else name
        groups[{"conductor": 0, "prefill": 1, "decode": 1}.get(role, 2)].append(name)
    return [g for g in groups if g]
