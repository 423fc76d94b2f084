"""Loading a LLaMA-architecture GGUF file: weights dequantized to the serving dtype at load.

Quantized tensors (Q4_1, Q8_0, K-quants, ...) are dequantized with ``gguf.quants`` (the format's
reference implementation) to float32 and then cast, so the model computes in ``dtype`` exactly as
it would from an unquantized checkpoint of the dequantized values. A pipeline stage dequantizes
only its own layers.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from mooncake_lite.model.args import ModelArgs
from mooncake_lite.model.errors import CheckpointError
from mooncake_lite.model.gguf_file import args_from_meta, read_meta
from mooncake_lite.model.gguf_read import TensorInfo
from mooncake_lite.model.llama import Transformer

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
              layer_range: tuple[int, int] | None = None) -> Transformer:
    """The model (or the pipeline stage ``layer_range`` of it) with the file's weights."""
    meta = read_meta(path)
    args = args_from_meta(meta, name)
    # llama.cpp reorders q/k rows for LLaMA only; Qwen2/Qwen3 files keep the checkpoint's order.
    permuted = meta.arch == "llama"
    with torch.device("meta"):
        model = Transformer(args, layer_range)
    tensors = meta.tensors
    data = np.memmap(path, dtype=np.uint8, mode="r")   # tensors are read from here as needed
    expected = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    loaded: dict[str, torch.Tensor] = {}
    for ours, meta_tensor in expected.items():
        gguf_name = _gguf_name(ours, args, tensors)
        if gguf_name not in tensors:
            raise CheckpointError(f"{path}: lacks tensor {gguf_name!r} (for {ours})")
        if gguf_name not in loaded:
            values = _dequantize(tensors[gguf_name], data, path)
            values = _unpermute(ours, values, args) if permuted else values
            if tuple(values.shape) != tuple(meta_tensor.shape):
                raise CheckpointError(f"{path}: tensor {gguf_name!r} has shape {tuple(values.shape)}, "
                                      f"the metadata implies {tuple(meta_tensor.shape)}")
            loaded[gguf_name] = torch.from_numpy(_writable(values)).to(device=device, dtype=dtype)
        state[ours] = loaded[gguf_name]   # tied embeddings share one tensor
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()


def _gguf_name(ours: str, args: ModelArgs, tensors: dict) -> str:
    if ours == "output.weight" and args.tie_embeddings:
        return "token_embd.weight"   # no output.weight in the file: the head reuses the embedding
    if ours in _TOP_NAMES:
        return _TOP_NAMES[ours]
    m = _LAYER_RE.match(ours)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise CheckpointError(f"no GGUF name known for parameter {ours!r}")
    return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _dequantize(info: TensorInfo, data: np.ndarray, path: str) -> np.ndarray:
    """float32 values in PyTorch's [out, in] order (GGUF lists dimensions innermost first)."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize
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
    raw = data[info.offset:info.offset + nbytes].reshape(rows, inner // block * type_bytes)
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
