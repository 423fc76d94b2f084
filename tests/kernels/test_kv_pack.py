"""The torch references for moving KV between the paged cache, store blocks and token streams."""

import itertools

import pytest
import torch

from mooncake_kernels import gather_tokens, pack_blocks, scatter_tokens, unpack_blocks
from mooncake_kernels.dispatch import fast_module
from mooncake_lite.model.args import ModelArgs
from mooncake_lite.model.kv_cache import PagedKVCache, slot_mapping

LAYERS, BLOCKS, BS, KVH, HD = 3, 10, 4, 2, 8


@pytest.fixture
def kv():
    return torch.randn(LAYERS, 2, BLOCKS, BS, KVH, HD, generator=torch.Generator().manual_seed(0))


def test_pack_layout_is_the_store_block_contract(kv):
    ids = [7, 2, 5]
    packed = pack_blocks(kv, torch.tensor(ids))
    assert packed.shape == (3, LAYERS, KVH, 2, BS, HD) and packed.is_contiguous()
    chunk = BS * HD
    for i, block in enumerate(ids):
        flat = packed[i].reshape(-1)  # the bytes one store value holds
        for layer, head in itertools.product(range(LAYERS), range(KVH)):
            base = (layer * KVH + head) * 2 * chunk  # head-major: one head's K then V, per layer
            assert torch.equal(flat[base:base + chunk], kv[layer, 0, block, :, head].reshape(-1))
            assert torch.equal(flat[base + chunk:base + 2 * chunk], kv[layer, 1, block, :, head].reshape(-1))


def test_unpack_reads_block_bytes_in_the_cluster_layout_whatever_their_shape(kv):
    packed = pack_blocks(kv, torch.tensor([4, 1]))
    dst = torch.zeros_like(kv)
    unpack_blocks(dst, torch.tensor([2, 3]), packed.reshape(2, LAYERS, -1))
    assert torch.equal(dst[:, :, [2, 3]], kv[:, :, [4, 1]])


def test_block_bytes_match_model_args():
    args = ModelArgs.from_name("tiny")
    cache = PagedKVCache(args, num_blocks=4, block_size=16, dtype=torch.bfloat16)
    packed = pack_blocks(cache.kv, torch.tensor([1, 3]))
    assert packed[0].numel() * packed.element_size() == args.kv_block_bytes(16, torch.bfloat16)


def test_pack_unpack_round_trip_into_other_blocks(kv):
    packed = pack_blocks(kv, torch.tensor([7, 2, 5]))
    other = torch.zeros_like(kv)
    unpack_blocks(other, torch.tensor([0, 9, 4]), packed)
    for src, dst in zip([7, 2, 5], [0, 9, 4]):
        assert torch.equal(other[:, :, dst], kv[:, :, src])
    untouched = [b for b in range(BLOCKS) if b not in (0, 9, 4)]
    assert not other[:, :, untouched].any()


def test_layer_ranges_pack_and_unpack(kv):
    ids = torch.tensor([1, 8])
    full = pack_blocks(kv, ids)
    middle = pack_blocks(kv, ids, first_layer=1, num_layers=2)
    assert torch.equal(middle, full[:, 1:3])
    # A pipeline stage's cache holds only layers 1..2; one layer can be loaded at a time.
    stage = torch.zeros(2, 2, BLOCKS, BS, KVH, HD)
    unpack_blocks(stage, torch.tensor([3, 4]), full[:, 2:3], first_layer=1)
    assert torch.equal(stage[1, :, [3, 4]], kv[2, :, [1, 8]]) and not stage[0].any()


def test_unpack_converts_dtype(kv):
    packed = pack_blocks(kv, torch.tensor([0])).to(torch.bfloat16)
    dst = torch.zeros_like(kv)
    unpack_blocks(dst, torch.tensor([6]), packed)
    assert dst.dtype == torch.float32
    assert torch.equal(dst[:, :, 6], packed[0].permute(0, 2, 3, 1, 4).float())


def test_gather_scatter_tokens(kv):
    slots = torch.tensor([0, 13, 5, 39, 22])
    data = gather_tokens(kv, 1, slots)
    assert data.shape == (2, 5, KVH, HD)
    for j, s in enumerate(slots.tolist()):
        assert torch.equal(data[0, j], kv[1, 0, s // BS, s % BS])
        assert torch.equal(data[1, j], kv[1, 1, s // BS, s % BS])
    dst = torch.zeros_like(kv)
    scatter_tokens(dst, 2, slots, data)
    assert torch.equal(gather_tokens(dst, 2, slots), data)
    assert not dst[:2].any()
    written = (dst[2] != 0).any(-1).any(-1).any(0).flatten()  # per flat slot
    assert written.nonzero().flatten().tolist() == sorted(slots.tolist())


def test_token_stream_agrees_with_block_packing(kv):
    """Streaming a sequence's tokens and shipping its blocks carry the same KV."""
    table, num_tokens = [6, 1, 3], 10
    slots = slot_mapping(table, 0, num_tokens, BS)
    tokens = gather_tokens(kv, 2, slots)
    blocks = pack_blocks(kv, torch.tensor(table))[:, 2]  # [3, KVH, 2, BS, HD]
    as_tokens = blocks.permute(2, 0, 3, 1, 4).reshape(2, -1, KVH, HD)[:, :num_tokens]
    assert torch.equal(tokens, as_tokens)


def test_bad_ids_raise(kv):
    with pytest.raises(IndexError):
        pack_blocks(kv, torch.tensor([BLOCKS]))
    with pytest.raises(IndexError):
        gather_tokens(kv, 0, torch.tensor([BLOCKS * BS]))


def test_cpu_always_uses_reference(kv, monkeypatch):
    assert fast_module("triton_kv_pack", kv) is None
    monkeypatch.setenv("MOONCAKE_KERNELS", "ref")
    assert fast_module("triton_attention", kv) is None
