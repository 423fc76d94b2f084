"""The Triton kernels must equal their torch references.

``cuda`` cases run on a GPU (marked ``gpu``: skipped without CUDA). ``interpret`` cases run the very
same kernels on CPU through Triton's interpreter, only when ``TRITON_INTERPRET=1`` is set and
Triton imports (``TRITON_INTERPRET=1 pytest tests/kernels``); otherwise they skip.
"""

import os

import pytest
import torch

from mooncake_kernels.attention import paged_decode_attention_ref
from mooncake_kernels.kv_pack import gather_tokens_ref, pack_blocks_ref, scatter_tokens_ref, unpack_blocks_ref

DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu), "interpret"]


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param == "interpret" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 to run the Triton kernels on CPU")
    pytest.importorskip("triton")
    return "cuda" if request.param == "cuda" else "cpu"


def randn(*shape, dtype, device, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 10, 4, 2, 8), (2, 7, 16, 8, 128), (1, 5, 3, 1, 80)])
def test_pack_unpack(device, dtype, shape):
    from mooncake_kernels.triton_kv_pack import pack_blocks_triton, unpack_blocks_triton

    layers, blocks, bs, kvh, hd = shape
    kv = randn(layers, 2, blocks, bs, kvh, hd, dtype=dtype, device=device, seed=blocks)
    ids = torch.tensor([blocks - 1, 0, 2], device=device)
    assert torch.equal(pack_blocks_triton(kv, ids), pack_blocks_ref(kv, ids))
    if layers > 1:
        assert torch.equal(pack_blocks_triton(kv, ids, 1, layers - 1), pack_blocks_ref(kv, ids, 1, layers - 1))
    packed = pack_blocks_ref(kv, ids)
    fast, ref = torch.zeros_like(kv), torch.zeros_like(kv)
    dst = torch.tensor([1, 3, 4], device=device)
    unpack_blocks_triton(fast, dst, packed)
    unpack_blocks_ref(ref, dst, packed)
    assert torch.equal(fast, ref)
    one_layer = packed[:, layers - 1:]
    unpack_blocks_triton(fast, dst, one_layer.float(), layers - 1)  # also converts dtype
    unpack_blocks_ref(ref, dst, one_layer.float(), layers - 1)
    assert torch.equal(fast, ref)
    assert pack_blocks_triton(kv, torch.tensor([], dtype=torch.long, device=device)).shape[0] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_scatter(device, dtype):
    from mooncake_kernels.triton_kv_pack import gather_tokens_triton, scatter_tokens_triton

    kv = randn(3, 2, 9, 16, 4, 64, dtype=dtype, device=device, seed=4)
    slots = torch.tensor([0, 17, 143, 5, 64, 63], device=device)
    for layer in range(3):
        assert torch.equal(gather_tokens_triton(kv, layer, slots), gather_tokens_ref(kv, layer, slots))
    data = randn(2, 6, 4, 64, dtype=torch.float32, device=device, seed=5)
    fast, ref = torch.zeros_like(kv), torch.zeros_like(kv)
    scatter_tokens_triton(fast, 2, slots, data)
    scatter_tokens_ref(ref, 2, slots, data)
    assert torch.equal(fast, ref)


def test_bad_ids_raise_instead_of_touching_memory(device):
    from mooncake_kernels.triton_kv_pack import gather_tokens_triton, pack_blocks_triton

    kv = torch.zeros(2, 2, 4, 4, 1, 8, device=device)
    with pytest.raises(IndexError):
        pack_blocks_triton(kv, torch.tensor([4], device=device))
    with pytest.raises(IndexError):
        gather_tokens_triton(kv, 0, torch.tensor([-1], device=device))


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (4, 4, 64, 16), (8, 2, 128, 16), (32, 8, 128, 32), (6, 3, 80, 8), (4, 1, 64, 1)])
def test_paged_decode_attention(device, dtype, atol, heads, kv_heads, head_dim, block_size):
    from mooncake_kernels.triton_attention import paged_decode_attention_triton

    num_blocks = 64
    lens = [1, block_size, block_size + 1, 5 * block_size - 1, 300 if block_size > 1 else 37]
    width = max(-(-n // block_size) for n in lens)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(6)).tolist()
    if width * len(lens) > num_blocks:
        num_blocks = width * len(lens)
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(6)).tolist()
    tables = torch.tensor([perm[i * width:(i + 1) * width] for i in range(len(lens))], device=device)
    k = randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device, seed=7)
    v = randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device, seed=8)
    q = randn(len(lens), heads, head_dim, dtype=dtype, device=device, seed=9)
    context_lens = torch.tensor(lens, device=device)
    got = paged_decode_attention_triton(q, k, v, tables, context_lens)
    ref = paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, context_lens)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=0)


def test_decode_attention_on_a_paged_cache_view(device):
    """The model passes per-layer views of one big cache tensor, not standalone tensors."""
    from mooncake_kernels.triton_attention import paged_decode_attention_triton

    kv = randn(3, 2, 12, 8, 2, 64, dtype=torch.float32, device=device, seed=10)
    k, v = kv[1, 0], kv[1, 1]
    tables = torch.tensor([[4, 7, 1], [11, 0, 0]], device=device)
    lens = torch.tensor([19, 5], device=device)
    q = randn(2, 8, 64, dtype=torch.float32, device=device, seed=11)
    torch.testing.assert_close(paged_decode_attention_triton(q, k, v, tables, lens),
                               paged_decode_attention_ref(q, k, v, tables, lens), atol=1e-5, rtol=0)


def test_model_decode_through_triton_matches_reference(device, monkeypatch):
    """The tiny model's paged decode with the Triton kernels chosen gives the reference tokens."""
    import mooncake_kernels.attention
    from mooncake_kernels.dispatch import _import, fast_module
    from mooncake_lite.model.generate import generate, reference_greedy
    from mooncake_lite.model.runner import ModelRunner
    from mooncake_lite.model.sampling import SamplingParams
    from mooncake_lite.model.weights import build_model

    if device == "cuda":
        assert fast_module("triton_attention", torch.zeros(1, device="cuda")) is not None
    else:  # interpreter on CPU: force the dispatcher to pick the Triton module anyway
        monkeypatch.setattr(mooncake_kernels.attention, "fast_module", lambda name, *t: _import(name))
    model = build_model("tiny", device=device, seed=1)
    prompt = list(range(40, 61))
    runner = ModelRunner(model, num_blocks=16, block_size=8)
    got = generate(runner, prompt, SamplingParams(max_tokens=8), chunk_size=5)
    monkeypatch.undo()
    assert got == reference_greedy(model, prompt, 8)
