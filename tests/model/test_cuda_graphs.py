"""CUDA-graph decode (model/cuda_graphs.py): the bucketing, the padding and the eager fallback run
on the CPU (``capture=False`` runs the same static buffers without a graph) and must give the
eager step's logits and cache; the capture itself is checked on CUDA only (marked ``gpu``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mooncake_lite.model.cuda_graphs import (DecodeGraphs, StepLayout, bucket_for, default_width, fill_step,
                                             graph_buckets)
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model

BS = 16


def test_buckets_cover_the_largest_batch_and_no_more():
    assert graph_buckets(None) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert graph_buckets(20) == (1, 2, 4, 8, 16, 32)
    assert graph_buckets(64)[-1] == 64 and graph_buckets(1) == (1,)
    assert graph_buckets(100)[-2:] == (64, 100)
    assert [bucket_for(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    with pytest.raises(ValueError):
        graph_buckets(0)


def test_fill_step_pads_rows_and_tables_with_the_pad_block():
    layout = StepLayout(bucket=4, width=3)
    out = np.full(layout.size, -1, dtype=np.int64)
    fill_step(out, layout, [7, 8], [[5], [2, 9]], [3, 17], block_size=BS, pad_block=6)
    tokens, positions, slots, lens, tables = layout.views(torch.from_numpy(out))
    assert tokens.tolist() == [7, 8, 0, 0] and positions.tolist() == [3, 17, 0, 0]
    assert slots.tolist() == [5 * BS + 3, 9 * BS + 1, 6 * BS, 6 * BS]
    assert lens.tolist() == [4, 18, 1, 1]
    assert tables.tolist() == [[5, 6, 6], [2, 9, 6], [6, 6, 6], [6, 6, 6]]
    with pytest.raises(ValueError, match="does not fit"):
        fill_step(out, layout, [1] * 5, [[1]] * 5, [0] * 5, block_size=BS, pad_block=6)
    with pytest.raises(ValueError, match="does not fit"):
        fill_step(out, layout, [1], [[1, 2, 3, 4]], [0], block_size=BS, pad_block=6)


def _runner(device: str = "cpu", dtype: torch.dtype = torch.float32) -> ModelRunner:
    return ModelRunner(build_model("tiny", device=device, dtype=dtype, seed=3), num_blocks=48, block_size=BS)


def _prefilled(runner: ModelRunner, lens: list[int]) -> tuple[list[list[int]], list[int]]:
    """Sequences of ``lens`` tokens prefilled into the cache: their tables and next positions."""
    gen = torch.Generator().manual_seed(1)
    tables = []
    for n in lens:
        table = runner.allocator.allocate(-(-(n + 1) // BS))
        runner.prefill(torch.randint(0, runner.args.vocab_size, (n,), generator=gen).tolist(), table)
        tables.append(table)
    return tables, list(lens)


def _twins(device="cpu", dtype=torch.float32, lens=(5, 40, 17, 33, 2)):
    """Two runners with the same weights and cache: one stepped through the graphs' buffers, one eagerly."""
    a, b = _runner(device, dtype), _runner(device, dtype)
    tables, positions = _prefilled(a, list(lens))
    _prefilled(b, list(lens))
    return a, b, tables, positions


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_bucketed_steps_match_the_eager_step(batch):
    a, b, tables, positions = _twins()
    graphs = DecodeGraphs(a, (1, 2, 4, 8), capture=False)
    assert graphs.pad_block not in {blk for t in tables for blk in t}
    tokens = [11, 12, 13, 14, 15][:batch]
    got = graphs.decode(tokens, tables[:batch], positions[:batch])
    want = b.decode(tokens, tables[:batch], positions[:batch])
    assert got.shape == want.shape == (batch, a.args.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (graphs.num_bucketed, graphs.num_eager) == (1, 0)
    # the padding rows wrote only into the pad block: every other block holds what the eager step wrote
    keep = [i for i in range(a.allocator.num_blocks) if i != graphs.pad_block]
    torch.testing.assert_close(a.cache.kv[:, :, keep], b.cache.kv[:, :, keep], atol=1e-5, rtol=1e-5)


def test_above_the_largest_bucket_the_step_runs_eagerly():
    a, b, tables, positions = _twins()
    graphs = DecodeGraphs(a, (1, 2), capture=False)
    got = graphs.decode([1, 2, 3], tables[:3], positions[:3])
    torch.testing.assert_close(got, b.decode([1, 2, 3], tables[:3], positions[:3]), atol=1e-4, rtol=1e-4)
    assert (graphs.num_bucketed, graphs.num_eager) == (0, 1)
    narrow = DecodeGraphs(a, (1, 2), capture=False, width=2)    # a table wider than captured: eager too
    narrow.decode([1], [tables[1]], [positions[1]])
    assert narrow.num_eager == 1 and len(tables[1]) > 2


def test_width_and_device_checks():
    runner = _runner()
    assert default_width(runner) == min(-(-runner.args.max_seq_len // BS), 48)
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(runner, capture=True)


def test_successive_steps_reuse_the_buffers():
    """Sequences grow a token per step and the batch shrinks: each step still matches."""
    a, b, tables, positions = _twins(lens=(5, 30, 12))
    graphs = DecodeGraphs(a, (1, 2, 4), capture=False)
    tokens = [4, 5, 6]
    for step in range(3):
        n = 3 - step
        got = graphs.decode(tokens[:n], tables[:n], positions[:n])
        want = b.decode(tokens[:n], tables[:n], positions[:n])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        tokens = want.argmax(-1).tolist()
        positions = [p + 1 for p in positions[:n]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_graphs_match_the_eager_step_on_cuda(dtype):
    a, b, tables, positions = _twins("cuda", dtype)
    graphs = DecodeGraphs(a, (1, 2, 4, 8), capture=True)
    assert all(bucket.graph is not None for bucket in graphs.buckets.values())
    tokens = [11, 12, 13, 14, 15]
    for batch in (1, 3, 5, 5):    # the same bucket twice: replay picks up the new inputs
        got = graphs.decode(tokens[:batch], tables[:batch], positions[:batch]).clone()
        want = b.decode(tokens[:batch], tables[:batch], positions[:batch])
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        tokens = want.argmax(-1).tolist() + tokens[batch:]
        positions = [p + 1 for p in positions[:batch]] + positions[batch:]
    assert graphs.num_eager == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_preset_is_drawn_on_the_device_the_same_each_time():
    a, b = (build_model("tiny", device="cuda", dtype=torch.bfloat16, seed=4) for _ in range(2))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.device.type == "cuda" and p.dtype == torch.bfloat16, name
        assert torch.equal(p, q), name
    assert a.layers["0"].attention_norm.weight.eq(1).all()
