"""ModelRunner: the model plus its paged cache, driven by prefill chunks and batched decode steps.

The runner holds no per-sequence state: callers own block tables (allocated from
``runner.allocator``) and positions. Prefill can run whole (``prefill``) or layer by layer
(``LayerwisePass``), which is how layer-wise KV streaming and pipeline stages drive it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mooncake_kernels import gather_tokens, pack_blocks, scatter_tokens, unpack_blocks
from mooncake_kernels.quant_linear import float_activations
from mooncake_lite.model.grammar import Grammars
from mooncake_lite.model.kv_cache import BlockAllocator, PagedKVCache, slot_mapping
from mooncake_lite.model.llama import AttentionMetadata, Transformer


class ModelRunner:
    # Whether the ranks of a tensor-parallel instance each send their own heads of computed
    # layers, and each read and write their own heads in a store (model/tp_step.TPLeaderRunner):
    # a one-process instance has one "rank", rank 0, which does all of it itself.
    ranks_send = False
    ranks_store = False

    def __init__(self, model: Transformer, *, num_blocks: int, block_size: int, grammars: Grammars | None = None):
        param = next(model.parameters())
        self.model = model
        self.grammars = grammars   # requests' structured-output grammars (model/grammar.py)
        self.args = model.args
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        self.cache = PagedKVCache(model.args, num_blocks, block_size, dtype=self.dtype, device=self.device,
                                  layer_range=(model.first_layer, model.end_layer))
        self.allocator = BlockAllocator(num_blocks)

    # --- KV in and out of the cache (a tensor-parallel leader's also moves its followers') --
    def gather_kv(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """``[2, len(slots), kv_heads, head_dim]``: layer ``layer``'s K and V at flat slots."""
        return gather_tokens(self.cache.kv, self.cache.local_layer(layer), slots)

    def pack_kv(self, block_ids: torch.Tensor) -> torch.Tensor:
        """``[len(block_ids), layers, kv_heads, 2, block_size, head_dim]``: whole blocks, head-major."""
        return pack_blocks(self.cache.kv, block_ids)

    def unpack_kv(self, layer: int, block_ids: torch.Tensor, packed: torch.Tensor) -> None:
        """Write :meth:`pack_kv`-shaped blocks into the cache from layer ``layer`` on."""
        unpack_blocks(self.cache.kv, block_ids, packed, self.cache.local_layer(layer))

    def scatter_kv(self, layer: int, slots: torch.Tensor, data: torch.Tensor, heads: range | None = None) -> None:
        """Write :meth:`gather_kv`-shaped K and V into layer ``layer`` at flat slots; ``heads``:
        the KV heads ``data`` holds when not all (a TP prefill rank's slice of a frame)."""
        if heads is None:
            scatter_tokens(self.cache.kv, self.cache.local_layer(layer), slots, data)
            return
        layer_kv = self.cache.kv[self.cache.local_layer(layer)].flatten(1, 2)   # [2, slots, kv_heads, head_dim]
        layer_kv[:, slots, heads.start:heads.stop] = data.to(layer_kv.dtype)

    @property
    def kv_senders(self) -> tuple[range, ...] | None:
        """The KV heads each rank that stores and sends them holds, in rank order (one range
        per writing rank: ``common/tp_split.py``); None for a one-process instance (all heads
        in one piece)."""
        return None

    # --- metadata -------------------------------------------------------------------------------
    def prefill_meta(self, block_table: Sequence[int], start_pos: int, num_tokens: int) -> AttentionMetadata:
        end = start_pos + num_tokens
        if -(-end // self.block_size) > len(block_table):
            raise ValueError(f"block table of {len(block_table)} blocks cannot hold {end} tokens")
        return AttentionMetadata(
            is_prefill=True,
            positions=torch.arange(start_pos, end, device=self.device),
            slot_mapping=slot_mapping(block_table, start_pos, end, self.block_size).to(self.device),
            block_tables=torch.as_tensor([list(block_table)], dtype=torch.long, device=self.device),
            context_lens=torch.tensor([end], device=self.device),
            start_pos=start_pos)

    def packed_prefill_meta(self, seqs: Sequence[tuple[Sequence[int], int, int]]) -> AttentionMetadata:
        """Several sequences' prefill chunks in one forward: ``seqs`` holds (block table, start_pos,
        num_tokens) per sequence; their tokens are concatenated in that order."""
        metas = [self.prefill_meta(table, start, n) for table, start, n in seqs]
        width = max(len(t) for t, _, _ in seqs)
        offsets, segments = 0, []
        for _, start, n in seqs:
            segments.append((offsets, n, start))
            offsets += n
        return AttentionMetadata(
            is_prefill=True,
            positions=torch.cat([m.positions for m in metas]),
            slot_mapping=torch.cat([m.slot_mapping for m in metas]),
            block_tables=torch.as_tensor([list(t) + [t[0]] * (width - len(t)) for t, _, _ in seqs],
                                         dtype=torch.long, device=self.device),
            context_lens=torch.cat([m.context_lens for m in metas]),
            segments=tuple(segments))

    def decode_meta(self, block_tables: Sequence[Sequence[int]], positions: Sequence[int]) -> AttentionMetadata:
        width = max(len(t) for t in block_tables)
        padded = [list(t) + [t[0]] * (width - len(t)) for t in block_tables]
        slots = [t[p // self.block_size] * self.block_size + p % self.block_size
                 for t, p in zip(block_tables, positions)]
        return AttentionMetadata(
            is_prefill=False,
            positions=torch.as_tensor(list(positions), device=self.device),
            slot_mapping=torch.as_tensor(slots, dtype=torch.long, device=self.device),
            block_tables=torch.as_tensor(padded, dtype=torch.long, device=self.device),
            context_lens=torch.as_tensor([p + 1 for p in positions], device=self.device))

    # --- compute --------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, token_ids: Sequence[int], block_table: Sequence[int], start_pos: int = 0,
                chunk_size: int | None = None) -> torch.Tensor:
        """Compute ``token_ids`` at positions ``start_pos..``, attending to whatever the cache already
        holds before ``start_pos``; in chunks of ``chunk_size`` tokens. Returns the last position's logits."""
        chunk = chunk_size or len(token_ids)
        logits = None
        for off in range(0, len(token_ids), chunk):
            piece = LayerwisePass(self, block_table, start_pos + off, token_ids=token_ids[off:off + chunk])
            for layer in self.model.layer_ids:
                piece.run_layer(layer)
            logits = piece.output()
        if logits is None:
            raise ValueError("prefill needs at least one token")
        return logits

    @torch.no_grad()
    def prefill_packed(self, seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]]) -> torch.Tensor:
        """One forward over several sequences' new tokens, ``seqs`` = (block table, start_pos,
        token ids) each; returns each sequence's last-position logits ``[num_seqs, vocab]``."""
        piece = PackedPass(self, seqs)
        for layer in self.model.layer_ids:
            piece.run_layer(layer)
        return piece.output()

    @torch.no_grad()
    def decode(self, token_ids: Sequence[int], block_tables: Sequence[Sequence[int]],
               positions: Sequence[int]) -> torch.Tensor:
        """One step for a batch: token i sits at ``positions[i]`` of sequence i. Returns [batch, vocab]."""
        meta = self.decode_meta(block_tables, positions)
        tokens = torch.as_tensor(list(token_ids), device=self.device)
        return self.model(tokens, meta, self.cache)


class LayerwisePass:
    """One prefill chunk, advanced one layer at a time by the caller.

    First stage: pass ``token_ids``; later pipeline stages: pass the previous stage's ``hidden``.
    After the last layer, :meth:`output` gives the last position's logits on the final stage and
    the hidden states (to send to the next stage) otherwise.
    """

    def __init__(self, runner: ModelRunner, block_table: Sequence[int], start_pos: int, *,
                 token_ids: Sequence[int] | None = None, hidden: torch.Tensor | None = None, exact: bool = False):
        """``exact``: float activations in every product where a compact (GGUF) model would round
        them to int8 (``mooncake_kernels.quant_linear.float_activations``): a request reporting logprobs."""
        model = runner.model
        if (token_ids is None) == (hidden is None):
            raise ValueError("pass exactly one of token_ids or hidden")
        num_tokens = len(token_ids) if token_ids is not None else hidden.shape[0]
        if num_tokens == 0:
            raise ValueError("prefill needs at least one token")
        self.runner, self.exact = runner, exact
        self.start_pos = start_pos
        self.num_tokens = num_tokens
        self.meta = runner.prefill_meta(block_table, start_pos, num_tokens)
        self.rope = model.rope(self.meta.positions)
        with torch.no_grad():
            if token_ids is not None:
                self.h = model.embed(torch.as_tensor(list(token_ids), device=runner.device))
            else:
                self.h = hidden.to(device=runner.device, dtype=runner.dtype)
        self.next_layer = model.first_layer

    @torch.no_grad()
    def run_layer(self, layer: int) -> None:
        if layer != self.next_layer:
            raise ValueError(f"layers must run in order: expected {self.next_layer}, got {layer}")
        with float_activations(self.exact):
            self.h = self.runner.model.layer_forward(layer, self.h, self.rope, self.meta, self.runner.cache)
        self.next_layer += 1

    @property
    def slots(self) -> torch.Tensor:
        """Flat cache slots this chunk wrote (to stream its K/V per layer)."""
        return self.meta.slot_mapping

    @torch.no_grad()
    def output(self, all_positions: bool = False) -> torch.Tensor:
        """``all_positions``: every position's logits ``[n, vocab]`` (a prompt's log-probabilities)."""
        model = self.runner.model
        if self.next_layer != model.end_layer:
            raise RuntimeError(f"output() before the last layer ran (next is {self.next_layer})")
        if model.is_last:
            with float_activations(self.exact):
                return model.head(self.h) if all_positions else model.head(self.h[-1:])[0]
        return self.h


class PackedPass(LayerwisePass):
    """Prefill chunks of several sequences packed into one forward, advanced one layer at a time
    (first stage and whole models only). The projections and MLP run over every sequence's tokens
    together (one large matmul instead of one small one per sequence); attention stays within each
    sequence. :meth:`slots_of` gives a sequence's cache slots, :meth:`output` the last logits of
    each sequence ``[num_seqs, vocab]``."""

    def __init__(self, runner: ModelRunner, seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]],
                 exact: bool = False):
        """``seqs``: (block table, start_pos, token ids) per sequence; ``exact``: as LayerwisePass."""
        model = runner.model
        if not seqs or any(len(toks) == 0 for _, _, toks in seqs):
            raise ValueError("a packed prefill needs at least one sequence, each with a token")
        if not model.is_first:
            raise ValueError("a packed prefill starts at the embeddings (no CPP stage > 0)")
        self.runner, self.exact = runner, exact
        self.meta = runner.packed_prefill_meta([(t, start, len(toks)) for t, start, toks in seqs])
        self.start_pos = seqs[0][1]
        self.num_tokens = int(self.meta.positions.shape[0])
        self.rope = model.rope(self.meta.positions)
        tokens = [t for _, _, toks in seqs for t in toks]
        with torch.no_grad():
            self.h = model.embed(torch.as_tensor(tokens, device=runner.device))
        self.next_layer = model.first_layer

    @property
    def segments(self) -> tuple[tuple[int, int, int], ...]:
        return self.meta.segments

    def slots_of(self, i: int) -> torch.Tensor:
        off, n, _ = self.meta.segments[i]
        return self.meta.slot_mapping[off:off + n]

    @torch.no_grad()
    def output(self) -> torch.Tensor:
        model = self.runner.model
        if self.next_layer != model.end_layer:
            raise RuntimeError(f"output() before the last layer ran (next is {self.next_layer})")
        if not model.is_last:
            return self.h
        last = torch.as_tensor([off + n - 1 for off, n, _ in self.meta.segments], device=self.h.device)
        with float_activations(self.exact):
            return model.head(self.h.index_select(0, last))
