"""RMSNorm's C path (``kernels/rms_norm.c``) against ``F.rms_norm``; with a gradient to track,
or another dtype, torch's own runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mooncake_kernels.norm import rms_norm
from mooncake_kernels.quant_build import library


@pytest.mark.skipif(library() is None, reason="no C compiler: F.rms_norm serves")
@pytest.mark.parametrize("shape", [(1, 576), (16, 64), (3, 9, 48)])
def test_the_c_norm_matches_torch(shape):
    x, w = torch.randn(*shape) * 3, torch.randn(shape[-1])
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, w, 1e-5), F.rms_norm(x, (shape[-1],), w, 1e-5), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(rms_norm(x[::2], w, 1e-5), F.rms_norm(x[::2], (shape[-1],), w, 1e-5))   # strided rows


def test_gradients_and_other_dtypes_take_torchs_norm():
    w = torch.randn(32, requires_grad=True)
    out = rms_norm(torch.randn(2, 32), w, 1e-6)
    assert out.requires_grad
    x = torch.randn(2, 32, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, w.double(), 1e-6), F.rms_norm(x, (32,), w.double(), 1e-6))
