"""The decoder's matrix products and the weight surgery behind them.

:func:`linear` is every projection's product: on a weight's oneDNN-packed copy where it has one
(a decode instance's model, ``Transformer.pack_``), else plain, with a few-row path for batched
decode on CPU. :func:`fuse_linears` puts several projections' weights in one tensor (one product
instead of several), :func:`pack_weight` makes a packed copy, and :func:`unheld` is what a plain
weight becomes once its packed copy serves every product (docs/model.md,
"CPU paths").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mooncake_kernels.timing import best_seconds
from mooncake_lite.model.quantized import QuantizedWeight

SKINNY_ROWS = 32   # up to this many rows (a decode batch), linear() takes the few-rows paths
PACK_ROWS = 16     # the row count oneDNN chooses a packed weight's blocked layout for (any count runs)
# Packing where it measures at least this much faster (``Transformer.pack_if_faster_``): below it
# the two paths are within what one start-up measurement on a busy machine can tell apart.
PACK_GAIN = 1.1
PACK_PROBE_ROWS = 256    # the rows a prefill's --pack-weights auto measures at (at most its chunk)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a float32 CPU weight, for :func:`linear`'s products, or
    ``None`` where there is none (another device or dtype, a torch without oneDNN): the plain
    paths serve. At 16 rows on weights streamed from memory its kernel ran smollm2-135m's matmuls
    1.26x faster than MKL's sgemm (the head 1.5x; docs/model.md, "CPU paths"), and one row as fast
    as ``F.linear``, so the packed copy replaces the plain weight (``Transformer.pack_``)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
    except (AttributeError, RuntimeError):   # this torch lacks the op: the plain paths serve
        return None


def packing_speedup(weights: Sequence[torch.Tensor], rows: int, repeats: int = 3) -> float | None:
    """How many times faster the products of ``rows`` rows with each of ``weights`` run on their
    oneDNN-packed copies than on the plain weights, measured here and now (the best of
    ``repeats`` runs of each); None where nothing packs. The answer is the CPU's, not ours: at
    256 rows the packed products ran 1.2x slower than MKL's sgemm on an AVX2 EPYC and 2x faster
    on an AVX-512 one (docs/model.md, "CPU paths"), so a prefill asks at start-up."""
    packs = [pack_weight(w) for w in weights]
    if not weights or any(p is None for p in packs):
        return None
    inputs = [torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]

    def plain() -> None:
        for x, w in zip(inputs, weights):
            linear(x, w)

    def packed() -> None:
        for x, w, p in zip(inputs, weights, packs):
            linear(x, w, packed=p)
    device = weights[0].device
    return best_seconds(plain, device, repeats, warmup=1) / best_seconds(packed, device, repeats, warmup=1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | QuantizedWeight | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``. On ``packed`` when given, at any row count: a oneDNN-packed copy
    (:func:`pack_weight`) or a GGUF file's own quantized blocks (``model/quantized.py``), either
    of which replaces the plain weight (``Transformer.pack_``, ``gguf_loader``). Otherwise, for a few rows
    on CPU, as ``(weight @ x.T).T``: MKL's kernel for a tall weight times a few columns streams
    the weight once, where its few-rows ``x @ weight.T`` kernel measured 1.2-1.5x slower at 4-16
    rows here (docs/model.md, "CPU paths"). One row and prefill-sized inputs keep ``F.linear``."""
    if isinstance(packed, QuantizedWeight):
        return packed.matmul(x, bias)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if 1 < x.shape[0] <= SKINNY_ROWS and x.dim() == 2 and x.device.type == "cpu":
        out = torch.mm(weight, x.t()).t().contiguous()
        return out.add_(bias) if bias is not None else out
    return F.linear(x, weight, bias)


def unheld(weight: torch.Tensor) -> nn.Parameter:
    """A parameter of ``weight``'s shape and dtype that holds no memory (the ``meta`` device):
    what a plain weight becomes once its packed copy serves every product. Shapes, names and
    weight counts stay; reading its values fails loudly instead of computing on stale bytes."""
    return nn.Parameter(weight.detach().to("meta"), requires_grad=False)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    # On the meta device (the loaders fuse before loading) torch.cat runs torch's Python reference,
    # whose first call imports torch._dynamo and sympy, ~1.6 s of CPU in every instance's start-up;
    # a meta result is only a shape.
    if parts[0].is_meta:
        return torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype, device="meta")
    return torch.cat(parts)


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding the linears' output rows in order; each linear's parameters
    become views of it, so checkpoints, state dicts and weight counts see no change and nothing is
    held twice."""
    weight = _cat([lin.weight.detach() for lin in linears])
    has_bias = linears[0].bias is not None
    bias = _cat([lin.bias.detach() for lin in linears]) if has_bias else None
    row = 0
    for lin in linears:
        rows = lin.out_features
        lin.weight = nn.Parameter(weight[row:row + rows], requires_grad=False)
        if has_bias:
            lin.bias = nn.Parameter(bias[row:row + rows], requires_grad=False)
        row += rows
    return weight, bias
