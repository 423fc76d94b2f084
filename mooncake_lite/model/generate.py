"""Monolithic generation in one process: the reference the disaggregated path must match.

``mooncake generate --model tiny --prompt "hello" --max-tokens 16`` runs it from the shell.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from mooncake_lite.model.args import DTYPES
from mooncake_lite.model.kv_cache import blocks_needed
from mooncake_lite.model.llama import Transformer
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.source import DEFAULT_MODEL
from mooncake_lite.model.sampling import SamplingParams, SequenceSampler


def generate(runner: ModelRunner, prompt_ids: Sequence[int], params: SamplingParams,
             chunk_size: int | None = None) -> list[int]:
    """Paged prefill (optionally chunked) then one decode step per token."""
    total = len(prompt_ids) + params.max_tokens
    table = runner.allocator.allocate(blocks_needed(total, runner.block_size))
    sampler = SequenceSampler(params, 0, runner.device)
    try:
        logits = runner.prefill(prompt_ids, table, 0, chunk_size)
        out = [sampler.next(logits)[0]]
        while len(out) < params.max_tokens and out[-1] not in params.stop_token_ids:
            pos = len(prompt_ids) + len(out) - 1
            logits = runner.decode([out[-1]], [table], [pos])[0]
            out.append(sampler.next(logits)[0])
        return out
    finally:
        runner.allocator.free(table)


@torch.no_grad()
def full_recompute_logits(model: Transformer, token_ids: Sequence[int], block_size: int = 16) -> torch.Tensor:
    """Logits of every position from one plain prefill over the whole sequence in a fresh cache."""
    runner = ModelRunner(model, num_blocks=blocks_needed(len(token_ids), block_size), block_size=block_size)
    table = list(range(runner.cache.num_blocks))
    meta = runner.prefill_meta(table, 0, len(token_ids))
    return model(torch.as_tensor(list(token_ids), device=runner.device), meta, runner.cache)


def reference_greedy(model: Transformer, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """Greedy tokens by recomputing the whole sequence from scratch at every step (no KV reuse)."""
    seq = list(prompt_ids)
    for _ in range(max_tokens):
        seq.append(int(torch.argmax(full_recompute_logits(model, seq)[-1])))
    return seq[len(prompt_ids):]


def main(argv: Sequence[str]) -> int:
    from mooncake_lite.model.tokenizer import load_tokenizer
    from mooncake_lite.model.weights import build_model

    ap = argparse.ArgumentParser(prog="mooncake generate", description=__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="named real model, GGUF file, checkpoint directory "
                    "or preset (default: %(default)s)")
    ap.add_argument("--prompt", default="The moon is")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--weights", default="quantized", choices=("quantized", "dequantize"),
                    help="a GGUF's quantized weights kept as its blocks, or dequantized at load")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=None)
    a = ap.parse_args(list(argv))
    try:
        model = build_model(a.model, dtype=DTYPES[a.dtype], seed=a.seed, weights=a.weights)
        params = SamplingParams(temperature=a.temperature, top_p=a.top_p, seed=a.seed, max_tokens=a.max_tokens)
    except (ValueError, FileNotFoundError) as exc:
        sys.stderr.write(f"mooncake generate: error: {exc}\n")
        return 2
    tok = load_tokenizer(a.model, model.args.vocab_size)
    prompt = tok.encode(a.prompt)
    runner = ModelRunner(model, num_blocks=blocks_needed(len(prompt) + a.max_tokens, a.block_size) + 1,
                         block_size=a.block_size)
    out = generate(runner, prompt, params, a.prefill_chunk)
    print(f"prompt tokens: {len(prompt)}  generated: {out}")
    print(f"text: {tok.decode(out)!r}")
    return 0
