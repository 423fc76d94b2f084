"""Routed experts in place of the dense MLP (Qwen3-MoE, DeepSeek-V3).

A router scores every expert per token and keeps the top k; the tokens are then sorted by the
expert they go to, so each expert runs once on its whole group of rows (a loop over the experts
the batch touches, never over tokens), and the weighted outputs are added back to their tokens.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from mooncake_lite.model.args import ModelArgs
from mooncake_lite.model.llama import FeedForward


class Router(nn.Module):
    """Which experts each token goes to, and with what weight (``MoEArgs`` names the rules)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.moe = args.moe
        self.weight = nn.Parameter(torch.empty(self.moe.num_experts, args.dim))
        # DeepSeek-V3: a per-expert bias the training balanced load with; it picks, never weighs.
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(self.moe.num_experts))
                                        if self.moe.has_correction_bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [n, k] float32, expert ids [n, k]); scores in float32 whatever the model's dtype."""
        m = self.moe
        logits = F.linear(x.float(), self.weight.float())
        if m.scoring == "softmax":
            weights, ids = logits.softmax(dim=-1).topk(m.top_k, dim=-1)
            return (weights / weights.sum(dim=-1, keepdim=True) if m.norm_topk_prob else weights), ids
        scores = logits.sigmoid()
        ids = self._group_limited_topk(scores + self.e_score_correction_bias.float())
        weights = scores.gather(1, ids)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * m.routed_scaling, ids

    def _group_limited_topk(self, choice: torch.Tensor) -> torch.Tensor:
        """Top k among the experts of the ``topk_groups`` groups whose best two scores sum highest."""
        m = self.moe
        if m.num_groups > 1:
            grouped = choice.view(-1, m.num_groups, m.num_experts // m.num_groups)
            best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(m.topk_groups, dim=-1).indices
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        return choice.topk(m.top_k, dim=-1).indices


class MoE(nn.Module):
    """Router, routed experts and (DeepSeek) always-on shared experts; each expert is a
    :class:`FeedForward` ``expert_ffn_dim`` wide, so it fuses and packs like the dense MLP.

    A tensor-parallel rank holds a share (``model/tensor_parallel.py``): a slice of every expert's
    width, or whole experts (``MoEArgs.held_experts``), and a slice of the shared experts. Either
    way the router is whole, every rank routes every token alike (their hidden states are equal),
    and the rank's output is a partial sum that the block's one all-reduce completes."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        m = args.moe
        self.gate = Router(args)
        expert = dataclasses.replace(args, ffn_dim=m.expert_ffn_dim)
        # Keyed by the global expert id, so a rank's placed share keeps the checkpoint's names.
        self.experts = nn.ModuleDict({str(e): FeedForward(expert) for e in m.expert_ids})
        self.first_expert = m.expert_ids.start
        self.shared_experts = (FeedForward(dataclasses.replace(args, ffn_dim=m.shared_width))
                               if m.shared_width else None)
        self.gate_up = None   # no single fused weight: Transformer.packing_speedup measures none here
        self.num_touched = 0  # experts the last call ran (their union over its tokens), for bench model

    def _mlps(self) -> list[FeedForward]:
        return [*self.experts.values(), *([self.shared_experts] if self.shared_experts is not None else [])]

    def fuse_(self) -> None:
        for mlp in self._mlps():
            mlp.fuse_()

    def pack_(self) -> None:
        for mlp in self._mlps():
            mlp.pack_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.routed(x, weights, ids)
        return out.add_(self.shared_experts(x)) if self.shared_experts is not None else out

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sum over each token's experts (those this module holds) of weight × expert(token), the
        rows grouped per expert."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)   # (token, choice) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.gate.moe.num_experts).tolist()   # one device sync per layer
        # The held experts are consecutive ids, so their pairs are one run of ``order``.
        first, held = self.first_expert, counts[self.first_expert:self.first_expert + len(self.experts)]
        start = sum(counts[:first])
        order = order[start:start + sum(held)]
        self.num_touched = sum(1 for count in held if count)
        rows = order // k
        xs = x.index_select(0, rows)
        ys = torch.empty_like(xs)
        start = 0
        for expert, count in zip(self.experts.values(), held):
            if count:
                ys[start:start + count] = expert(xs[start:start + count])
                start += count
        ys.mul_(weights.reshape(-1)[order, None].to(ys.dtype))
        return torch.zeros_like(x).index_add_(0, rows, ys)
