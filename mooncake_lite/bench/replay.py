"""``mooncake bench replay``: replay a Mooncake trace against a live OpenAI-compatible server.

    mooncake bench replay --trace ../shared/traces/conversation_trace.jsonl \\
        --base-url http://127.0.0.1:8000 --max-requests 200 --speed 4 --scale auto \\
        --goodput ttft:2000 tpot:100

Requests go out at their trace timestamps (divided by ``--speed``) through ``/v1/completions``
with ``stream: true``; prompts follow the trace's ``hash_ids`` so prefix sharing is real
(``replay_prompts.py``), and their lengths are counted in the served model's own tokenizer
(``--tokenizer``; by default the model the server names, when it resolves locally). Reports vLLM
``bench serve`` metrics plus the paper's TBT, 429s and the prefix-cache hit rate measured from
``usage.prompt_tokens_details.cached_tokens``; writes ``result.json`` and ``cdf.png`` under
``--output-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import orjson

from mooncake_lite.bench.replay_client import cache_hit_rate, scrape_metrics, served_model_info
from mooncake_lite.bench.replay_metrics import (cached_token_hit_rate, compute_metrics, parse_slos,
                                                 prefix_hit_request_share)
from mooncake_lite.bench.replay_prompts import PromptConfig, PromptSynth, TextTokenizer, auto_scale
from mooncake_lite.bench.replay_report import format_table, per_request, plot_cdfs, write_result
from mooncake_lite.bench.replay_run import replay, select_window
from mooncake_lite.common.auth import api_key_headers
from mooncake_lite.common.units import parse_duration
from mooncake_lite.trace.format import TRACE_BLOCK_SIZE, TraceError, read_trace
from mooncake_lite.trace.stats import compute_stats


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mooncake bench replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name to send (default: first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="Bearer key (default: $OPENAI_API_KEY or $MOONCAKE_API_KEY)")
    p.add_argument("--speed", type=float, default=1.0, help="replay this many times faster than the trace")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--duration", type=parse_duration, default=None,
                   help="replay only requests arriving within this much replay time (e.g. 60s, 5min)")
    p.add_argument("--scale", default="1.0",
                   help="length scale (0.05: a 512-token trace block becomes 26 tokens) or 'auto' "
                        "to fit the longest selected request into 90%% of the context")
    p.add_argument("--block-tokens", type=int, default=None,
                   help="tokens per trace block (overrides --scale: scale = N/512); make it a multiple of "
                        "the server's KV block size so shared trace blocks are whole cache blocks")
    p.add_argument("--output-scale", type=float, default=None, help="output length scale (default: --scale)")
    p.add_argument("--max-output-tokens", type=int, default=None)
    p.add_argument("--max-context", type=int, default=None,
                   help="prompt + output budget (default: max_model_len from /v1/models, if given)")
    p.add_argument("--tokenizer", default="auto", metavar="MODEL_SPEC|auto|bytes",
                   help="count prompt lengths in this model's tokenizer (a named model such as smollm2-135m, "
                        "a .gguf file or an HF checkpoint dir); auto (default): the model the server names, "
                        "if it resolves here; bytes: one printable ASCII byte per token (exact for presets)")
    p.add_argument("--prompt-mode", choices=("text", "tokens"), default="text",
                   help="text: words of the tokenizer (or printable ASCII bytes without one); "
                        "tokens: send token id lists (exact for any model that accepts them)")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="tokens mode without a tokenizer: draw ids below this")
    p.add_argument("--min-token-id", type=int, default=0,
                   help="tokens mode without a tokenizer: draw ids from here (skip specials)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-hash-id block contents")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send vLLM's ignore_eos (for servers that reject unknown fields)")
    p.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:2000 tpot:100 (metrics: ttft, tpot, e2el)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--request-timeout", type=parse_duration, default=600.0)
    p.add_argument("--output-dir", default="replay-results", help="where result.json and cdf.png go")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return p


def validate(ns: argparse.Namespace) -> None:
    if ns.speed <= 0:
        raise ValueError("--speed must be positive")
    if ns.max_requests is not None and ns.max_requests < 1:
        raise ValueError("--max-requests must be at least 1")
    if ns.duration is not None and ns.duration <= 0:
        raise ValueError("--duration must be positive")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if ns.block_tokens is not None and ns.block_tokens < 1:
        raise ValueError("--block-tokens must be at least 1")
    if ns.scale != "auto":
        try:
            float(ns.scale)
        except ValueError:
            raise ValueError(f"--scale must be a number or 'auto', got {ns.scale!r}") from None


def resolve_tokenizer(choice: str, model: str) -> tuple[TextTokenizer | None, str, str | None]:
    """(tokenizer or None for bytes, what lengths are counted in, a note or None).

    ``auto`` uses ``model`` (the served name) when it names a checkpoint this machine has: a
    named model, a .gguf file or an HF directory. A preset's tokenizer is the byte-level one,
    for which bytes are exact. Any other name (another server's model) falls back to bytes with
    a note. An explicit spec that does not load is an error.
    """
    from mooncake_lite.model.args import PRESETS
    from mooncake_lite.model.source import resolve
    from mooncake_lite.model.tokenizer import ByteTokenizer, load_tokenizer

    if choice in ("bytes", "none"):
        return None, "bytes", None
    spec = model if choice == "auto" else choice
    try:
        source = resolve(spec)
    except FileNotFoundError as exc:
        if choice != "auto":
            raise ValueError(f"--tokenizer {choice}: {exc}") from None
        source = None
    if source is not None and source.kind == "preset":
        if spec in PRESETS:
            return None, f"bytes ({spec}: byte-level tokenizer)", None
        if choice != "auto":
            raise ValueError(f"--tokenizer {choice!r}: not a preset, named model, .gguf file or checkpoint dir")
        source = None
    if source is None:
        return None, "bytes", (f"prompt lengths are counted in bytes: the served model {model!r} is not a "
                               f"model this machine can load a tokenizer for, so the server's token counts "
                               f"will differ; pass --tokenizer MODEL_SPEC (named model, .gguf, HF dir)")
    tok = load_tokenizer(spec, 320)
    if isinstance(tok, ByteTokenizer):
        return None, f"bytes ({spec}: byte-level tokenizer)", None
    return tok, spec, None


async def run(ns: argparse.Namespace) -> dict:
    trace = read_trace(ns.trace, speed=ns.speed)
    count = select_window([r.arrival_s for r in trace], max_requests=ns.max_requests, duration_s=ns.duration)
    window = trace[:count]
    if not window:
        raise ValueError("the replay window holds no requests")
    base = ns.base_url.rstrip("/")
    key = ns.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("MOONCAKE_API_KEY")
    headers = api_key_headers(key)
    notes: list[str] = []
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as session:
        served, served_ctx = await served_model_info(session, base)
        before = await scrape_metrics(session, base)
    model = ns.model or served
    if model is None:
        raise ValueError(f"no model name: {base}/v1/models did not answer with one (is the server up?); pass --model")
    max_context = ns.max_context or served_ctx
    if ns.block_tokens is not None:
        scale = ns.block_tokens / TRACE_BLOCK_SIZE
    elif ns.scale == "auto":
        if max_context is None:
            raise ValueError("--scale auto needs the context length: pass --max-context")
        scale = auto_scale(window, max_context)
    else:
        scale = float(ns.scale)
    pcfg = PromptConfig(scale=scale, output_scale=ns.output_scale, max_output_tokens=ns.max_output_tokens,
                        max_context=max_context, mode=ns.prompt_mode, vocab_size=ns.vocab_size,
                        min_token_id=ns.min_token_id, seed=ns.seed)
    tokenizer, counted_in, note = resolve_tokenizer(ns.tokenizer, model)
    if note:
        notes.append(note)
    synth = PromptSynth(pcfg, tokenizer)
    requests = [synth.build(r) for r in window]
    if synth.mismatched:
        notes.append(f"{synth.mismatched} text prompts did not re-encode to their drawn tokens in {counted_in}; "
                     f"their lengths are the re-encoded ones (--prompt-mode tokens is exact)")
    if any(r.is_truncated for r in requests):
        notes.append(f"{sum(r.is_truncated for r in requests)} prompts were cut to fit a {max_context}-token context")
    slos = parse_slos(ns.goodput)
    started_at = time.time()
    records, duration = await replay(requests, base + ns.endpoint, model, headers=headers,
                                     ignore_eos=ns.ignore_eos, max_concurrency=ns.max_concurrency,
                                     request_timeout_s=ns.request_timeout, progress=not ns.no_progress)
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as session:
        after = await scrape_metrics(session, base)
    hit, why_not = cache_hit_rate(before, after)
    if hit is None:
        notes.append(f"cluster cache hit rate omitted: {why_not}")
    errors = sorted({r.error for r in records if r.error and not r.is_rejected})
    if errors:
        notes.append(f"{len(errors)} distinct error(s), first: {errors[0]}")
    metrics = compute_metrics(records, max(duration, 1e-9), slos)
    measured = cached_token_hit_rate(records)
    if measured["cached_token_hit_rate"] is None and metrics["completed"]:
        notes.append("measured hit rate omitted: the server reported no usage.prompt_tokens_details.cached_tokens")
    return {
        "config": {"trace": str(ns.trace), "base_url": base, "endpoint": ns.endpoint, "model": model,
                   "speed": ns.speed, "scale": scale, "block_tokens": pcfg.block_tokens,
                   "max_context": max_context, "prompt_mode": ns.prompt_mode, "tokenizer": counted_in,
                   "ignore_eos": ns.ignore_eos,
                   "num_requests": len(requests), "max_concurrency": ns.max_concurrency,
                   "goodput_slos_ms": {k: v * 1000 for k, v in slos.items()}, "started_at_unix": started_at},
        "metrics": metrics,
        "cache": {**measured, "cache_hit_rate": hit, "requests_with_prefix_hit": prefix_hit_request_share(records),
                  "ideal_block_hit_rate": compute_stats(window).block_reuse_share},
        "notes": notes,
        "_records": records,
    }


def main(argv: Sequence[str]) -> int:
    ns = build_parser().parse_args(list(argv))
    try:
        validate(ns)
        parse_slos(ns.goodput)
        summary = asyncio.run(run(ns))
    except (ValueError, TraceError, OSError) as exc:
        sys.stderr.write(f"mooncake bench replay: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("mooncake bench replay: interrupted; no results written\n")
        return 130
    records = summary.pop("_records")
    out = Path(ns.output_dir)
    series = per_request(records)
    write_result(out / "result.json", summary, series)
    files = {"result": str(out / "result.json")}
    if not ns.no_plot and plot_cdfs(out / "cdf.png", series, f"{summary['config']['model']} · {ns.trace}"):
        files["cdf_plot"] = str(out / "cdf.png")
    summary["files"] = files
    if ns.json:
        sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    else:
        sys.stdout.write(format_table(summary) + "\n" + "".join(f"wrote {p}\n" for p in files.values()))
    return 0 if summary["metrics"]["completed"] > 0 else 1
