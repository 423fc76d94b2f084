"""``python -m mooncake_lite.model.grammar_check MODEL VOCAB_SIZE MEMORY_BYTES``: the conductor's
grammar checker (``conductor/api/structured.py``) in a process of its own, so that a compile that
runs long can be abandoned by killing it. One JSON line in (a grammar's text), one out (its
compile error, "" when it compiles), until stdin closes; "" on a line of its own once ready."""

from __future__ import annotations

import json
import resource
import sys

from mooncake_lite.model.grammar import check, ll_tokenizer


def main(argv: list[str]) -> None:
    model, vocab_size, memory_bytes = argv[0], int(argv[1]), int(argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    ll_tokenizer(model, vocab_size)
    _say("")
    for line in sys.stdin:
        try:
            _say(check(json.loads(line), model, vocab_size) or "")
        except (MemoryError, ValueError) as exc:
            _say(f"it could not be compiled: {exc}")


def _say(verdict: str) -> None:
    sys.stdout.write(json.dumps(verdict) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
