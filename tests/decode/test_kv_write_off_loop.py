"""Received KV is written into the paged cache in the engine's executor, never on the event loop:
queued behind a running step, and a sequence joins the batch only once all its writes are done;
an abort while writes are queued leaves nothing half-joined."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mooncake_kernels import gather_tokens
from mooncake_lite.common.protocol import GenerateRequest, Sampling
from mooncake_lite.decode.batcher import DecodeBatcher
from mooncake_lite.decode.engine import DecodeEngine
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model

pytestmark = pytest.mark.timeout(60)
BS, PROMPT = 8, 12


@pytest.fixture
def engine():
    runner = ModelRunner(build_model("tiny"), num_blocks=16, block_size=BS)
    engine = DecodeEngine(runner, DecodeBatcher(runner.allocator, BS), ThreadPoolExecutor(1))
    yield engine
    engine.executor.shutdown(wait=True)


def hold_executor(engine: DecodeEngine) -> threading.Event:
    """Occupy the engine's one thread, as a running step does, until the event is set."""
    gate = threading.Event()
    engine.executor.submit(gate.wait, 10)
    return gate


def layer_kv(engine: DecodeEngine, layer: int) -> torch.Tensor:
    args = engine.runner.args
    g = torch.Generator().manual_seed(layer)
    return torch.randn(2, PROMPT, args.num_kv_heads, args.head_dim, generator=g)


async def test_sequence_joins_only_after_its_writes(engine):
    engine.add_request(GenerateRequest("r", "t", PROMPT, Sampling(max_tokens=4)))
    threads = []
    write = engine._write_kv

    def recording_write(*args):
        threads.append(threading.current_thread())
        return write(*args)

    engine._write_kv = recording_write
    gate = hold_executor(engine)
    num_layers = engine.runner.args.num_layers
    writes = [engine.kv_layer(1, "t", layer, 0, PROMPT, layer_kv(engine, layer)) for layer in range(num_layers)]
    done = engine.kv_end(1, "t", first_token=3)
    await asyncio.sleep(0.05)   # the loop runs on while the "step" holds the executor
    assert done is not None and not done.done() and not any(w.done() for w in writes)
    assert "t" in engine.pending and engine.batcher.num_running == 0   # received, not written: not joined
    gate.set()
    await asyncio.wait_for(done, 10)
    assert "t" not in engine.pending and engine.batcher.num_running == 1
    assert threads and all(t is not threading.main_thread() for t in threads)
    pos = torch.arange(PROMPT)
    slots = torch.as_tensor(engine.batcher.seqs["r"].block_ids)[pos // BS] * BS + pos % BS
    for layer in range(num_layers):
        torch.testing.assert_close(gather_tokens(engine.runner.cache.kv, layer, slots), layer_kv(engine, layer))


async def test_abort_with_writes_queued_fails_the_end_and_frees(engine):
    engine.add_request(GenerateRequest("r", "t", PROMPT, Sampling(max_tokens=4)))
    free = engine.batcher.allocator.num_free
    gate = hold_executor(engine)
    for layer in range(engine.runner.args.num_layers):
        engine.kv_layer(1, "t", layer, 0, PROMPT, layer_kv(engine, layer))
    done = engine.kv_end(1, "t", first_token=3)
    assert engine.abort("r", "abort")
    gate.set()
    with pytest.raises(Exception, match="ended before its KV was written"):
        await asyncio.wait_for(done, 10)
    assert engine.batcher.num_running == 0 and "t" not in engine.pending
    assert engine.batcher.allocator.num_free > free   # its blocks went back to the pool
