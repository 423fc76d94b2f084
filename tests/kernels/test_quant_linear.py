"""The GGUF block kernels against their torch references, and the references against gguf.quants,
the format's own implementation: dequantized values bit for bit; the float path's products
(``kernels/quant_matmul.c``) within float32 rounding at every row count and tile shape it
specialises; the int8-activation path (``quant_matmul_i8.c``, where the CPU has VNNI) equal to its
own reference within float32 rounding, within its stated bound of the float product, and the
same for a row whatever its batch; and an AVX2-only build, which falls back to the float path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mooncake_kernels.quant_build import MARCH_ENV, build, library
from mooncake_kernels.quant_linear import (ACTIVATIONS_ENV, BLOCK, DEQUANTIZE_ROWS, NO_INT8_PATH, Q4_0, Q4_1, Q8_0, dequantize,
                                  dequantize_ref, quant_linear, quant_linear_i8_ref, quant_linear_ref, to_planar)

gguf_quants = pytest.importorskip("gguf.quants")
needs_kernel = pytest.mark.skipif(library() is None, reason="no C compiler: the kernel did not build")
TYPES = [Q4_0, Q4_1, Q8_0]


def quantized(qtype: int, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks as gguf.quants writes them, row-planar, gguf.quants' dequantized float32 values)."""
    from gguf import GGMLQuantizationType
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 2 + rng.standard_normal((rows, 1))).astype(np.float32)
    raw = gguf_quants.quantize(w, GGMLQuantizationType(qtype))
    values = gguf_quants.dequantize(raw, GGMLQuantizationType(qtype)).astype(np.float32)
    return to_planar(torch.from_numpy(np.ascontiguousarray(raw)), qtype), torch.from_numpy(values)


def has_int8_path() -> bool:
    lib = library()
    x, out = torch.zeros(1, 32), torch.empty(1, 1)
    return lib is not None and lib.quant_matmul_i8(Q8_0, torch.zeros(1, 34, dtype=torch.uint8).data_ptr(), 1, 32,
                                                   x.data_ptr(), 32, 1, out.data_ptr(), 1, None, 0.0, 0,
                                                   None) != NO_INT8_PATH


needs_int8 = pytest.mark.skipif(not has_int8_path(), reason="no AVX-512 VNNI here: the float path serves")


@pytest.fixture
def float_activations(monkeypatch):
    monkeypatch.setenv(ACTIVATIONS_ENV, "float")


@pytest.mark.parametrize("qtype", TYPES)
def test_the_reference_dequantizes_to_gguf_values_exactly(qtype):
    blocks, values = quantized(qtype, 37, 96)
    assert torch.equal(dequantize_ref(blocks, qtype), values)


def test_the_planar_layout_regroups_each_rows_bytes():
    from gguf import GGMLQuantizationType
    raw = torch.from_numpy(np.ascontiguousarray(gguf_quants.quantize(np.ones((2, 64), np.float32) * [[1], [2]],
                                                                     GGMLQuantizationType.Q4_1)))
    planar = to_planar(raw, Q4_1)
    assert planar.shape == raw.shape
    assert torch.equal(planar[0, :4], torch.cat([raw[0, 0:2], raw[0, 20:22]]))   # the two blocks' d
    assert torch.equal(planar[1, 8:24], raw[1, 4:20])                          # block 0's quants
    assert torch.equal(planar.sort(dim=1).values, raw.sort(dim=1).values)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
def test_the_kernel_computes_on_gguf_values_exactly(qtype, float_activations):
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
def test_the_kernel_matches_the_reference(qtype, batch, float_activations):
    blocks, _ = quantized(qtype, 67, 128, seed=batch)   # 67 rows: groups of 4 and a ragged end
    x = torch.randn(batch, 128, generator=torch.Generator().manual_seed(batch))
    bias = torch.randn(67)
    torch.testing.assert_close(quant_linear(x, blocks, qtype, bias), quant_linear_ref(x, blocks, qtype, bias),
                               atol=1e-4, rtol=1e-5)


def rounding_bound(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """How far rounding x to its two int8 parts per block can move each product: every x value
    moves by at most half its block's finer step (max|x| / 127 / 256 / 2), against |w| (Q4_1's
    centred d*(q - 8), which the kernel multiplies by the rounded x: its m + 8d meets the exact
    block sums)."""
    step = x.reshape(x.shape[0], -1, BLOCK).abs().amax(-1, keepdim=True) / 127 / 256 / 2
    w = dequantize_ref(blocks, qtype)
    if qtype == Q4_1:
        nblk = blocks.shape[1] // 20
        d = blocks[:, :2 * nblk].contiguous().view(torch.float16).float()
        m = blocks[:, 2 * nblk:4 * nblk].contiguous().view(torch.float16).float()
        w = w - (m + 8 * d).repeat_interleave(BLOCK, dim=1)
    return step.expand(-1, -1, BLOCK).reshape(x.shape) @ w.abs().t()


@needs_int8
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("batch", [1, 5, 32])
@pytest.mark.parametrize("cols", [32, 160, 576])   # 1, 5, 18 blocks: ragged last groups of 4 and 2
def test_int8_activations_match_their_reference_within_the_rounding_bound(qtype, batch, cols):
    blocks, _ = quantized(qtype, 37, cols, seed=batch)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(cols)) * 3
    x[-1, :32] = 0 if batch > 1 else x[-1, :32]   # an all-zero block: scale 0
    bias = torch.randn(37, generator=torch.Generator().manual_seed(batch))
    out = quant_linear(x, blocks, qtype, bias)
    # float32 sums of per-block terms that cancel, against float64: 1e-4 was met but for one value
    # in a thousand (1.1e-4); rounding to one int8 part instead of two moves products by ~0.1
    torch.testing.assert_close(out, quant_linear_i8_ref(x, blocks, qtype) + bias, atol=5e-4, rtol=1e-4)
    exact = quant_linear_ref(x, blocks, qtype, bias)
    assert ((out - exact).abs() <= rounding_bound(x, blocks, qtype) + 1e-4).all()
    assert (out - exact).abs().max() > 0   # the int8 path did run


@needs_int8
@pytest.mark.parametrize("qtype", TYPES)
def test_int8_rows_do_not_depend_on_their_batch(qtype):
    """Batched decode and one sequence alone must sample the same tokens."""
    blocks, _ = quantized(qtype, 21, 160)
    x = torch.randn(7, 160)
    batched = quant_linear(x, blocks, qtype)
    for i in range(7):
        assert torch.equal(quant_linear(x[i:i + 1], blocks, qtype), batched[i:i + 1])
    assert torch.equal(quant_linear(x[2:5], blocks, qtype), batched[2:5])


@needs_kernel
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_builds_without_avx512_have_no_int8_path_and_their_float_path_matches(monkeypatch, march):
    """What an AVX2-only machine runs (x86-64-v3: two 8-float registers a vector) and one with no
    AVX (x86-64: GCC's vector types); the build picks its code by the target's ISA."""
    lib = build(march)
    if lib is None:
        pytest.skip(f"the compiler cannot target {march} here")
    blocks, _ = quantized(Q4_1, 19, 96)
    x, out = torch.randn(3, 96), torch.empty(3, 19)
    assert lib.quant_matmul_i8(Q4_1, blocks.data_ptr(), 19, 96, x.data_ptr(), 96, 3, out.data_ptr(), 1, None, 0.0, 0,
                               None) == NO_INT8_PATH
    monkeypatch.setenv(MARCH_ENV, march)
    for qtype in TYPES:
        blocks, values = quantized(qtype, 19, 96)
        for rows in (1, 3, 9):   # one row, a tile, and a tile of eight with one more
            x = torch.randn(rows, 96)
            torch.testing.assert_close(quant_linear(x, blocks, qtype), quant_linear_ref(x, blocks, qtype),
                                       atol=1e-4, rtol=1e-5)
        assert torch.equal(dequantize(blocks, qtype, 96), values)


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
    import mooncake_kernels.quant_linear as ql
    monkeypatch.setattr(ql, "TILE_BYTES", 4 * 128 * 16)
    blocks, values = quantized(Q4_1, 67, 128)
    x, bias = torch.randn(DEQUANTIZE_ROWS + 9, 128), torch.randn(67)
    torch.testing.assert_close(quant_linear(x, blocks, Q4_1, bias), x @ values.t() + bias, atol=1e-4, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("int8", [True, False])
def test_a_norm_and_a_residual_folded_into_the_product_equal_them_apart(monkeypatch, int8):
    """``quant_linear_fused``: one C call on the integer path (the norm by rms_norm.c's own row
    function; a product may still differ in float32 rounding), torch's operators on the float
    path; x may be a view's columns (a split's first half)."""
    from mooncake_kernels.norm import rms_norm
    from mooncake_kernels.quant_linear import quant_linear_fused
    if not int8:
        monkeypatch.setenv(ACTIVATIONS_ENV, "float")
    elif not has_int8_path():
        pytest.skip("no AVX-512 VNNI here")
    blocks, _ = quantized(Q4_1, 40, 96)
    torch.manual_seed(0)
    x, res = torch.randn(5, 96) * 2, torch.randn(5, 40)
    weight = torch.rand(96) + 0.5
    # On the integer path a normed value one float32 ulp apart can round to the next int8 code:
    # one activation step (here ~3e-4 in the product; it failed 1e-4 on 6 of 200 outputs once)
    atol = 1e-3 if int8 else 1e-4
    torch.testing.assert_close(quant_linear_fused(x, blocks, Q4_1, norm=(weight, 1e-5)),
                               quant_linear(rms_norm(x, weight, 1e-5), blocks, Q4_1), atol=atol, rtol=1e-5)
    assert torch.equal(quant_linear_fused(x, blocks, Q4_1, residual=res), quant_linear(x, blocks, Q4_1) + res)
    wide = torch.randn(5, 192)
    assert torch.equal(quant_linear_fused(wide[:, :96], blocks, Q4_1), quant_linear(wide[:, :96].contiguous(), blocks, Q4_1))
