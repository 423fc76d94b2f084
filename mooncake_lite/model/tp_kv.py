"""Which part of a KV tensor each rank of a tensor-parallel group holds: a rank's heads of one
that holds some of the instance's heads, every rank's joined into the instance's (a replicated
head taken once), and a loaded prefix's slots. Used by ``model/tp_step.py``'s steps."""

from __future__ import annotations

import torch

from mooncake_lite.model.tensor_parallel import TPLayout


def owners(parts: list[torch.Tensor], layout: TPLayout, dim: int) -> torch.Tensor:
    """The whole model's KV heads from every rank's: each replicated head taken once."""
    return torch.cat([p for r, p in enumerate(parts) if r % layout.kv_replicas == 0], dim=dim)


# The KV-heads axis of what moves: whole blocks (``pack_kv``: [blocks, layers, heads, 2, block_size,
# head_dim], the store's head-major layout, transfer/kv_layout.py) and token frames (``gather_kv``:
# [2, tokens, heads, head_dim]).
PACKED_HEADS, FRAME_HEADS = 2, 2


def my_heads(data: torch.Tensor, layout: TPLayout, dim: int,
             heads: range | None = None) -> tuple[torch.Tensor, range | None] | None:
    """This rank's part of ``data``, which holds the instance's KV heads ``heads`` (None: all),
    and where that part goes among the rank's own heads (None: all of them); None when the rank
    holds none of ``heads``."""
    mine = layout.kv_heads
    heads = range(layout.args.num_kv_heads) if heads is None else heads
    lo, hi = max(mine.start, heads.start), min(mine.stop, heads.stop)
    if lo >= hi:
        return None
    local = None if (lo, hi) == (mine.start, mine.stop) else range(lo - mine.start, hi - mine.start)
    return data.narrow(dim, lo - heads.start, hi - lo), local


def prefix_slots(block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Every slot of whole blocks ``block_ids``, in order (a loaded prefix's tokens)."""
    return (block_ids[:, None] * block_size + torch.arange(block_size, device=block_ids.device)).reshape(-1)
