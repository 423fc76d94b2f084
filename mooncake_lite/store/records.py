"""Plain records of the block pool: blocks, leases, put tickets, counters, and its errors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class StoreFull(RuntimeError):
    """No DRAM slot can be freed: every block is leased or being written."""


class BadRequest(ValueError):
    """The request itself is wrong (sizes, layer ranges)."""


@dataclass(slots=True, eq=False)
class Block:
    slot: int
    size: int
    num_layers: int
    chain_pos: int
    pins: int = 0
    is_live: bool = True  # False once deleted while pinned: slot freed at the last unpin


@dataclass(slots=True, eq=False)
class Lease:
    blocks: list[Block]
    expires_at: float
    on_expire: Callable[[], None] | None
    is_active: bool = True


@dataclass(slots=True)
class PutTicket:
    """Slots reserved for one put; ``slots[i]`` is None when key i is already stored."""
    keys: list[bytes]
    sizes: list[int]
    num_layers: int
    first_pos: int
    slots: list[int | None]


@dataclass
class StoreStats:
    hits_dram: int = 0
    hits_ssd: int = 0
    misses_dram: int = 0  # reads DRAM could not serve (some then served by the SSD)
    misses: int = 0  # reads no tier could serve
    evictions_dram: int = 0
    blocks_put: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    full_errors: int = 0
    leases_expired: int = 0
    read_leases_dropped: int = 0  # same-node read leases ended because a connection held too many


def discard_view(scratch: memoryview, size: int) -> memoryview:
    """Where bytes we must read but not keep go (a shared scratch buffer, reused for every block)."""
    return scratch[:size] if size <= scratch.nbytes else memoryview(bytearray(size))
