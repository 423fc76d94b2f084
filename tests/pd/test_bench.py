"""`mooncake bench pd` runs end to end on a tiny setup and its profile loads in the simulator."""

import subprocess
import sys

import orjson
import pytest

from mooncake_lite.bench.pd.cli import main, parse_args, profile_dict
from mooncake_lite.sim.costs import load_profile
from tests.conftest import REPO
from tests.real_model import SMOLLM

pytestmark = pytest.mark.timeout(240)


def test_bench_pd_json_and_profile(tmp_path):
    profile = tmp_path / "tiny.json"
    out = subprocess.run([sys.executable, "-m", "mooncake_lite", "bench", "pd", "--models", "tiny",
                          "--prompt-len", "128", "--chunk", "64", "--repeats", "1", "--batch-sizes", "1,2",
                          "--context-len", "64", "--no-cpp", "--threads", "1", "--json", "--profile", str(profile),
                          "--burst", "4", "--burst-len", "20", "--burst-tokens", "64"],
                         cwd=REPO, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    res = orjson.loads(out.stdout)
    tiny = res["models"]["tiny"]
    assert tiny["overlap"]["kv_bytes"] == 128 * 1024 and tiny["overlap"]["transfer_s"] > 0
    o = tiny["overlap"]
    assert o["forward_s"] > 0 and o["served_over_forward"] == pytest.approx(o["compute_compute_only_s"] / o["forward_s"])
    assert [r["cached_tokens"] for r in tiny["prefix"]] == [0, 0, 64, 64]   # whole 64-token blocks only
    assert [r["batch"] for r in tiny["decode"]] == [1, 2]
    assert tiny["source"]["kind"] == "preset" and tiny["source"]["load_s"] > 0
    burst = tiny["burst"]     # (e): 4 prompts of 20 tokens, 64 tokens a forward: packed
    assert burst["prompts"] == 4 and burst["packed_forwards"] >= 1 and burst["mean_ratio"] > 0
    hw = load_profile(profile)
    saved = orjson.loads(profile.read_bytes())
    assert hw.name == "tiny-cpu" and hw.kv_bytes_per_token == 1024 and saved["block_size"] == 64
    assert hw.network_bytes_per_s == saved["bandwidth_bytes_per_s"] > 0
    assert hw.prefill.to_dict() == tiny["cost"]["prefill"] and hw.decode.to_dict() == tiny["cost"]["decode"]


def test_any_model_spec_is_accepted_and_prompt_lengths_follow_it(tmp_path):
    a = parse_args([])
    assert a.models == ["tiny", SMOLLM] and a.prompt_lens == {"tiny": 1024, SMOLLM: 256}
    assert a.cpp_lens == {"tiny": 4096, SMOLLM: 512}
    assert parse_args(["--cpp-prompt-factor", "3"]).cpp_lens == {"tiny": 3072, SMOLLM: 768}
    a = parse_args(["--models", f"{SMOLLM},small,/ckpt/m=1.gguf", "--prompt-len", f"{SMOLLM}=128,/ckpt/m=1.gguf=64"])
    assert a.prompt_lens == {SMOLLM: 128, "small": 512, "/ckpt/m=1.gguf": 64}
    assert parse_args(["--models", SMOLLM, "--prompt-len", "96"]).prompt_lens == {SMOLLM: 96}
    for bad in (["--prompt-len", "tiny=x"], ["--prompt-len", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    part = {"cost": {"prefill": {}, "decode": {}}, "overlap": {"stream_gbps": 1.0}}
    gguf = tmp_path / "SmolLM2.gguf"
    gguf.write_bytes(b"")
    assert profile_dict(str(gguf), part)["name"] == "SmolLM2-cpu"     # named as the cluster serves it
    assert profile_dict("tiny", part)["name"] == "tiny-cpu"


def test_a_bad_model_is_an_error_before_any_measuring(capsys, tmp_path):
    assert main(["--models", "no-such-preset", "--no-cpp"]) == 2
    assert "unknown model preset" in capsys.readouterr().err
    assert main(["--models", str(tmp_path / "none.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cached_prefix_is_stored_in_the_cache_dtype(dtype):
    """(b) caches the prompt's blocks in the store at the cache's bytes per layer: on CUDA the
    cache is bfloat16, and blocks drawn in float32 were twice the store's size (the first GPU
    run's `bench pd` failed so)."""
    import asyncio
    from types import SimpleNamespace

    import torch

    from mooncake_lite.bench.pd.overlap import BLOCK, measure_prefix
    from mooncake_lite.model.runner import ModelRunner
    from mooncake_lite.model.weights import build_model
    from mooncake_lite.prefill.store_io import MemoryStore

    model = build_model("tiny", dtype=getattr(torch, dtype))
    runner = ModelRunner(model, num_blocks=8, block_size=BLOCK)
    layer_bytes = runner.cache.kv[0].numel() // runner.cache.num_blocks * runner.cache.kv.element_size()
    store = MemoryStore((0, model.args.num_layers), layer_bytes)

    async def run(mode, hit=0):
        return {"ttft_s": 1.0 + hit}
    rig = SimpleNamespace(tokens=list(range(3 * BLOCK)), runner=runner, layer_bytes=layer_bytes, store=store, run=run)
    rows = asyncio.run(measure_prefix(rig, repeats=1))
    assert len(store) == 3 and [r["cached_tokens"] for r in rows] == [0, 0, BLOCK, 2 * BLOCK]
