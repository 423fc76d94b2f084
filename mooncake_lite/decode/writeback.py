"""The decode's write-back of generated tokens' full blocks to its store (issue #37).

A block a sequence's tokens fill (the prompt's partial tail, then its output) goes to the store
under the chained key a prefill of prompt + output computes (``common/hashing.block_key`` from the
prompt's last full block's key, which the prefill's END frame names with the tail's ids:
``decode/pending.ResumePoint``). So a continuation of a request whose decode died, and the
conversation's next turn, find those blocks in the store: at most the last partial block is
recomputed.

Never in a step's way: after each step the engine says which sequences fed which token
(:meth:`GeneratedBlocks.stepped`); a block whose last position the step just wrote is packed in
the model thread (a copy: queued there before any later step or KV write, so before its blocks
can be freed and reused) and put in the background. At most ``max_blocks`` are in flight; beyond
that a block is dropped and counted, not queued (a slow store must not hold host memory hostage).
Failures are counted and the first of each kind logged. Under ``--kv-compression`` the blocks are
encoded as the prefill's writes are (``kernels/kv_codec.encode_heads``: the same bytes for the
same KV), in a worker thread, not the model's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import torch

from mooncake_kernels.copies import Copier, Staged
from mooncake_kernels.kv_codec import KVCodec, encode_heads
from mooncake_lite.common.hashing import block_key
from mooncake_lite.decode.batcher import StepPlan
from mooncake_lite.decode.pending import ResumePoint
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.store.link import StoreLink
from mooncake_lite.transfer.framing import as_bytes_view
from mooncake_lite.transfer.kv_layout import BlockLayout

log = logging.getLogger(__name__)

MAX_BLOCKS = 32   # blocks packed or being put at once; more are dropped (counted)


class BlockPuts(Protocol):
    """Where whole blocks go (``prefill/store_io.PrefixStore``'s put, which an in-process
    store in tests has too)."""

    async def put_layers(self, keys: Sequence[bytes], values: Sequence[memoryview], first_layer: int,
                         num_layers: int, first_pos: int = 0) -> None: ...


class StorePuts:
    """:class:`BlockPuts` on the store role, through a kept connection (``store/link.py``: a store
    that stops answering is skipped until it answers again); blocks named in this release's
    layout (whole model's heads). ``encoding``: this decode's --kv-compression; a store that keeps
    blocks otherwise is written nothing (each put fails naming both: counted, logged once) rather
    than sent blocks its readers would misread."""

    def __init__(self, address: str, token: str | None, layout: BlockLayout, encoding: str = "none") -> None:
        self.address, self.layout, self.encoding = address, layout, encoding
        self.link = StoreLink(address, token, "decode-writeback")

    async def put_layers(self, keys: Sequence[bytes], values: Sequence[memoryview], first_layer: int,
                         num_layers: int, first_pos: int = 0) -> None:
        kept = (await self.link.client()).frames.hello.get("kv_compression")
        if isinstance(kept, str) and kept != self.encoding:
            raise ValueError(f"store {self.address} keeps KV blocks as {kept} (--kv-compression) but this decode "
                             f"writes {self.encoding}: give every role of the cluster the same value")
        await self.link.call(lambda c: c.put(keys, values, num_layers=num_layers, first_pos=first_pos,
                                             layout=self.layout))

    async def close(self) -> None:
        await self.link.close()


@dataclass
class _Chain:
    """One sequence's chain: its last full block's key, and the ids of the block it is filling."""
    key: bytes | None
    tokens: list[int]


class GeneratedBlocks:
    def __init__(self, runner: ModelRunner, executor: Executor, puts: BlockPuts, hash_seed: int,
                 copier: Copier | None = None, max_blocks: int = MAX_BLOCKS, codec: KVCodec | None = None) -> None:
        self.runner, self.executor, self.puts, self.hash_seed = runner, executor, puts, hash_seed
        self.codec = codec   # --kv-compression's (None: blocks go in the model's dtype)
        self.copier = copier or Copier(runner.device)
        self.max_blocks = max_blocks
        self.chains: dict[str, _Chain] = {}      # by sequence key (the batcher's)
        self.tasks: set[asyncio.Task] = set()
        self.num_in_flight = 0
        self.num_written = self.num_dropped = self.num_failed = 0
        self._logged: set[str] = set()

    def start(self, seq_keys: Sequence[str], resume: ResumePoint) -> None:
        """Sequences that joined the batch, whose prompt's chain ``resume`` names (none: a
        sender that did not say, so nothing of theirs is written)."""
        if resume.tail is not None:
            for key in seq_keys:
                self.chains[key] = _Chain(resume.key, list(resume.tail))

    def stepped(self, plan: StepPlan, live: set[str] | dict) -> None:
        """A step wrote the KV of ``plan.token_ids`` at ``plan.positions``: the blocks that filled
        are keyed, packed and put. Call before the step's tokens are committed (which may free a
        finished sequence's blocks); ``live``: the sequences still held (the others are forgotten)."""
        for key in [k for k in self.chains if k not in live]:
            del self.chains[key]
        full: list[tuple[bytes, int, int]] = []    # (key, block id, block position)
        bs = self.runner.block_size
        for key, token, pos, table in zip(plan.keys, plan.token_ids, plan.positions, plan.block_tables):
            chain = self.chains.get(key)
            if chain is None:
                continue
            chain.tokens.append(token)
            if len(chain.tokens) == bs:
                chain.key, chain.tokens = block_key(chain.key, chain.tokens, self.hash_seed), []
                full.append((chain.key, table[pos // bs], pos // bs))
        if full:
            self._write(full)

    def _write(self, full: list[tuple[bytes, int, int]]) -> None:
        room = self.max_blocks - self.num_in_flight
        if room < len(full):
            self.num_dropped += len(full) - max(room, 0)
            full = full[:max(room, 0)]
        if not full:
            return
        self.num_in_flight += len(full)
        loop = asyncio.get_running_loop()
        packed = loop.run_in_executor(self.executor, self._pack, [block_id for _, block_id, _ in full])
        task = asyncio.ensure_future(self._put(packed, full))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _pack(self, block_ids: list[int]) -> Staged:
        """In the model thread: a copy of the blocks (on CUDA, to pinned host memory on the copy stream)."""
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=self.runner.cache.kv.device)
        return self.copier.to_host(self.runner.pack_kv(ids))

    async def _put(self, packed: asyncio.Future, full: list[tuple[bytes, int, int]]) -> None:
        staged = None
        try:
            staged = await packed
            await staged.ready()
            num_layers = self.runner.args.num_layers
            blocks = staged.tensor if self.codec is None else await asyncio.to_thread(encode_heads, staged.tensor,
                                                                                      self.codec)
            for (key, _, position), block in zip(full, blocks):
                try:
                    await self.puts.put_layers([key], [as_bytes_view(block.contiguous().view(torch.uint8).numpy())],
                                               0, num_layers, first_pos=position)
                    self.num_written += 1
                except Exception as exc:   # counted and said once a kind; the decode goes on
                    self._failed(exc)
        except Exception as exc:
            self._failed(exc, len(full))
        finally:
            self.num_in_flight -= len(full)
            if staged is not None:
                staged.release()

    def _failed(self, exc: BaseException, num_blocks: int = 1) -> None:
        self.num_failed += num_blocks
        kind = type(exc).__name__
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("writing generated blocks to the store failed (%s: %s); later failures of this kind "
                        "are only counted (mooncake_decode_writeback_blocks_failed_total)", kind, exc)

    async def drain(self) -> None:
        while self.tasks:
            await asyncio.wait(set(self.tasks))

    def figures(self) -> dict[str, float]:
        return {"writeback_blocks_total": self.num_written, "writeback_blocks_dropped_total": self.num_dropped,
                "writeback_blocks_failed_total": self.num_failed}
