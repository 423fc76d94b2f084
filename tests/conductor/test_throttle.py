"""A real slowdown (issue #36): a live prefill instance is throttled with a cgroup CPU limit after
start-up, and the conductor's predictions follow it: the online correction raises the model
the scheduler prices that instance with, and the predicted TTFT a client is told rises with it.

The instances run ``--no-profile``: they report no cost model and refine none, so the only
thing that can make the predictions follow is the conductor's own correction. The CPU limit is
cgroup v2's ``cpu.max`` where the ``cpu`` controller is on the unified hierarchy, else v1's
``cpu.cfs_quota_us`` (the same CFS bandwidth limit; this machine mounts ``cpu`` on v1);
without a writable one (not root, a read-only /sys) the test is skipped, saying why."""

from __future__ import annotations

import json
import os
import statistics
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.conductor.test_e2e import COMMON, _wait_ready

pytestmark = pytest.mark.slow

PERIOD_US, QUOTA_US = 10_000, 1_000     # 10% of one CPU, in 10 ms periods (a forward spans many)


class CpuLimit:
    """A child cgroup with a CFS bandwidth limit (v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``)."""

    def __init__(self) -> None:
        self.dir: Path | None = None
        for root, v2 in ((Path("/sys/fs/cgroup"), True), (Path("/sys/fs/cgroup/unified"), True),
                         (Path("/sys/fs/cgroup/cpu"), False)):
            controllers = root / "cgroup.controllers"
            ok = ("cpu" in controllers.read_text().split()) if v2 and controllers.is_file() else \
                (not v2 and (root / "cpu.cfs_quota_us").is_file())
            if ok and os.access(root, os.W_OK):
                self.root, self.v2 = root, v2
                return
        self.root = None

    def apply(self, pid: int) -> None:
        self.dir = self.root / f"mooncake-test-{os.getpid()}"
        self.dir.mkdir(exist_ok=True)
        if self.v2:
            # v2 gives a child the cpu controller only once its parent enables it for children
            control = self.root / "cgroup.subtree_control"
            if "cpu" not in control.read_text().split():
                control.write_text("+cpu")
            (self.dir / "cpu.max").write_text(f"{QUOTA_US} {PERIOD_US}")
        else:
            (self.dir / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.dir / "cpu.cfs_quota_us").write_text(str(QUOTA_US))
        (self.dir / "cgroup.procs").write_text(str(pid))   # the whole process, every thread

    def remove(self) -> None:
        if self.dir is None:
            return
        for pid in (self.dir / "cgroup.procs").read_text().split():
            (self.root / "cgroup.procs").write_text(pid)
        self.dir.rmdir()


@pytest.fixture
def cpu_limit():
    limit = CpuLimit()
    if limit.root is None:
        pytest.skip("no writable cgroup CPU controller (v2 cpu.max or v1 cpu.cfs_quota_us): need root")
    yield limit
    limit.remove()


def _status(url: str) -> dict:
    with urllib.request.urlopen(url + "/internal/v1/status", timeout=10) as resp:
        return json.load(resp)


def _predicted_ttfts(client: openai.OpenAI, prompt: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=2,
                                                          temperature=0, extra_body={"ignore_eos": True})
        out.append(float(raw.headers["X-Mooncake-Predicted-TTFT"]))
    return out


def test_a_throttled_prefill_is_predicted_slower(role_procs, cpu_limit):
    conductor = role_procs("conductor", "--port", "0", "--model", "tiny", "--admission", "none", *COMMON)
    url = conductor.url()
    args = ("--conductor", url, "--model", "tiny", "--threads", "1", "--heartbeat-interval", "0.5",
            "--no-profile", *COMMON)
    with ThreadPoolExecutor(2) as pool:
        started = [pool.submit(role_procs, "prefill", "--instance-id", "p0", *args),
                   pool.submit(role_procs, "decode", "--instance-id", "d0", "--data-port", "0", *args)]
        prefill, _ = (f.result() for f in started)
    _wait_ready(url)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    prompt = "The quick brown fox jumps over the lazy dog; " * 12     # ~540 tokens
    before = _predicted_ttfts(client, prompt, 8)
    scale_before = _status(url)["predictions"]["corrections"]["p0"]["scale"]
    cpu_limit.apply(prefill.pid)
    after = _predicted_ttfts(client, prompt, 24)
    status = _status(url)["predictions"]
    scale_after = status["corrections"]["p0"]["scale"]
    assert scale_after > 2 * scale_before, (scale_before, scale_after, status)
    # the TTFT clients are told follows: the last requests are predicted well above the unthrottled ones
    assert statistics.median(after[-5:]) > 2 * statistics.median(before[-5:]), (before, after)
    print(f"predicted TTFT before {statistics.median(before[-5:]):.4f}s, throttled {statistics.median(after[-5:]):.4f}s;"
          f" scale {scale_before:.3f} -> {scale_after:.3f}; measured/predicted median now "
          f"{status['ttft']['median_ratio']}")
