"""``mooncake trace stats|synth|scale``: look at, make and time-scale Mooncake traces."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import orjson

from mooncake_lite.trace.format import TraceError, read_trace, write_trace
from mooncake_lite.trace.stats import compute_stats, format_stats
from mooncake_lite.trace.synth import DISTRIBUTIONS, SynthConfig, iter_synthesize


def parse_tokens(text: str) -> int:
    """Token counts like ``512``, ``16k`` (= 16,384) or ``1.5k``; k means 1024 as in "128k context"."""
    t = text.strip().lower()
    mult = 1024 if t.endswith("k") else 1
    try:
        value = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (examples: 512, 16k)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"token count must be >= 1: {text!r}")
    return int(value)


def _token_list(text: str) -> tuple[int, ...]:
    return tuple(parse_tokens(part) for part in text.split(",") if part.strip())


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mooncake trace", description="Mooncake trace tools.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("stats", help="summary figures of a trace (count, lengths, reuse)")
    st.add_argument("file")
    st.add_argument("--speed", type=float, default=1.0, help="replay speed factor (2 = twice as fast)")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    sy = sub.add_parser("synth", help="generate a synthetic trace (Poisson arrivals)")
    sy.add_argument("--out", "-o", required=True)
    sy.add_argument("--num-requests", "-n", type=int, default=1000)
    sy.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second")
    sy.add_argument("--input-len", type=_token_list, default=(16384,),
                    help="mean input length(s), comma list drawn uniformly, e.g. 16k,32k,64k,128k")
    sy.add_argument("--output-len", type=_token_list, default=(512,))
    sy.add_argument("--input-dist", choices=DISTRIBUTIONS, default="fixed")
    sy.add_argument("--output-dist", choices=DISTRIBUTIONS, default="fixed")
    sy.add_argument("--cache-ratio", type=float, default=0.5, help="share of each input that is a reused prefix")
    sy.add_argument("--num-prefixes", type=int, default=64, help="distinct shared documents/system prompts")
    sy.add_argument("--max-len", type=parse_tokens, default=131072)
    sy.add_argument("--seed", type=int, default=0)
    sc = sub.add_parser("scale", help="write a copy replayed --speed times faster")
    sc.add_argument("file")
    sc.add_argument("--speed", type=float, required=True)
    sc.add_argument("--out", "-o", required=True)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if args.cmd == "stats":
            stats = compute_stats(read_trace(args.file, speed=args.speed))
            print(orjson.dumps(stats.to_dict()).decode() if args.json else format_stats(stats))
        elif args.cmd == "synth":
            cfg = SynthConfig(num_requests=args.num_requests, rate_per_s=args.rate,
                              input_lengths=args.input_len, output_lengths=args.output_len,
                              input_dist=args.input_dist, output_dist=args.output_dist,
                              cache_ratio=args.cache_ratio, num_prefixes=args.num_prefixes,
                              max_length=args.max_len, seed=args.seed)
            n = write_trace(iter_synthesize(cfg), args.out)
            print(f"wrote {n:,} requests to {args.out}")
        else:
            n = write_trace(read_trace(args.file, speed=args.speed), args.out)
            print(f"wrote {n:,} requests to {args.out} ({args.speed}x speed)")
    except (TraceError, ValueError, OSError) as exc:
        sys.stderr.write(f"mooncake trace {args.cmd}: error: {exc}\n")
        return 2
    return 0
