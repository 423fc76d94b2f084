"""``mooncake up`` with the real roles: the official openai client gets completions through the
cluster, a trace slice replays with prefix hits, and Ctrl-C-style shutdown leaves no process."""

import random
import re
import signal
import urllib.error
import urllib.request

import orjson
import pytest

from tests.cluster.helpers import read_until, start_up, wait_gone
from tests.conftest import TRACE, needs_trace

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.timeout(420), needs_trace]
KEY = "sk-up-test"


def test_up_serves_openai_client_replays_with_hits_and_stops_clean(tmp_path, capsys):
    from mooncake_lite.bench.replay.cli import main as replay_main

    # a random hash seed is on every child's command line: it finds leftovers, and nothing else has it
    tag = str(random.randrange(10**8, 10**9))
    # Admission off: this test is about serving and shutdown; SLO admission has its own tests, and
    # start-up profiles on a busy CI CPU can predict an idle cluster's TBT above the 200 ms SLO.
    proc = start_up("--model", "tiny", "--hash-seed", tag, "--block-size", "16", "--api-key", KEY, "--cluster-token", "tok-up",
                    "--conductor-args", "--admission none", fake=False)
    try:
        banner = read_until(proc, "Ctrl-C stops every process", timeout=300)
        api = re.search(r"OpenAI-compatible API: (http://\S+/v1)", banner).group(1)
        assert len([ln for ln in banner.splitlines() if " pid " in ln]) == 4

        client = openai.OpenAI(base_url=api, api_key=KEY, max_retries=0, timeout=120)
        done = client.completions.create(model="tiny", prompt="The moon is", max_tokens=8, temperature=0)
        assert done.choices[0].finish_reason in ("length", "stop") and 1 <= done.usage.completion_tokens <= 8
        chunks = list(client.completions.create(model="tiny", prompt="The moon is", max_tokens=8,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text  # greedy: same
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=api, api_key="wrong", max_retries=0).completions.create(
                model="tiny", prompt="x", max_tokens=1)

        # internal endpoints want the cluster token: a stranger cannot register or post block events
        base = api.removesuffix("/v1")
        for headers in ({}, {"X-Mooncake-Token": "guess"}):
            req = urllib.request.Request(base + "/internal/v1/register", data=b"{}", headers=headers)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(req, timeout=30)
            assert refused.value.code == 403
        with urllib.request.urlopen(base + "/health", timeout=30) as resp:   # /health stays open
            assert orjson.loads(resp.read())["ready"] is True

        # 10 requests at t=0 and 4 at t=3 s, all sharing hash id 0 (32 tokens = 2 cluster blocks)
        rc = replay_main(["--trace", str(TRACE), "--base-url", api.removesuffix("/v1"), "--api-key", KEY,
                          "--max-requests", "14", "--block-tokens", "32", "--max-output-tokens", "4",
                          "--output-dir", str(tmp_path), "--no-progress", "--no-plot", "--json"])
        assert rc == 0
        summary = orjson.loads(capsys.readouterr().out)
        assert summary["metrics"]["completed"] + summary["metrics"]["num_rejected_429"] == 14
        assert summary["metrics"]["completed"] > 0 and summary["metrics"]["num_failed"] == 0
        assert summary["cache"]["cache_hit_rate"] > 0

        proc.send_signal(signal.SIGINT)   # what Ctrl-C delivers
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "tok-up" not in err and "[decode-0]" in err
    assert wait_gone(f"--hash-seed {tag}") == []
