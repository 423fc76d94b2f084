"""The peer of ``bench model --llamacpp PYTHON``: llama.cpp (through llama-cpp-python, installed in
another environment: it brings its own native build) decoding the same GGUF file on this machine,
at batch 1, in the same run as our figures.

The peer runs as a child process of that environment's Python (``PEER_SCRIPT``): it fills a
context of ``context_len`` tokens, then times single-token evaluations (one decode step each,
logits included), best and median of ``steps``, at our thread count. It prints one JSON line.
"""

from __future__ import annotations

import json
import subprocess

PEER_SCRIPT = r"""
import json, statistics, sys, time
import llama_cpp
path, threads, context_len, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=context_len + steps + 8, n_threads=threads,
                      n_threads_batch=threads, n_batch=512, verbose=False)
llm.eval([(7 * i) % 1000 + 10 for i in range(context_len)])
times = []
for i in range(steps + 1):
    t0 = time.perf_counter()
    llm.eval([11])
    times.append(time.perf_counter() - t0)
times = times[1:]   # the first step warms up
print(json.dumps({"version": llama_cpp.__version__, "threads": threads, "token_ms": statistics.median(times) * 1e3,
                  "token_ms_best": min(times) * 1e3, "steps": steps, "context_len": context_len}))
"""


def measure_peer(python: str, gguf_path: str, threads: int, context_len: int, steps: int) -> dict:
    """llama.cpp's per-token decode on ``gguf_path``; ``{"error": ...}`` when the peer did not run
    (the report says so rather than failing the whole benchmark)."""
    try:
        done = subprocess.run([python, "-c", PEER_SCRIPT, gguf_path, str(threads), str(context_len), str(steps)],
                              capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{python}: {exc}"}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])
