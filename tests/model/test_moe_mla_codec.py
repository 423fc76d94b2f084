"""``--kv-compression int8|fp8`` of an MLA cache: the latent's row is coded with a third scale per
head for the rope key (the V plane's tail, ``kernels/kv_codec.py``), wired into the prefill's store
and its block sizes, and its effect on logits measured against the shared-scale codec."""

import dataclasses

import pytest
import torch

from mooncake_kernels.kv_codec import KVCodec, encoded_layer_bytes, round_trip
from mooncake_kernels.kv_pack import pack_blocks
from mooncake_lite.model.family_args import MLAArgs
from mooncake_lite.model.kv_codec import compressed_prefix_run, model_codec
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model, model_args
from mooncake_lite.prefill.app import make_store, stored_block_bytes
from mooncake_lite.prefill.config import Config

BS = 8


def test_an_mla_instance_takes_int8_with_the_rope_scale_in_its_block_bytes():
    args = model_args("tiny-mla")
    rope = args.mla.qk_rope_head_dim
    cfg = Config(model="tiny-mla", kv_compression="int8", block_size=BS)
    assert model_codec("int8", args) == KVCodec("int8", rope) and model_codec("none", args) is None
    assert model_codec("int8", model_args("tiny-moe")) == KVCodec("int8")            # experts alone: 2 scales
    assert stored_block_bytes(cfg) == args.num_layers * (2 * BS * args.head_dim + 3 * 4)


def test_a_rope_key_wider_than_a_cache_plane_is_refused_naming_it():
    args = model_args("tiny-mla")
    wide = dataclasses.replace(args, mla=MLAArgs(kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=8,
                                                 qk_rope_head_dim=24, v_head_dim=8), head_size=16)
    with pytest.raises(ValueError, match=r"MLA rope key \(24 values\) fills a whole cache plane \(16\)"):
        model_codec("int8", wide)


async def test_the_prefill_store_keeps_latent_blocks_coded_with_the_rope_scale():
    model = build_model("tiny-mla", seed=0)
    runner = ModelRunner(model, num_blocks=4, block_size=BS)
    table = runner.allocator.allocate(3)
    runner.prefill(torch.arange(2 * BS + 1).tolist(), table, 0)
    store = make_store(Config(model="tiny-mla", kv_compression="int8", block_size=BS), runner)
    packed = pack_blocks(runner.cache.kv, torch.tensor(table[:2]))     # [2, layers, 1, 2, bs, hd]
    keys = [b"a" * 16, b"b" * 16]
    await store.put_layers(keys, [memoryview(b.contiguous().view(torch.uint8).numpy()) for b in packed],
                           0, model.args.num_layers)
    rope = model.args.mla.qk_rope_head_dim
    assert len(store.inner._blocks[keys[0]]) == model.args.num_layers * encoded_layer_bytes(BS, 1, model.args.head_dim, rope)
    views = await store.get_layers(keys, 0, model.args.num_layers)
    got = torch.stack([torch.frombuffer(bytearray(v), dtype=torch.float32).view(packed.shape[1:]) for v in views])
    expected = round_trip(packed.movedim(-4, -2), KVCodec("int8", rope)).movedim(-2, -4)
    assert torch.equal(got, expected)


def test_an_int8_latent_prefix_moves_the_logits_little():
    """``tiny-mla`` (dummy weights) with 8 blocks of prefix through the codec: logits within 0.1 of
    the logits' std of the uncompressed run (measured 0.012 here; 0.010-0.068 over six prompts).
    Its rope key and latent have like magnitudes (absmax ~3 each), so a shared scale does about
    as well on it; the third scale is for weights where they differ (test_kv_codec.py)."""
    model = build_model("tiny-mla", seed=0)
    ids = torch.randint(0, model.args.vocab_size, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    plain, plain_logits = compressed_prefix_run(model, ids, 8, BS, None, 6)
    _, logits = compressed_prefix_run(model, ids, 8, BS, model_codec("int8", model.args), 6, forced=plain)
    assert float(((logits - plain_logits).abs() / plain_logits.std(dim=-1, keepdim=True)).max()) < 0.1
