"""``decode_layers.c`` (a decode step's layers in one C call) against its reference, the same
layers called one by one from Python (``Block._compact_forward``, itself equal to torch's
operators: tests/model/test_quantized.py), on a small model whose products are Q4_0, Q4_1 and
Q8_0 blocks: the logits within the tolerance that the kernel's own exp in SwiGLU leaves (see
TOLERANCE), the same greedy tokens, the KV it writes likewise; a row's result whatever its batch;
the per-layer path wherever the C loop does not run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mooncake_kernels import decode_layers as c_layers
from mooncake_kernels.quant_linear import Q4_0, Q4_1, Q8_0, float_activations
from mooncake_lite.model import llama
from mooncake_lite.model.args import ModelArgs
from mooncake_lite.model.gguf_loader import install_compact
from mooncake_lite.model.quantized import QuantizedWeight
from mooncake_lite.model.runner import ModelRunner
from tests.kernels.test_quant_linear import needs_int8

gguf_quants = pytest.importorskip("gguf.quants")
pytestmark = needs_int8
ARGS = ModelArgs(dim=128, num_layers=3, num_heads=4, num_kv_heads=2, ffn_dim=192, vocab_size=300, max_seq_len=512,
                 name="compact-test")
TYPES = {"wq": Q4_1, "wk": Q4_1, "wv": Q4_1, "wo": Q8_0, "w1": Q4_0, "w3": Q4_0, "w2": Q4_1}
# Logits differ from the per-layer path only by SwiGLU's exp (the kernel's, not torch's: ~1 ulp),
# carried through the int8 rounding of the next product's input: measured 2.4e-3 at most on the
# default model (logits ~±20), 2.8e-5 here.
TOLERANCE = 5e-3


def _blocks(values: torch.Tensor, qtype: int) -> QuantizedWeight:
    from gguf import GGMLQuantizationType
    raw = gguf_quants.quantize(values.numpy(), GGMLQuantizationType(qtype))
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(raw)), qtype, values.shape[1])


@pytest.fixture(scope="module")
def model() -> llama.Transformer:
    torch.manual_seed(0)
    net = llama.Transformer(ARGS)
    weights = {}
    for i, block in net.layers.items():
        block.attention_norm.weight.data.uniform_(0.5, 1.5)
        block.ffn_norm.weight.data.uniform_(0.5, 1.5)
        for part, module in (("attention", block.attention), ("feed_forward", block.feed_forward)):
            for name, qtype in TYPES.items():
                if hasattr(module, name):
                    weights[f"layers.{i}.{part}.{name}.weight"] = _blocks(getattr(module, name).weight.data, qtype)
    weights["output.weight"] = _blocks(net.output.weight.data, Q8_0)   # a batched float head depends on its batch
    install_compact(net, weights, torch.float32)
    return net.eval()


def run(model, monkeypatch, mode: str, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """Prefill sequences of ``lens`` tokens, then two decode steps of the batch; (the steps'
    logits, the cache, whether each step ran the C loop)."""
    monkeypatch.setenv(c_layers.LAYERS_ENV, mode)
    ran = []

    def spy(*args):
        ran.append(c_layers.decode_layers(*args))
        return ran[-1]
    monkeypatch.setattr(llama, "decode_layers", spy)
    runner = ModelRunner(model, num_blocks=4 * len(lens), block_size=16)
    tables = [[4 * i + j for j in range(4)] for i in range(len(lens))]
    with torch.inference_mode():
        for n, table in zip(lens, tables):
            runner.prefill([(5 * n + 3 * t) % ARGS.vocab_size for t in range(n)], table, 0)
        steps = [runner.decode([7 + s] * len(lens), tables, [n + s for n in lens]) for s in range(2)]
    return torch.stack(steps), runner.cache.kv.clone(), ran


@pytest.mark.parametrize("lens", [[9], [1, 17, 33, 5, 40]])
def test_one_c_call_a_step_matches_the_layers_called_one_by_one(model, monkeypatch, lens):
    ours, kv, ran = run(model, monkeypatch, "c", lens)
    ref, ref_kv, ref_ran = run(model, monkeypatch, "python", lens)
    assert ran == [True, True] and ref_ran == [False, False]
    assert (ours - ref).abs().max() <= TOLERANCE
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert (kv - ref_kv).abs().max() <= TOLERANCE


def test_a_rows_logits_do_not_depend_on_its_batch(model, monkeypatch):
    alone, _, _ = run(model, monkeypatch, "c", [17])
    batched, _, _ = run(model, monkeypatch, "c", [1, 17, 33])
    assert torch.equal(alone[:, 0], batched[:, 1])


def test_the_per_layer_path_serves_where_the_loop_does_not_run(model, monkeypatch):
    """Reported log-probabilities (float activations) and more rows than the integer kernel takes."""
    with float_activations():
        _, _, ran = run(model, monkeypatch, "c", [3])
    assert ran == [False, False]
    plan = model.decode_plan[1]
    x, rows = torch.zeros(33, ARGS.dim), torch.zeros(33, dtype=torch.int64)
    assert not c_layers.decode_layers(plan, x, torch.ones(33, 32), torch.zeros(33, 32), rows, rows[:, None], rows + 1)


def test_a_bad_block_table_is_refused_naming_it(model, monkeypatch):
    runner = ModelRunner(model, num_blocks=2, block_size=16)
    with torch.inference_mode(), pytest.raises(ValueError, match="block tables"):
        runner.decode([1], [[0, 5]], [20])
