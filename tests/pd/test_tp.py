"""Tensor-parallel instances as real processes: a TP=2 prefill and a TP=2 decode give the
monolithic greedy tokens, and either pairs with a TP=1 peer; a rank killed under load fails the
whole instance at once (no hang, a clear error, exit 1 for the supervisor to restart it)."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.model.weights import build_model
from tests.pd.client import generate
from tests.pd.test_e2e import BS, COMMON, check_prompts, prompt, start_many

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


async def test_tp2_prefill_and_decode_match_the_monolithic_tokens(role_procs, model):
    decode, decode1, prefill = start_many(
        role_procs, ("decode", *COMMON, "--num-blocks", "128", "--tp", "2"),
        ("decode", *COMMON, "--num-blocks", "128"),
        ("prefill", *COMMON, "--num-blocks", "64", "--prefill-chunk", "20", "--tensor-parallel", "2"))
    async with aiohttp.ClientSession() as session:
        await check_prompts(session, model, prefill, decode)    # TP=2 → TP=2, prefix reuse included
        for i, p in enumerate((prompt(3 * BS, 1) + prompt(9, 8), prompt(11, 9))):   # TP=2 → TP=1
            out = await generate(session, prefill.url(), decode1.url(), decode1.addresses["data"], p, 5)
            assert out.error is None and out.tokens == reference_greedy(model, p, 5)
            assert out.prefill["num_prefix_tokens"] == (3 * BS if i == 0 else 0)   # a prefix written at TP=2
        async with session.get(f"{decode.url()}/health") as resp:
            assert resp.status == 200
    assert prefill.stop() == 0 and decode.stop() == 0   # the whole group stops cleanly


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["dies", "hangs"])
async def test_a_dead_or_hung_rank_fails_the_whole_instance_without_a_hang(role_procs, model, sig):
    """A rank that dies is seen at once (rank 0 watches its children); one that hangs, at the
    first collective that waits past --tp-timeout."""
    decode, prefill = start_many(role_procs, ("decode", *COMMON, "--num-blocks", "128", "--tp", "2",
                                              "--tp-timeout", "5"),
                                 ("prefill", *COMMON, "--num-blocks", "64"))
    async with aiohttp.ClientSession() as session:
        runs = [asyncio.ensure_future(generate(session, prefill.url(), decode.url(), decode.addresses["data"],
                                               prompt(BS + i, i), 400)) for i in range(3)]
        await asyncio.sleep(3.0)   # under load: the three are decoding
        (follower,) = [p for p in _children(decode.proc.pid) if "spawn_main" in _cmdline(p)]
        os.kill(follower, sig)
        t0 = time.monotonic()
        try:
            outs = await asyncio.wait_for(asyncio.gather(*runs), timeout=60)
            assert time.monotonic() - t0 < 30
            for out in outs:
                assert out.finish_reason == "error" and "tensor-parallel" in (out.error or "")
            assert decode.proc.wait(timeout=60) == 1   # exits to be restarted whole, never one rank alone
        finally:
            if os.path.exists(f"/proc/{follower}"):
                os.kill(follower, signal.SIGKILL)


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def test_a_degree_that_does_not_divide_the_model_refuses_to_start_naming_the_shapes():
    out = subprocess.run([sys.executable, "-m", "mooncake_lite", "--role", "decode", "--model", "tiny", "--tp", "3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--tensor-parallel: tensor-parallel degree 3 does not divide model 'tiny': num_heads 4" in out.stderr
