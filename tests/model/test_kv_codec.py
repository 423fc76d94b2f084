"""The KV block codec (kernels/kv_codec.py): error bounds of int8/fp8 with per-block, per-head
scales, the byte layout (layer-sliceable, fixed size per layer) and exact round trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_kernels.kv_codec import (KVCodec, codec_for, decode_layers, dequantize, encode_layers,
                              encoded_layer_bytes, fp8_supported, quantize, round_trip)

CODECS = ["int8"] + (["fp8"] if fp8_supported() else [])

shapes = st.tuples(st.integers(1, 3), st.integers(1, 6), st.integers(1, 3), st.integers(1, 8))


def _block(shape, seed, spread):
    """[layers, 2, bs, kvh, hd] with per-head magnitudes spread over 10**spread (as real heads are)."""
    layers, bs, kvh, hd = shape
    g = torch.Generator().manual_seed(seed)
    mags = 10.0 ** (torch.rand(layers, 2, 1, kvh, 1, generator=g) * spread - spread / 2)
    return torch.randn(layers, 2, bs, kvh, hd, generator=g) * mags


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), spread=st.floats(0, 6))
def test_int8_error_is_at_most_half_a_step_of_its_head(shape, seed, spread):
    x = _block(shape, seed, spread)
    codes, scale = quantize(x, KVCodec("int8"))
    assert codes.dtype == torch.int8 and scale.shape == (shape[0], 2, shape[2])
    err = (dequantize(codes, scale, torch.float32) - x).abs()
    step = x.abs().amax(dim=(-3, -1), keepdim=True) / 127      # per layer, K/V and head
    assert bool((err <= step / 2 * (1 + 1e-5) + 1e-30).all())


@pytest.mark.skipif(not fp8_supported(), reason="this torch build cannot cast float8_e4m3fn")
@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), spread=st.floats(0, 6))
def test_fp8_error_is_relative_to_the_value_plus_a_subnormal_floor(shape, seed, spread):
    x = _block(shape, seed, spread)
    codes, scale = quantize(x, KVCodec("fp8"))
    err = (dequantize(codes, scale, torch.float32) - x).abs()
    s = scale[:, :, None, :, None]
    # e4m3: 3 mantissa bits → half an ulp is 2**-4 of the value; below 2**-6 subnormals step 2**-9.
    assert bool((err <= x.abs() * 2**-4 * (1 + 1e-5) + s * 2**-10 * (1 + 1e-5)).all())


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_encoded_block_is_layer_sliceable_and_decodes_like_round_trip(name, dtype):
    codec = codec_for(name)
    layers, bs, kvh, hd = 3, 4, 2, 8
    x = _block((layers, bs, kvh, hd), 7, 3).to(dtype)
    raw = encode_layers(x[None], codec)[0]
    assert raw.dtype == torch.uint8 and raw.shape == (layers, encoded_layer_bytes(bs, kvh, hd))
    full = decode_layers(raw, (bs, kvh, hd), codec, dtype)
    assert full.dtype == dtype
    assert torch.equal(full, round_trip(x, codec))
    # One layer's slice of the encoded bytes decodes on its own to that layer.
    assert torch.equal(decode_layers(raw[1:2], (bs, kvh, hd), codec, dtype)[0], full[1])
    # Coding what was decoded again changes nothing: a block reloaded and rewritten stays put.
    assert torch.equal(decode_layers(encode_layers(full, codec), (bs, kvh, hd), codec, dtype), full)


def test_zero_heads_and_sizes():
    x = torch.zeros(1, 2, 4, 2, 8)
    x[0, 0, :, 1] = 3.0
    out = round_trip(x, KVCodec("int8"))
    assert torch.equal(out, x)        # zero heads stay zero; a constant head is exact
    assert encoded_layer_bytes(16, 3, 64) == 2 * 16 * 3 * 64 + 2 * 3 * 4
    assert codec_for("none") is None and codec_for(None) is None
    with pytest.raises(ValueError):
        KVCodec("int4")
    with pytest.raises(ValueError):
        decode_layers(torch.zeros(1, 10, dtype=torch.uint8), (4, 2, 8), KVCodec("int8"), torch.float32)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), rope_dim=st.integers(1, 7), rope_mag=st.floats(-3, 3))
def test_an_mla_rope_key_gets_its_own_scale_and_error_bound(shape, seed, rope_dim, rope_mag):
    """With ``rope_dim`` the V plane's tail (an MLA cache's rope key) is scaled apart from the
    latent values before it: each part's int8 error is at most half a step of its own absmax."""
    layers, bs, kvh, _ = shape
    x = _block((layers, bs, kvh, 8), seed, 2)
    x[:, 1, ..., -rope_dim:] *= 10.0 ** rope_mag
    codec = KVCodec("int8", rope_dim)
    codes, scale = quantize(x, codec)
    assert scale.shape == (layers, 3, kvh) and codec.num_scales == 3
    err = (dequantize(codes, scale, torch.float32, rope_dim) - x).abs()
    for part in ((slice(None), 0), (slice(None), 1, Ellipsis, slice(None, -rope_dim)),
                 (slice(None), 1, Ellipsis, slice(-rope_dim, None))):
        step = x[part].abs().amax(dim=(-3, -1), keepdim=True) / 127     # per layer, part and head
        assert bool((err[part] <= step / 2 * (1 + 1e-5) + 1e-30).all())


@pytest.mark.parametrize("name", CODECS)
def test_the_rope_scale_is_a_third_scale_per_head_in_a_sliceable_record(name):
    codec = codec_for(name, 4)
    layers, bs, kvh, hd = 3, 4, 1, 12
    x = _block((layers, bs, kvh, hd), 5, 2)
    raw = encode_layers(x[None], codec)[0]
    assert raw.shape == (layers, encoded_layer_bytes(bs, kvh, hd, 4)) and raw.shape[1] == 2 * bs * hd + 3 * 4
    full = decode_layers(raw, (bs, kvh, hd), codec, torch.float32)
    assert torch.equal(full, round_trip(x, codec))
    assert torch.equal(decode_layers(raw[2:], (bs, kvh, hd), codec, torch.float32)[0], full[2])
    with pytest.raises(ValueError, match="3 scales per head"):      # bytes of the 2-scale format
        decode_layers(encode_layers(x[None], codec_for(name))[0], (bs, kvh, hd), codec, torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        quantize(x, KVCodec(name, hd))


def test_a_large_rope_key_sharing_a_scale_would_round_the_latent_away():
    """Why MLA gets the third scale: a rope key 100x the latent tail leaves the shared-scale codec
    about one code for the latent; its own scale keeps the latent at int8's usual error."""
    x = _block((2, 16, 1, 32), 3, 0)
    x[:, 1, ..., -8:] *= 100.0
    latent = (slice(None), 1, Ellipsis, slice(None, -8))
    shared = (round_trip(x, KVCodec("int8")) - x)[latent].abs().max()
    own = (round_trip(x, KVCodec("int8", 8)) - x)[latent].abs().max()
    assert own * 30 < shared
