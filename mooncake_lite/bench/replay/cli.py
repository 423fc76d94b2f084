"""``mooncake bench replay``: replay a Mooncake trace against a live OpenAI-compatible server.

    mooncake bench replay --trace ../shared/traces/conversation_trace.jsonl \\
        --base-url http://127.0.0.1:8000 --max-requests 200 --speed 4 --scale auto \\
        --goodput ttft:2000 tpot:100

Requests go out at their trace timestamps (divided by ``--speed``) through ``/v1/completions``
with ``stream: true``; prompts follow the trace's ``hash_ids`` so prefix sharing is real
(``workload.py``), and their lengths are counted in the served model's own tokenizer
(``--tokenizer``; by default the model the server names, when it resolves locally). Reports vLLM
``bench serve`` metrics plus the paper's TBT, 429s and the prefix-cache hit rate measured from
``usage.prompt_tokens_details.cached_tokens``; writes ``result.json`` and ``cdf.png`` under
``--output-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from mooncake_lite.bench import options
from mooncake_lite.bench.options import Options, flag, freeze
from mooncake_lite.bench.replay.metrics import RequestRecord, parse_slos
from mooncake_lite.bench.replay.report import format_table, per_request, plot_cdfs, write_result
from mooncake_lite.bench.replay.run import run
from mooncake_lite.bench.report import emit
from mooncake_lite.common.units import parse_duration
from mooncake_lite.sim.request import MaxTokensPolicy
from mooncake_lite.trace.format import TraceError

FLAGS = (
    flag("--trace", required=True, help="Mooncake-format JSONL trace"),
    flag("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)"),
    flag("--endpoint", default="/v1/completions"),
    flag("--model", default=None, help="model name to send (default: first of GET /v1/models)"),
    flag("--api-key", default=None, help="Bearer key (default: $OPENAI_API_KEY or $MOONCAKE_API_KEY)"),
    flag("--speed", type=float, default=1.0, help="replay this many times faster than the trace"),
    flag("--arrival-spread", type=parse_duration, default=0.0, metavar="DURATION",
         help="the trace's timestamps are rounded to this (3s for the Mooncake conversation trace): send "
              "each request at a random point of its interval (seeded by --seed), not all at its start "
              "(default 0: as recorded, a burst per timestamp)"),
    flag("--max-requests", type=int, default=None, help="replay only the first N requests"),
    flag("--duration", type=parse_duration, default=None,
                   help="replay only requests arriving within this much replay time (e.g. 60s, 5min)"),
    flag("--scale", default="1.0",
                   help="length scale (0.05: a 512-token trace block becomes 26 tokens) or 'auto' "
                        "to fit the longest selected request into 90%% of the context"),
    flag("--block-tokens", type=int, default=None,
                   help="tokens per trace block (overrides --scale: scale = N/512); make it a multiple of "
                        "the server's KV block size so shared trace blocks are whole cache blocks"),
    flag("--output-scale", type=float, default=None, help="output length scale (default: --scale)"),
    flag("--max-output-tokens", type=int, default=None),
    flag("--max-tokens-policy", default="output", type=MaxTokensPolicy.parse, metavar="output|cap:N",
                   help="what to send as max_tokens: the trace's output length (the server learns every "
                        "output length in advance), or a fixed cap N as chat clients send (the client stops "
                        "reading at the trace's output); `mooncake sim --max-tokens-policy` models the same"),
    flag("--max-context", type=int, default=None,
                   help="prompt + output budget (default: max_model_len from /v1/models, if given)"),
    flag("--tokenizer", default="auto", metavar="MODEL_SPEC|auto|bytes",
                   help="count prompt lengths in this model's tokenizer (a named model such as smollm2-135m, "
                        "a .gguf file or an HF checkpoint dir); auto (default): the model the server names, "
                        "if it resolves here; bytes: one printable ASCII byte per token (exact for presets)"),
    flag("--prompt-mode", choices=("text", "tokens"), default="text",
                   help="text: words of the tokenizer (or printable ASCII bytes without one); "
                        "tokens: send token id lists (exact for any model that accepts them)"),
    flag("--vocab-size", type=int, default=32000,
                   help="tokens mode without a tokenizer: draw ids below this"),
    flag("--min-token-id", type=int, default=0,
                   help="tokens mode without a tokenizer: draw ids from here (skip specials)"),
    flag("--seed", type=int, default=0, help="seed of the per-hash-id block contents"),
    flag("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send vLLM's ignore_eos (for servers that reject unknown fields)"),
    flag("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:2000 tpot:100 (metrics: ttft, tpot, e2el)"),
    flag("--max-concurrency", type=int, default=None, help="cap on requests in flight"),
    flag("--request-timeout", type=parse_duration, default=600.0),
    flag("--output-dir", default="replay-results", help="where result.json and cdf.png go"),
    flag("--no-plot", action="store_true"),
    flag("--no-progress", action="store_true", help="no progress bar"),
    flag("--json", action="store_true", help="print the summary as one JSON object"),
)


def build_parser() -> argparse.ArgumentParser:
    return options.build_parser("mooncake bench replay", __doc__.split("\n\n")[0], FLAGS)


def parse_args(argv: Sequence[str]) -> Options:
    return freeze(build_parser().parse_args(list(argv)), "ReplayOptions")


def validate(ns: Options) -> None:
    if ns.speed <= 0:
        raise ValueError("--speed must be positive")
    if ns.arrival_spread < 0:
        raise ValueError("--arrival-spread must be a duration >= 0")
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


def main(argv: Sequence[str]) -> int:
    ns = parse_args(argv)
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
    summary["files"] = save(summary, summary.pop("_records"), ns)
    emit(summary, render, as_json=ns.json)
    return 0 if summary["metrics"]["completed"] > 0 else 1


def save(summary: dict, records: Sequence[RequestRecord], ns: Options) -> dict[str, str]:
    """Write ``result.json`` (and ``cdf.png``) under ``--output-dir``; the paths written, by kind."""
    out = Path(ns.output_dir)
    series = per_request(records)
    write_result(out / "result.json", summary, series)
    files = {"result": str(out / "result.json")}
    if not ns.no_plot and plot_cdfs(out / "cdf.png", series, f"{summary['config']['model']} · {ns.trace}"):
        files["cdf_plot"] = str(out / "cdf.png")
    return files


def render(summary: dict) -> str:
    return format_table(summary) + "".join(f"\nwrote {p}" for p in summary["files"].values())
