"""A KV frame's slot indices reach the paged cache the way its K/V do: on CUDA through the
copier's pinned staging pool and copy stream, the scatter ordered after both copies (checked on
CPU with the fake copy stream); on a GPU the frame lands in its slots."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mooncake_kernels.copies import Copier
from mooncake_lite.decode.batcher import DecodeBatcher
from mooncake_lite.decode.engine import DecodeEngine
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model
from tests.kernels.fake_stream import FakeBackend

BS = 8


class IndexFakeBackend(FakeBackend):
    """The fake copy stream for integer tensors too: a copy not yet run leaves -1, not NaN."""

    def copy_to_device(self, src: torch.Tensor, device: torch.device):
        if src.is_floating_point():
            return super().copy_to_device(src, device)
        dst = torch.full(src.shape, -1, dtype=src.dtype)
        return dst, self._enqueue(lambda: dst.copy_(src))


def make_engine(device: str, copier: Copier | None = None) -> DecodeEngine:
    runner = ModelRunner(build_model("tiny", device=device), num_blocks=8, block_size=BS)
    return DecodeEngine(runner, DecodeBatcher(runner.allocator, BS), ThreadPoolExecutor(1), copier=copier)


def frame(engine: DecodeEngine, n: int) -> torch.Tensor:
    args = engine.runner.args
    return torch.randn(2, n, args.num_kv_heads, args.head_dim, generator=torch.Generator().manual_seed(n))


def test_slot_indices_are_staged_and_copied_like_the_kv(monkeypatch):
    fake = IndexFakeBackend()
    engine = make_engine("cpu", Copier("cpu", backend=fake))
    scattered = []
    monkeypatch.setattr(engine.runner, "scatter_kv", lambda layer, slots, data, heads=None: scattered.append(slots))
    slots = torch.tensor([17, 18, 19, 40, 41])
    try:
        engine._write_kv(1, slots, frame(engine, 5))
        assert fake.num_copies == 2 and len(fake.waited_on_compute) == 2   # K/V and indices, both ordered
        assert engine.copier.pool.num_allocated == 2                      # indices from the staging pool
        assert (scattered[0] == -1).all()                                 # not the pageable tensor: a copy
        fake.run()
        assert torch.equal(scattered[0], slots)                           # what the copy delivered
        engine._write_kv(2, slots + 1, frame(engine, 5))
        assert engine.copier.pool.num_allocated == 2                      # buffers reused once copied
    finally:
        engine.executor.shutdown(wait=True)


@pytest.mark.gpu
def test_a_frame_lands_in_its_slots_on_cuda():
    engine = make_engine("cuda")
    pool, taken = engine.copier.pool, []
    take = pool.take
    pool.take = lambda nbytes: taken.append(nbytes) or take(nbytes)
    try:
        slots = torch.tensor([3, 4, 5, 9, 10, 11, 12])
        kv = frame(engine, len(slots))
        engine._write_kv(0, slots, kv)
        torch.cuda.synchronize()
        layer = engine.runner.cache.kv[engine.runner.cache.local_layer(0)].flatten(1, 2)
        assert torch.equal(layer[:, slots.cuda()].cpu(), kv.to(layer.dtype))
        # both through pinned staging: K/V, then the indices (which may reuse the K/V's buffer:
        # on a GPU its copy is done by then, the first run on an H200 saw one buffer for both)
        assert len(taken) == 2 and taken[1] == slots.numel() * slots.element_size() and pool.pin
    finally:
        engine.executor.shutdown(wait=True)
