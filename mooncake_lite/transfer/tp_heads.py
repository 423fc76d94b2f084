"""Which KV heads each tensor-parallel rank holds, which rank writes them, and which prefill rank
sends which heads to which decode rank (docs/store.md §2g). Pure: no IO, no torch.

Heads are split in contiguous ranges, Megatron-style: at TP = N with H KV heads,

* N <= H (N divides H): rank r holds heads ``[r*H/N, (r+1)*H/N)``, no two ranks the same;
* N > H (H divides N): each head is replicated on N/H consecutive ranks, rank r holds head
  ``r // (N/H)``; the first of them writes it to the store (a replicated head is stored once);
* a replicated layout (MLA's latent) is one "head" that every rank holds; rank 0 writes it.

A transfer between TP degrees sends each head a decode rank needs from exactly one prefill rank
that holds it: decode ranks asking for the same head are spread over its holders.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_lite.common.tp_split import kv_head_range, writes_kv
from mooncake_lite.transfer.kv_layout import HeadRange, LayoutError


@dataclass(frozen=True, slots=True)
class HeadTransfer:
    """Prefill rank ``src_rank`` sends KV heads ``heads`` to decode rank ``dst_rank``."""
    src_rank: int
    dst_rank: int
    heads: HeadRange


def check_split(num_kv_heads: int, tp: int) -> None:
    """LayoutError unless ``num_kv_heads`` heads can be split over ``tp`` ranks."""
    if tp < 1 or num_kv_heads < 1:
        raise LayoutError(f"cannot split {num_kv_heads} KV heads over {tp} ranks")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise LayoutError(f"{num_kv_heads} KV heads cannot be split over {tp} tensor-parallel ranks: "
                          "one must divide the other")


def rank_heads(num_kv_heads: int, tp: int, rank: int, *, is_replicated: bool = False) -> HeadRange:
    """The KV heads rank ``rank`` of ``tp`` holds (a replicated layout: its one head, on every rank)."""
    if is_replicated:
        num_kv_heads = 1
    check_split(num_kv_heads, tp)
    if not 0 <= rank < tp:
        raise LayoutError(f"rank {rank} outside a TP group of {tp}")
    heads = kv_head_range(num_kv_heads, tp, rank)
    return HeadRange(heads.start, heads.stop)


def writes_heads(num_kv_heads: int, tp: int, rank: int, *, is_replicated: bool = False) -> bool:
    """Whether ``rank`` writes its heads to the store: the first of the ranks holding them."""
    if is_replicated:
        num_kv_heads = 1
    check_split(num_kv_heads, tp)
    return writes_kv(num_kv_heads, tp, rank)


def plan_head_transfers(num_kv_heads: int, src_tp: int, dst_tp: int, *,
                        is_replicated: bool = False) -> list[HeadTransfer]:
    """Every (prefill rank, decode rank, heads) a prefill at TP ``src_tp`` sends a decode at TP
    ``dst_tp``, in decode-rank order: each decode rank gets each of its heads exactly once, and
    consecutive heads from one prefill rank travel as one range."""
    plan: list[HeadTransfer] = []
    for dst in range(dst_tp):
        want = rank_heads(num_kv_heads, dst_tp, dst, is_replicated=is_replicated)
        for head in range(want.start, want.stop):
            holders = [r for r in range(src_tp)
                       if _holds(rank_heads(num_kv_heads, src_tp, r, is_replicated=is_replicated), head)]
            src = holders[dst % len(holders)]
            last = plan[-1] if plan else None
            if last is not None and (last.src_rank, last.dst_rank, last.heads.stop) == (src, dst, head):
                plan[-1] = HeadTransfer(src, dst, HeadRange(last.heads.start, head + 1))
            else:
                plan.append(HeadTransfer(src, dst, HeadRange(head, head + 1)))
    return plan


def _holds(heads: HeadRange, head: int) -> bool:
    return heads.start <= head < heads.stop
