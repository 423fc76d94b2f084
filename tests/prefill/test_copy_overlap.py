"""Prefill with KV copies in flight (a fake copy stream on CPU, as a CUDA one would run them):
every layer computes without waiting for the copy of the one before, frames and write-backs go
out only once their copy has landed, with the same bytes as a plain run, and the staging
buffers are reused from one prompt to the next."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mooncake_kernels.copies import Copier
from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.engine import StageEngine
from mooncake_lite.prefill.kv_sender import KVSender
from mooncake_lite.prefill.results import Firsts
from mooncake_lite.prefill.store_io import MemoryStore
from mooncake_lite.transfer.kv_stream import OP_KV_LAYER
from tests.kernels.fake_stream import FakeBackend

BS = 8


class FakeClient:
    """Records the frames a KVSender sends; answers each at once."""

    def __init__(self):
        self.frames: list[tuple[int, int, bytes]] = []

    async def request(self, op, meta=None, payload=(), sink=None, *, timeout=None, what=None):
        if op == OP_KV_LAYER:
            self.frames.append((meta["layer"], meta["start"], b"".join(bytes(p) for p in payload)))

    def abort(self):
        pass


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=5)


def make_stage(model, copier=None):
    layer_bytes = 2 * BS * model.args.num_kv_heads * model.args.head_dim * 4
    store = MemoryStore((0, model.args.num_layers), layer_bytes)
    stage = StageEngine(ModelRunner(model, num_blocks=16, block_size=BS), store, ThreadPoolExecutor(1),
                        copier=copier)
    return stage, store


async def compute(stage, tokens, chunk):
    """Run every chunk of ``tokens``; returns the job, its sender's client and the first token."""
    client = FakeClient()
    job = stage.begin("r", tokens, prefix_hash(tokens, BS), 0, KVSender(client, "t"))
    out = None
    for start in range(0, len(tokens), chunk):
        out = await stage.run_chunk(job, start, token_ids=tokens[start:start + chunk])
    return job, client, int(torch.argmax(out))


async def test_layers_compute_while_their_copies_are_in_flight(model):
    tokens = torch.randint(0, 256, (2 * BS + 5,), generator=torch.Generator().manual_seed(3)).tolist()
    plain, plain_store = make_stage(model)
    job, plain_client, plain_first = await compute(plain, tokens, chunk=BS)
    await plain.finish(job, Firsts((plain_first,)))
    await plain.release(job)
    await plain.drain_puts()

    backend = FakeBackend()
    stage, store = make_stage(model, Copier("cpu", backend=backend))
    num_layers = model.args.num_layers
    for round_ in range(2):
        job, client, first = await compute(stage, tokens, chunk=BS)
        # All chunks and layers ran with no copy done: nothing was sent or stored yet.
        assert first == plain_first
        assert client.frames == [] and len(backend.queue) == 3 * num_layers + 2   # + 2 write-backs
        assert round_ == 1 or len(store) == 0
        backend.run()
        await stage.finish(job, Firsts((first,)))
        await stage.release(job)
        await stage.drain_puts()
        assert client.frames == plain_client.frames   # same frames, same bytes, same order
        assert len(store) == len(plain_store) == 2
        keys = prefix_hash(tokens, BS)
        for key in keys:
            got = await store.get_layers([key], 0, num_layers)
            want = await plain_store.get_layers([key], 0, num_layers)
            assert bytes(got[0]) == bytes(want[0])
        if round_ == 0:
            allocated = stage.copier.pool.num_allocated
    assert stage.copier.pool.num_allocated == allocated   # the second prompt reused every buffer
    stage.copier.close()
