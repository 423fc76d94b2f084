"""Batched decode's fast paths on CPU: oneDNN-packed weights for few-row matmuls (``pack_``) and
the per-thread buffers decode attention gathers K/V into. Both must compute what the plain paths do."""

import pytest
import torch

import kernels.attention as attention
from mooncake_lite.model.llama import SKINNY_ROWS
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model

BS = 8
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture(autouse=True)
def one_thread():
    """These small products at two OpenMP threads on a shared box spin for seconds (docs/model.md,
    "Threads on a shared box"); one thread runs them in milliseconds and computes the same."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def prefilled(model, batch: int):
    """A runner whose cache holds ``batch`` prompts of unequal lengths (the masked attention path),
    each over SKINNY_ROWS tokens (prefill's own path); their tables, lengths and last logits."""
    runner = ModelRunner(model, num_blocks=7 * batch, block_size=BS)
    tables = [list(range(7 * i, 7 * i + 7)) for i in range(batch)]
    lens = [SKINNY_ROWS + 1 + (5 * i) % 17 for i in range(batch)]
    first = [runner.prefill(prompt(i, n), t) for i, (t, n) in enumerate(zip(tables, lens))]
    return runner, tables, lens, first


def prompt(i: int, n: int) -> list[int]:
    return [(7 * i + j) % 256 for j in range(n)]


def steps(runner, tables, lens) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-row step, then a step of every sequence, at the same positions on every call (each
    rewrites the same cache slots from the same prefilled context)."""
    one = runner.decode([9], tables[:1], [lens[0]])
    many = runner.decode([5 + i for i in range(len(tables))], tables, [n + (i == 0) for i, n in enumerate(lens)])
    return one, many


@needs_onednn
@pytest.mark.parametrize("batch", [3, 16])
def test_packed_decode_computes_what_the_plain_path_does(batch):
    model = build_model("tiny", seed=4)
    runner, tables, lens, first = prefilled(model, batch)
    plain = steps(runner, tables, lens)
    assert not model.packed
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        packed = steps(runner, tables, lens) if model.pack_() else None
    assert model.packed and model.output_pack is not None
    ran = [e.key for e in prof.key_averages()]
    assert "mkldnn::_linear_pointwise" in ran   # the packed weights did run
    # Prefill (many rows) and one-row steps do not take the packed weights: the same bits.
    assert torch.equal(runner.prefill(prompt(0, lens[0]), tables[0]), first[0])
    assert torch.equal(plain[0], packed[0])
    # Few-row steps do: another kernel, the same products up to summation order.
    torch.testing.assert_close(packed[1], plain[1], atol=1e-4, rtol=1e-4)
    assert torch.equal(packed[1].argmax(-1), plain[1].argmax(-1))
    model.pack_(False)
    assert not model.packed and model.output_pack is None
    assert torch.equal(steps(runner, tables, lens)[1], plain[1])   # dropped: the plain path again


@needs_onednn
def test_packing_keeps_parameters_and_skips_what_onednn_does_not_pack():
    model = build_model("tiny", seed=4)
    params = {n: p.data_ptr() for n, p in model.named_parameters()}
    model.pack_()
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == params   # no parameter replaced
    assert set(model.layers["0"].attention.packs) == {"qkv", "wo"}
    assert set(model.layers["0"].feed_forward.packs) == {"gate_up", "w2"}
    assert not build_model("tiny", dtype=torch.bfloat16).pack_().packed   # float32 only


def test_decode_attention_gathers_into_reused_buffers_without_changing_results(monkeypatch):
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(12, BS, 2, 16, generator=g) for _ in range(2))
    calls = [(torch.randn(3, 4, 16, generator=g), torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]]),
              torch.tensor([20, 17, 24])),
             (torch.randn(2, 4, 16, generator=g), torch.tensor([[9, 10], [11, 9]]), torch.tensor([9, 16]))]
    monkeypatch.setattr(attention, "WORKSPACE_MAX_BYTES", 0)   # every gather freshly allocated
    fresh = [attention.paged_decode_attention_ref(q, k_cache, v_cache, t, n) for q, t, n in calls]
    monkeypatch.setattr(attention, "WORKSPACE_MAX_BYTES", 64 << 20)
    reused = [attention.paged_decode_attention_ref(q, k_cache, v_cache, t, n) for q, t, n in calls * 2]
    for i, out in enumerate(reused):   # earlier outputs are not overwritten by later gathers
        assert torch.equal(out, fresh[i % 2])
    held = attention._workspace.__dict__[("k", torch.float32, k_cache.device)]
    again = attention._gather_blocks(k_cache, torch.tensor([1, 0]), "k")
    assert again.data_ptr() == held.data_ptr() and torch.equal(again, k_cache[[1, 0]])
