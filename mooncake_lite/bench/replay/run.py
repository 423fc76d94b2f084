"""One replay, measured: the trace window, its prompts in the served model's tokens, the sending,
and the figures (``run(ns)`` returns them as one dict; ``cli.py`` renders it)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import aiohttp

from mooncake_lite.bench.options import Options
from mooncake_lite.bench.replay.client import cache_hit_rate, scrape_metrics, served_model_info
from mooncake_lite.bench.replay.metrics import (RequestRecord, cached_token_hit_rate, compute_metrics, parse_slos,
                                                prediction_errors, prefix_hit_request_share)
from mooncake_lite.bench.replay.sender import replay, select_window
from mooncake_lite.bench.replay.workload import PromptConfig, PromptSynth, SynthRequest, TextTokenizer, auto_scale
from mooncake_lite.common.auth import api_key_headers
from mooncake_lite.trace.format import TRACE_BLOCK_SIZE, TraceRequest, read_trace, spread_arrivals
from mooncake_lite.trace.stats import compute_stats


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


def read_window(ns: Options) -> list[TraceRequest]:
    """The requests of the trace that ``--max-requests`` / ``--duration`` select."""
    trace = spread_arrivals(read_trace(ns.trace, speed=ns.speed), ns.arrival_spread * 1e3 / ns.speed, ns.seed)
    count = select_window([r.arrival_s for r in trace], max_requests=ns.max_requests, duration_s=ns.duration)
    if not count:
        raise ValueError("the replay window holds no requests")
    return trace[:count]


def length_scale(ns: Options, window: Sequence[TraceRequest], max_context: int | None) -> float:
    """Tokens per trace token: ``--block-tokens``, ``--scale auto`` (fit the context) or ``--scale``."""
    if ns.block_tokens is not None:
        return ns.block_tokens / TRACE_BLOCK_SIZE
    if ns.scale == "auto":
        if max_context is None:
            raise ValueError("--scale auto needs the context length: pass --max-context")
        return auto_scale(window, max_context)
    return float(ns.scale)


def build_requests(ns: Options, window: Sequence[TraceRequest], pcfg: PromptConfig, model: str,
                   notes: list[str]) -> tuple[list[SynthRequest], str]:
    """The prompts of ``window`` and what their lengths are counted in; caveats go to ``notes``."""
    tokenizer, counted_in, note = resolve_tokenizer(ns.tokenizer, model)
    if note:
        notes.append(note)
    synth = PromptSynth(pcfg, tokenizer)
    requests = [synth.build(r) for r in window]
    if synth.mismatched:
        notes.append(f"{synth.mismatched} text prompts did not re-encode to their drawn tokens in {counted_in}; "
                     f"their lengths are the re-encoded ones (--prompt-mode tokens is exact)")
    if any(r.is_truncated for r in requests):
        notes.append(f"{sum(r.is_truncated for r in requests)} prompts were cut to fit a "
                     f"{pcfg.max_context}-token context")
    return requests, counted_in


async def run(ns: Options) -> dict:
    """Replay the window against the server; the summary (config, metrics, cache, notes) plus the
    per-request records under ``_records``."""
    window = read_window(ns)
    base = ns.base_url.rstrip("/")
    headers = api_key_headers(ns.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("MOONCAKE_API_KEY"))
    notes: list[str] = []
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as session:
        served, served_ctx = await served_model_info(session, base)
        before = await scrape_metrics(session, base)
    model = ns.model or served
    if model is None:
        raise ValueError(f"no model name: {base}/v1/models did not answer with one (is the server up?); pass --model")
    max_context = ns.max_context or served_ctx
    scale = length_scale(ns, window, max_context)
    pcfg = PromptConfig(scale=scale, output_scale=ns.output_scale, max_output_tokens=ns.max_output_tokens,
                        max_tokens_cap=ns.max_tokens_policy.cap, max_context=max_context, mode=ns.prompt_mode, vocab_size=ns.vocab_size,
                        min_token_id=ns.min_token_id, seed=ns.seed)
    requests, counted_in = build_requests(ns, window, pcfg, model, notes)
    slos = parse_slos(ns.goodput)
    started_at = time.time()
    records, duration = await replay(requests, base + ns.endpoint, model, headers=headers,
                                     ignore_eos=ns.ignore_eos, max_concurrency=ns.max_concurrency,
                                     request_timeout_s=ns.request_timeout, progress=not ns.no_progress)
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as session:
        after = await scrape_metrics(session, base)
    metrics, cache = figures(records, duration, slos, before, after, notes)
    cache["ideal_block_hit_rate"] = compute_stats(window).block_reuse_share
    return {
        "config": {"trace": str(ns.trace), "base_url": base, "endpoint": ns.endpoint, "model": model,
                   "speed": ns.speed, "arrival_spread_s": ns.arrival_spread, "scale": scale,
                   "block_tokens": pcfg.block_tokens, "max_context": max_context, "prompt_mode": ns.prompt_mode,
                   "tokenizer": counted_in, "ignore_eos": ns.ignore_eos, "max_tokens_policy": str(ns.max_tokens_policy),
                   "num_requests": len(requests), "max_concurrency": ns.max_concurrency,
                   "goodput_slos_ms": {k: v * 1000 for k, v in slos.items()}, "started_at_unix": started_at},
        "metrics": metrics,
        "cache": cache,
        "predictions": prediction_errors(records),
        "notes": notes,
        "_records": records,
    }


def figures(records: Sequence[RequestRecord], duration: float, slos: dict[str, float],
            before: dict[str, float] | None, after: dict[str, float] | None, notes: list[str]) -> tuple[dict, dict]:
    """(serving metrics, cache figures) of a finished replay; caveats go to ``notes``."""
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
    return metrics, {**measured, "cache_hit_rate": hit, "requests_with_prefix_hit": prefix_hit_request_share(records)}
