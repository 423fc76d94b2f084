"""``x @ Wᵀ`` for a weight kept in one of GGUF's block formats (Q4_0, Q4_1, Q8_0): each row of W
is K/32 blocks of one scale ``d`` (float16), for Q4_1 a minimum ``m`` (float16), and 32 quants
(4-bit pairs or int8), the file's bytes regrouped within each row (:func:`to_planar`).

:func:`quant_linear` runs the C kernel (``quant_matmul.c``, built by ``quant_build``) on CPU
float32 activations (prefill-sized inputs: W dequantized tile by tile for ``F.linear``), else
the torch reference :func:`quant_linear_ref`: the weight dequantized
with gguf.quants' own operations (:func:`dequantize_ref`, equal to it bit for bit) and then one
``F.linear``. ``MOONCAKE_KERNELS=ref`` forces the reference.

Few rows (a decode batch) multiply int8-quantized activations where the CPU has VNNI
(``quant_matmul_i8.c``, as llama.cpp does; within the tolerance docs/model.md states), the float
path elsewhere or with ``MOONCAKE_QUANT_ACTIVATIONS=float`` (products equal to the reference's
values up to summation order).
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import torch.nn.functional as F

from mooncake_kernels.norm import rms_norm
from mooncake_kernels.device import traced
from mooncake_kernels.quant_build import library

# Above this many rows (a prefill chunk) the weight is dequantized into a float32 copy for one
# matmul: the copy costs about one pass over the float32 bytes, which a product of this many rows
# amortises, while the block-by-block kernel's work grows with every row.
DEQUANTIZE_ROWS = 32
TILE_BYTES = 1 << 20   # a dequantized tile that stays in L2 while its product reads it
BLOCK = 32                                    # values per block, in every type here
Q4_0, Q4_1, Q8_0 = 2, 3, 8                    # GGMLQuantizationType values
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}  # d (+ m) and the quants
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
ACTIVATIONS_ENV = "MOONCAKE_QUANT_ACTIVATIONS"   # int8 (default where the CPU has VNNI) or float
NO_INT8_PATH = -2   # quant_matmul_i8's answer in a build without VNNI


def to_planar(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """The kernels' layout of GGUF ``blocks`` (uint8 [N, K/32 * block bytes], as the file holds
    them): the same bytes per row, regrouped as all the row's scales ``d``, then (Q4_1) all its
    minimums ``m``, then all its quants, so one vector load reads several blocks' scales or quants
    (``quant_matmul_i8.c``). Rows stay whole, so rows may still be moved, stacked and sliced."""
    rows, size = blocks.shape[0], BLOCK_BYTES[qtype]
    b = blocks.reshape(rows, -1, size)
    head = 4 if qtype == Q4_1 else 2
    parts = [b[..., 0:2]] + ([b[..., 2:4]] if qtype == Q4_1 else []) + [b[..., head:]]
    return torch.cat([p.reshape(rows, -1) for p in parts], dim=1).contiguous()


def dequantize_ref(planar: torch.Tensor, qtype: int) -> torch.Tensor:
    """float32 [N, K] from ``planar`` rows (:func:`to_planar`), with gguf.quants' operations in
    its order: Q4_0 ``d * (q - 8)``, Q4_1 ``(d * q) + m``, Q8_0 ``q * d``."""
    rows = planar.shape[0]
    nblk = planar.shape[1] // BLOCK_BYTES[qtype]
    d = planar[:, :2 * nblk].contiguous().view(torch.float16).float()[..., None]   # [N, blocks, 1]
    head = (4 if qtype == Q4_1 else 2) * nblk
    if qtype == Q8_0:
        return (planar[:, head:].contiguous().view(torch.int8).reshape(rows, nblk, BLOCK).float() * d).reshape(rows, -1)
    qs = planar[:, head:].reshape(rows, nblk, BLOCK // 2)
    q = torch.cat([qs & 15, qs >> 4], dim=-1)   # byte j: element j (low nibble), j + 16 (high)
    if qtype == Q4_0:
        return (d * (q.to(torch.int8) - 8).float()).reshape(rows, -1)
    m = planar[:, 2 * nblk:head].contiguous().view(torch.float16).float()[..., None]
    return (d * q.float() + m).reshape(rows, -1)


def _tiled_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Many rows (a prefill chunk): W dequantized a tile of rows at a time into a reused buffer
    of about TILE_BYTES, each tile one ``F.linear`` while it is still in cache. A whole float32
    copy per call cost a prefill as much again: its writes, and page faults on fresh memory."""
    rows, k = blocks.shape[0], x.shape[1]
    tile = max(16, TILE_BYTES // (4 * k) // 16 * 16)
    buf = _scratch(tile * k)
    out = torch.empty(x.shape[0], rows, dtype=torch.float32)
    for n0 in range(0, rows, tile):
        n1 = min(rows, n0 + tile)
        w = buf[:(n1 - n0) * k].view(n1 - n0, k)
        if library().quant_dequantize(qtype, blocks[n0:n1].data_ptr(), n1 - n0, k, w.data_ptr(),
                                      torch.get_num_threads()) != 0:
            raise ValueError(f"quant_linear: type {qtype} with {k} values per row is not supported")
        out[:, n0:n1] = F.linear(x, w, None if bias is None else bias[n0:n1])
    return out


_scratch_local = threading.local()


def _scratch(numel: int) -> torch.Tensor:
    """This thread's float32 buffer of at least ``numel`` values, grown as needed, kept."""
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _scratch_local.buf = torch.empty(numel, dtype=torch.float32)
    return buf


def dequantize(blocks: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """:func:`dequantize_ref`'s values, by the C kernel where it runs (MOONCAKE_KERNELS aside)."""
    lib = library() if os.environ.get("MOONCAKE_KERNELS") != "ref" else None
    if lib is None:
        return dequantize_ref(blocks, qtype)
    out = torch.empty(blocks.shape[0], cols, dtype=torch.float32)
    if lib.quant_dequantize(qtype, blocks.data_ptr(), blocks.shape[0], cols, out.data_ptr(),
                            torch.get_num_threads()) != 0:
        raise ValueError(f"dequantize: type {qtype} with {cols} values per row is not supported")
    return out


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [B, K] float32 as ``quant_matmul_i8.c`` holds it: per block of 32, ``q = round(x /
    dx)`` with ``dx = max|x| / 127`` and the remainder's ``r = round((x - q*dx) * 256 / dx)``
    (within ±127; round half to even). Returns (the values ``(256q + r) * dx / 256`` in float64,
    each block's float32 sum of x)."""
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(scale > 0, 1 / scale, 0)
    q = torch.round(blocks * inv)
    rest = (blocks.double() - q.double() * scale.double()).float()   # one rounding, as fmaf
    r = torch.round(rest * (inv * 256)).clamp(-127, 127)
    return ((256 * q.double() + r.double()) * (scale.double() / 256)).reshape(x.shape), blocks.sum(-1)


def quant_linear_i8_ref(x: torch.Tensor, planar: torch.Tensor, qtype: int) -> torch.Tensor:
    """What the integer-activation kernel computes, in float64: the rounded activations times the
    weights with Q4_1's ``d*q + m`` taken as ``d*(q - 8)`` against them and ``m + 8d`` against
    the exact block sums (``quant_matmul_i8.c``); equal to the kernel within float32 rounding."""
    nblk = planar.shape[1] // BLOCK_BYTES[qtype]
    rounded, sums = quantize_activations_ref(x.float())
    w = dequantize_ref(planar, qtype).double()
    if qtype != Q4_1:
        return (rounded @ w.t()).float()
    d = planar[:, :2 * nblk].contiguous().view(torch.float16).double()
    m = planar[:, 2 * nblk:4 * nblk].contiguous().view(torch.float16).double()
    centred = w - (m + 8 * d).repeat_interleave(BLOCK, dim=1)
    return (rounded @ centred.t() + sums.double() @ (m + 8 * d).t()).float()


def quant_linear_ref(x: torch.Tensor, blocks: torch.Tensor, qtype: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize_ref(blocks, qtype).to(x.dtype), bias)


_activations_local = threading.local()


@contextlib.contextmanager
def float_activations(on: bool = True):
    """Within (``on``): this thread's products keep float activations where int8 ones would run;
    for a step whose log-probabilities are reported (issue #32: within 1e-3 of transformers,
    which the int8 activations' ~1e-3 logit error breaks)."""
    before = getattr(_activations_local, "float", False)
    _activations_local.float = before or on
    try:
        yield
    finally:
        _activations_local.float = before


def float_activations_on() -> bool:
    """Whether this thread is within :func:`float_activations` (a TP leader tells its followers)."""
    return getattr(_activations_local, "float", False)


def _int8_activations() -> bool:
    """Whether products may quantize their activations to int8: not where the environment says
    float, nor within :func:`float_activations` on this thread."""
    return os.environ.get(ACTIVATIONS_ENV, "int8") != "float" and not float_activations_on()


def kernel_runs(x: torch.Tensor) -> bool:
    """Whether :func:`quant_linear` runs the C kernel for activations like ``x``."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and os.environ.get("MOONCAKE_KERNELS") != "ref"
            and library() is not None)


def quant_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] @ Wᵀ (+ ``bias``) → [..., N], W being rows of ``qtype`` blocks, row-planar
    (:func:`to_planar`)."""
    if not kernel_runs(x):
        return quant_linear_ref(x, blocks, qtype, bias)
    return traced("quant_linear", _kernel_linear, x, blocks, qtype, bias)


def quant_linear_fused(x: torch.Tensor, blocks: torch.Tensor, qtype: int, *, norm: tuple[torch.Tensor, float] | None = None,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
    """``rms_norm(x) @ Wᵀ + residual`` for a decode step's rows ``x`` [B, K] (the norm by ``norm``
    = (weight, eps), each part where given). Where the integer-activation kernel runs, one C call
    does all of it (the work around a layer's products, each a dispatched operator otherwise);
    elsewhere ``mooncake_kernels.norm.rms_norm``, :func:`quant_linear` and an add."""
    return traced("quant_linear", _fused_linear, x, blocks, qtype, norm, residual)   # named as the products are


def _fused_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int, norm: tuple[torch.Tensor, float] | None,
                  residual: torch.Tensor | None) -> torch.Tensor:
    if _int8_runs(x, blocks.shape[0], residual):
        out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
        status = library().quant_matmul_i8(
            qtype, blocks.data_ptr(), blocks.shape[0], x.shape[1], x.data_ptr(), x.stride(0), x.shape[0],
            out.data_ptr(), torch.get_num_threads(), None if norm is None else norm[0].data_ptr(),
            0.0 if norm is None else norm[1], None if residual is None else residual.data_ptr())
        if status == 0:
            return out
    out = quant_linear(x if norm is None else rms_norm(x, *norm), blocks, qtype)
    return out if residual is None else out.add_(residual)


def int8_runs(x: torch.Tensor) -> bool:
    """Whether products of activations like ``x`` run the integer-activation kernel (the C kernels
    with VNNI, int8 activations allowed on this thread)."""
    return kernel_runs(x) and library().has_int8 and _int8_activations()


def _int8_runs(x: torch.Tensor, rows: int, residual: torch.Tensor | None) -> bool:
    """Whether :func:`quant_linear_fused` can hand ``x`` (rows of unit stride: a view's columns
    too) to the integer-activation kernel as is."""
    return (int8_runs(x) and x.dim() == 2 and x.stride(1) == 1 and x.shape[0] <= DEQUANTIZE_ROWS
            and (residual is None or (residual.is_contiguous() and residual.shape == (x.shape[0], rows)
                                      and residual.dtype == torch.float32)))


def _kernel_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None) -> torch.Tensor:
    k, rows = x.shape[-1], blocks.shape[0]
    if x.dim() == 2 and x.is_contiguous():   # a decode step's rows: no reshapes (each an operator call)
        flat, whole = x, True
    else:
        flat, whole = x.reshape(-1, k).contiguous(), False
    if flat.shape[0] > DEQUANTIZE_ROWS:
        return _tiled_linear(flat, blocks, qtype, bias).reshape(*x.shape[:-1], rows)
    out = torch.empty(flat.shape[0], rows, dtype=torch.float32)
    lib, threads = library(), torch.get_num_threads()
    status = NO_INT8_PATH
    if lib.has_int8 and _int8_activations():
        status = lib.quant_matmul_i8(qtype, blocks.data_ptr(), rows, k, flat.data_ptr(), k, flat.shape[0],
                                     out.data_ptr(), threads, None, 0.0, None)
    if status == NO_INT8_PATH:
        sums = torch.empty(flat.shape[0] * (k // BLOCK), dtype=torch.float32)   # the kernel's scratch
        status = lib.quant_matmul(qtype, blocks.data_ptr(), rows, k, flat.data_ptr(), flat.shape[0],
                                  out.data_ptr(), sums.data_ptr(), threads)
    if status != 0:
        raise ValueError(f"quant_linear: type {qtype} with {k} values per row is not supported")
    if bias is not None:
        out.add_(bias)
    return out if whole else out.reshape(*x.shape[:-1], rows)
