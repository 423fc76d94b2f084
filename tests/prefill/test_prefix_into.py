"""Prefix loads read each block's layer straight into the stage's reused load buffer (issue 17
item 1, the client side), on the shared-memory path and over TCP, and the KV that ends up in the
paged cache and in the frames to decode is byte for byte what the old path made of the same
store bytes (fresh memory, ``bytearray``, ``torch.stack``, unpack, then a gather of every token)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mooncake_kernels import gather_tokens, unpack_blocks
from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.engine import StageEngine
from mooncake_lite.prefill.load_buffers import LoadBuffers
from mooncake_lite.prefill.remote_store import RemoteStore
from mooncake_lite.prefill.store_io import MemoryStore
from mooncake_lite.transfer import shm
from tests.conftest import start_role

pytestmark = pytest.mark.timeout(120)
BS = 8
TRANSPORTS = ["tcp", pytest.param("shm", marks=pytest.mark.skipif(not shm.is_supported(),
                                                                  reason="no memfd_create or /proc here"))]


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=3)


def _layer_bytes(model) -> int:
    a = model.args
    return 2 * BS * a.num_kv_heads * a.head_dim * 4


@pytest.fixture(scope="module")
def store(model):
    slot = _layer_bytes(model) * model.args.num_layers
    proc = start_role("store", "--port", "0", "--data-port", "0", "--dram", str(64 * slot), "--slot-bytes", str(slot))
    yield proc
    proc.stop()


async def _remote(model, store, transport: str) -> RemoteStore:
    address = store.addresses["data"]
    remote = RemoteStore(address, None, model.args.num_layers, _layer_bytes(model), shm=transport != "tcp")
    assert (await remote.client()).transport == transport
    return remote


def _prompt(num_blocks: int, seed: int) -> list[int]:
    """``num_blocks`` full blocks and one more token (the prefix must leave one to compute)."""
    return torch.randint(0, 256, (num_blocks * BS + 1,), generator=torch.Generator().manual_seed(seed)).tolist()


def _blocks(model, keys, seed: int) -> list[bytes]:
    """Random KV bytes for each block: every byte differs between blocks, layers and K/V."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(model.args.num_layers * _layer_bytes(model) // 4, generator=g).numpy().tobytes() for _ in keys]


class KeepingSender:
    """Keeps each frame's tensor as sent, no copy: a frame that aliased a reused load buffer
    would change under it by the time the test reads it."""

    error = None

    def __init__(self):
        self.frames: dict[int, torch.Tensor] = {}

    def send_layer(self, layer, start, kv):
        assert start == 0
        self.frames[layer] = kv

    async def abort(self, reason):
        pass


def _old_path(runner: ModelRunner, blocks: list[bytes], layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the stage made of a layer's bytes before: (the blocks as unpacked into a cache, the
    frame gathered back out of it), on a cache of its own."""
    a, lb = runner.args, _layer_bytes(runner.model)
    shape = (1, 2, BS, a.num_kv_heads, a.head_dim)
    views = [memoryview(b)[layer * lb:(layer + 1) * lb] for b in blocks]
    packed = torch.stack([torch.frombuffer(bytearray(v), dtype=torch.float32).view(shape) for v in views])
    kv = torch.zeros_like(runner.cache.kv)
    ids = torch.as_tensor(block_ids)
    unpack_blocks(kv, ids, packed, layer)
    slots = torch.arange(len(blocks) * BS)
    slots = ids[slots // BS] * BS + slots % BS
    return kv[layer, :, ids], gather_tokens(kv, layer, slots)


async def _load_all(stage: StageEngine, store, prompt, name: str) -> tuple[list[int], KeepingSender]:
    keys = prefix_hash(prompt, BS)
    assert await store.match(keys) == len(keys)
    sender = KeepingSender()
    job = stage.begin(name, prompt, keys, len(keys), sender)
    for layer in stage.layer_ids:
        await stage._load_prefix_layer(job, layer)
    stage._prefix_in(job)
    return job, sender


class OwnViewsStore(MemoryStore):
    """A store that ignores ``out`` (hands back views of its own memory): the stage copies."""

    async def get_layers(self, keys, first_layer, num_layers, out=None):
        return await super().get_layers(keys, first_layer, num_layers)


@pytest.mark.parametrize("transport", TRANSPORTS + ["own-views"])
async def test_prefix_kv_in_the_cache_and_frames_is_the_old_paths(model, store, transport):
    """Two requests back to back (the second reuses the first's load buffers; one has a single
    block, whose frame a buffer view could alias): every layer's cache blocks and frame equal
    the old path's for the same bytes, read only after both requests loaded."""
    if transport == "own-views":
        adapter = OwnViewsStore((0, model.args.num_layers), _layer_bytes(model))
        client = None
    else:
        adapter = await _remote(model, store, transport)
        client = await adapter.client()
    runner = ModelRunner(model, num_blocks=16, block_size=BS)
    stage = StageEngine(runner, adapter, ThreadPoolExecutor(1), write_back=False)
    loaded = []
    try:
        for num_blocks, seed in ((3, 11), (1, 12), (3, 13)):
            prompt = _prompt(num_blocks, seed + len(transport))
            keys = prefix_hash(prompt, BS)
            blocks = _blocks(model, keys, seed)
            if client is None:
                await adapter.put_layers(keys, [memoryview(b) for b in blocks], 0, model.args.num_layers)
            else:
                await client.put(keys, blocks, num_layers=model.args.num_layers)
            job, sender = await _load_all(stage, adapter, prompt, f"r{seed}")
            cached = {layer: runner.cache.kv[layer, :, job.block_ids[:num_blocks]].clone() for layer in stage.layer_ids}
            loaded.append((blocks, list(job.block_ids[:num_blocks]), cached, sender))
            await stage.release(job)
        # Reused: two loads in flight at a time (layer i+1's while i unpacks), of two size
        # classes (4 blocks, 1 block); without reuse each of the 12 layer loads allocates.
        assert stage.load_buffers.num_allocated <= 4
        for blocks, block_ids, cached, sender in loaded:
            for layer in stage.layer_ids:
                want_cache, want_frame = _old_path(runner, blocks, layer, block_ids)
                assert torch.equal(cached[layer], want_cache)
                assert sender.frames[layer].dtype == want_frame.dtype
                assert torch.equal(sender.frames[layer], want_frame)
    finally:
        if client is not None:
            await adapter.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_store_writes_each_block_into_its_out_buffer(model, store, transport):
    """Not only the same bytes: the views handed back are the buffer's own blocks (the client
    copied from the slab, or received from the socket, into them), pinned or not."""
    remote = await _remote(model, store, transport)
    client = await remote.client()
    lb = _layer_bytes(model)
    buffers = LoadBuffers((1, 2, BS, model.args.num_kv_heads, model.args.head_dim), torch.float32)
    try:
        keys = prefix_hash(_prompt(5, 40 + len(transport)), BS)
        blocks = _blocks(model, keys, 41)
        await client.put(keys, blocks, num_layers=model.args.num_layers)
        for pinned in (False, True):   # a plain get, then (shm) reads under the match's lease
            if pinned:
                assert await remote.match(keys) == len(keys)
            for layer in (0, model.args.num_layers - 1):
                buf = buffers.take(len(keys))
                views = await remote.get_layers(keys, layer, 1, out=buf.block_views)
                assert all(buf.holds(i, v) for i, v in enumerate(views))
                assert bytes(buf.packed.view(torch.uint8).numpy()) == \
                    b"".join(b[layer * lb:(layer + 1) * lb] for b in blocks)
                buffers.give(buf)
        remote.prefix_loaded(keys)
    finally:
        await remote.close()
