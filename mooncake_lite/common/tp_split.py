"""The tensor-parallel split of KV heads, once: which heads a rank holds and which rank of those
holding a head stores and sends it. The model's sharding (``model/tensor_parallel.py``) and the
KV layout's head slices and transfer plans (``transfer/tp_heads.py``) both read it. Pure ints.

At TP = N over H KV heads (one divides the other): N <= H, rank r holds ``[r*H/N, (r+1)*H/N)``;
N > H, each head is replicated on N/H consecutive ranks and rank r holds head ``r // (N/H)``,
the first of those ranks being the one that writes it.
"""

from __future__ import annotations


def kv_head_range(num_kv_heads: int, tp: int, rank: int) -> range:
    """The KV heads rank ``rank`` of ``tp`` holds (the caller has checked the split)."""
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


def writes_kv(num_kv_heads: int, tp: int, rank: int) -> bool:
    """Whether ``rank`` is the first of the ranks holding its heads (a replicated head is stored once)."""
    return rank % max(1, tp // num_kv_heads) == 0
