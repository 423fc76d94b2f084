"""A CPP group whose stages are started apart, as separate ``mooncake`` processes on their own
ports (as their own units on other nodes would be): the head dials them, retrying until they are
up; tokens equal the monolithic reference; each stage writes its layer slice of new blocks and
the store assembles them, so a second request with the same prefix loads them; the prompt's
logprobs come from the last stage; the head has a cost model profiled through the whole group
(the one it registers)."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest
import torch

from mooncake_lite.common.launch import RoleProcess, role_argv
from mooncake_lite.common.ports import free_port
from mooncake_lite.instance.profile import QUICK_PREFILL
from mooncake_lite.model.generate import full_recompute_logits, reference_greedy
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.config import Config
from mooncake_lite.prefill.pipeline import NextStage, NullSender, StageServer, StageUnreachable
from mooncake_lite.prefill.stage_process import GroupMismatch, check_group
from tests.conftest import REPO
from tests.pd.client import generate
from tests.store.helpers import metric

pytestmark = pytest.mark.timeout(180)

BS = 16
BASE = ("--host", "127.0.0.1", "--model", "tiny", "--block-size", str(BS), "--port", "0", "--threads", "1",
        "--num-blocks", "64")
GROUP = (*BASE, "--prefill-chunk", "12", "--pipeline-group", "3")


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def procs():
    started: list[RoleProcess] = []
    yield started
    for proc in started:      # all drain at once
        proc.send(signal.SIGTERM)
    for proc in reversed(started):
        proc.stop()


def launch(procs: list, name: str, role: str, *args: str) -> RoleProcess:
    """Start a role without waiting for its ready line (several then load their models at once)."""
    proc = RoleProcess(name, role_argv(role, *args), cwd=REPO)
    procs.append(proc)
    return proc


async def test_stages_started_apart_give_reference_tokens_and_assemble_blocks_in_the_store(procs):
    store = launch(procs, "store", "store", "--host", "127.0.0.1", "--port", "0", "--data-port", "0",
                   "--dram", "16MiB", "--slot-bytes", "64KiB")
    decode = launch(procs, "decode", "decode", *BASE, "--no-profile")
    store_data = store.wait_ready(60)["data"]
    ports = [free_port(), free_port()]
    stage_at = [f"127.0.0.1:{p}" for p in ports]
    # The head first: it keeps dialling its stages until they answer. Uneven slices (--layers).
    head = launch(procs, "head", "prefill", *GROUP, "--store", store_data, "--layers", "0:2",
                  "--stages", ",".join(stage_at), "--stage-connect-timeout", "60")
    for _ in range(600):     # the stages start only once the head is dialling them in vain
        if "does not answer yet" in head.logs() or head.proc.poll() is not None:
            break
        await asyncio.sleep(0.1)
    assert "does not answer yet" in head.logs(), head.logs()
    launch(procs, "stage 2", "prefill", *GROUP, "--store", store_data, "--no-profile", "--pipeline-stage", "2",
           "--layers", "3:4", "--data-port", str(ports[1]))
    launch(procs, "stage 1", "prefill", *GROUP, "--store", store_data, "--no-profile", "--pipeline-stage", "1",
           "--layers", "2:3", "--data-port", str(ports[0]), "--next-stage", stage_at[1])
    for proc in procs[2:]:
        proc.wait_ready(90)
    model = build_model("tiny", seed=0)
    shared = prompt(3 * BS, 31)
    data = decode.wait_ready(60)["data"]
    async with aiohttp.ClientSession() as session:
        first_toks = shared + prompt(7, 32)
        first = await generate(session, head.out.url("http"), decode.out.url("http"), data, first_toks, 5)
        assert first.error is None and first.tokens == reference_greedy(model, first_toks, 5)
        assert first.prefill["num_prefix_tokens"] == 0
        # Each stage wrote its slice; the store shows the 3 shared blocks only once all three are in.
        url = store.out.url("http")
        for _ in range(100):
            if metric(url, "mooncake_store_blocks_assembled_total") >= 3:
                break
            await asyncio.sleep(0.1)
        assert metric(url, "mooncake_store_blocks_assembled_total") == 3
        assert metric(url, "mooncake_store_slices_total") == 9 and metric(url, "mooncake_store_partial_blocks") == 0
        again_toks = shared + prompt(9, 33)
        again = await generate(session, head.out.url("http"), decode.out.url("http"), data, again_toks, 5)
        assert again.prefill["num_prefix_tokens"] == 3 * BS        # loaded, each stage its own layers
        assert again.tokens == reference_greedy(model, again_toks, 5)
        # Prompt logprobs (echo): the last stage holds the LM head and computes them, chunk by chunk.
        scored = await generate(session, head.out.url("http"), decode.out.url("http"), data, again_toks, 1,
                                sampling={"prompt_logprobs": 2})
        assert scored.prefill["num_prefix_tokens"] == 0           # every position computed, none loaded
        rows = torch.log_softmax(full_recompute_logits(model, again_toks).float(), dim=-1)
        lps = scored.prefill["prompt_logprobs"]
        assert len(lps) == len(again_toks) - 1
        for i, lp in enumerate(lps):
            assert lp["logprob"] == pytest.approx(float(rows[i, again_toks[i + 1]]), abs=1e-4)
            assert lp["top_ids"] == rows[i].topk(2).indices.tolist()
        async with session.get(f"{head.out.url('http')}/v1/load") as resp:
            cost = (await resp.json())["cost"]
    # a model of its own (registered with the conductor as is), timed through the group: not none
    assert cost is not None and cost["c0"] + 100 * cost["c1"] > 0


async def test_dialling_a_stage_that_never_comes_up_ends_with_a_clear_error():
    port = free_port()
    with pytest.raises(StageUnreachable, match=f"CPP stage at 127.0.0.1:{port} did not answer within 0.3 s"):
        await NextStage.connect(f"127.0.0.1:{port}", None, deadline_s=0.3)


def head(**kw) -> Config:
    return Config(model="tiny", pipeline_group=3, block_size=16, stages="10.0.0.2:7001,10.0.0.3:7001", **kw)


def stage_info(k: int, layers: list[int], **kw) -> dict:
    return {"stage": k, "group": 3, "layers": layers, "model": "tiny", "dtype": "float32", "block_size": 16,
            "kv_compression": "none", "seed": 0, "next": "10.0.0.3:7001" if k == 1 else None, **kw}


@pytest.mark.parametrize("stages, why", [
    ([stage_info(1, [1, 3])], "has 1 stage"),
    ([stage_info(2, [1, 3]), stage_info(1, [3, 4])], "stage 1 at 10.0.0.2:7001: it is --pipeline-stage 2"),
    ([stage_info(1, [2, 3]), stage_info(2, [3, 4])], "do not start where the stage before ends"),
    ([stage_info(1, [1, 3]), stage_info(2, [3, 4], model="small")], "stage 2 at 10.0.0.3:7001: model 'small'"),
    ([stage_info(1, [1, 3]), stage_info(2, [3, 4], block_size=32)], "block_size 32"),
    ([stage_info(1, [1, 2]), stage_info(2, [2, 3])], "end at 3, the model has 4"),
])
def test_the_head_refuses_a_group_that_does_not_fit(stages, why):
    check_group(head(), [stage_info(1, [1, 3]), stage_info(2, [3, 4])])   # the default slices fit
    with pytest.raises(GroupMismatch, match=why):
        check_group(head(), stages)


async def test_group_profile_and_a_lost_upstream_link_leave_nothing_behind():
    """In process, over loopback: the head's profile through a stage (FLUSH, KV to nowhere) fits a
    model and frees everything; a stage whose previous stage vanishes mid-request frees its blocks."""
    from concurrent.futures import ThreadPoolExecutor

    from mooncake_lite.model.runner import ModelRunner
    from mooncake_lite.prefill.engine import StageEngine
    from mooncake_lite.prefill.profiling import profile_served
    from mooncake_lite.transfer.server import server_address, start_server

    def stage(layers):
        runner = ModelRunner(build_model("tiny", seed=0, layer_range=layers), num_blocks=32, block_size=BS)
        return StageEngine(runner, None, ThreadPoolExecutor(1))

    head, last = stage((0, 2)), stage((2, 4))
    server = StageServer(last, None, None)
    listening = await start_server(server, "127.0.0.1", 0, name="stage")
    try:
        link = await NextStage.connect(server_address(listening), None)
        # best of three: a tiny model's forwards take milliseconds, and timed once each inside the
        # loaded suite they were noise enough that the fit kept c3 alone (predict(192, 0) = 0)
        cost, samples = await profile_served(head, link, repeats=3)
        # every start-up shape the stages' 32 blocks hold, the long-context one left out
        assert [x[:2] for x in samples] == [(n + p, p) for n, p in QUICK_PREFILL if n + p <= 32 * BS] != []
        assert len(samples) < len(QUICK_PREFILL) and cost.predict(192, 0) > 0
        for s in (head, last):
            assert s.jobs == {} and s.runner.allocator.num_free == 32
        assert server.works == {}
        tokens = prompt(40, 51)
        job = head.begin("cut", tokens, [], 0, NullSender())
        await link.begin("cut", "", tokens, None, {"max_tokens": 1}, [], 0)
        await link.send_chunk("cut", 0, await head.run_chunk(job, 0, token_ids=tokens[:20]))
        assert last.runner.allocator.num_free < 32
        await link.close()                      # the head is gone, END never comes
        for _ in range(200):
            if not server.works:
                break
            await asyncio.sleep(0.01)
        assert server.works == {} and last.jobs == {} and last.runner.allocator.num_free == 32
        await head.release(job)
    finally:
        listening.close()


def test_a_stage_writing_to_another_store_is_warned_about(caplog):
    stages = [stage_info(1, [1, 3], store="10.0.0.2:8101"), stage_info(2, [3, 4], store="10.0.0.1:8101")]
    check_group(head(), stages, store="10.0.0.1:8101")
    assert "CPP stage 1 writes its layer slices to store 10.0.0.2:8101, this head to 10.0.0.1:8101" in caplog.text
    assert "CPP stage 2" not in caplog.text
