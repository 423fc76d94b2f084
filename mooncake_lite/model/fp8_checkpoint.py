"""fp8 checkpoints (``quantization_config.quant_method: fp8``, as DeepSeek-V3 and Kimi-K2 publish
theirs): e4m3 weights, each with a ``weight_scale_inv`` beside it that is one float32 per tensor
or one per 128 x 128 block (``weight_block_size``).

Loaded by dequantizing each weight once, at load, block by block: ``value = fp8 * scale_inv``
over the block's rows and columns (the last blocks may be partial), in float32, then cast to the
serving dtype. The model then holds its weights in that dtype: 4 bytes a weight in float32 (4x
the checkpoint's 1), 2 in bfloat16; the float32 copy of the tensor being converted is the only
extra memory at load. No fp8 matmul runs (not on a GPU either): what a scaled fp8 product would
compute is what the dequantized product computes, up to float rounding.

Any other ``quant_method`` (awq, gptq, bitsandbytes, compressed-tensors, ...) is refused naming
it, as are activation scales (static activation quantization) and fp8 formats other than e4m3.
"""

from __future__ import annotations

from typing import Any

import json
import os
from dataclasses import dataclass

SUPPORTED_METHODS = ("fp8",)
SCALE_SUFFIX = "_scale_inv"   # "model.layers.0.mlp.up_proj.weight" -> "...up_proj.weight_scale_inv"


def fp8_block(cfg: dict[str, Any], path: str) -> tuple[bool, tuple[int, int] | None]:
    """(whether ``cfg`` is an fp8 checkpoint's, its ``weight_block_size`` as (rows, cols) or None
    for per-tensor scales); raises ValueError naming the field for an unsupported quantization."""
    q = cfg.get("quantization_config")
    if q is None:
        return False, None
    if not isinstance(q, dict):
        raise ValueError(f"{path}: quantization_config must be an object")
    method = q.get("quant_method")
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"{path}: quantization_config.quant_method {method!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_METHODS)})")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{path}: quantization_config.activation_scheme {q['activation_scheme']!r} is not "
                         "supported (only dynamic: the weights carry the scales)")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{path}: quantization_config.fmt {q['fmt']!r} is not supported (only e4m3)")
    block = q.get("weight_block_size")
    if block is None:
        return True, None
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"{path}: quantization_config.weight_block_size {block!r} must be two positive integers")
    return True, (int(block[0]), int(block[1]))


def dequantize_fp8(weight, scale_inv, name: str, block: tuple[int, int] | None):
    """float32 values of an e4m3 ``weight`` times ``scale_inv``: one value (per tensor), or with
    ``block`` (rows, cols) one per block, [ceil(rows / br), ceil(cols / bc)]."""
    import torch
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"tensor {name!r} is {weight.dtype}, not float8_e4m3fn, yet has a {SCALE_SUFFIX} scale")
    values = weight.to(torch.float32)
    scale = scale_inv.to(torch.float32)
    if block is None:
        if scale.numel() != 1:
            raise ValueError(f"tensor {name!r}: {tuple(scale.shape)} scales, per-tensor scaling takes one")
        return values * scale.reshape(())
    br, bc = block
    rows, cols = weight.shape
    if weight.dim() != 2 or tuple(scale.shape) != (-(-rows // br), -(-cols // bc)):
        raise ValueError(f"tensor {name!r}: scales of shape {tuple(scale.shape)} do not tile a "
                         f"{tuple(weight.shape)} weight in {br}x{bc} blocks")
    full = scale.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]
    return values * full


@dataclass(frozen=True)
class Fp8Weights:
    """An fp8 checkpoint's weights and their scales (tensor name -> file), converted as read."""
    ckpt_dir: str
    index: dict[str, str]
    block: tuple[int, int] | None

    @property
    def scale_names(self) -> list[str]:
        return [n for n in self.index if n.endswith(SCALE_SUFFIX)]

    def convert(self, name: str, tensor):
        """``tensor`` (checkpoint tensor ``name``) dequantized where it has a scale, else as is;
        an fp8 tensor without one is refused (its values would be off by the scale)."""
        import torch
        from safetensors import safe_open
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self.index:
            if tensor.dtype == torch.float8_e4m3fn:
                raise ValueError(f"tensor {name!r} is float8_e4m3fn but the checkpoint has no {scale_name!r}")
            return tensor
        with safe_open(os.path.join(self.ckpt_dir, self.index[scale_name]), framework="pt") as f:
            scale = f.get_tensor(scale_name)
        return dequantize_fp8(tensor, scale, name, self.block)


def fp8_weights(ckpt_dir: str, index: dict[str, str]) -> Fp8Weights | None:
    """The checkpoint's fp8 weights, or None where ``config.json`` declares no quantization."""
    path = os.path.join(ckpt_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        quantized, block = fp8_block(json.load(f), path)
    return Fp8Weights(ckpt_dir, index, block) if quantized else None
