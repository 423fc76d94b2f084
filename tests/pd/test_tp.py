"""Tensor-parallel instances as real processes: a TP=2 prefill and a TP=2 decode give the
monolithic greedy tokens, and either pairs with a TP=1 peer, as does a TP=4 decode (tiny's two
KV heads replicated over four ranks); a rank killed under load fails the
whole instance at once (no hang, a clear error, exit 1 for the supervisor to restart it), and one
of a CPP group's TP stages fails the whole group."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest

from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.model.weights import build_model
from tests.pd.client import generate
from tests.pd.test_e2e import BS, COMMON, check_prompts, decode_load, prompt, start_many
from tests.real_model import SMOLLM, needs_smollm

pytestmark = pytest.mark.timeout(600)
START_S = 400   # TP groups' ranks, CPP groups' stages, on this shared 2-vCPU box


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


async def test_tp2_prefill_and_decode_match_the_monolithic_tokens(role_procs, model):
    """TP=2 ↔ TP=2, TP=2 → TP=1, TP=2 and TP=1 → TP=4 (each KV head on two decode ranks) and a CPP
    group of TP=2 stages give the reference tokens (a TP=2
    prefill sends each rank's heads as a frame of their own); a prefix the TP=2 prefill wrote to
    the store as two rank slices is reused by a TP=1 prefill and by the CPP group, and one the
    TP=1 prefill wrote by the TP=2 prefill, one the CPP group wrote by the TP=1 prefill."""
    store = role_procs("store", "--port", "0", "--data-port", "0", "--dram", "16MiB", "--slot-bytes", "64KiB")
    on_store = ("--store", store.addresses["data"])
    specs = [("decode", *COMMON, "--num-blocks", "128", "--tp", "2"), ("decode", *COMMON, "--num-blocks", "128"),
             ("prefill", *COMMON, "--num-blocks", "64", "--prefill-chunk", "20", "--tensor-parallel", "2", *on_store),
             ("prefill", *COMMON, "--num-blocks", "64", *on_store),
             ("prefill", *COMMON, "--num-blocks", "64", "--prefill-chunk", "8", "--pipeline-group", "2", "--tp", "2",
              *on_store),
             ("decode", *COMMON, "--num-blocks", "128", "--tp", "4")]
    with ThreadPoolExecutor(len(specs)) as pool:   # 13 processes at once: the CPP group starts stage by stage
        decode, decode1, prefill, prefill1, cpp, decode4 = pool.map(lambda spec: role_procs(*spec, timeout=START_S), specs)
    async with aiohttp.ClientSession() as session:
        # The shared prefix of check_prompts, written by the TP=2 prefill (write-back is asynchronous)
        await _reused(session, model, prefill, decode, prompt(3 * BS, 1) + prompt(4, 7), 0)
        await check_prompts(session, model, prefill, decode)    # TP=2 → TP=2, prefix reuse included
        for i, p in enumerate((prompt(3 * BS, 1) + prompt(9, 8), prompt(11, 9))):   # TP=2 → TP=1
            out = await generate(session, prefill.url(), decode1.url(), decode1.addresses["data"], p, 5)
            assert out.error is None and out.tokens == reference_greedy(model, p, 5)
            assert out.prefill["num_prefix_tokens"] == (3 * BS if i == 0 else 0)   # a prefix written at TP=2
        for p, source in ((prompt(13, 18), prefill), (prompt(3 * BS, 1) + prompt(7, 19), prefill1)):   # → TP=4
            out = await generate(session, source.url(), decode4.url(), decode4.addresses["data"], p, 5)
            assert out.error is None and out.tokens == reference_greedy(model, p, 5)
        # written at TP=2, read at TP=1 (feeding the TP=2 decode); then the other way round
        assert await _reused(session, model, prefill1, decode, prompt(3 * BS, 1) + prompt(6, 10), 3 * BS)
        await _reused(session, model, prefill1, decode1, prompt(2 * BS, 11) + prompt(3, 12), 0)
        assert await _reused(session, model, prefill, decode1, prompt(2 * BS, 11) + prompt(5, 13), 2 * BS)
        # A CPP group of two TP=2 stages (each stage's ranks send and write their own heads of its
        # layers): reads a prefix written at TP=2, writes one the TP=1 prefill reads
        assert await _reused(session, model, cpp, decode1, prompt(3 * BS, 1) + prompt(8, 14), 3 * BS)
        await _reused(session, model, cpp, decode, prompt(2 * BS, 15) + prompt(3, 16), 0)
        assert await _reused(session, model, prefill1, decode1, prompt(2 * BS, 15) + prompt(4, 17), 2 * BS)
        async with session.get(f"{decode.url()}/health") as resp:
            assert resp.status == 200
        await _a_dead_rank_fails_the_cpp_group_whole(session, model, cpp, decode1)
    assert prefill.stop() == 0 and decode.stop() == 0   # the whole groups stop cleanly


async def _a_dead_rank_fails_the_cpp_group_whole(session, model, cpp, decode) -> None:
    """On the cluster above (its CPP group of two TP=2 stages is five processes, and what is
    tested is how they exit): stage 1's follower rank is killed under load; the requests end,
    each with the reference tokens or its error, none hangs; stage 1 exits, and so does the head,
    with 1, for its supervisor to restart the group whole."""
    (stage1,) = [p for p in _children(cpp.proc.pid) if "--pipeline-stage" in _cmdline(p)]
    (follower,) = [p for p in _children(stage1) if "spawn_main" in _cmdline(p)]
    prompts = [prompt(12 * BS + i, 30 + i) for i in range(3)]
    runs = [asyncio.ensure_future(generate(session, cpp.url(), decode.url(), decode.addresses["data"], p, 4))
            for p in prompts]
    await asyncio.sleep(0.5)   # under load: the three are prefilling
    os.kill(follower, signal.SIGKILL)
    t0 = time.monotonic()
    outs = await asyncio.wait_for(asyncio.gather(*runs), timeout=60)   # none hangs
    for p, o in zip(prompts, outs):
        if o.error is None and o.prefill_status == 200:
            assert o.tokens == reference_greedy(model, p, 4)   # done before the kill
        else:
            assert o.error or o.prefill.get("error")   # failed, with its reason
    assert cpp.proc.wait(timeout=60) == 1   # the head: its group cannot prefill any more
    assert time.monotonic() - t0 < 60
    assert not os.path.exists(f"/proc/{stage1}") or _zombie(stage1)   # stage 1 exited, not alone alive


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1].startswith("Z")


async def _reused(session, model, prefill, decode, toks: list[int], expect: int) -> int:
    """Generate ``toks`` until the prefill reuses ``expect`` prefix tokens (the store's
    write-back is asynchronous; 0: once, then until the store holds the prompt's full blocks);
    the tokens must equal the reference each time. The tokens reused."""
    for _ in range(50):
        out = await generate(session, prefill.url(), decode.url(), decode.addresses["data"], toks, 4)
        assert out.error is None and out.tokens == reference_greedy(model, toks, 4)
        reused = out.prefill["num_prefix_tokens"]
        if expect == 0 or reused == expect:
            break
        await asyncio.sleep(0.1)
    if expect == 0:   # wait for the write-back: the next reader should find it
        for _ in range(50):
            again = await generate(session, prefill.url(), decode.url(), decode.addresses["data"], toks, 1)
            if again.prefill["num_prefix_tokens"] == len(toks) // BS * BS:
                break
            await asyncio.sleep(0.1)
    return reused


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
        for _ in range(600):   # under load: the three are decoding (waited for, not a fixed 3 s)
            if (await decode_load(session, decode))["num_running"] == 3:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the three requests never decoded together")
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


@needs_smollm
@pytest.mark.slow
async def test_smollm2_tp1_prefill_feeds_a_tp3_decode_with_the_tp1_tokens(role_procs):
    """SmolLM2 (9 heads, 3 KV heads): a TP=1 prefill's whole-layer frames are cut at a TP=3
    decode's rank 0 into each rank's KV head; the greedy tokens equal the one-process model's."""
    common = ("--model", SMOLLM, "--block-size", str(BS), "--port", "0", "--no-profile", "--threads", "1")
    with ThreadPoolExecutor(2) as pool:
        decode, prefill = pool.map(lambda spec: role_procs(*spec, timeout=START_S), [
            ("decode", *common, "--num-blocks", "16", "--tp", "3"), ("prefill", *common, "--num-blocks", "16")])
    ref = build_model(SMOLLM)
    async with aiohttp.ClientSession() as session:
        for p in (prompt(2 * BS + 5, 31), prompt(9, 32)):
            out = await generate(session, prefill.url(), decode.url(), decode.addresses["data"], p, 6)
            assert out.error is None and out.tokens == reference_greedy(ref, p, 6)
