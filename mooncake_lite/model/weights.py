"""Building a model: seeded dummy weights for presets (as the paper did), or a local checkpoint.

Dummy weights are seeded per parameter *name*, so a pipeline stage holding only some layers gets
exactly the weights the full model has for those layers.
"""

from __future__ import annotations

import hashlib
import math

import torch

from mooncake_lite.model.args import ModelArgs
from mooncake_lite.model.checkpoint_config import model_args  # also imported from here by callers
from mooncake_lite.model.family import build_transformer
from mooncake_lite.model.llama import Transformer


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


@torch.no_grad()
def init_dummy_weights(model: Transformer, seed: int = 0) -> None:
    """Scaled so activations stay O(1) through the depth and logits are decisive (clear argmax).
    Drawn on the parameters' device: on CUDA from its generator (an 8B preset in a second, not the
    CPU's minute), so a preset's weights are the same on every CUDA device and on every CPU, but
    differ between the two (mix devices in one cluster with a checkpoint, not a preset)."""
    for name, param in model.named_parameters():
        gen = torch.Generator(param.device).manual_seed(_name_seed(seed, name))
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if param.dim() == 1:  # biases
            std = 0.02
        elif "tok_embeddings" in name:
            std = 1.0
        else:
            std = 1.0 / math.sqrt(param.shape[1])
            if name.endswith(("wo.weight", "w2.weight")):
                std /= math.sqrt(2 * model.args.num_layers)
        values = torch.randn(param.shape, generator=gen, dtype=torch.float32, device=param.device) * std
        param.copy_(values.to(param.dtype))


def build_model(model: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                layer_range: tuple[int, int] | None = None, seed: int = 0, weights: str = "quantized") -> Transformer:
    """``model`` is a preset name (dummy weights from ``seed``), a named packaged model, a GGUF
    file or a checkpoint directory. ``weights``: a GGUF's quantized tensors kept as its blocks
    (``quantized``, where they compute: ``gguf_loader``) or ``dequantize``d at load."""
    from mooncake_lite.model.source import resolve
    source = resolve(model)
    if source.kind == "hf":
        from mooncake_lite.model.loader import load_checkpoint
        net = load_checkpoint(model, device=device, dtype=dtype, layer_range=layer_range)
    elif source.kind == "gguf":
        from mooncake_lite.model.gguf_loader import load_gguf
        net = load_gguf(source.path, source.served_name, device=device, dtype=dtype, layer_range=layer_range,
                        weights=weights)
    elif torch.device(device).type == "cuda":   # allocated and drawn on the device, in its dtype
        with torch.device("meta"):
            net = build_transformer(model_args(model), layer_range)
        net = net.to(dtype=dtype).to_empty(device=device)
        init_dummy_weights(net, seed)
        net = net.eval()
    else:
        net = build_transformer(model_args(model), layer_range)
        init_dummy_weights(net, seed)
        net = net.to(device=device, dtype=dtype).eval()
    return net.fuse_()   # last: fused q/k/v and gate/up weights (see Transformer.fuse_)


def build_meta(args: ModelArgs) -> Transformer:
    """The model on the ``meta`` device: sizes without allocating (for llama2-70b sizing)."""
    with torch.device("meta"):
        return build_transformer(args)
