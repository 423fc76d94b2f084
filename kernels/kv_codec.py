"""Compressed KV blocks: int8 (or fp8 e4m3) values with one float32 scale per layer, K/V and head.

A block in the store is ``[num_layers][2][block_size][kv_heads][head_dim]`` in the model dtype
(``kv_pack.py``). Encoded, each layer becomes one contiguous record

    ``[2][block_size][kv_heads][head_dim]`` 1-byte codes, then ``[2][kv_heads]`` float32 scales,

so every layer still has the same byte size and a layer range is still one contiguous slice of a
block: the store's get-layers needs no change. Per-block, per-head scales (absmax over the
block's tokens and the head's dims) follow the magnitude differences between heads, which are
large, while keeping the scale overhead at 8 bytes per head and layer.

Pure functions of tensors; the codes are computed in float32 whatever the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CODEC_NAMES = ("none", "int8", "fp8")
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4


def fp8_supported() -> bool:
    """Whether this torch build has float8_e4m3fn and can cast to and from it here (CPU torch has
    had it since 2.1; the cast is what an old or stripped build lacks)."""
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        return False
    try:
        return bool(torch.tensor([1.5, -448.0]).to(dtype).float().eq(torch.tensor([1.5, -448.0])).all())
    except (RuntimeError, TypeError):
        return False


@dataclass(frozen=True)
class KVCodec:
    name: str          # "int8" or "fp8"

    def __post_init__(self) -> None:
        if self.name not in ("int8", "fp8"):
            raise ValueError(f"unknown KV codec {self.name!r} (int8, fp8)")
        if self.name == "fp8" and not fp8_supported():
            raise ValueError("fp8 KV blocks need torch.float8_e4m3fn, which this torch build cannot cast")

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.name == "int8" else torch.float8_e4m3fn

    @property
    def qmax(self) -> float:
        """Largest code magnitude: the head's absmax maps to it. 127 keeps int8 symmetric."""
        return 127.0 if self.name == "int8" else 448.0


def codec_for(name: str | None) -> KVCodec | None:
    """The codec a ``--kv-compression`` value names (None for "none")."""
    if name in (None, "", "none"):
        return None
    return KVCodec(name)


def encoded_layer_bytes(block_size: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of one encoded layer of one block (both codecs use 1-byte codes)."""
    return 2 * block_size * kv_heads * head_dim + 2 * kv_heads * SCALE_BYTES


def quantize(x: torch.Tensor, codec: KVCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` is ``[..., 2, block_size, kv_heads, head_dim]``; returns the codes (same shape, the
    codec's dtype) and the scales ``[..., 2, kv_heads]`` (float32, code * scale ≈ x)."""
    x = x.to(torch.float32)
    amax = x.abs().amax(dim=(-3, -1))
    # An all-zero head gets scale 1 (its codes are all zero either way): never divide by zero.
    scale = torch.where(amax > 0, amax / codec.qmax, torch.ones_like(amax))
    y = x / scale[..., None, :, None]
    if codec.name == "int8":
        return y.round().clamp_(-127, 127).to(torch.int8), scale
    return y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize`, in ``dtype``."""
    return (codes.to(torch.float32) * scale[..., None, :, None]).to(dtype)


def round_trip(x: torch.Tensor, codec: KVCodec) -> torch.Tensor:
    """What a block's KV becomes after a store round trip: quantized, dequantized, in x's dtype."""
    codes, scale = quantize(x, codec)
    return dequantize(codes, scale, x.dtype)


def encode_layers(packed: torch.Tensor, codec: KVCodec) -> torch.Tensor:
    """``packed`` ``[..., num_layers, 2, bs, kvh, hd]`` → uint8 ``[..., num_layers, layer_bytes]``
    (codes then scales per layer: :func:`encoded_layer_bytes`)."""
    codes, scale = quantize(packed, codec)
    lead = packed.shape[:-4]
    code_bytes = codes.contiguous().view(torch.uint8).reshape(*lead, -1)
    scale_bytes = scale.contiguous().view(torch.uint8).reshape(*lead, -1)
    return torch.cat([code_bytes, scale_bytes], dim=-1)


def decode_layers(raw: torch.Tensor, block_shape: tuple[int, int, int], codec: KVCodec,
                  dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode_layers`: uint8 ``[..., num_layers, layer_bytes]`` → ``[...,
    num_layers, 2, bs, kvh, hd]`` in ``dtype``. ``block_shape`` is (block_size, kv_heads, head_dim)."""
    bs, kvh, hd = block_shape
    n_codes = 2 * bs * kvh * hd
    if raw.shape[-1] != n_codes + 2 * kvh * SCALE_BYTES:
        raise ValueError(f"an encoded layer of {raw.shape[-1]} bytes is not one of "
                         f"{encoded_layer_bytes(bs, kvh, hd)} for block shape {block_shape}")
    lead = raw.shape[:-1]
    codes = raw[..., :n_codes].contiguous().view(codec.code_dtype).reshape(*lead, 2, bs, kvh, hd)
    scale = raw[..., n_codes:].contiguous().view(SCALE_DTYPE).reshape(*lead, 2, kvh)
    return dequantize(codes, scale, dtype)
