"""Operating a live cluster (issue #19): one request's id in every role's log lines, and
``mooncake status`` (``--json``, ``--once``, and the live view driven in a pty) against a real
conductor, store, prefill and decode on 127.0.0.1."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from mooncake_lite.conductor.cluster.status import quantiles
from tests.conftest import REPO
from tests.cluster.helpers import wait_until

pytestmark = pytest.mark.timeout(180)

TOKEN = "status-test-token"
COMMON = ("--block-size", "16", "--cluster-token", TOKEN)
INSTANCE = ("--model", "tiny", "--threads", "1", "--no-profile", "--heartbeat-interval", "0.3")
PROMPT = "The quick brown fox jumps over the lazy dog; " * 2


@pytest.fixture(scope="module")
def cluster():
    """conductor, store, prefill and decode; conductor and prefill log JSON, decode plain text,
    all at debug level (where a request's per-role lines are)."""
    from tests.conftest import start_role
    started = []

    def start(*args, **kw):
        started.append(start_role(*args, **kw))
        return started[-1]
    try:
        conductor = start("conductor", "--port", "0", "--model", "tiny", "--log-level", "debug", "--log-json",
                          *COMMON)
        url = conductor.url()
        store = start("store", "--port", "0", "--data-port", "0", "--dram", "64MiB", "--conductor", url,
                      "--event-interval", "0.05", "--log-level", "warning", *COMMON)
        with ThreadPoolExecutor(2) as pool:
            p = pool.submit(start, "prefill", "--port", "0", "--conductor", url, "--store", store.addresses["data"],
                            "--log-level", "debug", "--log-json", *INSTANCE, *COMMON)
            d = pool.submit(start, "decode", "--port", "0", "--data-port", "0", "--conductor", url,
                            "--log-level", "debug", *INSTANCE, *COMMON)
            prefill, decode = p.result(), d.result()
        wait_until(lambda: len([i for i in _status(url)["instances"] if i["health"] == "alive"]) == 2, "registration")
        yield {"url": url, "conductor": conductor, "store": store, "prefill": prefill, "decode": decode}
    finally:
        for rp in started:        # all drain at once
            rp.send(signal.SIGTERM)
        for rp in reversed(started):
            rp.stop()


def _status(url: str, token: str | None = TOKEN) -> dict:
    req = urllib.request.Request(url + "/internal/v1/status", headers={"X-Mooncake-Token": token} if token else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.load(resp)


def _complete(url: str, max_tokens: int = 6) -> str:
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)["id"]


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _status_cli(url: str, *args: str, token: str = TOKEN) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mooncake_lite", "status", "--conductor", url, *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "MOONCAKE_CLUSTER_TOKEN": token})


def test_one_request_id_tags_its_log_lines_in_every_role(cluster):
    rid = _complete(cluster["url"])
    # decode logs "finished" as its stream ends, just before the conductor's answer completes
    wait_until(lambda: f"[{rid}]: finished: length" in cluster["decode"].logs(), "decode's last line")
    # the conductor logs its outcome after the answer's last byte: the client can read it first
    wait_until(lambda: any(e.get("request_id") == rid and e["msg"].startswith("completions ok")
                           for e in _json_lines(cluster["conductor"].logs())), "conductor's last line")
    for role in ("conductor", "prefill"):
        tagged = [e for e in _json_lines(cluster[role].logs()) if e.get("request_id") == rid]
        # tagged by the context, not by quoting the id in the message
        assert any(rid not in e["msg"] for e in tagged), (role, tagged)
    conductor = [e["msg"] for e in _json_lines(cluster["conductor"].logs()) if e.get("request_id") == rid]
    assert any(m.startswith("completions ok") for m in conductor), conductor
    prefill = [e["msg"] for e in _json_lines(cluster["prefill"].logs()) if e.get("request_id") == rid]
    assert any(m.startswith("prefilled for decode") for m in prefill), prefill
    decode = [line for line in cluster["decode"].logs().splitlines() if f"[{rid}]" in line]
    assert any("admitted" in line for line in decode), decode
    # lines of other requests, or of none, do not carry it
    assert not any(e.get("request_id") == rid and "registered" in e["msg"]
                   for e in _json_lines(cluster["conductor"].logs()))


def test_status_json_and_once_show_instances_stores_and_recent_requests(cluster):
    url = cluster["url"]
    _complete(url)
    with pytest.raises(urllib.error.HTTPError) as refused:   # an internal endpoint: the cluster token
        _status(url, token=None)
    assert refused.value.code == 403
    # the store's usage arrives with its block events (the request's blocks were written back)
    wait_until(lambda: any((s.get("usage") or {}).get("dram_blocks", 0) > 0 for s in _status(url)["stores"]),
           "the store's usage")
    # and a heartbeat from after the request: one sent while decode still held its KV (written,
    # not yet joined to the batch) would show batch 0 with KV in use
    # (the decode's kv_used is None until its first heartbeat with a load: wait for 0.0 itself)
    wait_until(lambda: all(i.get("kv_used") == 0.0 if i.get("role") == "decode" else i.get("kv_used") in (None, 0.0)
                           for i in _status(url)["instances"]), "an idle decode")
    out = _status_cli(url, "--json")
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    roles = {i["role"]: i for i in st["instances"]}
    assert set(roles) == {"prefill", "decode"} and all(i["health"] == "alive" for i in st["instances"])
    assert roles["prefill"]["queue"] == 0 and roles["decode"]["batch"] == 0
    assert roles["prefill"]["node"] == "127.0.0.1" and roles["decode"]["kv_used"] == 0.0
    assert roles["prefill"]["store"] == cluster["store"].addresses["data"]
    (store,) = st["stores"]
    assert store["store"] == cluster["store"].addresses["data"] and store["indexed_blocks"] > 0
    assert store["usage"]["dram_used_bytes"] > 0 and store["usage"]["dram_capacity_bytes"] == 64 << 20
    req = st["requests"]
    ttft = req["ttft_s"]   # a few requests: their values (test_a_few_samples_are_shown_as_measured_...)
    assert req["outcomes"].get("ok", 0) >= 1 and 1 <= ttft["count"] < 10 and len(ttft["values"]) == ttft["count"]
    assert all(v > 0 for v in ttft["values"]) and ttft["p50"] is None
    assert req["requests_per_s"] > 0 and req["tokens_per_s"] > 0

    once = _status_cli(url, "--once")
    assert once.returncode == 0, once.stderr
    assert "\x1b" not in once.stdout
    for text in ("REQUESTS", "INSTANCES", "STORES", roles["prefill"]["instance_id"],
                 roles["decode"]["instance_id"], store["store"], "TTFT        n="):
        assert text in once.stdout, once.stdout
    bad = _status_cli(url, "--once", token="wrong")
    assert bad.returncode == 1 and "403" in bad.stderr


def test_live_view_redraws_in_place_in_a_terminal(cluster):
    url = cluster["url"]
    before = _status(url)["requests"]["outcomes"].get("ok", 0)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([sys.executable, "-m", "mooncake_lite", "status", "--conductor", url, "--interval", "0.2"],
                            stdin=slave, stdout=slave, stderr=slave, cwd=REPO, start_new_session=True,
                            env={**env, "MOONCAKE_CLUSTER_TOKEN": TOKEN, "TERM": "xterm"})
    os.close(slave)
    screen = b""

    def readwait_until(pred, what: str, timeout: float = 30.0) -> None:
        nonlocal screen
        deadline = time.monotonic() + timeout
        while not pred(screen.decode(errors="replace")):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"no {what} on the terminal: {screen[-2000:]!r}")
            os.set_blocking(master, False)
            try:
                screen += os.read(master, 65536)
            except (BlockingIOError, OSError):
                time.sleep(0.05)
    try:
        readwait_until(lambda s: s.count("INSTANCES") >= 2, "two frames")
        text = screen.decode(errors="replace")
        assert text.startswith("\x1b[?1049h")                     # the alternate screen
        assert text.count("\x1b[H") >= 2 and "decode@" in text and "prefill@" in text
        _complete(url)                                             # a new frame shows the new request
        readwait_until(lambda s: f"ok {before + 1:.0f}" in s.rsplit("\x1b[H", 1)[-1]
                   or f"ok {before + 1:.0f}" in s.rsplit("\x1b[H", 2)[-2], "the refreshed outcome count")
        proc.send_signal(signal.SIGINT)                           # what Ctrl-C sends
        # keep reading while it exits: a full pty would block its last writes (a busy box lets
        # frames pile up while the test was not reading)
        deadline = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < deadline:
            screen += _read_rest(master)
            time.sleep(0.05)
        assert proc.wait(1) == 0
        screen += _read_rest(master)
        assert screen.endswith(b"\x1b[?25h\x1b[?1049l")         # cursor and main screen restored
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        os.close(master)


def _read_rest(fd: int) -> bytes:
    """What a pty holds after its process exited (EIO once it is drained)."""
    rest = b""
    os.set_blocking(fd, False)
    while True:
        try:
            chunk = os.read(fd, 65536)
        except (BlockingIOError, OSError):
            return rest
        if not chunk:
            return rest
        rest += chunk


def test_quantiles_interpolate_like_prometheus():
    inf = float("inf")
    # 10 samples: 4 at <= 0.1, 4 in (0.1, 0.2], 2 beyond the last bound
    q = quantiles(((0.1, 4.0), (0.2, 8.0), (inf, 10.0)))
    assert q["count"] == 10
    assert q["p50"] == pytest.approx(0.1 + 0.1 * (5 - 4) / 4)
    assert q["p99"] == 0.2        # in the +Inf bucket: the highest finite bound
    assert quantiles(((0.1, 0.0), (inf, 0.0)))["p50"] is None


def test_a_few_samples_are_shown_as_measured_not_as_quantiles():
    """One request's TTFT of 0.412 s is one value, not p50 375ms p90 475ms p99 497ms read off its
    bucket (0.25, 0.5]; from FEW_SAMPLES on, quantiles as before."""
    from mooncake_lite.cluster.status import _quantiles
    from mooncake_lite.conductor.cluster.metrics import FEW_SAMPLES, ConductorMetrics
    from mooncake_lite.conductor.cluster.status import Recent, recent_figures
    m = ConductorMetrics()
    for v in (0.412, 0.03):
        m.ttft.observe(v)
    q = recent_figures(Recent(), m, time.monotonic())["ttft_s"]
    assert q == {"p50": None, "p90": None, "p99": None, "count": 2.0, "values": [0.03, 0.412]}
    assert _quantiles(q) == "n=2: 30.0ms  412.0ms"
    for _ in range(FEW_SAMPLES - 2):
        m.ttft.observe(0.2)
    q = recent_figures(Recent(), m, time.monotonic())["ttft_s"]
    assert "values" not in q and q["count"] == FEW_SAMPLES and 0.1 < q["p50"] <= 0.25
    assert _quantiles(q).startswith("p50 ")
    assert recent_figures(Recent(), m, time.monotonic())["tbt_s"] == {"p50": None, "p90": None, "p99": None,
                                                                      "count": 0.0}


def test_the_prediction_lines_show_the_error_and_admissions_spread():
    from mooncake_lite.cluster.status import _prediction_lines
    lines = _prediction_lines({"ttft": {"count": 3, "median_error": 0.2, "p90_error": 0.5, "median_ratio": 1.1},
                               "tbt": {"count": 0},
                               "corrections": {"p0": {"spread": {"ttft": 1.62}}, "d0": {"spread": {"tbt": 2.1}},
                                               "p1": {}}})
    assert lines[1] == "  TBT error   no checked requests"
    assert lines[2] == "  admission spread  d0 TBT x2.10  p0 TTFT x1.62"
    assert "TTFT error   median" in lines[0] and "x1.10  (n=3)" in lines[0]


def test_an_unreachable_conductor_is_named_in_the_error(capsys):
    from mooncake_lite.cluster.status import main
    assert main(["--once", "--conductor", "http://127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert "cannot read the conductor at http://127.0.0.1:1" in err and "--conductor" in err
