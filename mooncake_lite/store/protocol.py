"""The store's data-plane messages, carried as frames of ``mooncake_lite.transfer``.

Every request is one frame whose meta is a JSON object; ``keys`` is one hex string, 32
characters per key (a list of 32-character hex strings is accepted too). Block
bytes travel only as raw payload, back to back in key order. Replies use the same op with
FLAG_REPLY; errors are error frames ``{"error": code, "message": text}`` with code one of
``bad_request``, ``full``, ``unknown_op``, ``peer_error``.

| op | request meta | request payload | reply meta | reply payload |
|---|---|---|---|---|
| PUT | keys, sizes, num_layers, first_pos, first_layer + block_layers (a slice), kvl (layout), heads | the blocks | num_new | - |
| GET | keys | - | sizes (null = miss), num_layers (per key, null = miss) | found blocks |
| GET_LAYERS | keys, first_layer, num_layers, heads + kvl (optional) | - | sizes, num_layers (of the block) | layer slices (of those heads) |
| MATCH | keys, lease_s (optional) | - | num_matched (longest prefix held in any tier), lease_id | - |
| EXISTS | keys | - | exists (list of bool) | - |
| DELETE | keys | - | num_deleted | - |
| REPLICATE | keys, peer ("host:port"), first_pos | - | num_copied, num_present, num_missing, num_bytes (pulled) | - |
| RELEASE | lease_id | - | released (bool) | - |
| SHM_ATTACH | - | - | a staging area's offer (pid, fd, size, nonce, host) | - |
| SHM_READY | - | - | ok | - |
| READ_DONE | reads (read lease ids) | - | (no reply: one-way, request id 0) | - |
| FAST_ATTACH | - | - | socket (an abstract Unix socket's name), secret (hex) | - |
| PIN | keys, pin (owner id), expires_at (unix s) | - | num_held (of keys, held in any tier) | - |
| UNPIN | pin | - | released (bool) | - |

PIN holds a cached context's blocks against eviction until ``expires_at`` (a repeated PIN of the
same owner replaces its keys and expiry); holds are journaled beside the SSD files.

Same-node fast path (docs/store.md): a GET/GET_LAYERS with ``shm: true`` is answered with
``spans`` ([offset, slot, generation] per block in the shared slab, under the read lease
``read``) instead of payload; a PUT with ``staged`` (one offset per key in the connection's
staging area) carries no payload. Any request of a same-node client may carry ``reads_done``
(read lease ids it has finished with, as READ_DONE's ``reads``): the store ends those leases
before handling the request.

``kvl`` names the blocks' layout (``transfer/kv_layout.py``: ``{"v", "heads", "rep"}``); a
version the store does not keep is refused (``bad_request``), and the store's HELLO answer names
the version it keeps (``kvl``), which a prefill checks at start. A slice PUT with ``heads``
([start, stop), with ``kvl``) carries only those KV heads of its layers: a tensor-parallel rank's;
a GET_LAYERS with ``heads`` and ``kvl`` is answered with only those heads of each layer (one run
per layer, back to back), so a rank reads its share, not the whole layer range.

A PUT with ``first_layer`` carries one layer slice per key: layers ``[first_layer, first_layer +
num_layers)`` of blocks of ``block_layers`` layers (a CPP stage's). The store assembles them
(``store/assembly.py``): a block becomes visible, and its block event goes out, only once every
layer has arrived; ``num_new`` counts the blocks a slice completed. A slice of a block the store
holds, or of a range already put, is a no-op; one out of range, overlapping a range in part, or
of another layer size than the block's first slice is refused (``bad_request``); unfinished
blocks expire. A same-node client may stage slices too (``staged``, as whole blocks are;
``store/shm.py``): they land in the same assembly.

``first_pos`` is the chain position of ``keys[0]`` (used by length-aware eviction). MATCH with
``lease_s`` also brings the matched prefix into DRAM and pins it for up to ``lease_s`` seconds (at
most the store's ``--lease-ttl``), until RELEASE, or until the connection closes, so blocks found
by a match cannot be evicted before the layer-wise loads that follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import Any

from mooncake_lite.common.hashing import KEY_BYTES
from mooncake_lite.transfer.client import split_address
from mooncake_lite.transfer.kv_layout import META_KEY, BlockLayout, HeadRange, LayoutError, heads_from_meta, layout_from_meta


class Op(IntEnum):
    PUT = 1
    GET = 2
    GET_LAYERS = 3
    MATCH = 4
    EXISTS = 5
    DELETE = 6
    REPLICATE = 7
    RELEASE = 8
    SHM_ATTACH = 9
    SHM_READY = 10
    READ_DONE = 11
    FAST_ATTACH = 12   # the same-node single-block channel: one-key gets and puts (store/fastget.py)
    PIN = 16       # context holds (conductor/contexts.py)
    UNPIN = 17


class MetaError(ValueError):
    """A request meta is malformed (reported to the client as ``bad_request``)."""


def keys_to_hex(keys: Sequence[bytes]) -> str:
    """All keys as one hex string (32 characters per key): one C call each way instead of one
    string per key, which matters for batches of hundreds of blocks."""
    for key in keys:
        if len(key) != KEY_BYTES:
            raise ValueError(f"keys must be {KEY_BYTES} bytes, got {len(key)}")
    return b"".join(keys).hex()


def keys_from_meta(meta: dict[str, Any], field: str = "keys") -> list[bytes]:
    """Keys from one concatenated hex string, or from a list of 32-character hex strings."""
    raw = meta.get(field)
    width = 2 * KEY_BYTES
    if isinstance(raw, list):
        if not all(isinstance(item, str) and len(item) == width for item in raw):
            bad = next(item for item in raw if not isinstance(item, str) or len(item) != width)
            raise MetaError(f"bad key {str(bad)[:40]!r}: expected {width} hex characters")
        raw = "".join(raw)
    if not isinstance(raw, str) or len(raw) % width:
        raise MetaError(f"'{field}' must be a hex string of {width} characters per key "
                        f"(or a list of such keys)")
    try:
        flat = bytes.fromhex(raw)
    except ValueError:
        raise MetaError(f"'{field}' is not hex") from None
    if len(flat) * 2 != len(raw):  # fromhex skips whitespace; keys never contain any
        raise MetaError(f"'{field}' is not hex")
    return [flat[i:i + KEY_BYTES] for i in range(0, len(flat), KEY_BYTES)]


def int_from_meta(meta: dict[str, Any], field: str, default: int | None = None, minimum: int = 0) -> int:
    value = meta.get(field, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise MetaError(f"'{field}' must be an integer >= {minimum}, got {value!r}")
    return value


def sizes_from_meta(meta: dict[str, Any], count: int) -> list[int]:
    sizes = meta.get("sizes")
    if not isinstance(sizes, list) or len(sizes) != count or \
            not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
        raise MetaError(f"'sizes' must be {count} positive integers (one per key)")
    return sizes


def check_layout(meta: dict[str, Any]) -> None:
    """MetaError unless a put's ``kvl`` (its blocks' layout, ``transfer/kv_layout.py``), when it
    names one, is a layout version this store keeps: bytes of another are refused, never kept to
    be misread. A put without it is raw bytes (benchmarks, tests); the cluster's prefills name it."""
    if META_KEY in meta:
        try:
            layout_from_meta(meta, 1, 1)
        except LayoutError as exc:
            raise MetaError(str(exc)) from None


def heads_from_read(meta: dict[str, Any]) -> tuple[int, HeadRange] | None:
    """A GET_LAYERS's head range and its blocks' head count (``heads`` with ``kvl``), or None for
    every head. MetaError for a range without a layout, an unknown version, a range out of bounds."""
    if "heads" not in meta:
        return None
    if META_KEY not in meta:
        raise MetaError("a head range read ('heads') needs the blocks' layout ('kvl')")
    try:
        num_heads = layout_from_meta(meta, 1, 1).num_heads
        return num_heads, heads_from_meta(meta, num_heads)
    except LayoutError as exc:
        raise MetaError(str(exc)) from None


def head_spans(block_bytes: int, num_layers: int, first_layer: int, count: int,
               read: tuple[int, HeadRange]) -> list[tuple[int, int]]:
    """(offset in the block, nbytes) of a head range read of layers ``[first_layer, +count)``:
    one run per layer. MetaError where the block's layers do not split into that many heads."""
    num_heads, heads = read
    layer_bytes = block_bytes // num_layers
    if layer_bytes % num_heads:
        raise MetaError(f"a {layer_bytes}-byte layer does not split into {num_heads} heads")
    try:
        return BlockLayout(num_layers, num_heads, layer_bytes // num_heads).spans(first_layer, count, heads)
    except LayoutError as exc:
        raise MetaError(str(exc)) from None


def parse_peer(peer: Any) -> tuple[str, int]:
    try:
        return split_address(peer)
    except ValueError as exc:
        raise MetaError(f"'peer' {exc}") from None
