"""Decode's fast paths on CPU: oneDNN-packed weights in place of the plain ones (``pack_``) and
the per-thread buffers decode attention gathers K/V into. Both must compute what the plain paths do."""

import dataclasses

import pytest
import torch

import mooncake_kernels.attention as attention
from mooncake_lite.model.linear import SKINNY_ROWS
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
    plain_model, model = build_model("tiny", seed=4), build_model("tiny", seed=4)
    runner, tables, lens, first = prefilled(model, batch)
    plain = steps(prefilled(plain_model, batch)[0], tables, lens)
    assert not model.packed
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        packed = steps(runner, tables, lens) if model.pack_() else None
    assert model.packed and model.output_pack is not None
    ran = {e.key: e.count for e in prof.key_averages()}
    # Every product of both steps ran on the packed weights, the one-row step's too: per layer
    # q/k/v, output, gate/up and down, then the head.
    assert ran.get("mkldnn::_linear_pointwise") == 2 * (4 * len(model.layers) + 1)
    assert not {"aten::mm", "aten::addmm", "aten::linear"} & set(ran)
    # Another kernel, the same products up to summation order: the same greedy tokens.
    for got, want in zip(packed, plain):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    # Prefill-sized products run packed too (a decode never prefills; this one still can).
    again = runner.prefill(prompt(0, lens[0]), tables[0])
    torch.testing.assert_close(again, first[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(again.argmax(-1), first[0].argmax(-1))


@needs_onednn
def test_packing_releases_the_plain_weights_but_not_the_tied_embedding():
    model = build_model("tiny", seed=4)
    model.output.weight = model.tok_embeddings.weight   # tied, as smollm2-135m's head
    shapes = {n: (p.shape, p.dtype) for n, p in model.named_parameters(remove_duplicate=False)}
    embedding = model.tok_embeddings.weight.clone()
    model.pack_()
    assert set(model.layers["0"].attention.packs) == {"qkv", "wo"}
    assert set(model.layers["0"].feed_forward.packs) == {"gate_up", "w2"}
    after = dict(model.named_parameters(remove_duplicate=False))
    assert {n: (p.shape, p.dtype) for n, p in after.items()} == shapes   # names, shapes, counts kept
    released = {n for n, p in after.items() if p.is_meta}
    assert released == {n for n in shapes if n.endswith(("wq.weight", "wk.weight", "wv.weight", "wo.weight",
                                                         "w1.weight", "w2.weight", "w3.weight"))} | {"output.weight"}
    att, mlp = model.layers["0"].attention, model.layers["0"].feed_forward
    assert att.qkv[0].is_meta and mlp.gate_up.is_meta      # the fused plain copies too
    assert torch.equal(model.tok_embeddings.weight, embedding)   # the embedding stays, untouched
    packs = dict(att.packs)
    assert model.pack_().layers["0"].attention.packs == packs   # a second call changes nothing
    assert not build_model("tiny", dtype=torch.bfloat16).pack_().packed   # float32 only


def test_a_packed_model_holds_beyond_its_weights_only_a_tied_heads_copy():
    args = build_model("tiny").args
    assert args.packed_extra_bytes("float32") == 0
    tied = dataclasses.replace(args, tie_embeddings=True)
    assert tied.packed_extra_bytes("float32") == tied.vocab_size * tied.dim * 4


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


@needs_onednn
def test_packing_speedup_is_measured_on_the_plain_weights_and_only_where_they_pack():
    model = build_model("tiny", seed=4)
    gain = model.packing_speedup(32)
    assert gain is not None and gain > 0          # a ratio of two timings, whichever way it goes here
    assert build_model("tiny", dtype=torch.bfloat16).packing_speedup(32) is None   # float32 only
    model.pack_()
    assert model.packing_speedup(32) is None      # nothing plain left to compare


@needs_onednn
@pytest.mark.parametrize("mode, gain, packs", [("off", 9.0, False), ("on", 0.5, True),
                                               ("auto", 1.5, True), ("auto", 1.05, False), ("auto", None, False)])
def test_prefill_packs_its_weights_as_the_flag_and_the_measurement_say(monkeypatch, mode, gain, packs):
    from mooncake_lite.model.linear import PACK_GAIN
    from mooncake_lite.prefill import app
    model = build_model("tiny", seed=4)
    asked = []
    monkeypatch.setattr(type(model), "packing_speedup", lambda self, rows: asked.append(rows) or gain)
    app.pack_weights(model, mode, chunk=64)
    assert model.packed == packs
    assert asked == ([64] if mode == "auto" else [])    # measured at the chunk (below the probe's rows)
    assert 1.05 < PACK_GAIN < 1.5
