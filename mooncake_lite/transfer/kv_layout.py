"""The cluster's one KV block layout, whatever the tensor-parallel degree (issue 33).

A block (``block_size`` tokens of every layer) is, in version 1, head-major:

    for each layer: for each KV head: K ``[block_size][head_dim]`` then V ``[block_size][head_dim]``

(compressed: that head's 1-byte codes, K then V, then its two float32 scales; ``kernels/kv_codec.py``).
So one head's keys and values are contiguous in each layer, a layer range is one contiguous slice
of a block (what a CPP stage puts and a layer-wise load gets), and a head range of a layer range
is one contiguous run per layer (what a TP rank holding those heads puts or reads). Today's paged
cache and token frames keep ``[2][tokens][kv_heads][head_dim]``; only the block bytes (the store,
its tiers, the load buffers) are in this layout.

A layout that cannot be split by head (MLA's latent: every rank holds all of it) is *replicated*:
it counts as one head, which every rank holds, and is written and sent once. A block's layout
travels as ``{"v": version, "heads": num_heads, "rep": replicated}`` under ``"kvl"`` in the metas
of the frames that carry block bytes; a reader refuses a version it does not know
(:class:`LayoutError`) instead of misreading it.

Pure: no torch, no IO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LAYOUT_VERSION = 1
KNOWN_VERSIONS = frozenset({1})
META_KEY = "kvl"
MAX_HEADS = 4096        # far above any model; bounds a hostile meta's head ranges


class LayoutError(ValueError):
    """A block or frame of a layout this process cannot read, or a head range outside it."""


@dataclass(frozen=True, slots=True)
class HeadRange:
    """KV heads ``[start, stop)`` of a block."""
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise LayoutError(f"head range [{self.start}, {self.stop}) is empty or negative")

    @property
    def num_heads(self) -> int:
        return self.stop - self.start

    def to_meta(self) -> list[int]:
        return [self.start, self.stop]


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The shape of one block's bytes: ``num_layers`` layers of ``num_heads`` head records of
    ``head_bytes`` each (``2 * block_size * head_dim * itemsize`` plain; codes and scales encoded)."""
    num_layers: int
    num_heads: int
    head_bytes: int
    is_replicated: bool = False
    version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        check_version(self.version)
        if self.num_layers < 1 or self.head_bytes < 1 or not 1 <= self.num_heads <= MAX_HEADS:
            raise LayoutError(f"a block of {self.num_layers} layers, {self.num_heads} heads of "
                              f"{self.head_bytes} bytes is not a block")
        if self.is_replicated and self.num_heads != 1:
            raise LayoutError(f"a replicated layout is one head, not {self.num_heads}")

    @property
    def layer_bytes(self) -> int:
        return self.num_heads * self.head_bytes

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def all_heads(self) -> HeadRange:
        return HeadRange(0, self.num_heads)

    def spans(self, first_layer: int, num_layers: int, heads: HeadRange | None = None) -> list[tuple[int, int]]:
        """(offset, length) in the block of heads ``heads`` (default: all) of layers
        ``[first_layer, first_layer + num_layers)``: one span per layer, or one in all when the
        range covers every head (then the layers are contiguous)."""
        heads = self.all_heads if heads is None else heads
        self.check(first_layer, num_layers, heads)
        if heads == self.all_heads:
            return [(first_layer * self.layer_bytes, num_layers * self.layer_bytes)]
        length = heads.num_heads * self.head_bytes
        return [(layer * self.layer_bytes + heads.start * self.head_bytes, length)
                for layer in range(first_layer, first_layer + num_layers)]

    def slice_bytes(self, num_layers: int, heads: HeadRange | None = None) -> int:
        """Bytes of a slice of ``num_layers`` layers of ``heads`` (what one rank's put carries per block)."""
        return num_layers * (self.num_heads if heads is None else heads.num_heads) * self.head_bytes

    def cut(self, view: memoryview, first_layer: int, num_layers: int, heads: HeadRange,
            out: memoryview | None = None) -> memoryview:
        """Heads ``heads`` out of ``view``, the bytes of layers ``[first_layer, first_layer +
        num_layers)`` of a block: that slice's bytes (in ``out`` when given), laid out as a put
        of that head range carries them."""
        if view.nbytes != num_layers * self.layer_bytes:
            raise LayoutError(f"{view.nbytes} bytes are not {num_layers} layers of {self.layer_bytes}")
        size = self.slice_bytes(num_layers, heads)
        target = memoryview(bytearray(size)) if out is None else out[:size]
        if target.nbytes != size:
            raise LayoutError(f"an output of {target.nbytes} bytes cannot hold a {size}-byte head slice")
        base, at = first_layer * self.layer_bytes, 0
        for offset, length in self.spans(first_layer, num_layers, heads):
            target[at:at + length] = view[offset - base:offset - base + length]
            at += length
        return target

    def check(self, first_layer: int, num_layers: int, heads: HeadRange) -> None:
        if first_layer < 0 or num_layers < 1 or first_layer + num_layers > self.num_layers:
            raise LayoutError(f"layers [{first_layer}, {first_layer + num_layers}) are outside a "
                              f"{self.num_layers}-layer block")
        if heads.stop > self.num_heads:
            raise LayoutError(f"heads [{heads.start}, {heads.stop}) are outside a block of {self.num_heads} heads")

    def to_meta(self) -> dict[str, Any]:
        return {"v": self.version, "heads": self.num_heads, "rep": self.is_replicated}


def check_version(version: Any) -> None:
    """LayoutError unless ``version`` is a layout this code reads."""
    if version not in KNOWN_VERSIONS or isinstance(version, bool):
        raise LayoutError(f"KV block layout version {version!r} is not one this process reads "
                          f"({', '.join(map(str, sorted(KNOWN_VERSIONS)))}): refusing the bytes rather "
                          "than misreading them (are the cluster's roles of different releases?)")


def layout_from_meta(meta: dict[str, Any], num_layers: int, head_bytes: int) -> BlockLayout:
    """The layout a frame's meta names under ``"kvl"`` (``num_layers`` and ``head_bytes`` come
    from the frame's sizes); LayoutError for an unknown version or a malformed entry."""
    raw = meta.get(META_KEY)
    if not isinstance(raw, dict):
        raise LayoutError(f"'{META_KEY}' must be an object {{v, heads, rep}}, got {raw!r}")
    check_version(raw.get("v"))
    heads, rep = raw.get("heads"), raw.get("rep", False)
    if not isinstance(heads, int) or isinstance(heads, bool) or not isinstance(rep, bool):
        raise LayoutError(f"'{META_KEY}' needs an integer 'heads' and a boolean 'rep', got {raw!r}")
    return BlockLayout(num_layers, heads, head_bytes, rep, raw["v"])


def heads_from_meta(meta: dict[str, Any], num_heads: int, field: str = "heads") -> HeadRange:
    """The head range a frame's meta names under ``field`` (absent: all ``num_heads``)."""
    raw = meta.get(field)
    if raw is None:
        return HeadRange(0, num_heads)
    if not (isinstance(raw, list) and len(raw) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in raw)):
        raise LayoutError(f"'{field}' must be [start, stop], got {raw!r}")
    heads = HeadRange(*raw)
    if heads.stop > num_heads:
        raise LayoutError(f"heads [{heads.start}, {heads.stop}) are outside a block of {num_heads} heads")
    return heads
