"""Compressed KV blocks: int8 (or fp8 e4m3) values with one float32 scale per layer, K/V and head.

A block in the store is ``[num_layers][kv_heads][2][block_size][head_dim]`` in the model dtype,
head-major (``transfer/kv_layout.py``, ``kv_pack.py``). Encoded, each head of each layer becomes
one contiguous record

    ``[2][block_size][head_dim]`` 1-byte codes (K then V), then its 2 float32 scales (K, V),

so every layer still has the same byte size, a layer range is one contiguous slice of a block and
a head range one contiguous run per layer, exactly as in a plain block: a TP rank's slice of an
encoded block is encoded on its own, with its own heads' scales, and slices written at one TP
degree decode bit for bit at another. Per-block, per-head scales (absmax over the block's tokens
and the head's dims) follow the magnitude differences between heads, which are large, while
keeping the scale overhead at 8 bytes per head and layer; a scale shared across heads would tie a
rank's bytes to heads it does not hold.

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


def encoded_head_bytes(block_size: int, head_dim: int) -> int:
    """Bytes of one head's record in one encoded layer: its K and V codes, then their 2 scales."""
    return 2 * block_size * head_dim + 2 * SCALE_BYTES


def encoded_layer_bytes(block_size: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of one encoded layer of one block (both codecs use 1-byte codes)."""
    return kv_heads * encoded_head_bytes(block_size, head_dim)


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


def encode_heads(packed: torch.Tensor, codec: KVCodec) -> torch.Tensor:
    """Head-major blocks ``[..., num_layers, kvh, 2, bs, hd]`` → uint8 ``[..., num_layers,
    layer_bytes]``: per head, its codes then its scales (:func:`encoded_head_bytes`)."""
    # quantize's axes are [2, bs, kvh, hd]: a view moves the heads there, no copy.
    codes, scale = quantize(packed.movedim(-4, -2), codec)
    lead = packed.shape[:-3]                                   # [..., num_layers, kvh]
    code_bytes = codes.movedim(-2, -4).contiguous().view(torch.uint8).reshape(*lead, -1)
    scale_bytes = scale.transpose(-1, -2).contiguous().view(torch.uint8).reshape(*lead, -1)
    return torch.cat([code_bytes, scale_bytes], dim=-1).flatten(-2)


def decode_heads(raw: torch.Tensor, block_shape: tuple[int, int, int], codec: KVCodec,
                 dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode_heads`: uint8 ``[..., num_layers, layer_bytes]`` → ``[...,
    num_layers, kvh, 2, bs, hd]`` in ``dtype``. ``block_shape`` is (block_size, kv_heads, head_dim),
    ``kv_heads`` the heads the bytes hold (a head range's count for a rank's slice)."""
    bs, kvh, hd = block_shape
    if raw.shape[-1] != encoded_layer_bytes(bs, kvh, hd):
        raise ValueError(f"an encoded layer of {raw.shape[-1]} bytes is not one of "
                         f"{encoded_layer_bytes(bs, kvh, hd)} for block shape {block_shape}")
    heads = raw.reshape(*raw.shape[:-1], kvh, encoded_head_bytes(bs, hd))
    n_codes = 2 * bs * hd
    codes = heads[..., :n_codes].contiguous().view(codec.code_dtype).unflatten(-1, (2, bs, hd))
    scale = heads[..., n_codes:].contiguous().view(SCALE_DTYPE)          # [..., kvh, 2]
    return dequantize(codes.movedim(-4, -2), scale.transpose(-1, -2), dtype).movedim(-2, -4)


def encode_layers(packed: torch.Tensor, codec: KVCodec) -> torch.Tensor:
    """:func:`encode_heads` of token-major blocks ``[..., num_layers, 2, bs, kvh, hd]`` (the
    paged cache's axis order), into the same head-major bytes."""
    return encode_heads(packed.movedim(-2, -4), codec)


def decode_layers(raw: torch.Tensor, block_shape: tuple[int, int, int], codec: KVCodec,
                  dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode_layers`: encoded bytes → ``[..., num_layers, 2, bs, kvh, hd]``."""
    return decode_heads(raw, block_shape, codec, dtype).movedim(-4, -2)
