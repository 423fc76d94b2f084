"""Compressed KV blocks: int8 (or fp8 e4m3) values with one float32 scale per layer, K/V and head
(and one more for an MLA cache's rope key).

A block in the store is ``[num_layers][kv_heads][2][block_size][head_dim]`` in the model dtype,
head-major (``transfer/kv_layout.py``, ``kv_pack.py``). Encoded, each head of each layer becomes
one contiguous record

    ``[2][block_size][head_dim]`` 1-byte codes (K then V), then its 2 float32 scales (K, V),

or 3 scales (K, V, rope key) with ``rope_dim``: an MLA cache (``model/mla.py``) holds one row per
token, the normalised latent then the rope key, split into the K and V planes, so the V plane's
last ``rope_dim`` values are the rope key, which is not normalised and can be far larger or
smaller than the latent it sits beside; one scale over both would spend the codes on the larger
and round the smaller away. Either way every layer still has the same byte size, a layer range is one contiguous slice of a block and
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
    rope_dim: int = 0  # the V plane's last values scaled on their own (an MLA cache's rope key); 0: none

    def __post_init__(self) -> None:
        if self.name not in ("int8", "fp8"):
            raise ValueError(f"unknown KV codec {self.name!r} (int8, fp8)")
        if self.name == "fp8" and not fp8_supported():
            raise ValueError("fp8 KV blocks need torch.float8_e4m3fn, which this torch build cannot cast")
        if self.rope_dim < 0:
            raise ValueError(f"rope_dim must be >= 0, not {self.rope_dim}")

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.name == "int8" else torch.float8_e4m3fn

    @property
    def qmax(self) -> float:
        """Largest code magnitude: the head's absmax maps to it. 127 keeps int8 symmetric."""
        return 127.0 if self.name == "int8" else 448.0

    @property
    def num_scales(self) -> int:
        """Scales per head and layer: K and V, and the rope key's with ``rope_dim``."""
        return 3 if self.rope_dim else 2


def codec_for(name: str | None, rope_dim: int = 0) -> KVCodec | None:
    """The codec a ``--kv-compression`` value names (None for "none"); ``rope_dim`` for an MLA cache."""
    if name in (None, "", "none"):
        return None
    return KVCodec(name, rope_dim)


def encoded_head_bytes(block_size: int, head_dim: int, rope_dim: int = 0) -> int:
    """Bytes of one head's record in one encoded layer: its K and V codes, then their scales."""
    return 2 * block_size * head_dim + (3 if rope_dim else 2) * SCALE_BYTES


def encoded_layer_bytes(block_size: int, kv_heads: int, head_dim: int, rope_dim: int = 0) -> int:
    """Bytes of one encoded layer of one block (both codecs use 1-byte codes)."""
    return kv_heads * encoded_head_bytes(block_size, head_dim, rope_dim)


def _spread(scale: torch.Tensor, head_dim: int, rope_dim: int) -> torch.Tensor:
    """Scales ``[..., num_scales, kvh]`` as a tensor broadcasting against ``[..., 2, bs, kvh, hd]``."""
    if not rope_dim:
        return scale[..., None, :, None]
    _check_fits(rope_dim, head_dim)
    k, v, rope = (s[..., None] for s in scale.unbind(-2))                        # [..., kvh, 1] each
    v_row = torch.cat([v.expand(*v.shape[:-1], head_dim - rope_dim), rope.expand(*rope.shape[:-1], rope_dim)], -1)
    return torch.stack([k.expand_as(v_row), v_row], dim=-3)[..., None, :, :]   # [..., 2, 1, kvh, hd]


def _check_fits(rope_dim: int, head_dim: int) -> None:
    if not 0 < rope_dim < head_dim:
        raise ValueError(f"a rope key of {rope_dim} values does not fit beside latent values in a head of {head_dim}")


def _absmax(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Per block, K/V (and rope key) and head: ``[..., num_scales, kvh]``."""
    a = x.abs()
    if not rope_dim:
        return a.amax(dim=(-3, -1))
    _check_fits(rope_dim, x.shape[-1])
    k, v = a.unbind(-4)
    return torch.stack([k.amax(dim=(-3, -1)), v[..., :-rope_dim].amax(dim=(-3, -1)),
                        v[..., -rope_dim:].amax(dim=(-3, -1))], dim=-2)


def quantize(x: torch.Tensor, codec: KVCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` is ``[..., 2, block_size, kv_heads, head_dim]``; returns the codes (same shape, the
    codec's dtype) and the scales ``[..., num_scales, kv_heads]`` (float32, code * scale ≈ x)."""
    x = x.to(torch.float32)
    amax = _absmax(x, codec.rope_dim)
    # An all-zero head gets scale 1 (its codes are all zero either way): never divide by zero.
    scale = torch.where(amax > 0, amax / codec.qmax, torch.ones_like(amax))
    y = x / _spread(scale, x.shape[-1], codec.rope_dim)
    if codec.name == "int8":
        return y.round().clamp_(-127, 127).to(torch.int8), scale
    return y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rope_dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`quantize`, in ``dtype`` (``rope_dim`` the codec's)."""
    return (codes.to(torch.float32) * _spread(scale, codes.shape[-1], rope_dim)).to(dtype)


def round_trip(x: torch.Tensor, codec: KVCodec) -> torch.Tensor:
    """What a block's KV becomes after a store round trip: quantized, dequantized, in x's dtype."""
    codes, scale = quantize(x, codec)
    return dequantize(codes, scale, x.dtype, codec.rope_dim)


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
    expected = encoded_layer_bytes(bs, kvh, hd, codec.rope_dim)
    if raw.shape[-1] != expected:
        raise ValueError(f"an encoded layer of {raw.shape[-1]} bytes is not one of {expected} for block "
                         f"shape {block_shape} and {codec.num_scales} scales per head")
    heads = raw.reshape(*raw.shape[:-1], kvh, encoded_head_bytes(bs, hd, codec.rope_dim))
    n_codes = 2 * bs * hd
    codes = heads[..., :n_codes].contiguous().view(codec.code_dtype).unflatten(-1, (2, bs, hd))
    scale = heads[..., n_codes:].contiguous().view(SCALE_DTYPE)          # [..., kvh, num_scales]
    return dequantize(codes.movedim(-4, -2), scale.transpose(-1, -2), dtype, codec.rope_dim).movedim(-2, -4)


def encode_layers(packed: torch.Tensor, codec: KVCodec) -> torch.Tensor:
    """:func:`encode_heads` of token-major blocks ``[..., num_layers, 2, bs, kvh, hd]`` (the
    paged cache's axis order), into the same head-major bytes."""
    return encode_heads(packed.movedim(-2, -4), codec)


def decode_layers(raw: torch.Tensor, block_shape: tuple[int, int, int], codec: KVCodec,
                  dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode_layers`: encoded bytes → ``[..., num_layers, 2, bs, kvh, hd]``."""
    return decode_heads(raw, block_shape, codec, dtype).movedim(-4, -2)
