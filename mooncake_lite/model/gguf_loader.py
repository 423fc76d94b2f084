"""Loading a LLaMA-architecture GGUF file: quantized weights kept as the file's blocks, or
dequantized to the serving dtype at load.

``weights="quantized"`` (the default) keeps each projection whose tensors are Q4_0, Q4_1 or Q8_0
as those blocks (``model/quantized.py``), on a CPU in float32 where the block kernel builds:
4.5-8.5 bits a weight instead of 32. Everything else (norms, F16/F32 tensors, other
quantizations such as K-quants, a projection whose fused parts differ in type, another dtype or
device) is dequantized as with ``weights="dequantize"``: by ``gguf.quants`` (the format's
reference implementation) to float32 and then cast, so the model computes in ``dtype`` exactly as
it would from an unquantized checkpoint of the dequantized values. ``weights="hybrid"`` keeps the
blocks and a float32 copy of each layer product beside them (``QuantizedWeight.keep_dense``: a
prefill's wide products run on it). A pipeline stage reads only its own layers.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from mooncake_kernels.quant_linear import BLOCK_BYTES
from mooncake_lite.model.args import ModelArgs
from mooncake_lite.model.errors import CheckpointError
from mooncake_lite.model.gguf_file import args_from_meta, read_meta
from mooncake_lite.model.gguf_read import TensorInfo
from mooncake_lite.model.llama import Transformer
from mooncake_lite.model.quantized import QuantizedEmbedding, QuantizedWeight, layer_blocks

WEIGHT_MODES = ("quantized", "dequantize", "hybrid")

# Our parameter name (after ``layers.{i}.``) -> the GGUF one (after ``blk.{i}.``).
_LAYER_NAMES = {
    "attention.wq": "attn_q", "attention.wk": "attn_k", "attention.wv": "attn_v",
    "attention.wo": "attn_output", "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up",
    "feed_forward.w2": "ffn_down", "attention_norm": "attn_norm", "ffn_norm": "ffn_norm",
    "attention.q_norm": "attn_q_norm", "attention.k_norm": "attn_k_norm",   # Qwen3
}
_TOP_NAMES = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
              "output.weight": "output.weight"}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")


def load_gguf(path: str, name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
              layer_range: tuple[int, int] | None = None, weights: str = "quantized") -> Transformer:
    """The model (or the pipeline stage ``layer_range`` of it) with the file's weights; ``weights``
    is one of :data:`WEIGHT_MODES`."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights {weights!r}: expected one of {', '.join(WEIGHT_MODES)}")
    meta = read_meta(path)
    args = args_from_meta(meta, name)
    # llama.cpp reorders q/k rows for LLaMA only; Qwen2/Qwen3 files keep the checkpoint's order.
    permuted = meta.arch == "llama"
    with torch.device("meta"):
        model = Transformer(args, layer_range)
    tensors = meta.tensors
    data = np.memmap(path, dtype=np.uint8, mode="r")   # tensors are read from here as needed
    expected = model.state_dict()
    names = {ours: _gguf_name(ours, args, tensors) for ours in expected}
    for ours, gguf_name in names.items():
        if gguf_name not in tensors:
            raise CheckpointError(f"{path}: lacks tensor {gguf_name!r} (for {ours})")
    kept = compact_names(names, tensors) if weights != "dequantize" and keeps_compact(device, dtype) else set()
    state: dict[str, torch.Tensor] = {}
    loaded: dict[str, torch.Tensor | QuantizedWeight] = {}
    for ours, meta_tensor in expected.items():
        gguf_name = names[ours]
        if gguf_name not in loaded:   # tied embeddings share one tensor
            info = tensors[gguf_name]
            loaded[gguf_name] = (_blocks(ours, info, data, path, args, permuted) if ours in kept
                                 else _values(ours, info, data, path, args, permuted).to(device=device, dtype=dtype))
        value = loaded[gguf_name]
        shape = value.shape if isinstance(value, QuantizedWeight) else tuple(value.shape)
        if tuple(shape) != tuple(meta_tensor.shape):
            raise CheckpointError(f"{path}: tensor {gguf_name!r} has shape {tuple(shape)}, "
                                  f"the metadata implies {tuple(meta_tensor.shape)}")
        state[ours] = meta_tensor if ours in kept else value   # kept: a shape, its values in `loaded`
    model.load_state_dict(state, assign=True, strict=True)
    if kept:
        install_compact(model, {ours: loaded[names[ours]] for ours in kept}, dtype)
        if weights == "hybrid":
            _keep_dense(model)
    return model.eval()


def _keep_dense(model: Transformer) -> None:
    """Each layer product's float32 copy beside its blocks (the head, one row a prompt, keeps none)."""
    for block in model.layers.values():
        for weight in layer_blocks(block):
            weight.keep_dense()


def keeps_compact(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Where compact weights compute: a CPU in float32, with the block kernel built."""
    from mooncake_kernels.quant_build import library
    return torch.device(device).type == "cpu" and dtype == torch.float32 and library() is not None


# The parameters that run as one product (``Transformer.fuse_``), after ``layers.{i}.``: kept
# compact together or not at all.
_PRODUCTS = (("attention.wq", "attention.wk", "attention.wv"), ("attention.wo",),
             ("feed_forward.w1", "feed_forward.w3"), ("feed_forward.w2",))


def compact_names(names: dict[str, str], tensors: dict[str, TensorInfo]) -> set[str]:
    """Our parameters kept as blocks: the embedding, the head and each product whose tensors are
    all of one compact type (Q4_0, Q4_1, Q8_0)."""
    def qtype(ours: str) -> int | None:
        q = tensors[names[ours]].qtype
        return q if q in BLOCK_BYTES else None

    kept = {n for n in ("tok_embeddings.weight", "output.weight") if n in names and qtype(n) is not None}
    layers = {m.group(1) for m in map(_LAYER_RE.match, names) if m is not None}
    for layer in layers:
        for product in _PRODUCTS:
            members = [f"layers.{layer}.{p}.weight" for p in product]
            types = {qtype(n) for n in members}
            if len(types) == 1 and None not in types:
                kept.update(members)
    return kept


def install_compact(model: Transformer, weights: dict[str, QuantizedWeight], dtype: torch.dtype) -> None:
    """The kept weights take the place of the plain ones the model's products would read, as
    ``Transformer.pack_`` does with packed copies: the fused q/k/v and gate/up, the output and
    down projections, the head (``linear``'s ``packed``), and the embedding table."""
    model.fuse_()   # the parameters on `meta` fuse into a shape; build_model's fuse_ is then a no-op
    for layer, block in model.layers.items():
        att, ffn = block.attention, block.feed_forward
        for packs, key, product in ((att.packs, "qkv", _PRODUCTS[0]), (att.packs, "wo", _PRODUCTS[1]),
                                    (ffn.packs, "gate_up", _PRODUCTS[2]), (ffn.packs, "w2", _PRODUCTS[3])):
            members = [weights.get(f"layers.{layer}.{p}.weight") for p in product]
            if all(m is not None for m in members):
                packs[key] = QuantizedWeight.stack(members) if len(members) > 1 else members[0]
    if "tok_embeddings.weight" in weights:
        model.tok_embeddings = QuantizedEmbedding(weights["tok_embeddings.weight"], dtype)
    if "output.weight" in weights:
        model.output_pack = weights["output.weight"]


def _values(ours: str, info: TensorInfo, data: np.ndarray, path: str, args: ModelArgs,
            permuted: bool) -> torch.Tensor:
    """The tensor dequantized to float32, rows in our order."""
    values = _dequantize(info, data, path)
    values = _unpermute(ours, values, args) if permuted else values
    return torch.from_numpy(_writable(values))


def _blocks(ours: str, info: TensorInfo, data: np.ndarray, path: str, args: ModelArgs,
            permuted: bool) -> QuantizedWeight:
    """The tensor's blocks as they lie in the file, rows in our order (each row is whole blocks,
    so llama.cpp's q/k row order is undone by moving rows)."""
    raw = _raw(info, data, path)
    rows = np.arange(raw.shape[0])
    rows = _unpermute(ours, rows, args) if permuted else rows
    blocks = torch.from_numpy(np.ascontiguousarray(raw[rows]))
    return QuantizedWeight(blocks, info.qtype, info.dims[0])


def _gguf_name(ours: str, args: ModelArgs, tensors: dict) -> str:
    if ours == "output.weight" and args.tie_embeddings:
        return "token_embd.weight"   # no output.weight in the file: the head reuses the embedding
    if ours in _TOP_NAMES:
        return _TOP_NAMES[ours]
    m = _LAYER_RE.match(ours)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise CheckpointError(f"no GGUF name known for parameter {ours!r}")
    return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _raw(info: TensorInfo, data: np.ndarray, path: str) -> np.ndarray:
    """The tensor's bytes in the file, one row (of ``dims[0]`` values) per row: uint8 [rows, bytes]."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    try:
        qtype = GGMLQuantizationType(info.qtype)
        block, type_bytes = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise CheckpointError(f"{path}: tensor {info.name!r} has unknown quantization type {info.qtype}") from None
    inner = info.dims[0] if info.dims else 1
    rows = int(np.prod(info.dims[1:], dtype=np.int64)) if len(info.dims) > 1 else 1
    if inner % block:
        raise CheckpointError(f"{path}: tensor {info.name!r}: {inner} values per row is not a whole "
                              f"number of {qtype.name} blocks")
    nbytes = rows * inner // block * type_bytes
    if info.offset + nbytes > len(data):
        raise CheckpointError(f"{path}: tensor {info.name!r} runs past the end of the file (truncated?)")
    return data[info.offset:info.offset + nbytes].reshape(rows, inner // block * type_bytes)


def _dequantize(info: TensorInfo, data: np.ndarray, path: str) -> np.ndarray:
    """float32 values in PyTorch's [out, in] order (GGUF lists dimensions innermost first)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    raw = _raw(info, data, path)
    qtype = GGMLQuantizationType(info.qtype)
    try:
        if qtype == GGMLQuantizationType.F32:
            values = raw.view(np.float32)
        elif qtype == GGMLQuantizationType.F16:
            values = raw.view(np.float16).astype(np.float32)
        else:
            values = dequantize(raw, qtype)
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor {info.name!r} has quantization {qtype.name}, "
                              "which gguf cannot dequantize") from None
    return np.ascontiguousarray(values, dtype=np.float32).reshape(info.shape)


def _writable(values: np.ndarray) -> np.ndarray:
    # F32 tensors come back as views of the read-only memory map; torch wants to own writable memory.
    return values if values.flags.writeable else values.copy()


def _unpermute(ours: str, w: np.ndarray, args: ModelArgs) -> np.ndarray:
    """LLaMA GGUF files store q/k rows reordered for interleaved-pair rotary embeddings; our model
    (like HF checkpoints) rotates halves, so the conversion's row order is undone here."""
    if ".attention.wq." in ours:
        heads = args.num_heads
    elif ".attention.wk." in ours:
        heads = args.num_kv_heads
    else:
        return w
    rest = w.shape[1:]
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)
