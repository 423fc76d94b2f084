"""``mooncake bench kv-compression``: what ``--kv-compression int8|fp8`` costs and buys.

Cost, on a real model (default smollm2-135m) and a varied prompt set (24 questions over three
contexts: prose, code, a story): each prompt's full blocks are the reused prefix; the run with that
prefix KV through the codec (``model/kv_codec.py``, exactly what a prefix hit loads) is compared
with the uncompressed run, greedily (token agreement: the share of generated tokens equal to the
uncompressed ones before the first difference, and whole sequences equal) and under teacher
forcing along the uncompressed tokens (top-1 agreement and logit error at every position).

Gains, computed from the block format (the live test checks the store holds blocks of that size):
bytes a prefix hit moves from the store per request, store capacity in blocks at equal DRAM; and in
the simulator on the conversation trace at equal DRAM (``sim run --kv-compression``), the reused
token share and TTFT, at the preset's DRAM and at a DRAM small enough that capacity binds.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mooncake_kernels.kv_codec import codec_for, encoded_layer_bytes, fp8_supported
from mooncake_lite.bench.options import Options, build_parser, flag, freeze
from mooncake_lite.bench.report import emit
from mooncake_lite.model.args import DTYPES
from mooncake_lite.model.kv_codec import compressed_prefix_run, model_codec
from mooncake_lite.model.source import DEFAULT_MODEL

CONTEXTS = (
    "Mooncake is the serving platform of Kimi, an LLM chatbot. It separates the prefill and decode stages "
    "into different clusters and keeps a distributed cache of attention keys and values in the spare DRAM "
    "and SSD of the GPU nodes. A global scheduler places each request on a prefill instance by how much of "
    "its prompt is already cached there and how long that instance's queue is.",
    "def merge(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
    "            out.append(a[i]); i += 1\n        else:\n            out.append(b[j]); j += 1\n"
    "    return out + a[i:] + b[j:]\n\n# merge sort splits the list in two, sorts each half and merges them.",
    "Once upon a time a lighthouse keeper named Ada lived alone on a rocky island. Every night she climbed "
    "one hundred steps to light the lamp, and every morning she wrote one line in her logbook about the sea, "
    "the birds and the ships that passed far away on the horizon.",
)
QUESTIONS = (
    "What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
    "What is 12 times 7?", "Translate 'good morning' into Spanish.", "Give me one tip for learning Python.",
    "Why is the sky blue? Answer in one sentence.", "List the planets closest to the sun.",
    "What does the text above describe?", "What does HTTP stand for?", "Summarize the text above in one line.",
    "Who wrote 'Pride and Prejudice'?", "Explain what a linked list is.", "Suggest a name for a black cat.",
    "What's the boiling point of water in Fahrenheit?", "Écris une phrase en français sur la lune.",
    "What is the square root of 144?", "Describe a rainbow to a child.", "Give an example of a SQL query.",
    "How many days are in a leap year?", "What is the main idea above?", "Continue the text above.",
    "Name one word from the text above.", "Is the text above code or prose?",
)
TRACE = Path(__file__).resolve().parents[4] / "shared/traces/conversation_trace.jsonl"


FLAGS = (
    flag("--model", default=DEFAULT_MODEL),
    flag("--dtype", default="float32", choices=sorted(DTYPES), help="model and KV dtype"),
    flag("--block-size", type=int, default=16),
    flag("--max-tokens", type=int, default=16, help="generated tokens per prompt"),
    flag("--prompts", type=int, default=len(QUESTIONS), help=f"first N prompts (at most {len(QUESTIONS)})"),
    flag("--codecs", default="int8,fp8" if fp8_supported() else "int8"),
    flag("--dram", default="1GiB", help="store DRAM for the capacity figure"),
    flag("--trace", default=str(TRACE), help="trace for the simulator figures ('' to skip them)"),
    flag("--sim-limit", type=int, default=3000, help="first N trace requests simulated"),
    flag("--json", action="store_true"),
)


def parse_args(argv: Sequence[str]) -> Options:
    parser = build_parser("mooncake bench kv-compression", __doc__.split("\n\n")[0], FLAGS)
    return freeze(parser.parse_args(list(argv)), "KvCompressionOptions")


def prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode(f"{CONTEXTS[i % len(CONTEXTS)]}\n\nQuestion: {QUESTIONS[i]}\nAnswer:")
            for i in range(n)]


def agreeing_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def accuracy(model, ids: list[list[int]], bs: int, n: int, codecs: Sequence[str]) -> dict[str, dict]:
    """Per codec: greedy agreement and teacher-forced logit error against uncompressed."""
    rows: dict[str, list[dict]] = {c: [] for c in codecs}
    for p in ids:
        blocks = (len(p) - 1) // bs     # every full block but one that would leave nothing to compute
        plain, plain_logits = compressed_prefix_run(model, p, blocks, bs, None, n)
        spread = plain_logits.std(dim=-1, keepdim=True)
        for name in codecs:
            codec = model_codec(name, model.args)
            greedy, _ = compressed_prefix_run(model, p, blocks, bs, codec, n)
            forced, logits = compressed_prefix_run(model, p, blocks, bs, codec, n, forced=plain)
            err = (logits - plain_logits).abs()
            rows[name].append({"prefix_tokens": blocks * bs, "agree": agreeing_prefix(greedy, plain) / n,
                               "equal": greedy == plain, "top1": sum(a == b for a, b in zip(forced, plain)) / n,
                               "max_abs": float(err.max()), "mean_abs": float(err.mean()),
                               "max_rel": float((err / spread).max())})
    return {name: summary(r) for name, r in rows.items()}


def summary(rows: list[dict]) -> dict:
    return {"prompts": len(rows), "mean_prefix_tokens": statistics.mean(r["prefix_tokens"] for r in rows),
            "greedy_token_agreement": statistics.mean(r["agree"] for r in rows),
            "sequences_equal": sum(r["equal"] for r in rows) / len(rows),
            "forced_top1_agreement": statistics.mean(r["top1"] for r in rows),
            "logit_max_abs_err": max(r["max_abs"] for r in rows),
            "logit_mean_abs_err": statistics.mean(r["mean_abs"] for r in rows),
            "logit_max_err_over_logit_std": max(r["max_rel"] for r in rows)}


def block_figures(args: Options, model_args, dtype_bytes: int, mean_prefix_tokens: float, dram: int) -> dict:
    plain = model_args.num_layers * 2 * args.block_size * model_args.num_kv_heads * model_args.head_dim * dtype_bytes
    rope_dim = model_codec("int8", model_args).rope_dim
    coded = model_args.num_layers * encoded_layer_bytes(args.block_size, model_args.num_kv_heads,
                                                        model_args.head_dim, rope_dim)
    per_request = mean_prefix_tokens / args.block_size
    return {"block_bytes": {"none": plain, "coded": coded}, "ratio": coded / plain,
            "prefix_bytes_per_request": {"none": per_request * plain, "coded": per_request * coded},
            "store_blocks_at_dram": {"dram": dram, "none": dram // plain, "coded": dram // coded}}


def sim_figures(trace: str, limit: int, codecs: Sequence[str]) -> list[dict]:
    """The conversation trace at equal DRAM, uncompressed and per codec, at the preset's DRAM and
    at 1/16 of it (where the pool's capacity, not the trace's reuse, bounds the hits)."""
    from dataclasses import replace

    from mooncake_lite.scheduler import SchedulerConfig
    from mooncake_lite.sim.cluster import MooncakeSim
    from mooncake_lite.sim.config import SimConfig
    from mooncake_lite.sim.costs import get_hardware
    from mooncake_lite.sim.metrics import summarize
    from mooncake_lite.trace.format import read_trace
    base = get_hardware("llama2-70b-a800")
    requests = read_trace(trace, limit=limit, block_size=base.block_size)
    rows = []
    for share in (1.0, 1 / 16):
        for name in ("none", *codecs):
            hw = replace(base, dram_bytes_per_node=int(base.dram_bytes_per_node * share)).with_kv_compression(name)
            cfg = SimConfig(hardware="llama2-70b-a800", scheduler=SchedulerConfig(block_size=hw.block_size))
            s = summarize(MooncakeSim(cfg, hw).run(requests), cfg.scheduler.ttft_slo_s, cfg.scheduler.tbt_slo_s)
            rows.append({"dram_share": share, "codec": name, "store_blocks_per_node": hw.dram_blocks(),
                         "reused_token_share": s["reused_token_share"], "ttft_mean_s": s["ttft_s"]["mean"],
                         "ttft_p90_s": s["ttft_s"]["p90"], "completed": s["completed"],
                         "rejected": s["rejected"]})
    return rows


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    from mooncake_lite.common.units import parse_size
    from mooncake_lite.model.tokenizer import load_tokenizer
    from mooncake_lite.model.weights import build_model
    codecs = [c for c in args.codecs.split(",") if c]
    try:
        for c in codecs:
            codec_for(c)
        model = build_model(args.model, dtype=DTYPES[args.dtype])
        model_codec("int8", model.args)
        tok = load_tokenizer(args.model, model.args.vocab_size)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"mooncake bench kv-compression: error: {exc}\n")
        return 2
    ids = prompts(tok, min(args.prompts, len(QUESTIONS)))
    t0 = time.perf_counter()
    acc = accuracy(model, ids, args.block_size, args.max_tokens, codecs)
    mean_prefix = next(iter(acc.values()))["mean_prefix_tokens"] if acc else 0.0
    out = {"model": args.model, "dtype": args.dtype, "block_size": args.block_size, "max_tokens": args.max_tokens,
           "accuracy": acc, "accuracy_wall_s": time.perf_counter() - t0,
           "blocks": block_figures(args, model.args, DTYPES[args.dtype].itemsize, mean_prefix, parse_size(args.dram)),
           "blocks_bfloat16": block_figures(args, model.args, 2, mean_prefix, parse_size(args.dram))}
    if args.trace:
        out["sim"] = sim_figures(args.trace, args.sim_limit, codecs)
    emit(out, report, as_json=args.json)
    return 0


def report(out: dict) -> str:
    lines = [f"{out['model']} ({out['dtype']}), block {out['block_size']} tokens, "
             f"{out['max_tokens']} tokens per prompt"]
    for c, a in out["accuracy"].items():
        lines.append(f"  {c}: {a['prompts']} prompts (mean reused prefix {a['mean_prefix_tokens']:.0f} tokens): "
                     f"greedy token agreement {a['greedy_token_agreement']:.1%}, sequences equal "
                     f"{a['sequences_equal']:.1%}; teacher-forced top-1 {a['forced_top1_agreement']:.1%}, "
                     f"logit error max {a['logit_max_abs_err']:.3g} mean {a['logit_mean_abs_err']:.3g} "
                     f"(max {a['logit_max_err_over_logit_std']:.3g} logit std)")
    for key, label in (("blocks", out["dtype"]), ("blocks_bfloat16", "bfloat16")):
        b, per, cap = out[key], out[key]["prefix_bytes_per_request"], out[key]["store_blocks_at_dram"]
        lines.append(f"  {label}: block {b['block_bytes']['none']:,} B -> {b['block_bytes']['coded']:,} B "
                     f"(x{b['ratio']:.3f}); prefix bytes per request {per['none']:,.0f} -> {per['coded']:,.0f}; "
                     f"blocks in {cap['dram']:,} B of DRAM {cap['none']:,} -> {cap['coded']:,}")
    for r in out.get("sim", []):
        lines.append(f"  sim DRAM x{r['dram_share']:g} {r['codec']:<5} {r['store_blocks_per_node']:>6} blocks/node: "
                     f"reused {r['reused_token_share']:.1%}, TTFT mean {r['ttft_mean_s']:.2f}s "
                     f"p90 {r['ttft_p90_s']:.2f}s, completed {r['completed']}, rejected {r['rejected']}")
    return "\n".join(lines)
