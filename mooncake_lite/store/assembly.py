"""Whole blocks assembled from slices: each stage of a CPP group puts only its own layers, each
rank of a tensor-parallel instance only its own KV heads (or both: a CPP stage of TP ranks).

A put with ``first_layer`` carries layers ``[first_layer, first_layer + num_layers)`` of blocks of
``block_layers`` layers; with ``heads`` (and the block's layout ``kvl``, ``transfer/kv_layout.py``)
only heads ``[start, stop)`` of those layers. A block is a grid of cells, one per layer and head
(one per layer for a put without heads); a key's first slice takes a DRAM slot for the whole
block; each slice lands in place (the head-major layout keeps a layer range contiguous, and a head
range one run per layer); the slot stays invisible (no match, no get, no block event) until every
cell has arrived, and is then committed like a put. Slices written at any TP degree assemble into
the same block, which a reader at any other degree reads whole or by head range. Rules, per key:

* the store holds the whole block already (any tier): a slice is a no-op;
* a range already covered (arrived, or on its way): a no-op (two requests that share a prefix
  write the same slices);
* a range outside ``[0, block_layers)`` (or the block's heads), overlapping another only in part,
  or whose layer size, ``block_layers`` or head count differ from the key's first slice: refused
  (``BadRequest``), nothing reserved (two writers at TP degrees whose head ranges straddle each
  other's, writing one block at the same moment, lose the straddling write-back: a block never
  mixes bytes into one cell);
* a partial block expires ``ttl_s`` after its first slice (a stage died, a put was lost), and at
  most ``max_partial`` are held at once (``StoreFull`` beyond): their slots are bounded, and
  counted in ``/metrics``.

State and rules only; the slots come from the ``BlockStore`` this serves (``alloc_slot``,
``adopt``), and ``now`` is passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mooncake_lite.store.protocol import MetaError, int_from_meta
from mooncake_lite.store.records import BadRequest, StoreFull, discard_view
from mooncake_lite.store.slab import Slab
from mooncake_lite.transfer.kv_layout import META_KEY, HeadRange, LayoutError, heads_from_meta, layout_from_meta

MAX_BLOCK_LAYERS = 1024     # far above any model; bounds a hostile put's layer masks
PARTIAL_TTL_S = 30.0        # a group's slices of one block arrive within a few chunk times
PARTIAL_SHARE = 0.5         # of the DRAM slots, at most, held by partial blocks


class SlotSource(Protocol):
    """What the assembler needs of the block pool (``store/blocks.py``)."""
    slab: Slab

    def __contains__(self, key: object) -> bool: ...
    def alloc_slot(self) -> int | None: ...
    def adopt(self, key: bytes, slot: int, size: int, num_layers: int, chain_pos: int) -> None: ...


@dataclass(slots=True, eq=False)
class Partial:
    """One block being assembled: its slot, its shape, and which cells are in (bit
    ``layer * num_heads + head``; one cell per layer when it is put without heads)."""
    slot: int
    block_layers: int
    layer_bytes: int
    chain_pos: int
    expires_at: float
    num_heads: int = 1
    arrived: int = 0
    receiving: int = 0         # layers whose bytes are on their way into the slot
    num_writers: int = 0       # slices being received: the slot is freed only once they end
    is_dropped: bool = False   # expired (or made moot) while being written

    @property
    def is_complete(self) -> bool:
        return self.arrived == (1 << (self.block_layers * self.num_heads)) - 1


@dataclass(slots=True)
class SliceTicket:
    """One slice put's reservation; ``partials[i]`` is None when key i's bytes are dropped."""
    keys: list[bytes]
    sizes: list[int]
    first_layer: int
    num_layers: int
    partials: list[Partial | None] = field(default_factory=list)
    num_heads: int = 1                 # the block's cells per layer
    heads: HeadRange | None = None     # this slice's heads (None: all)

    @property
    def mask(self) -> int:
        if self.heads is None or self.heads.num_heads == self.num_heads:   # whole layers: one run of bits
            return ((1 << (self.num_layers * self.num_heads)) - 1) << (self.first_layer * self.num_heads)
        heads = self.heads
        row = ((1 << heads.num_heads) - 1) << heads.start
        return sum(row << (layer * self.num_heads)
                   for layer in range(self.first_layer, self.first_layer + self.num_layers))

    def spans(self, layer_bytes: int) -> list[tuple[int, int]]:
        """(offset in the block, length) where one key's slice lands: one run, or one per layer."""
        if self.heads is None or self.heads.num_heads == self.num_heads:
            return [(self.first_layer * layer_bytes, self.num_layers * layer_bytes)]
        head_bytes = layer_bytes // self.num_heads
        return [(layer * layer_bytes + self.heads.start * head_bytes, self.heads.num_heads * head_bytes)
                for layer in range(self.first_layer, self.first_layer + self.num_layers)]


@dataclass
class AssemblyStats:
    slices: int = 0            # slices received (whole frames committed), per key
    slices_dropped: int = 0    # of which no-ops: block present, or range covered already
    assembled: int = 0         # blocks made visible
    expired: int = 0           # partial blocks dropped unfinished
    refused: int = 0           # slice puts refused (hostile ranges, at the bound, no slot)


def check_range(first_layer: int, num_layers: int, block_layers: int) -> None:
    """BadRequest unless ``[first_layer, first_layer + num_layers)`` lies in a block of ``block_layers``."""
    if not 1 <= block_layers <= MAX_BLOCK_LAYERS:
        raise BadRequest(f"block_layers must be in [1, {MAX_BLOCK_LAYERS}], got {block_layers}")
    if first_layer < 0 or num_layers < 1 or first_layer + num_layers > block_layers:
        raise BadRequest(f"layers [{first_layer}, {first_layer + num_layers}) are outside a "
                         f"{block_layers}-layer block")


def covers(partial: Partial, mask: int, block_layers: int, layer_bytes: int, num_heads: int = 1) -> bool:
    """True when ``partial`` already has (or is receiving) the cells of ``mask``; False when they
    are new to it; BadRequest when the slice does not fit it."""
    if (block_layers, layer_bytes, num_heads) != (partial.block_layers, partial.layer_bytes, partial.num_heads):
        raise BadRequest(f"slice of {block_layers} layers of {layer_bytes} bytes in {num_heads} head cell(s) "
                         f"does not match the block being assembled ({partial.block_layers} layers of "
                         f"{partial.layer_bytes} bytes in {partial.num_heads})")
    held = (partial.arrived | partial.receiving) & mask
    if held and held != mask:
        raise BadRequest("slice overlaps a layer range already put in part only")
    return held == mask


class Assembler:
    def __init__(self, store: SlotSource, *, max_partial: int | None = None, ttl_s: float = PARTIAL_TTL_S):
        self.store = store
        self.max_partial = max(1, int(store.slab.num_slots * PARTIAL_SHARE)) if max_partial is None else max_partial
        self.ttl_s = ttl_s
        self.partials: dict[bytes, Partial] = {}
        self.stats = AssemblyStats()

    @property
    def num_partial(self) -> int:
        return len(self.partials)

    def reserve_put(self, meta: dict[str, Any], keys: Sequence[bytes], sizes: Sequence[int], num_layers: int,
                    first_pos: int, now: float) -> SliceTicket:
        """``reserve`` for a slice put, its layer range read from the frame's meta
        (``first_layer``, ``block_layers``; ``heads`` with the block's ``kvl``): the one step
        socket and staged slice puts share."""
        block_heads, heads = 1, None
        try:
            if META_KEY in meta:    # the layout's own sizes are checked by _check, against the payload
                block_heads = layout_from_meta(meta, 1, 1).num_heads
                heads = heads_from_meta(meta, block_heads)
            elif "heads" in meta:
                raise LayoutError(f"a put of a head range needs the block's layout '{META_KEY}'")
        except LayoutError as exc:
            raise MetaError(str(exc)) from None
        return self.reserve(keys, sizes, int_from_meta(meta, "first_layer"), num_layers,
                            int_from_meta(meta, "block_layers", minimum=1), first_pos, now,
                            heads=heads, block_heads=block_heads)

    def reserve(self, keys: Sequence[bytes], sizes: Sequence[int], first_layer: int, num_layers: int,
                block_layers: int, first_pos: int, now: float, *, heads: HeadRange | None = None,
                block_heads: int = 1) -> SliceTicket:
        """Slots (or a drop) for each key's slice (heads ``heads`` of ``block_heads``, default all);
        all or nothing: BadRequest, StoreFull."""
        try:
            if heads is not None and heads.stop > block_heads:
                raise BadRequest(f"heads [{heads.start}, {heads.stop}) are outside a block of {block_heads}")
            layer_bytes = self._check(keys, sizes, first_layer, num_layers, block_layers,
                                      block_heads, block_heads if heads is None else heads.num_heads)
            ticket = SliceTicket(list(keys), list(sizes), first_layer, num_layers, num_heads=block_heads, heads=heads)
            try:
                for i, key in enumerate(keys):
                    ticket.partials.append(self._take(key, ticket.mask, block_layers, layer_bytes[i],
                                                      first_pos + i, now, block_heads))
            except BaseException:
                self.cancel(ticket)
                raise
        except (BadRequest, StoreFull):
            self.stats.refused += 1
            raise
        return ticket

    def _check(self, keys, sizes, first_layer: int, num_layers: int, block_layers: int, block_heads: int = 1,
               num_heads: int = 1) -> list[int]:
        """Each key's whole-block layer bytes, from its slice of ``num_heads`` of ``block_heads``."""
        if len(keys) != len(sizes):
            raise BadRequest(f"{len(keys)} keys but {len(sizes)} sizes")
        check_range(first_layer, num_layers, block_layers)
        slot_bytes = self.store.slab.slot_bytes
        for size in sizes:
            if size <= 0 or size % (num_layers * num_heads):
                raise BadRequest(f"slice of {size} bytes is not divisible into {num_layers} layers"
                                 + (f" of {num_heads} heads" if num_heads > 1 else ""))
            if size // (num_layers * num_heads) * block_heads * block_layers > slot_bytes:
                raise BadRequest(f"a block of {block_layers} layers of {size // (num_layers * num_heads) * block_heads} "
                                 f"bytes does not fit a {slot_bytes}-byte slot (start the store with a larger "
                                 "--slot-bytes)")
        return [size // (num_layers * num_heads) * block_heads for size in sizes]

    def _take(self, key: bytes, mask: int, block_layers: int, layer_bytes: int, chain_pos: int,
              now: float, num_heads: int = 1) -> Partial | None:
        if key in self.store:            # the whole block is here already
            self._drop(key)
            return None
        partial = self.partials.get(key)
        if partial is None:
            partial = self._open(key, block_layers, layer_bytes, chain_pos, now)
            partial.num_heads = num_heads
        elif covers(partial, mask, block_layers, layer_bytes, num_heads):
            return None
        partial.receiving |= mask
        partial.num_writers += 1
        return partial

    def _open(self, key: bytes, block_layers: int, layer_bytes: int, chain_pos: int, now: float) -> Partial:
        if len(self.partials) >= self.max_partial:
            raise StoreFull(f"{len(self.partials)} blocks are being assembled from layer slices already "
                            f"(at most {self.max_partial})")
        slot = self.store.alloc_slot()
        if slot is None:
            raise StoreFull(f"no free DRAM slot for a block to assemble: all {self.store.slab.num_slots} "
                            "slots are leased or being written")
        partial = self.partials[key] = Partial(slot, block_layers, layer_bytes, chain_pos, now + self.ttl_s)
        return partial

    def views(self, ticket: SliceTicket, scratch: memoryview) -> list[memoryview]:
        """Where each slice's bytes land: its layers' place in the slot, or ``scratch`` (dropped)."""
        views = []
        for partial, size in zip(ticket.partials, ticket.sizes):
            if partial is None:
                views.append(discard_view(scratch, size))
            else:
                views += [self.store.slab.view(partial.slot, length, offset)
                          for offset, length in ticket.spans(partial.layer_bytes)]
        return views

    def commit(self, ticket: SliceTicket) -> int:
        """The slices are in: mark their layers; returns how many blocks became whole (visible)."""
        num_new = 0
        for key, partial in zip(ticket.keys, ticket.partials):
            self.stats.slices += 1
            if partial is None:
                self.stats.slices_dropped += 1
                continue
            self._release(partial, ticket.mask, arrived=True)
            if partial.is_dropped or not partial.is_complete:
                continue
            del self.partials[key]
            if key in self.store:        # a whole put of it won meanwhile
                self.store.slab.free(partial.slot)
                continue
            self.store.adopt(key, partial.slot, partial.layer_bytes * partial.block_layers,
                             partial.block_layers, partial.chain_pos)
            self.stats.assembled += 1
            num_new += 1
        ticket.partials = []
        return num_new

    def cancel(self, ticket: SliceTicket) -> None:
        """The put died before its bytes were all in: its layers are not marked (nor reserved)."""
        for key, partial in zip(ticket.keys, ticket.partials):
            if partial is None:
                continue
            self._release(partial, ticket.mask, arrived=False)
            if not partial.is_dropped and partial.arrived == 0 and partial.num_writers == 0:
                self._drop(key)          # nothing of it arrived: it holds its slot for nothing
        ticket.partials = []

    def _release(self, partial: Partial, mask: int, *, arrived: bool) -> None:
        partial.receiving &= ~mask
        if arrived:
            partial.arrived |= mask
        partial.num_writers -= 1
        if partial.is_dropped and partial.num_writers == 0:
            self.store.slab.free(partial.slot)

    def expire(self, now: float) -> int:
        """Drop partial blocks past their deadline; returns how many."""
        late = [key for key, partial in self.partials.items() if partial.expires_at <= now]
        for key in late:
            self._drop(key)
        self.stats.expired += len(late)
        return len(late)

    def _drop(self, key: bytes) -> None:
        """Forget a partial block; its slot is freed now, or by the last slice still landing in it."""
        partial = self.partials.pop(key, None)
        if partial is None:
            return
        partial.is_dropped = True
        if partial.num_writers == 0:
            self.store.slab.free(partial.slot)
