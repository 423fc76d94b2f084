"""``mooncake_kernels.quant_linear.float_activations`` (issue #32: the forwards of a request reporting
logprobs): within it, this thread's block products take the float path where int8 activations
would run, bit for bit what ``MOONCAKE_QUANT_ACTIVATIONS=float`` computes; outside it, and in
another thread meanwhile, they stay on the int8 path."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from mooncake_kernels.quant_linear import ACTIVATIONS_ENV, Q4_1, float_activations, quant_linear
from tests.kernels.test_quant_linear import needs_int8, quantized


@needs_int8
def test_float_activations_holds_in_its_scope_and_thread_only(monkeypatch):
    blocks, _ = quantized(Q4_1, 48, 256)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    default = quant_linear(x, blocks, Q4_1)
    with ThreadPoolExecutor(1) as other:
        with float_activations():
            with float_activations(False):      # nested off: the outer scope still holds
                inside = quant_linear(x, blocks, Q4_1)
            beside = other.submit(quant_linear, x, blocks, Q4_1).result()
    assert torch.equal(beside, default) and torch.equal(quant_linear(x, blocks, Q4_1), default)
    monkeypatch.setenv(ACTIVATIONS_ENV, "float")
    floated = quant_linear(x, blocks, Q4_1)
    assert torch.equal(inside, floated) and not torch.equal(default, floated)
