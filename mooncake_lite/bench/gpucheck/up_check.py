"""``mooncake up`` 1P+1D on the device: the README's question, then a trace replayed through it.

    python -m mooncake_lite.bench.gpucheck.up_check --model M --device cuda --out DIR --requests 100

Starts the cluster as a user would (``--device cuda --gpus 0``: both instances share the GPU,
split by ``--gpu-memory-fraction``), reads the API address from its banner, asks the question
through ``/v1/chat/completions``, synthesizes a trace (``mooncake trace synth``) and replays it
(``mooncake bench replay``: TTFT and ITL), then stops the cluster with Ctrl-C's signal. Prints one
JSON object; the cluster's log goes to ``DIR/up.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from mooncake_lite.bench.gpucheck.plan import README_QUESTION

API_LINE = re.compile(r"OpenAI-compatible API: (\S+)/v1")


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def wait_for_api(proc: subprocess.Popen, deadline: float) -> str:
    """The API base URL from the banner ``mooncake up`` prints once every role is registered."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            raise RuntimeError(f"mooncake up exited ({proc.wait()}) before its banner; see up.log")
        if m := API_LINE.search(line):
            return m.group(1)
    raise TimeoutError("mooncake up did not print its banner in time; see up.log")


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def ask(api: str, timeout: float) -> dict:
    with urllib.request.urlopen(f"{api}/v1/models", timeout=timeout) as resp:
        name = json.loads(resp.read())["data"][0]["id"]
    t0 = time.monotonic()
    res = _post(f"{api}/v1/chat/completions", {"model": name, "max_tokens": 24, "temperature": 0,
                                               "messages": [{"role": "user", "content": README_QUESTION}]}, timeout)
    return {"question": README_QUESTION, "answer": res["choices"][0]["message"]["content"],
            "seconds": time.monotonic() - t0, "completion_tokens": res["usage"]["completion_tokens"]}


def replay(api: str, out: Path, ns: argparse.Namespace, timeout: float) -> dict:
    mooncake = [sys.executable, "-m", "mooncake_lite"]
    trace = out / "trace.jsonl"
    # The trace counts 512-token blocks; replayed at 64 tokens a block (the KV block size), so it is
    # written 8x long. Half of each prompt is a shared prefix: the store's reuse is exercised too.
    subprocess.run([*mooncake, "trace", "synth", "-o", str(trace), "-n", str(ns.requests), "--rate", str(ns.rate),
                    "--input-len", str(8 * ns.request_len), "--output-len", str(8 * ns.output_len),
                    "--num-prefixes", "8", "--max-len", str(32 * ns.request_len)],
                   check=True, capture_output=True, timeout=timeout)
    res = subprocess.run([*mooncake, "bench", "replay", "--trace", str(trace), "--base-url", api,
                          "--block-tokens", "64", "--output-dir", str(out / "replay"), "--json"],
                         capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"bench replay failed ({res.returncode}): {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait()


def run(ns: argparse.Namespace) -> dict:
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "mooncake_lite", "up", "--port", "0", "--no-color", "--no-restart",
            "--prefill", "1", "--decode", "1", "--model", ns.model, "--block-size", "64"]
    if ns.device.startswith("cuda"):
        argv += ["--device", "cuda", "--gpus", "0"]
    deadline = time.monotonic() + ns.timeout
    t0 = time.monotonic()
    with open(out / "up.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        try:
            api = wait_for_api(proc, deadline)
            result = {"start_s": time.monotonic() - t0, "answer": ask(api, deadline - time.monotonic())}
            result["replay"] = replay(api, out, ns, deadline - time.monotonic())
        finally:
            code = stop(proc)
    return result | {"stop_code": code}


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="gpucheck.up_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--rate", type=float, default=10.0, help="trace arrivals per second")
    ap.add_argument("--request-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=300.0)
    ns = ap.parse_args(list(argv))
    sys.stdout.write(json.dumps(run(ns)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
