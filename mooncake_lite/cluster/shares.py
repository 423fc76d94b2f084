"""How one box is divided among the instances ``mooncake up`` starts (pure): CPUs per instance,
the decodes' CPUs a prefill may borrow, and the memory left after weights split into KV caches
and store DRAM, per rank for a tensor-parallel instance. ``cluster/plan.py`` turns these shares
into flags; ``cluster/machine.py`` reads the machine they divide."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

STORE_DRAM = 1 << 30                    # at least the store's default --dram
INSTANCE_KV_MEMORY = 256 << 20          # ModelRoleConfig.kv_memory's default: the floor of a KV share
PROCESS_OVERHEAD = 512 << 20            # Python, torch, tokenizer and buffers of one instance, beside weights
DEFAULT_MEMORY_FRACTION = 0.25          # of MemAvailable: the box is shared with the OS and other work
# How the memory left after weights is split: decode holds every running sequence's whole
# context; the store's DRAM is the prefix cache (more is more reuse); prefill holds the prompts
# in flight only.
SHARE_DECODE, SHARE_STORE, SHARE_PREFILL = 0.45, 0.4, 0.15
# Caps, in full-length (max_seq_len) sequences, past which a share is memory nobody can use at
# once; they keep a small model (tests' `tiny`) from zeroing gigabytes at start.
PREFILL_SEQUENCES, DECODE_SEQUENCES, STORE_SEQUENCES = 4, 64, 256


@dataclass(frozen=True)
class MachineShare:
    """What ``mooncake up`` may divide among its roles (read at start by ``cluster/machine.py``)."""
    cpus: tuple[int, ...]                 # CPUs this process may run on
    available_memory: int                 # bytes available at start (MemAvailable)
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    weight_bytes: int | None = None       # one instance's model weights in its dtype (None: unknown)
    # of those, what every tensor-parallel rank holds whole (the embedding, the norms): a TP=N
    # instance's ranks hold it N times and the rest once, split (model/tensor_parallel.py)
    replicated_weight_bytes: int = 0
    decode_pack_bytes: int = 0            # what a decode holds beyond them once packed (CPU float32: its tied head's packed copy)
    prefill_pack_bytes: int = 0           # the same for a prefill (packed where it measures faster: --pack-weights)
    kv_token_bytes: int | None = None     # KV bytes of one token, every layer (None: unknown)
    max_seq_len: int | None = None        # the model's longest sequence
    threads: int | None = None            # `mooncake up --threads`: this many per instance, not pinned
    pin: bool = False                     # `mooncake up --pin`: also bind each instance to its CPUs

    def __post_init__(self) -> None:
        if not self.cpus:
            raise ValueError("a machine share needs at least one CPU")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"--kv-memory-fraction must be in (0, 1], got {self.memory_fraction}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be positive, got {self.threads}")


@dataclass(frozen=True)
class MemoryShares:
    prefill_kv: int        # --kv-memory of each prefill instance
    decode_kv: int         # --kv-memory of each decode instance
    store_dram: int        # --dram of each store


def core_shares(cpus: Sequence[int], num_prefill: int, num_decode: int) -> dict[str, tuple[int, ...]]:
    """CPUs of each instance ("prefill-0", ..., "decode-0", ...): disjoint contiguous slices when
    there are enough, the spare ones to prefills first (prefill is compute-bound, decode mostly
    waits on memory); with fewer CPUs than instances, one CPU each, dealt round-robin. The
    conductor and stores (event loops, mostly waiting on sockets) are not pinned."""
    names = [f"prefill-{i}" for i in range(num_prefill)] + [f"decode-{i}" for i in range(num_decode)]
    cpus = sorted(cpus)
    if len(cpus) < len(names):
        return {name: (cpus[i % len(cpus)],) for i, name in enumerate(names)}
    base, spare = divmod(len(cpus), len(names))
    shares, start = {}, 0
    for i, name in enumerate(names):
        width = base + (1 if i < spare else 0)
        shares[name] = tuple(cpus[start:start + width])
        start += width
    return shares


def lent_cpus(cpus: Sequence[int], num_prefill: int, num_decode: int) -> dict[str, int]:
    """How many of the decodes' CPUs each prefill may borrow while they are idle (its
    ``--borrow-threads``): all of them, split among the prefills. Prefill is bursty and
    compute-bound, decode steady but idle between bursts, so a prefill runs on the decode's
    cores too whenever the machine leaves them idle (``prefill/threads.py`` watches). With fewer
    CPUs than instances, none (every instance already shares)."""
    if len(cpus) < num_prefill + num_decode:
        return {f"prefill-{i}": 0 for i in range(num_prefill)}
    shares = core_shares(cpus, num_prefill, num_decode)
    lent = sum(len(shares[f"decode-{i}"]) for i in range(num_decode))
    base, spare = divmod(lent, num_prefill)
    return {f"prefill-{i}": base + (1 if i < spare else 0) for i in range(num_prefill)}


def rank_weight_bytes(share: MachineShare, tp: int) -> int:
    """What one rank of a TP=``tp`` instance holds of the weights: the replicated part whole,
    the rest split ``tp`` ways."""
    weights = share.weight_bytes or 0
    if tp == 1:
        return weights
    replicated = min(share.replicated_weight_bytes, weights)
    return replicated + -(-(weights - replicated) // tp)


def memory_shares(share: MachineShare, num_prefill: int, num_decode: int, num_stores: int, *,
                  prefill_tp: int = 1, decode_tp: int = 1) -> MemoryShares:
    """KV memory per instance and DRAM per store from ``memory_fraction`` of the available memory,
    less each instance's weights (with a tied head's packed copy where it packs them) and process
    overhead, per rank for a tensor-parallel instance (each of its ``tp`` processes holds its share
    of the weights and the replicated ones whole; its KV share is the instance's, split among its
    ranks by the instance itself). No share is below the role's own default
    (the cluster never gets less than it did before sizing); a prefill's is capped at what
    ``PREFILL_SEQUENCES`` full-length prompts need when the model's shape is known, and what that
    cap frees goes to decode (itself capped at ``DECODE_SEQUENCES``, the stores at ``STORE_SEQUENCES``)."""
    budget = int(share.available_memory * share.memory_fraction)
    budget -= (num_prefill * prefill_tp * (rank_weight_bytes(share, prefill_tp) + PROCESS_OVERHEAD)
               + num_decode * decode_tp * (rank_weight_bytes(share, decode_tp) + PROCESS_OVERHEAD)
               + num_decode * share.decode_pack_bytes + num_prefill * share.prefill_pack_bytes)
    budget = max(budget, 0)
    seq = share.max_seq_len * share.kv_token_bytes if share.kv_token_bytes and share.max_seq_len else None

    def capped(value: int, sequences: int) -> int:
        return value if seq is None else min(value, sequences * seq)
    prefill = capped(int(budget * SHARE_PREFILL) // num_prefill, PREFILL_SEQUENCES)
    decode = capped((int(budget * (SHARE_PREFILL + SHARE_DECODE)) - prefill * num_prefill) // num_decode,
                    DECODE_SEQUENCES)
    store = capped(int(budget * SHARE_STORE) // num_stores, STORE_SEQUENCES)
    return MemoryShares(prefill_kv=max(prefill, INSTANCE_KV_MEMORY), decode_kv=max(decode, INSTANCE_KV_MEMORY),
                        store_dram=max(store, STORE_DRAM))
