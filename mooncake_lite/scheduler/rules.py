"""The scheduler's choice rules, each written once: change a rule here and every path follows.

Algorithm 1 (docs/paper.md §2) costs each prefill instance with the prefix it would run with —
its own, or the best one in the cluster fetched to it (:func:`fetches_best_prefix`) — and picks
the smallest cost key (:func:`prefill_cost_key`, its predicted TTFT); the decode pick takes, of
the instances with room (:func:`decode_has_room`), the smallest predicted TBT with the request
added (``DecodeCostModel.predict``). Ties go to the earlier instance everywhere.

The paths that decide only produce the estimates these functions read: the per-instance loops
(``prefill_select.py``, ``admission.py``), the wide clusters' arrays (``wide.py``: a rule given
numpy rows computes every row at once, with the same IEEE-754 operations in the same order, so
the same keys) and the compiled build. Callers reach the rules through this module
(``rules.prefill_cost_key(...)``), so replacing one here (a test's monkeypatch) changes them all.
"""

from __future__ import annotations

from typing import overload

import numpy as np


def fetches_best_prefix(local_blocks: int, best_blocks: int, threshold: float) -> bool:
    """Algorithm 1's branch: whether an instance holding ``local_blocks`` of the prompt's prefix
    is costed with the best prefix in the cluster (``best_blocks``) fetched to it. The paper's
    ``best_len / prefix_len < kvcache_balancing_threshold`` keeps the local prefix; no local
    prefix at all makes the ratio infinite (fetch, if anything is cached)."""
    return local_blocks < best_blocks and (not local_blocks or best_blocks / local_blocks >= threshold)


@overload
def prefill_cost_key(transfer_s: float, queue_s: float, prefill_s: float) -> float: ...


@overload     # the wide path: one key per row
def prefill_cost_key(transfer_s: float | np.ndarray, queue_s: np.ndarray, prefill_s: float | np.ndarray
                     ) -> np.ndarray: ...


def prefill_cost_key(transfer_s: float | np.ndarray, queue_s: float | np.ndarray,
                     prefill_s: float | np.ndarray) -> float | np.ndarray:
    """Algorithm 1's cost key of one prefill instance: the predicted TTFT, its KV transfer (0
    when it keeps its local prefix), the queue ahead of the request and the request's own
    prefill, summed in this order (floats, or numpy rows of them)."""
    key = transfer_s + queue_s
    key += prefill_s        # (a fresh sum, so rows add in place: one array fewer a call)
    return key


def decode_has_room(max_batch_size: int | None, max_context_tokens: int | None, batch_size: int,
                    context_tokens: int, need_tokens: int) -> bool:
    """Whether a decode instance running ``batch_size`` sequences of ``context_tokens`` takes
    one more that may grow to ``need_tokens`` (prompt + max_tokens). None: no limit."""
    return (max_batch_size is None or batch_size < max_batch_size) and \
        (max_context_tokens is None or context_tokens + need_tokens <= max_context_tokens)
