"""``mooncake bench structured``: what constrained decoding (``model/grammar.py``) adds to a
decode step, and what compiling a grammar costs.

Per token: at batch 1 and 16, every sequence constrained by a 20-field JSON schema walks the
tokens of a valid answer; a step's grammar work is exactly what the decode's step adds (each
matcher takes its input token, its mask is computed and applied to its logits row), timed right
after each decode step of the same batch on the model, as a fraction of the step (medians over
``--steps``; goal: at most 10% at batch 16). Compile: the 20-field schema's grammar
text, a fresh matcher on the model's vocabulary (an instance's cache miss), and the
conductor's check (``grammar.check``: the compile and its 48-step walk).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from mooncake_lite.bench.options import Options, build_parser, flag, freeze
from mooncake_lite.bench.report import emit
from mooncake_lite.model.args import DTYPES
from mooncake_lite.model.source import DEFAULT_MODEL

NUM_FIELDS = 20
FLAGS = (
    flag("--model", default=DEFAULT_MODEL),
    flag("--dtype", default="float32", choices=sorted(DTYPES)),
    flag("--batches", default="1,16", help="batch sizes, comma-separated"),
    flag("--context", type=int, default=256, help="cached tokens per sequence in the decode steps timed"),
    flag("--steps", type=int, default=60, help="decode steps timed per batch size"),
    flag("--threads", type=int, default=None, help="torch threads (default: torch's own choice)"),
    flag("--json", action="store_true"),
)


def schema(num_fields: int = NUM_FIELDS) -> tuple[dict, dict]:
    """A schema of ``num_fields`` fields (strings, integers, arrays of numbers) and an answer to it."""
    kinds = ({"type": "string", "maxLength": 24}, {"type": "integer"}, {"type": "array", "items": {"type": "number"}})
    values = ("hello world", 12345, [1.5, 2, 3])
    names = [f"field_{i}" for i in range(num_fields)]
    return ({"type": "object", "properties": {n: kinds[i % 3] for i, n in enumerate(names)}, "required": names,
             "additionalProperties": False}, {n: values[i % 3] for i, n in enumerate(names)})


def interleaved(runner, grammar: str, answer: list[int], batch: int, context: int, steps: int) -> tuple[float, float]:
    """Median seconds of a decode step of ``batch`` sequences and of that step's grammar work (each
    matcher takes its input token, then its mask is computed and applied), timed one after the
    other at each step: on a shared machine both see the same load. The walk restarts at the
    answer's end."""
    from mooncake_lite.model.kv_cache import blocks_needed
    per_seq = blocks_needed(context + steps + 2, runner.block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    runner.decode([11] * batch, tables, [context] * batch)   # warm-up
    states, at, step_s, grammar_s = None, 0, [], []
    for k in range(steps):
        t0 = time.perf_counter()
        logits = runner.decode([11] * batch, tables, [context + 1 + k] * batch)
        t1 = time.perf_counter()
        if states is None or at == len(answer):
            states, at = [runner.grammars.start(grammar) for _ in range(batch)], 0
        t2 = time.perf_counter()
        for i, s in enumerate(states):   # as each row's sampler does (model/sampling.py)
            if at:
                s.advance(answer[at - 1])
            s.apply(logits[i])
        t3 = time.perf_counter()
        if torch.isinf(logits[0, answer[at]]):
            raise AssertionError(f"the grammar refused the answer's token {answer[at]}")
        at += 1
        step_s.append(t1 - t0)
        grammar_s.append(t3 - t2)
    return statistics.median(step_s), statistics.median(grammar_s)


def compile_figures(model: str, vocab_size: int, text: str) -> dict:
    import llguidance

    from mooncake_lite.model.grammar import Grammars, check, ll_tokenizer
    ll_tokenizer(model, vocab_size)   # once per process, not per grammar
    s, _ = schema()
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(s, overrides={"whitespace_flexible": False})
    t1 = time.perf_counter()
    Grammars(model, vocab_size).start(grammar)
    t2 = time.perf_counter()
    error = check(grammar, model, vocab_size)
    t3 = time.perf_counter()
    assert error is None, error
    return {"fields": NUM_FIELDS, "grammar_text_ms": (t1 - t0) * 1e3, "matcher_ms": (t2 - t1) * 1e3,
            "conductor_check_ms": (t3 - t2) * 1e3, "answer_tokens": len(text)}


def run(args: Options) -> dict:
    import llguidance

    from mooncake_lite.model.grammar import Grammars
    from mooncake_lite.model.kv_cache import blocks_needed
    from mooncake_lite.model.runner import ModelRunner
    from mooncake_lite.model.tokenizer import load_tokenizer
    from mooncake_lite.model.weights import build_model
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args.model, dtype=DTYPES[args.dtype])
    vocab = model.args.vocab_size
    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(batches) * blocks_needed(args.context + args.steps + 2, 16)
    runner = ModelRunner(model, num_blocks=blocks, block_size=16, grammars=Grammars(args.model, vocab))
    s, doc = schema()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(s, overrides={"whitespace_flexible": False})
    answer = load_tokenizer(args.model, vocab).encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)
    rows = []
    for b in batches:
        step, mask = interleaved(runner, grammar, answer, b, args.context, args.steps)
        rows.append({"batch": b, "decode_step_ms": step * 1e3, "grammar_ms": mask * 1e3, "fraction": mask / step})
    return {"model": args.model, "dtype": args.dtype, "context": args.context, "threads": torch.get_num_threads(),
            "per_token": rows, "compile": compile_figures(args.model, vocab, answer)}


def report(out: dict) -> str:
    lines = [f"constrained decoding on {out['model']} ({out['dtype']}, {out['context']} cached tokens, "
             f"{out['threads']} threads)", "batch  decode step ms  grammar ms  share of the step"]
    lines += [f"{r['batch']:>5}  {r['decode_step_ms']:>14.2f}  {r['grammar_ms']:>10.3f}  {r['fraction']:>17.1%}"
              for r in out["per_token"]]
    c = out["compile"]
    lines.append(f"{c['fields']}-field schema: grammar text {c['grammar_text_ms']:.2f} ms, matcher "
                 f"{c['matcher_ms']:.2f} ms, conductor check (with its walk) {c['conductor_check_ms']:.1f} ms")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    args = freeze(build_parser("mooncake bench structured", __doc__, FLAGS).parse_args(list(argv)), "structured")
    try:
        out = run(args)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"mooncake bench structured: error: {exc}\n")
        return 2
    emit(out, report, as_json=args.json)
    return 0
