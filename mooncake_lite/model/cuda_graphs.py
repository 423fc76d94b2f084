"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A small model's decode step on a GPU is launch-bound: a few hundred kernels of microseconds each,
every one launched from Python. Captured once as a CUDA graph, the whole forward is one launch.
A graph replays fixed shapes and addresses, so each bucket (1, 2, 4, 8, 16, 32, 48, 64 sequences,
up to the instance's largest batch) owns static input buffers: token ids, positions, cache slots,
context lengths and block tables at their widest (``width`` blocks: the longest sequence the
cache or the model allows), filled before each replay by one pinned host→device copy. A step of
``n`` sequences runs in the smallest bucket ``≥ n``; the rows beyond ``n`` are padding that
writes its K/V into one block reserved for it (taken from the allocator, so no sequence ever owns
it) and attends to that block alone. The decode attention kernel's launch is one program per
(row, head) and walks each row's own length, so the step's longest sequence does not shape it.
Above the largest bucket, or with a table wider than captured, the step runs eagerly.

Sampling (and any logits masks) stays outside the graph: :meth:`DecodeGraphs.decode` returns the
static logits' first ``n`` rows, which the caller reads before the next step. Within a step the
host does not wait on the device; the caller's read of the sampled tokens is the step's one
synchronisation.

``capture=False`` builds the same buckets and buffers and runs the forward on them eagerly: the
bucketing, padding and fallback run on a CPU (tests), and graphs are captured only on CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mooncake_lite.model.llama import AttentionMetadata
from mooncake_lite.model.runner import ModelRunner

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64)


def graph_buckets(max_batch: int | None, buckets: Sequence[int] = BUCKETS) -> tuple[int, ...]:
    """The buckets worth capturing for batches of at most ``max_batch`` (None: all of them): each
    one below it, and the smallest that holds it."""
    if max_batch is None:
        return tuple(buckets)
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    below = [b for b in buckets if b < max_batch]
    return tuple(below + [next((b for b in buckets if b >= max_batch), max_batch)])


def bucket_for(batch: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``batch`` sequences; None above the largest (run eagerly)."""
    return next((b for b in buckets if b >= batch), None)


@dataclass(frozen=True)
class StepLayout:
    """Where each field sits in one bucket's flat int64 input buffer, ``[5 + width]`` per row
    grouped by field: tokens, positions, slots, context lengths, then the block tables."""
    bucket: int
    width: int

    @property
    def size(self) -> int:
        return self.bucket * (4 + self.width)

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(tokens, positions, slots, context_lens, block_tables) as views of ``flat``."""
        b = self.bucket
        return (flat[:b], flat[b:2 * b], flat[2 * b:3 * b], flat[3 * b:4 * b], flat[4 * b:].view(b, self.width))


def fill_step(out: np.ndarray, layout: StepLayout, token_ids: Sequence[int], block_tables: Sequence[Sequence[int]],
              positions: Sequence[int], *, block_size: int, pad_block: int) -> None:
    """Write one step's inputs into ``out`` (int64, ``layout.size``), padded to the bucket: rows
    past ``len(token_ids)`` are token 0 at position 0 of the pad block; every table is padded to
    ``width`` with the pad block (never read past a row's length). Raises ValueError for a batch
    or a table the layout cannot hold."""
    n, b, w = len(token_ids), layout.bucket, layout.width
    widest = max((len(t) for t in block_tables), default=0)
    if n > b or widest > w or len(block_tables) != n or len(positions) != n:
        raise ValueError(f"a step of {n} sequences (tables up to {widest} blocks) does not fit bucket {b} "
                         f"of width {w}, or its fields differ in length")
    pos = np.asarray(positions, dtype=np.int64)
    tables = out[4 * b:].reshape(b, w)
    tables.fill(pad_block)
    for i, table in enumerate(block_tables):
        tables[i, :len(table)] = table
    out[:n] = token_ids
    out[n:b] = 0
    out[b:b + n] = pos
    out[b + n:2 * b] = 0
    out[2 * b:2 * b + n] = tables[np.arange(n), pos // block_size] * block_size + pos % block_size
    out[2 * b + n:3 * b] = pad_block * block_size
    out[3 * b:3 * b + n] = pos + 1
    out[3 * b + n:4 * b] = 1


def default_width(runner: ModelRunner) -> int:
    """Block-table width the buckets are captured at: the model's longest sequence, or the whole
    cache where that is smaller."""
    return min(-(-runner.args.max_seq_len // runner.block_size), runner.allocator.num_blocks)


@dataclass
class _Bucket:
    """One bucket's buffers: the pinned host staging (and its numpy view), the device inputs the
    graph reads, the graph and its output once captured, and the event after the last copy."""
    layout: StepLayout
    host: torch.Tensor
    staged: np.ndarray
    inputs: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None


class DecodeGraphs:
    """A runner's decode steps through per-bucket static buffers, replayed as CUDA graphs
    (``capture=True``, CUDA only) or run eagerly on the same buffers (``capture=False``). Takes
    one block of the runner's allocator for the padding rows."""

    def __init__(self, runner: ModelRunner, buckets: Sequence[int] = BUCKETS, *, capture: bool,
                 width: int | None = None):
        if capture and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the runner is on {runner.device}")
        self.runner = runner
        self.width = width or default_width(runner)
        self.pad_block = runner.allocator.allocate(1)[0]
        self.buckets = {b: self._buffers(StepLayout(b, self.width)) for b in sorted(buckets)}
        self.num_eager = 0
        self.num_bucketed = 0
        if capture:
            self._capture_all()

    def _buffers(self, layout: StepLayout) -> _Bucket:
        on_cuda = self.runner.device.type == "cuda"
        host = torch.zeros(layout.size, dtype=torch.int64, pin_memory=on_cuda)
        staged = host.numpy()
        fill_step(staged, layout, [], [], [], block_size=self.runner.block_size, pad_block=self.pad_block)
        return _Bucket(layout, host, staged, host.to(self.runner.device))

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        tokens, positions, slots, lens, tables = bucket.layout.views(bucket.inputs)
        meta = AttentionMetadata(is_prefill=False, positions=positions, slot_mapping=slots, block_tables=tables,
                                 context_lens=lens)
        return self.runner.model(tokens, meta, self.runner.cache)

    @torch.no_grad()
    def _capture_all(self) -> None:
        """Largest bucket first, so the smaller ones reuse its memory pool. Each is run twice on a
        side stream before its capture (Triton compiles, the allocator settles), on padding only."""
        pool = None
        for size in sorted(self.buckets, reverse=True):
            bucket = self.buckets[size]
            side = torch.cuda.Stream(self.runner.device)
            side.wait_stream(torch.cuda.current_stream(self.runner.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(bucket)
            torch.cuda.current_stream(self.runner.device).wait_stream(side)
            bucket.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bucket.graph, pool=pool):
                bucket.logits = self._forward(bucket)
            pool = bucket.graph.pool()
        torch.cuda.synchronize(self.runner.device)
        log.info("decode CUDA graphs captured for batch buckets %s (block tables %d wide)",
                 ",".join(map(str, self.buckets)), self.width)

    @torch.no_grad()
    def decode(self, token_ids: Sequence[int], block_tables: Sequence[Sequence[int]],
               positions: Sequence[int]) -> torch.Tensor:
        """``ModelRunner.decode``'s contract; the result is a view of this bucket's static logits
        (read it before the next step)."""
        size = bucket_for(len(token_ids), tuple(self.buckets))
        if size is None or max(len(t) for t in block_tables) > self.width:
            self.num_eager += 1
            return self.runner.decode(token_ids, block_tables, positions)
        bucket = self.buckets[size]
        if bucket.copied is not None:
            bucket.copied.synchronize()   # the last step's copy out of the staging is done (it always
            # is by now: its tokens were read); refilling before it would race the DMA
        fill_step(bucket.staged, bucket.layout, token_ids, block_tables, positions,
                  block_size=self.runner.block_size, pad_block=self.pad_block)
        bucket.inputs.copy_(bucket.host, non_blocking=True)
        if self.runner.device.type == "cuda":
            bucket.copied = torch.cuda.Event()
            bucket.copied.record()
        self.num_bucketed += 1
        if bucket.graph is None:
            return self._forward(bucket)[:len(token_ids)]
        bucket.graph.replay()
        return bucket.logits[:len(token_ids)]
