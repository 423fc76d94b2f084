"""Fused q/k/v and gate/up weights: the same model, read with fewer matmuls, held once."""

import torch

from mooncake_lite.model.llama import Transformer
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model, init_dummy_weights, model_args

BS = 8


def unfused_tiny() -> Transformer:
    net = Transformer(model_args("tiny"))
    init_dummy_weights(net, seed=3)
    return net.eval()


def test_build_model_fuses_and_the_linears_become_views_of_the_fused_weight():
    model = build_model("tiny", seed=3)
    att, ffn = model.layers["0"].attention, model.layers["0"].feed_forward
    fused_qkv, fused_gate_up = att.qkv[0], ffn.gate_up
    assert att.wq.weight.data_ptr() == fused_qkv.data_ptr()
    assert att.wv.weight.data_ptr() == fused_qkv[-att.wv.out_features:].data_ptr()
    assert ffn.w3.weight.data_ptr() == fused_gate_up[ffn.w1.out_features:].data_ptr()
    # Nothing held twice: the distinct storages behind the parameters add up to the parameters.
    params = list(model.parameters())
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
    assert sum(storages.values()) == sum(p.numel() * p.element_size() for p in params)
    assert set(model.state_dict()) == set(unfused_tiny().state_dict())
    assert model.fuse_() is model and att.qkv[0] is fused_qkv   # idempotent


def test_fused_and_unfused_models_compute_the_same_logits():
    ref = unfused_tiny()
    fused = unfused_tiny().fuse_()
    tokens, table = list(range(3, 3 + 2 * BS + 3)), list(range(3))
    outs = []
    for model in (ref, fused):
        runner = ModelRunner(model, num_blocks=8, block_size=BS)
        first = runner.prefill(tokens, table)
        step = runner.decode([5, 7], [table, [4, 5, 6]], [len(tokens), 0])
        outs.append((first, step))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0][1][0], outs[1][1][0], atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[0][1].argmax(-1), outs[1][1].argmax(-1))


def test_weights_written_through_a_linear_reach_the_fused_matmul():
    model = unfused_tiny().fuse_()
    runner = ModelRunner(model, num_blocks=4, block_size=BS)
    before = runner.prefill([1, 2, 3], [0])
    with torch.no_grad():
        model.layers["0"].attention.wk.weight.mul_(3.0)   # e.g. a loader filling parameters in place
    after = runner.prefill([1, 2, 3], [1])
    assert not torch.allclose(before, after)
