"""A stream continues when its decode dies or hangs (issue #37), through ``mooncake up --prefill 1
--decode 2`` on the default model (real processes, one cluster for the module): a streamed chat at
temperature 0 whose decode is stopped (SIGSTOP) or killed (SIGKILL) mid-answer reads, to the
client, exactly as the uninterrupted run's, with no error event; the stopped decode, once
resumed, sends the client nothing more and gives back every block it held."""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import orjson
import pytest

from mooncake_lite.bench.chaos.cli import gauges, get_json
from mooncake_lite.bench.harness import UpCluster
from tests.real_model import SMOLLM, needs_smollm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), needs_smollm]

MAX_TOKENS = 32
KILL_AFTER = 4          # content chunks the client has read when its decode is stopped or killed
DEAD_AFTER_S = 2        # the conductor's --dead-after: how soon a hung decode is declared dead
MESSAGES = [{"role": "user", "content": "Tell me a long story about a dragon who learns to bake bread."}]


@pytest.fixture(scope="module")
def up():
    cluster = UpCluster(["--prefill", "1", "--decode", "2",
                         "--conductor-args", f"--dead-after {DEAD_AFTER_S}s --admission none",
                         "--prefill-args=--no-profile", "--decode-args=--no-profile"], ready_timeout=400)
    try:
        yield cluster
    finally:
        cluster.stop()


def _stream(up: UpCluster, on_chunk=None, **extra) -> tuple[str, list[dict], dict]:
    """One streamed chat: its text, every event (chunks, errors), and the response headers.
    ``on_chunk(headers, n)`` is called after the n-th content chunk."""
    body = {"model": SMOLLM, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    text, events, n, times = [], [], 0, []
    req = urllib.request.Request(up.api + "/v1/chat/completions", data=orjson.dumps(body),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:     # (an HTTP error raises)
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            events.append(event)
            for choice in event.get("choices", []):
                if choice["delta"].get("content"):
                    times.append(time.monotonic())
                    text.append(choice["delta"]["content"])
                    n += 1
                    if on_chunk is not None:
                        on_chunk(r.headers, n)
    gaps = [b - a for a, b in zip(times, times[1:])]
    print(f"streamed {n} chunks in {times[-1] - times[0]:.2f}s, longest gap {max(gaps, default=0):.2f}s")
    return "".join(text), events, dict(r.headers)


def _decode_child(up: UpCluster, instance_id: str) -> str:
    """The ``mooncake up`` child serving as decode ``instance_id`` (matched by address)."""
    status = get_json(up.api + "/internal/v1/status")
    http = next(i["http"] for i in status["instances"] if i["instance_id"] == instance_id)
    return next(name for name, child in up.children.items() if child.get("http") == http)


def _continued(up: UpCluster) -> float:
    with urllib.request.urlopen(up.api + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("mooncake_conductor_continuations_total{") and 'outcome="continued"' in line)


def _assert_same_answer(got: tuple[str, list[dict], dict], want: tuple[str, list[dict], dict]) -> None:
    text, events, _ = got
    assert not [e for e in events if "error" in e], events
    assert text == want[0]
    assert len({e["id"] for e in events}) == 1                        # one response id across the seam
    assert events[-1]["usage"]["prompt_tokens"] == want[1][-1]["usage"]["prompt_tokens"]
    assert events[-1]["usage"]["completion_tokens"] == want[1][-1]["usage"]["completion_tokens"]


def _two_decodes_serving(up: UpCluster) -> bool:
    """Two decodes the conductor counts alive, each answering its own /health. The conductor's
    count alone is not enough after a SIGKILL: the dead process stays counted (suspect) until
    --dead-after, while its restart is still loading the model at the same address."""
    decodes = [i for i in get_json(up.api + "/health")["instances"] if i["role"] == "decode" and i["alive"]]
    try:
        return len(decodes) == 2 and all(get_json(f"http://{i['http']}/health")["status"] == "ok" for i in decodes)
    except OSError:
        return False


def _wait(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


def test_a_stream_goes_on_when_its_decode_hangs_or_dies(up):
    want = _stream(up)
    assert want[1][-1]["usage"]["completion_tokens"] == MAX_TOKENS, "the answer must outlast the kill point"
    idle = gauges(up)
    victims: list[str] = []

    def stop_at(sig: int):
        def on_chunk(headers, n: int) -> None:
            if n == KILL_AFTER:
                victims.append(_decode_child(up, headers["X-Mooncake-Decode"]))
                os.kill(up.pid_of(victims[-1]), sig)
        return on_chunk

    # SIGSTOP: the stream goes silent and the heartbeats stop; --dead-after later it goes on elsewhere
    before = _continued(up)
    got = _stream(up, stop_at(signal.SIGSTOP))
    stopped = victims[-1]
    os.kill(up.pid_of(stopped), signal.SIGCONT)
    _assert_same_answer(got, want)
    assert _continued(up) == before + 1
    # fencing: the resumed decode was told to drop the old request; everything it held comes back
    assert _wait(lambda: gauges(up) == idle, 20), {k: v for k, v in gauges(up).items() if idle.get(k) != v}
    assert _wait(lambda: get_json(up.api + "/health")["decode"] == 2, 20)

    # SIGKILL: the connection drops at once and the stream goes on on the other decode
    got = _stream(up, stop_at(signal.SIGKILL))
    _assert_same_answer(got, want)
    assert _continued(up) == before + 2


def test_a_seeded_stream_goes_on_as_if_uninterrupted(up):
    """With a seed, each token is drawn from a generator derived from (seed, position), and the
    continuation tells the instances how many tokens are output already (Sampling.num_generated)."""
    assert _wait(lambda: _two_decodes_serving(up), 120)   # the killed decode is back
    seeded = {"temperature": 0.8, "seed": 7}
    want = _stream(up, **seeded)
    assert want[1][-1]["usage"]["completion_tokens"] == MAX_TOKENS
    victims: list[str] = []

    def kill_at(headers, n: int) -> None:
        if n == KILL_AFTER:
            victims.append(_decode_child(up, headers["X-Mooncake-Decode"]))
            os.kill(up.pid_of(victims[-1]), signal.SIGKILL)

    before = _continued(up)
    _assert_same_answer(_stream(up, kill_at, **seeded), want)
    assert _continued(up) == before + 1
