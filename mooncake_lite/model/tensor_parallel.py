"""Megatron-style tensor parallelism of the LLaMA-family decoder: which slice of each weight a
rank holds, and the rank's model built from the full checkpoint.

Per layer, q/k/v and gate/up are split by output rows (column-parallel: each rank computes its
own heads and its own share of the MLP's width with no communication), o and down by input
columns (row-parallel: each rank's product is a partial sum of the full output, added up by one
all-reduce each, ``model/tp_comms.py``). Heads go to ranks in order; where there are fewer KV
heads than ranks each rank holds the one KV head its query heads read (replicated on
``size / num_kv_heads`` ranks). The embedding is replicated (a lookup costs nothing and needs no
collective); the LM head is vocab-parallel where the vocabulary divides, each rank computing
its rows' logits, gathered into full-vocab logits on every rank, so whatever samples sees the
whole distribution (docs/model.md, Tensor parallelism, says what the head's split measured).

Experts (``model/moe.py``) are split one of two ways, each ending in the block's one all-reduce:
by width (the default: every expert's gate/up by rows and down by columns, as the dense MLP) or
placed whole (``expert_parallel``: rank r computes experts ``[r*E/N, (r+1)*E/N)`` for the tokens
routed to them; every rank holds every token, so no all-to-all is needed). The router is
replicated and the shared experts split by width either way. MLA (``model/mla.py``) splits its
heads: the per-head q, kv up-projection and o weights; its latent projection is replicated, so
every rank computes and caches the whole latent (one KV "head", held by every rank and written
by rank 0: ``common/tp_split.py``, the "replicated" layout of ``transfer/kv_layout.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from mooncake_lite.common.tp_split import kv_head_range, writes_kv
from mooncake_lite.model.args import ModelArgs
from mooncake_lite.model.family import make_block
from mooncake_lite.model.llama import Collectives, Transformer


@dataclass(frozen=True)
class TPLayout:
    """Rank ``rank`` of ``size`` over a model of shape ``args`` (the full model's)."""
    args: ModelArgs
    size: int
    rank: int
    expert_parallel: bool = False   # whole experts placed per rank, not each expert split by width

    def __post_init__(self) -> None:
        check_divides(self.args, self.size, self.expert_parallel)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside 0..{self.size - 1}")

    @property
    def heads(self) -> range:
        return self._share(self.args.num_heads)

    @property
    def kv_heads(self) -> range:
        """The KV heads this rank's query heads read: its share, or the one it replicates."""
        return kv_head_range(self.args.num_kv_heads, self.size, self.rank)

    @property
    def kv_replicas(self) -> int:
        """On how many ranks each KV head lives (1: split; more: replicated)."""
        return max(1, self.size // self.args.num_kv_heads)

    @property
    def owns_kv(self) -> bool:
        """Whether this rank is the one that stores and sends its KV heads (a replicated head is
        sent once, by the first of the ranks holding it)."""
        return writes_kv(self.args.num_kv_heads, self.size, self.rank)

    @property
    def ffn(self) -> range:
        return self._share(self.args.ffn_dim)

    def _share(self, total: int) -> range:
        per = total // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def experts(self) -> range:
        """The routed experts this rank computes: all (split by width) or its placed share."""
        return self._share(self.args.moe.num_experts) if self.expert_parallel else range(self.args.moe.num_experts)

    @property
    def expert_ffn(self) -> range:
        """Its slice of each expert it computes: a share of the width, or all of it (placed)."""
        width = self.args.moe.expert_ffn_dim
        return range(width) if self.expert_parallel else self._share(width)

    @property
    def shared_ffn(self) -> range:
        return self._share(self.args.moe.shared_width)

    @property
    def vocab_parallel(self) -> bool:
        return self.size > 1 and self.args.vocab_size % self.size == 0

    @property
    def vocab(self) -> range:
        if not self.vocab_parallel:
            return range(self.args.vocab_size)
        per = self.args.vocab_size // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def local_args(self) -> ModelArgs:
        """This rank's shapes: its heads, KV heads and MLP width; the head width stays, the
        vocabulary stays whole (the embedding is replicated; the head's rows are cut apart)."""
        a = self.args
        moe = None if a.moe is None else dataclasses.replace(
            a.moe, expert_ffn_dim=len(self.expert_ffn), held_experts=(self.experts.start, self.experts.stop),
            shared_ffn_dim=len(self.shared_ffn))
        return dataclasses.replace(a, num_heads=len(self.heads), num_kv_heads=len(self.kv_heads),
                                   ffn_dim=len(self.ffn), head_size=a.head_dim, moe=moe)


def check_divides(args: ModelArgs, size: int, expert_parallel: bool = False) -> None:
    """ValueError naming the shapes a tensor-parallel degree ``size`` cannot split (experts by
    width, or placed whole with ``expert_parallel``)."""
    if size < 1:
        raise ValueError(f"tensor-parallel degree must be at least 1, got {size}")
    bad = [f"num_heads {args.num_heads}"] if args.num_heads % size else []
    kv = args.num_kv_heads
    if (kv % size if kv >= size else size % kv):
        bad.append(f"num_kv_heads {kv} (split needs it a multiple of {size}, replication a divisor)")
    if args.ffn_dim % size:
        bad.append(f"ffn_dim {args.ffn_dim}")
    if (m := args.moe) is not None:
        if expert_parallel and m.num_experts % size:
            bad.append(f"num_experts {m.num_experts} (placed whole per rank)")
        if not expert_parallel and m.expert_ffn_dim % size:
            bad.append(f"expert_ffn_dim {m.expert_ffn_dim} (each expert split by width)")
        if m.shared_width % size:
            bad.append(f"shared experts' width {m.shared_width}")
    if bad:
        raise ValueError(f"tensor-parallel degree {size} does not divide model {args.name!r}: "
                         + ", ".join(bad))


def _rows(r: range, width: int = 1) -> slice:
    return slice(r.start * width, r.stop * width)


def shard_tensor(name: str, full: torch.Tensor, layout: TPLayout) -> torch.Tensor:
    """Rank ``layout.rank``'s slice of the full model's parameter ``name``."""
    hd = layout.args.head_dim
    if ".feed_forward.experts." in name or ".feed_forward.shared_experts." in name:
        width = layout.shared_ffn if ".shared_experts." in name else layout.expert_ffn
        return full[:, _rows(width)] if name.endswith(".w2.weight") else full[_rows(width)]
    if ".attention." in name and layout.args.mla is not None:
        return _mla_tensor(name, full, layout)
    if ".attention.wq." in name:
        return full[_rows(layout.heads, hd)]
    if ".attention.wk." in name or ".attention.wv." in name:
        return full[_rows(layout.kv_heads, hd)]
    if name.endswith("attention.wo.weight"):
        return full[:, _rows(layout.heads, hd)]
    if ".feed_forward.w1." in name or ".feed_forward.w3." in name:
        return full[_rows(layout.ffn)]
    if name.endswith("feed_forward.w2.weight"):
        return full[:, _rows(layout.ffn)]
    if name == "output.weight":
        return full[_rows(layout.vocab)]
    return full   # norms (q/k norms are per head width, the same for every head), the embedding


def _mla_tensor(name: str, full: torch.Tensor, layout: TPLayout) -> torch.Tensor:
    """MLA's per-head weights split by heads; the latent's projection and norms replicated."""
    m = layout.args.mla
    if ".q_proj." in name or ".q_b_proj." in name:
        return full[_rows(layout.heads, m.qk_head_dim)]
    if ".kv_b_proj." in name:
        return full[_rows(layout.heads, m.qk_nope_head_dim + m.v_head_dim)]
    if ".o_proj." in name:
        return full[:, _rows(layout.heads, m.v_head_dim)]
    return full   # q_a_proj, kv_a_proj_with_mqa and their norms: every rank computes the whole latent


def shard_model(full: Transformer, layout: TPLayout, comms: Collectives | None,
                device: str | torch.device | None = None, cls: type[Transformer] = Transformer) -> Transformer:
    """Rank ``layout.rank``'s model: the same layers as ``full`` holding their slices of its
    weights (copied, so ``full`` can be dropped), joined by ``comms``'s collectives; fused
    as :func:`build_model`'s models are. A tied head stays a view of the rank's embedding.
    ``cls``: a subclass to build (a leading rank's, ``model/tp_step.py``)."""
    state = full.state_dict()
    with torch.device("meta"):
        model = cls(layout.local_args(), (full.first_layer, full.end_layer),
                    lambda args, layer: make_block(args, layer, comms), comms=comms)
        if model.is_last and layout.vocab_parallel:
            model.output = nn.Linear(layout.args.dim, len(layout.vocab), bias=False)
    local: dict[str, torch.Tensor] = {}
    for name in model.state_dict():
        local[name] = shard_tensor(name, state[name], layout).to(device=device or state[name].device).clone()
    if model.is_first and model.is_last and layout.args.tie_embeddings:
        local["output.weight"] = local["tok_embeddings.weight"][_rows(layout.vocab)]
    model.load_state_dict(local, assign=True, strict=True)
    return model.eval().fuse_()


def build_sharded_model(spec: str, layout: TPLayout, comms: Collectives | None, *,
                        device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                        layer_range: tuple[int, int] | None = None, seed: int = 0,
                        cls: type[Transformer] = Transformer) -> Transformer:
    """:func:`build_model`'s model for rank ``layout.rank`` (a preset, HF directory or GGUF file
    alike): the full weights are read on the CPU, this rank's slices copied to ``device``, and the
    full model dropped. Loading thus peaks at the full model in host memory, once per rank.
    A preset bound for CUDA is drawn there instead where it fits (:func:`dummy_draw_device`)."""
    from mooncake_lite.model.weights import build_model
    # (float weights: a GGUF's quantized blocks are not cut into ranks' slices)
    full = build_model(spec, device=dummy_draw_device(spec, device, dtype), dtype=dtype, layer_range=layer_range,
                       seed=seed, weights="dequantize")
    if full.args != layout.args:
        raise ValueError(f"tensor-parallel layout is for {layout.args}, the checkpoint is {full.args}")
    return shard_model(full, layout, comms, device, cls)


def dummy_draw_device(spec: str, device: str | torch.device, dtype: torch.dtype,
                      free_bytes: int | None = None) -> str | torch.device:
    """Where a rank's full model is built: the CPU, but for a preset bound for CUDA that fits in
    half the device's free memory, the device. A preset's dummy weights are drawn where they are
    built (:func:`build_model`: on CUDA from the device's generator, an 8B preset in seconds), so a
    rank cut from a CPU draw held other weights than a one-GPU instance of the same preset, and
    TP 2 on CUDA did not compute TP 1's tokens (the first GPU run, 2026-11-30)."""
    from mooncake_lite.model.source import resolve
    from mooncake_lite.model.weights import build_meta, model_args
    if torch.device(device).type != "cuda" or resolve(spec).kind in ("hf", "gguf"):
        return "cpu"
    need = sum(p.numel() for p in build_meta(model_args(spec)).parameters()) * dtype.itemsize
    free = torch.cuda.mem_get_info(torch.device(device))[0] if free_bytes is None else free_bytes
    return device if need <= free // 2 else "cpu"
