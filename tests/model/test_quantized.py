"""A GGUF's quantized weights kept as its blocks (``--weights quantized``, the default): the real
default model holds its Q4_1 layers and Q8_0 embedding/head compact, computes on values equal to
the dequantized path's bit for bit, and answers the 20 chat prompts of the end-to-end test with
the dequantized path's greedy tokens; ``--weights dequantize`` keeps today's float32 model."""

from __future__ import annotations

import pytest
import torch

from mooncake_kernels.decode_layers import LAYERS_ENV
from mooncake_kernels.quant_build import library
from mooncake_lite.model.gguf_file import compact_weight_bytes, read_meta
from mooncake_lite.model.kv_cache import blocks_needed
from mooncake_lite.model.quantized import QuantizedEmbedding, QuantizedWeight
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.tokenizer import load_tokenizer
from mooncake_lite.model.weights import build_model
from tests.kernels.test_quant_linear import needs_int8
from tests.real_model import SMOLLM, needs_smollm, smollm_path

pytestmark = [needs_smollm, pytest.mark.skipif(library() is None, reason="no C compiler: nothing stays compact")]
MAX_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # small products on a shared box (docs/model.md, "Threads on a shared box")
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models():
    with torch.inference_mode():
        return build_model(SMOLLM), build_model(SMOLLM, weights="dequantize")


@pytest.fixture(scope="module")
def float_packed():
    """The dequantized model as a decode instance runs it: on oneDNN-packed weights where they exist."""
    with torch.inference_mode():
        return build_model(SMOLLM, weights="dequantize").pack_()


def compact_parts(model) -> list[QuantizedWeight]:
    parts = {id(p): p for b in model.layers.values() for p in [*b.attention.packs.values(), *b.feed_forward.packs.values()]}
    parts[id(model.output_pack)] = model.output_pack
    return list(parts.values())


def test_the_default_model_keeps_its_blocks_and_the_plan_counts_them(models):
    q, _ = models
    parts = compact_parts(q)
    assert all(isinstance(p, QuantizedWeight) for p in parts) and len(parts) == 4 * 30 + 1
    assert {p.type_name for p in parts} == {"Q4_1", "Q8_0"} and q.output_pack.type_name == "Q8_0"
    assert isinstance(q.tok_embeddings, QuantizedEmbedding) and q.tok_embeddings.quantized is q.output_pack
    held = sum(p.nbytes for p in parts) + sum(p.numel() * p.element_size() for p in q.parameters()
                                              if p.device.type != "meta")
    assert held == compact_weight_bytes(read_meta(smollm_path()), 4)[0]   # what `mooncake up` plans with
    assert held < 100e6 < 500e6 < sum(p.numel() * 4 for p in q.parameters())


def test_compact_values_equal_the_dequantized_models(models):
    """Fused and row-reordered (llama.cpp's q/k order undone) without changing a value."""
    q, d = models
    for layer in ("0", "17", "29"):
        qa, da = q.layers[layer].attention, d.layers[layer].attention
        qf, df = q.layers[layer].feed_forward, d.layers[layer].feed_forward
        assert torch.equal(qa.packs["qkv"].dequantize(), da.qkv[0])
        assert torch.equal(qa.packs["wo"].dequantize(), da.wo.weight)
        assert torch.equal(qf.packs["gate_up"].dequantize(), df.gate_up)
        assert torch.equal(qf.packs["w2"].dequantize(), df.w2.weight)
    ids = torch.tensor([0, 5, 49151, 1234])
    assert torch.equal(q.tok_embeddings(ids), d.tok_embeddings(ids))
    assert torch.equal(q.output_pack.dequantize(), d.output.weight)


def test_dequantize_keeps_the_float_model_and_it_still_packs(models, float_packed):
    _, d = models
    assert not d.packed and isinstance(d.tok_embeddings, torch.nn.Embedding)
    assert float_packed.packed == torch.backends.mkldnn.is_available()
    assert not any(isinstance(p, QuantizedWeight) for b in float_packed.layers.values() for p in b.attention.packs.values())


def greedy_batch(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens of every prompt, decoded together: one decode step for all of them, as a
    decode instance batches its sequences (the block kernel's many-row path)."""
    per_seq = blocks_needed(max(map(len, prompts)) + steps, runner.block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    out = [[int(runner.prefill(ids, table, 0).argmax())] for ids, table in zip(prompts, tables)]
    for _ in range(steps - 1):
        logits = runner.decode([t[-1] for t in out], tables, [len(p) + len(t) - 1 for p, t in zip(prompts, out)])
        for tokens, row in zip(out, logits):
            tokens.append(int(row.argmax()))
    return out


def until_stop(tokens: list[int], stops: tuple[int, ...]) -> list[int]:
    ends = [i for i, t in enumerate(tokens) if t in stops]
    return tokens[:ends[0] + 1] if ends else tokens


def test_greedy_tokens_on_the_twenty_prompts_equal_the_dequantized_path(models, float_packed):
    """The chat prompts of tests/pd/test_real_model.py, 24 tokens each (up to the end of the
    turn), the compact model against the dequantized one as a decode instance runs it."""
    from tests.pd.test_real_model import PROMPTS
    tok = load_tokenizer(SMOLLM, models[0].args.vocab_size)
    prompts = [tok.encode(tok.chat_template.render([{"role": "user", "content": text}], add_generation_prompt=True),
                          add_special_tokens=False) for text in PROMPTS]
    assert len(prompts) == 20
    with torch.inference_mode():
        ours, ref = (greedy_batch(ModelRunner(m, num_blocks=20 * 8, block_size=16), prompts, MAX_TOKENS)
                     for m in (models[0], float_packed))
    stops = tok.eos_token_ids
    assert [until_stop(t, stops) for t in ours] == [until_stop(t, stops) for t in ref]


def test_a_compact_layer_runs_in_c_calls_to_the_operator_paths_logits(models, monkeypatch):
    """``Block._compact_forward`` (norms and residuals folded into the products, rotary and KV
    write in one call) against the same layers through torch's operators: the same logits (C's
    expf in place of torch's SiLU moved them by 2e-3, so SwiGLU stays torch's). The whole step in
    one C call (``kernels/decode_layers.c``, the default) is kept out here: see the next test."""
    from mooncake_lite.model import llama
    monkeypatch.setenv(LAYERS_ENV, "python")
    model = models[0]
    assert all(llama.compact_layer(b.attention, b.feed_forward, torch.zeros(1, model.args.dim))
               for b in model.layers.values())
    prompt = [(7 * i) % 5000 + 10 for i in range(40)]

    def logits() -> torch.Tensor:
        runner = ModelRunner(model, num_blocks=8, block_size=16)
        with torch.inference_mode():
            runner.prefill(prompt, [0, 1, 2], 0)
            return runner.decode([11, 12], [[0, 1, 2], [3, 4, 5]], [40, 0])
    fused = logits()
    monkeypatch.setattr(llama, "compact_layer", lambda *_: False)
    assert torch.equal(fused, logits())


@needs_int8   # decode_layers.c is built only beside the integer-activation kernel
def test_the_step_in_one_c_call_is_within_its_tolerance_of_the_per_layer_path(models, monkeypatch):
    """``kernels/decode_layers.c`` on the default model (its SwiGLU's exp is its own: measured
    2.4e-3 at most): logits within tests/kernels/test_decode_layers.py's TOLERANCE, the same argmax;
    the 20-prompt greedy test above runs it (the default for a decode step)."""
    from tests.kernels.test_decode_layers import TOLERANCE
    prompt = [(7 * i) % 5000 + 10 for i in range(40)]

    def logits(mode: str) -> torch.Tensor:
        monkeypatch.setenv(LAYERS_ENV, mode)
        runner = ModelRunner(models[0], num_blocks=8, block_size=16)
        with torch.inference_mode():
            runner.prefill(prompt, [0, 1, 2], 0)
            return runner.decode([11, 12], [[0, 1, 2], [3, 4, 5]], [40, 0])
    ours, ref = logits("c"), logits("python")
    assert models[0].decode_plan[1] is not None   # the C loop ran
    assert (ours - ref).abs().max() <= TOLERANCE
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="module")
def hybrid():
    with torch.inference_mode():
        return build_model(SMOLLM, weights="hybrid")


def test_hybrid_runs_wide_products_on_its_float_copy_and_few_rows_on_the_blocks(models, hybrid):
    """``--weights hybrid`` (a prefill's auto): the blocks and, beside them, the dequantized
    values; a prefill chunk's rows multiply the copy, a decode batch's still run the blocks."""
    from mooncake_lite.model.linear import pack_weight
    q, d = models
    qkv, ref = hybrid.layers["3"].attention.packs["qkv"], q.layers["3"].attention.packs["qkv"]
    assert torch.equal(qkv.dense, d.layers["3"].attention.qkv[0]) and qkv.nbytes == ref.nbytes + qkv.dense.numel() * 4
    with torch.inference_mode():
        few, wide = torch.randn(4, qkv.cols), torch.randn(64, qkv.cols)
        assert torch.equal(qkv.matmul(few), ref.matmul(few))          # the block kernel, as served compact
        assert torch.equal(qkv.matmul(wide), torch.nn.functional.linear(wide, qkv.dense))
        plain = qkv.matmul(wide)
        copy = QuantizedWeight._of_planar(qkv.blocks, qkv.qtype, qkv.cols)
        copy.keep_dense()
        copy.pack_dense(pack_weight)
        assert copy.dense_packed == (pack_weight(qkv.dense) is not None)
        torch.testing.assert_close(copy.matmul(wide), plain, rtol=1e-4, atol=1e-4)
    assert hybrid.output_pack.dense is None   # the head multiplies one row a prompt: blocks only


def test_hybrid_prefill_logits_match_the_dequantized_model(models, hybrid, float_packed):
    """The prompts of the end-to-end test, prefilled (35-60 rows: the float copy's path) on the
    hybrid model, packed as a prefill packs it, against the dequantized model: the same next token,
    logits within float32 summation-order noise."""
    from tests.pd.test_real_model import PROMPTS
    tok = load_tokenizer(SMOLLM, models[0].args.vocab_size)
    with torch.inference_mode():
        packed = build_model(SMOLLM, weights="hybrid").pack_()
        runners = [ModelRunner(m, num_blocks=16, block_size=16) for m in (hybrid, packed, float_packed)]
        for text in PROMPTS[:6]:
            ids = tok.encode(tok.chat_template.render([{"role": "user", "content": text}], add_generation_prompt=True),
                             add_special_tokens=False)
            assert len(ids) > 32
            ours, ours_packed, ref = (r.prefill(ids, list(range(16)), 0) for r in runners)
            for logits in (ours, ours_packed):
                assert int(logits.argmax()) == int(ref.argmax())
                torch.testing.assert_close(logits, ref, rtol=0, atol=2e-3)
