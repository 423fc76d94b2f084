"""Which attention and feed-forward each layer of a model gets: grouped-query attention or MLA
(``args.mla``), the dense MLP or routed experts (``args.moe``, on its sparse layers)."""

from __future__ import annotations

from mooncake_lite.model.args import ModelArgs
from mooncake_lite.model.llama import Block, Collectives, Transformer
from mooncake_lite.model.mla import MLAttention
from mooncake_lite.model.moe import MoE


def make_block(args: ModelArgs, layer: int, comms: Collectives | None = None) -> Block:
    """Layer ``layer``'s block; ``comms``: a tensor-parallel rank's (``args`` its share's shapes)."""
    attention = MLAttention(args) if args.mla is not None else None
    feed_forward = MoE(args) if args.moe is not None and args.moe.is_sparse(layer) else None
    return Block(args, attention, feed_forward, comms)


def build_transformer(args: ModelArgs, layer_range: tuple[int, int] | None = None) -> Transformer:
    """The model of ``args`` (uninitialised, on the current default device): every family."""
    return Transformer(args, layer_range, make_block)

