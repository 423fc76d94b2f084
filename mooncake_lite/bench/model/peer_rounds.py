"""``bench model --llamacpp PYTHON --peer-rounds N``: our batch-1 decode and llama.cpp's on the same
GGUF file in alternating rounds, so both meet the same load (a shared machine's load swings more
between two runs a minute apart than the two decoders differ). Each round times ``decode_steps``
of our steps (the model built as a decode instance builds it), then the peer's tokens; the ratio
of token rates is taken per round and its median reported beside each round's."""

from __future__ import annotations

import statistics

import torch
from tqdm import tqdm

from mooncake_lite.bench.model.llamacpp_peer import measure_peer
from mooncake_lite.bench.model.measure import bench_decode
from mooncake_lite.model.kv_cache import blocks_needed
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.source import resolve
from mooncake_lite.model.weights import build_model

BLOCK_SIZE = 16


def alternate_with_peer(name: str, python: str, *, rounds: int, context_len: int, steps: int, bar: tqdm) -> dict:
    """Per-round medians (ms a token) of ours and llama.cpp's, and each round's ratio of token
    rates (llama.cpp's time over ours: above 1, we are faster); an ``error`` if the peer did not run."""
    model = build_model(name).pack_()
    runner = ModelRunner(model, num_blocks=blocks_needed(context_len + steps + 1, BLOCK_SIZE), block_size=BLOCK_SIZE)
    ours, peer = [], []
    for _ in range(rounds):
        with torch.inference_mode():
            ours.append(statistics.median(bench_decode(runner, 1, context_len, steps, bar)) * 1e3)
        answer = measure_peer(python, resolve(name).path, torch.get_num_threads(), context_len, max(steps, 16))
        if "error" in answer:
            return {"error": answer["error"]}
        peer.append(answer["token_ms"])
    ratios = [p / o for p, o in zip(peer, ours)]
    return {"ours_ms": ours, "peer_ms": peer, "ratios": ratios, "ratio_median": statistics.median(ratios)}


def peer_figures(name: str, python: str, *, rounds: int, context_len: int, steps: int, bar: tqdm) -> dict:
    """llama.cpp's batch-1 decode on GGUF model ``name`` (``measure_peer``), with ``rounds`` > 1
    also :func:`alternate_with_peer`'s rounds (under ``"rounds"``)."""
    peer = measure_peer(python, resolve(name).path, torch.get_num_threads(), context_len, max(steps, 16))
    if rounds > 1 and "error" not in peer:
        peer["rounds"] = alternate_with_peer(name, python, rounds=rounds, context_len=context_len, steps=steps,
                                             bar=bar)
    return peer


def render_rounds(name: str, r: dict) -> list[str]:
    if "error" in r:
        return [f"  alternating rounds on {name}: the peer did not run ({r['error']})"]
    fmt = ", ".join
    return [f"  alternating {len(r['ratios'])} rounds on {name}, batch 1, ms a token: ours "
            f"{fmt(f'{t:.2f}' for t in r['ours_ms'])}; llama.cpp {fmt(f'{t:.2f}' for t in r['peer_ms'])}",
            f"  ours against llama.cpp per round: {fmt(f'{x:.2f}x' for x in r['ratios'])}; "
            f"median {r['ratio_median']:.2f}x"]
