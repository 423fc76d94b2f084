"""Triton versions of the KV data movement in :mod:`mooncake_kernels.kv_pack` (CUDA only).

Importing this module raises ImportError without Triton, which makes the callers use the torch
reference. Each program copies one ``BLOCK``-element piece of one contiguous run: a whole
(block, layer, head, K|V) record of the head-major block for pack/unpack, or one token's
``kv_heads*head_dim`` row for gather/scatter. All offsets are int64: a 70B-sized cache exceeds
2^31 elements.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mooncake_kernels.kv_pack import as_blocks, gather_tokens_ref, pack_blocks_ref, scatter_tokens_ref, unpack_blocks_ref

_BLOCK = 1024


@triton.jit
def _blocks_kernel(kv_ptr, packed_ptr, block_ids_ptr, first_layer, num_layers, num_blocks, num_heads, head_dim,
                   chunk, IS_PACK: tl.constexpr, BLOCK: tl.constexpr):
    # One program: a piece of one (block, layer, head, K|V) record of the head-major block,
    # ``[block_size][head_dim]`` contiguous there, one ``head_dim`` run per token in the cache.
    i = tl.program_id(0).to(tl.int64)            # position in block_ids
    record = tl.program_id(1).to(tl.int64)       # (layer * num_heads + head) * 2 + (0 K, 1 V), packed-relative
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < chunk
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    which = record % 2
    head = (record // 2) % num_heads
    layer = record // (2 * num_heads)
    token = offs // head_dim
    dim = offs % head_dim
    cache_off = ((((first_layer + layer) * 2 + which) * num_blocks + block) * (chunk // head_dim) + token) \
        * (num_heads * head_dim) + head * head_dim + dim
    packed_off = (i * num_layers * num_heads * 2 + record) * chunk + offs
    if IS_PACK:
        x = tl.load(kv_ptr + cache_off, mask=mask)
        tl.store(packed_ptr + packed_off, x.to(packed_ptr.dtype.element_ty), mask=mask)
    else:
        x = tl.load(packed_ptr + packed_off, mask=mask)
        tl.store(kv_ptr + cache_off, x.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tokens_kernel(kv_ptr, data_ptr, slots_ptr, layer, num_tokens, num_slots, row,
                   IS_GATHER: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row
    slot = tl.load(slots_ptr + t).to(tl.int64)
    cache_off = ((layer * 2 + which) * num_slots + slot) * row + offs
    data_off = (which * num_tokens + t) * row + offs
    if IS_GATHER:
        x = tl.load(kv_ptr + cache_off, mask=mask)
        tl.store(data_ptr + data_off, x.to(data_ptr.dtype.element_ty), mask=mask)
    else:
        x = tl.load(data_ptr + data_off, mask=mask)
        tl.store(kv_ptr + cache_off, x.to(kv_ptr.dtype.element_ty), mask=mask)


def _ids_on(ids, device: torch.device, limit: int, what: str) -> torch.Tensor:
    """Ids as a contiguous int64 device tensor, bounds-checked: an out-of-range id would make the
    kernel touch foreign memory instead of raising like the reference does."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        raise IndexError(f"{what} out of range [0, {limit})")
    return ids.to(device).contiguous()


def pack_blocks_triton(kv: torch.Tensor, block_ids, first_layer: int = 0,
                       num_layers: int | None = None) -> torch.Tensor:
    if not kv.is_contiguous():
        return pack_blocks_ref(kv, torch.as_tensor(block_ids, device=kv.device), first_layer, num_layers)
    total_layers, _, num_blocks, bs, kvh, hd = kv.shape
    num_layers = total_layers - first_layer if num_layers is None else num_layers
    if not (0 <= first_layer and num_layers > 0 and first_layer + num_layers <= total_layers):
        raise IndexError(f"layers [{first_layer}, {first_layer + num_layers}) outside cache of {total_layers}")
    ids = _ids_on(block_ids, kv.device, num_blocks, "block id")
    out = torch.empty((ids.numel(), num_layers, kvh, 2, bs, hd), dtype=kv.dtype, device=kv.device)
    chunk = bs * hd
    if ids.numel():
        grid = (ids.numel(), num_layers * kvh * 2, triton.cdiv(chunk, _BLOCK))
        _blocks_kernel[grid](kv, out, ids, first_layer, num_layers, num_blocks, kvh, hd, chunk,
                             IS_PACK=True, BLOCK=_BLOCK)
    return out


def unpack_blocks_triton(kv: torch.Tensor, block_ids, packed: torch.Tensor, first_layer: int = 0) -> None:
    if not kv.is_contiguous():
        return unpack_blocks_ref(kv, torch.as_tensor(block_ids, device=kv.device), packed, first_layer)
    total_layers, _, num_blocks, bs, kvh, hd = kv.shape
    ids = _ids_on(block_ids, kv.device, num_blocks, "block id")
    num_layers = packed.shape[1]
    if packed.shape[0] != ids.numel() or math.prod(packed.shape[2:]) != kvh * 2 * bs * hd:
        raise ValueError(f"packed shape {tuple(packed.shape)} does not fit {ids.numel()} blocks of "
                         f"[layers, {kvh}, 2, {bs}, {hd}]")
    if not (0 <= first_layer and first_layer + num_layers <= total_layers):
        raise IndexError(f"layers [{first_layer}, {first_layer + num_layers}) outside cache of {total_layers}")
    # Convert in torch (round-to-nearest like the reference); the kernel then only copies.
    packed = as_blocks(packed, kv).to(kv.dtype).contiguous()
    chunk = bs * hd
    if ids.numel():
        grid = (ids.numel(), num_layers * kvh * 2, triton.cdiv(chunk, _BLOCK))
        _blocks_kernel[grid](kv, packed, ids, first_layer, num_layers, num_blocks, kvh, hd, chunk,
                             IS_PACK=False, BLOCK=_BLOCK)


def gather_tokens_triton(kv: torch.Tensor, layer: int, slots) -> torch.Tensor:
    if not kv.is_contiguous():
        return gather_tokens_ref(kv, layer, torch.as_tensor(slots, device=kv.device))
    num_layers, _, num_blocks, bs, kvh, hd = kv.shape
    if not 0 <= layer < num_layers:
        raise IndexError(f"layer {layer} outside cache of {num_layers}")
    slot_ids = _ids_on(slots, kv.device, num_blocks * bs, "slot")
    out = torch.empty((2, slot_ids.numel(), kvh, hd), dtype=kv.dtype, device=kv.device)
    row = kvh * hd
    if slot_ids.numel():
        grid = (slot_ids.numel(), 2, triton.cdiv(row, _BLOCK))
        _tokens_kernel[grid](kv, out, slot_ids, layer, slot_ids.numel(), num_blocks * bs, row,
                             IS_GATHER=True, BLOCK=_BLOCK)
    return out


def scatter_tokens_triton(kv: torch.Tensor, layer: int, slots, data: torch.Tensor) -> None:
    if not kv.is_contiguous():
        return scatter_tokens_ref(kv, layer, torch.as_tensor(slots, device=kv.device), data)
    num_layers, _, num_blocks, bs, kvh, hd = kv.shape
    if not 0 <= layer < num_layers:
        raise IndexError(f"layer {layer} outside cache of {num_layers}")
    slot_ids = _ids_on(slots, kv.device, num_blocks * bs, "slot")
    if tuple(data.shape) != (2, slot_ids.numel(), kvh, hd):
        raise ValueError(f"data shape {tuple(data.shape)} != (2, {slot_ids.numel()}, {kvh}, {hd})")
    data = data.to(kv.dtype).contiguous()
    row = kvh * hd
    if slot_ids.numel():
        grid = (slot_ids.numel(), 2, triton.cdiv(row, _BLOCK))
        _tokens_kernel[grid](kv, data, slot_ids, layer, slot_ids.numel(), num_blocks * bs, row,
                             IS_GATHER=False, BLOCK=_BLOCK)
