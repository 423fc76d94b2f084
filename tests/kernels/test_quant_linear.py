"""The GGUF block kernel (``kernels/quant_matmul.c``) against its torch reference, and the
reference against gguf.quants, the format's own implementation: dequantized values bit for bit,
products within float32 rounding at every row count and tile shape the kernel specialises."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.quant_build import library
from kernels.quant_linear import (DEQUANTIZE_ROWS, Q4_0, Q4_1, Q8_0, dequantize, dequantize_ref, quant_linear,
                                  quant_linear_ref)

gguf_quants = pytest.importorskip("gguf.quants")
needs_kernel = pytest.mark.skipif(library() is None, reason="no C compiler: the kernel did not build")
TYPES = [Q4_0, Q4_1, Q8_0]


def quantized(qtype: int, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks as gguf.quants writes them, gguf.quants' dequantized float32 values)."""
    from gguf import GGMLQuantizationType
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 2 + rng.standard_normal((rows, 1))).astype(np.float32)
    raw = gguf_quants.quantize(w, GGMLQuantizationType(qtype))
    values = gguf_quants.dequantize(raw, GGMLQuantizationType(qtype)).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(values)


@pytest.mark.parametrize("qtype", TYPES)
def test_the_reference_dequantizes_to_gguf_values_exactly(qtype):
    blocks, values = quantized(qtype, 37, 96)
    assert torch.equal(dequantize_ref(blocks, qtype), values)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
def test_the_kernel_computes_on_gguf_values_exactly(qtype):
    """Its own dequantization (prefill's copy) equals gguf's; an identity input reads back the values
    its block-by-block product multiplies by, which equal gguf's too (no fused rounding)."""
    blocks, values = quantized(qtype, 45, 32)
    assert torch.equal(dequantize(blocks, qtype, 32), values)
    eye = torch.eye(32)
    assert eye.shape[0] <= DEQUANTIZE_ROWS   # the block-by-block path
    for rows in (eye, eye[:1], eye[:5]):
        assert torch.equal(quant_linear(rows, blocks, qtype), values.t()[:rows.shape[0]])


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 7, 8, 9, 16, 17, 33])
def test_the_kernel_matches_the_reference(qtype, batch):
    blocks, _ = quantized(qtype, 67, 128, seed=batch)   # 67 rows: groups of 4 and a ragged end
    x = torch.randn(batch, 128, generator=torch.Generator().manual_seed(batch))
    bias = torch.randn(67)
    torch.testing.assert_close(quant_linear(x, blocks, qtype, bias), quant_linear_ref(x, blocks, qtype, bias),
                               atol=1e-4, rtol=1e-5)


@needs_kernel
def test_threads_split_rows_without_changing_the_result():
    blocks, _ = quantized(Q4_1, 130, 64)
    x = torch.randn(5, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant_linear(x, blocks, Q4_1)
        torch.set_num_threads(2)
        assert torch.equal(quant_linear(x, blocks, Q4_1), one)
    finally:
        torch.set_num_threads(threads)


def test_ref_mode_and_other_dtypes_take_the_reference(monkeypatch):
    blocks, values = quantized(Q8_0, 8, 64)
    x = torch.randn(2, 64, dtype=torch.float64)
    torch.testing.assert_close(quant_linear(x, blocks, Q8_0), x @ values.double().t())
    monkeypatch.setenv("MOONCAKE_KERNELS", "ref")
    x = torch.randn(2, 64)
    assert torch.equal(quant_linear(x, blocks, Q8_0), quant_linear_ref(x, blocks, Q8_0))


@needs_kernel
def test_prefill_sized_products_run_tile_by_tile(monkeypatch):
    """More than DEQUANTIZE_ROWS rows: W dequantized 16 rows at a time here (a ragged last tile),
    each tile's product with its slice of the bias."""
    import kernels.quant_linear as ql
    monkeypatch.setattr(ql, "TILE_BYTES", 4 * 128 * 16)
    blocks, values = quantized(Q4_1, 67, 128)
    x, bias = torch.randn(DEQUANTIZE_ROWS + 9, 128), torch.randn(67)
    torch.testing.assert_close(quant_linear(x, blocks, Q4_1, bias), x @ values.t() + bias, atol=1e-4, rtol=1e-5)
