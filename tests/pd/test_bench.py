"""`mooncake bench pd` runs end to end on a tiny setup and its profile loads in the simulator."""

import subprocess
import sys

import orjson
import pytest

from mooncake_lite.sim.costs import load_profile
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(240)


def test_bench_pd_json_and_profile(tmp_path):
    profile = tmp_path / "tiny.json"
    out = subprocess.run([sys.executable, "-m", "mooncake_lite", "bench", "pd", "--models", "tiny",
                          "--prompt-len", "128", "--chunk", "64", "--repeats", "1", "--batch-sizes", "1,2",
                          "--context-len", "64", "--no-cpp", "--threads", "1", "--json", "--profile", str(profile)],
                         cwd=REPO, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    res = orjson.loads(out.stdout)
    tiny = res["models"]["tiny"]
    assert tiny["overlap"]["kv_bytes"] == 128 * 1024 and tiny["overlap"]["transfer_s"] > 0
    assert [r["cached_tokens"] for r in tiny["prefix"]] == [0, 0, 64, 64]   # whole 64-token blocks only
    assert [r["batch"] for r in tiny["decode"]] == [1, 2]
    hw = load_profile(profile)
    saved = orjson.loads(profile.read_bytes())
    assert hw.name == "tiny-cpu" and hw.kv_bytes_per_token == 1024 and saved["block_size"] == 64
    assert hw.network_bytes_per_s == saved["bandwidth_bytes_per_s"] > 0
    assert hw.prefill.to_dict() == tiny["cost"]["prefill"] and hw.decode.to_dict() == tiny["cost"]["decode"]
