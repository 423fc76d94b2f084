"""The copier: pass-through on CPU, and with a fake stream the ordering and staging-buffer reuse
a CUDA copy stream relies on (nothing is read before its event, no buffer reused too early)."""

import asyncio

import pytest
import torch

from mooncake_kernels.copies import Copier, StagingPool
from tests.kernels.fake_stream import FakeBackend


def layer(i: int, n: int = 5) -> torch.Tensor:
    return torch.arange(2 * n * 3 * 4, dtype=torch.float32).view(2, n, 3, 4) + 1000 * i


def test_cpu_passes_tensors_through():
    copier = Copier("cpu")
    src = layer(0)
    staged = copier.to_host(src)
    assert staged.is_ready() and staged.tensor.data_ptr() == src.data_ptr()   # no copy on CPU
    view = src[:, 1:3]
    assert copier.to_host(view).tensor.is_contiguous()
    torch.testing.assert_close(copier.to_host(view).tensor, view)
    dev = copier.to_device(src)
    assert dev.is_ready() and copier.use(dev) is dev.tensor
    staged.release()
    assert copier.pool is None and copier._waiter is None   # no pool, no thread on CPU


def test_to_host_is_not_read_before_its_event():
    backend = FakeBackend()
    copier = Copier("cpu", backend=backend)
    staged = [copier.to_host(layer(i)) for i in range(3)]
    assert not any(s.is_ready() for s in staged)
    backend.run(1)
    assert [s.is_ready() for s in staged] == [True, False, False]   # stream order
    backend.run()
    for i, s in enumerate(staged):
        torch.testing.assert_close(s.tensor, layer(i))


def test_buffer_goes_out_again_only_after_release_and_event():
    backend = FakeBackend()
    copier = Copier("cpu", backend=backend)
    first = copier.to_host(layer(0))
    ptr = first.tensor.data_ptr()
    second = copier.to_host(layer(1))           # first not released: another buffer
    assert second.tensor.data_ptr() != ptr
    first.release()                              # released, but its copy has not run yet
    third = copier.to_host(layer(2))
    assert third.tensor.data_ptr() != ptr
    assert copier.pool.num_allocated == 3
    backend.run()
    torch.testing.assert_close(third.tensor, layer(2))
    fourth = copier.to_host(layer(3))            # now first's buffer is free: reused
    assert fourth.tensor.data_ptr() == ptr and copier.pool.num_allocated == 3
    backend.run()
    torch.testing.assert_close(fourth.tensor, layer(3))


def test_discarded_buffer_is_never_reused():
    backend = FakeBackend()
    copier = Copier("cpu", backend=backend)
    first = copier.to_host(layer(0))
    backend.run()
    first.discard()
    first.release()                              # after discard: a no-op
    assert copier.to_host(layer(1)).tensor.data_ptr() != first.tensor.data_ptr()


def test_to_device_staging_is_not_reused_before_the_copy_read_it():
    backend = FakeBackend()
    copier = Copier("cpu", backend=backend)
    a, b = layer(0), layer(1)
    sa = copier.to_device(a)   # staged in a buffer the fake copy reads only when it runs
    sb = copier.to_device(b)   # the same size: reusing a's buffer now would overwrite a's bytes
    backend.run()
    torch.testing.assert_close(copier.use(sa), a)
    torch.testing.assert_close(copier.use(sb), b)
    assert backend.waited_on_compute == [sa.event, sb.event]   # compute ordered after each copy
    copier.to_device(layer(2))
    assert copier.pool.num_allocated == 2        # once read, a staging buffer is reused


def test_pool_keeps_at_most_its_idle_budget():
    pool = StagingPool(pin=False, max_idle_bytes=3 * 4096)
    bufs = [pool.take(100) for _ in range(5)]
    for buf in bufs:
        pool.give(buf, None)
    assert pool.idle_bytes == 3 * 4096
    assert pool.take(8192).numel() == 8192 and pool.num_allocated == 6   # size classes: powers of two


async def test_ready_waits_off_the_loop_and_in_order():
    backend = FakeBackend()
    copier = Copier("cpu", backend=backend)
    staged = [copier.to_host(layer(i)) for i in range(3)]
    done: list[int] = []

    async def wait(i):
        await staged[i].ready()
        done.append(i)

    tasks = [asyncio.ensure_future(wait(i)) for i in range(3)]
    ticks = 0
    for _ in range(5):                           # the loop keeps running while the copies wait
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks == 5 and done == []
    backend.run()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert done == [0, 1, 2]
    copier.close()


@pytest.mark.gpu
def test_cuda_copies_round_trip():
    copier = Copier("cuda")
    src = torch.randn(2, 64, 4, 32, device="cuda")
    staged = copier.to_host(src)
    staged.wait()
    assert staged.tensor.is_pinned()
    torch.testing.assert_close(staged.tensor, src.cpu())
    back = copier.to_device(staged.tensor)
    torch.testing.assert_close(copier.use(back) * 1, src)   # a compute-stream kernel after the copy
    staged.release()
    copier.close()
