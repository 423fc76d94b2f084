"""The monolithic reference of ``--kv-compression``: what a request computes when its reused
prefix KV went through the store's codec (``kernels/kv_codec.py``) and everything else did not.

The prefix's full blocks are computed, quantized and dequantized in place (as a store round trip
leaves them), then the rest of the prompt is prefilled on top and tokens are decoded greedily.
With ``codec=None`` it is plain paged greedy generation, the uncompressed peer. :func:`model_codec`
is the codec a model's cache takes (its rope key scaled on its own for MLA).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from mooncake_kernels.kv_codec import KVCodec, codec_for, encoded_layer_bytes, round_trip
from mooncake_lite.model.args import ModelArgs

if TYPE_CHECKING:   # the runner pulls in torch's compiler stack: not for the instance config's model_codec
    from mooncake_lite.model.llama import Transformer


def model_codec(name: str | None, args: ModelArgs) -> KVCodec | None:
    """The codec ``--kv-compression name`` means for this model (None for "none"). An MLA cache row
    is the latent then the rope key over the K and V planes (``model/mla.py``): the rope key, the
    V plane's tail, gets a scale of its own. ValueError if it is wider than that plane."""
    if args.mla is None or codec_for(name) is None:
        return codec_for(name)
    rope_dim = args.mla.qk_rope_head_dim
    if rope_dim >= args.head_dim:
        raise ValueError(f"the MLA rope key ({rope_dim} values) fills a whole cache plane ({args.head_dim}): "
                         "the codec scales only the V plane's tail apart; use --kv-compression none")
    return codec_for(name, rope_dim)


def stored_layer_bytes(codec: KVCodec | None, args: ModelArgs, block_size: int, dtype: torch.dtype | str) -> int:
    """Bytes of one layer of one KV block as the store keeps it (the whole model's heads): encoded by
    ``codec`` (:func:`model_codec`'s), else in the model's dtype. Prefill and decode write the same."""
    if codec is None:
        return args.kv_block_bytes(block_size, dtype) // args.num_layers
    return encoded_layer_bytes(block_size, args.num_kv_heads, args.head_dim, codec.rope_dim)


@torch.no_grad()
def compressed_prefix_run(model: Transformer, prompt_ids: Sequence[int], num_prefix_blocks: int,
                          block_size: int, codec: KVCodec | None, max_tokens: int,
                          forced: Sequence[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their logits ``[max_tokens, vocab]`` for ``prompt_ids`` whose first
    ``num_prefix_blocks`` blocks of KV were reused through ``codec``. With ``forced`` (teacher
    forcing), those tokens are fed back instead of the argmax, so logits compare position by
    position with another run's. The prefix must leave at least one prompt token to compute (a
    prefill instance always computes the last one)."""
    from mooncake_lite.model.kv_cache import blocks_needed
    from mooncake_lite.model.runner import ModelRunner
    n = num_prefix_blocks * block_size
    if not 0 <= n < len(prompt_ids):
        raise ValueError(f"a {num_prefix_blocks}-block prefix leaves no token of a {len(prompt_ids)}-token prompt")
    total = len(prompt_ids) + max_tokens
    runner = ModelRunner(model, num_blocks=blocks_needed(total, block_size), block_size=block_size)
    table = runner.allocator.allocate(blocks_needed(total, block_size))
    if n:
        runner.prefill(prompt_ids[:n], table, 0)
        if codec is not None:
            ids = torch.as_tensor(table[:num_prefix_blocks], dtype=torch.long, device=runner.cache.kv.device)
            # Per block, layer, K/V and head, as the store's codec quantizes (its byte order aside).
            blocks = runner.cache.kv[:, :, ids].movedim(2, 0)     # [blocks, layers, 2, bs, kvh, hd]
            runner.cache.kv[:, :, ids] = round_trip(blocks, codec).movedim(0, 2)
    logits = [runner.prefill(prompt_ids[n:], table, n)]
    tokens = [int(torch.argmax(logits[-1]))]
    while len(tokens) < max_tokens:
        fed = tokens[-1] if forced is None else forced[len(tokens) - 1]
        logits.append(runner.decode([fed], [table], [len(prompt_ids) + len(tokens) - 1])[0])
        tokens.append(int(torch.argmax(logits[-1])))
    return tokens, torch.stack([x.float() for x in logits])
