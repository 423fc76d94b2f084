"""Chained block hashes: the key of block i covers block i's tokens *and* its whole prefix.

key_i = BLAKE2b-128(seed || key_{i-1} || tokens_i as little-endian int32)

Equal keys therefore mean equal whole prefixes, which is what lets any store answer
"longest cached prefix" by walking the key list. Only full blocks get keys: a partial tail
block can still grow, so caching it would be wrong.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

KEY_BYTES = 16
# Tokens per KV block of a live cluster. Prefix reuse works in whole blocks, so a block must be
# small enough that a chat turn (a few hundred tokens) fills some: at 512 a short conversation
# never reused anything. 64 tokens is 2.9 MB of KV for smollm2-135m in float32 and 8 MiB for
# llama3-8b in bf16 — still large transfers. The Mooncake traces count 512-token blocks; the
# simulator keeps those (scheduler/config.py).
DEFAULT_BLOCK_SIZE = 64
DEFAULT_HASH_SEED = 0


def _seed_bytes(seed: int) -> bytes:
    return seed.to_bytes(8, "little", signed=False)


def block_key(prev_key: bytes | None, block_tokens: Sequence[int], seed: int = DEFAULT_HASH_SEED) -> bytes:
    """The 16-byte key of one full block given the key of the block before it (None for the first)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, key=_seed_bytes(seed))
    h.update(prev_key if prev_key is not None else b"\x00" * KEY_BYTES)
    h.update(array("i", block_tokens).tobytes())
    return h.digest()


def prefix_hash(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE,
                seed: int = DEFAULT_HASH_SEED) -> list[bytes]:
    """Keys of every *full* block of ``token_ids`` (the paper's PrefixHash)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys: list[bytes] = []
    prev: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = block_key(prev, token_ids[start:start + block_size], seed)
        keys.append(prev)
    return keys
