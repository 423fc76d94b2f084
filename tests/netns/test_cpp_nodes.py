"""Issue #16 item 2 across nodes: a CPP group whose head and stage run on two nodes joined by a
shaped link, each bound to its node's address, the stage started on its own by the command of
docs/systemd/mooncake-prefill-stage.service and its node's TOML. Activations cross
the link; the stage writes its layer slice of new blocks to the store on the head's node, which
assembles them; the next request with the same prefix loads them, and tokens equal the reference."""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import pytest
import torch

from mooncake_lite.cluster.netns import Link, Nodes
from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.model.weights import build_model
from tests.netns.conftest import needs_netns
from tests.netns.systemd_cluster import CONFIG_PATH, ENV_PATH, UNITS, dump_toml, local_command
from tests.netns.units import read_unit
from tests.pd.client import generate
from tests.store.helpers import metric

pytestmark = [needs_netns, pytest.mark.timeout(180)]
BS = 16
STAGE_PORT = 7400


def role(node, name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "mooncake_lite", "--role", name, "--host", node.address, "--port", "0", *args]


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def stage_unit(far, store_data: str, tmp_path) -> tuple[list[str], dict]:
    """The stage unit's command and environment, with the stage node's /etc/mooncake files."""
    toml, env = tmp_path / "mooncake.toml", tmp_path / "mooncake.env"
    toml.write_text(dump_toml({"cluster": {"host": far.address}, "prefill": {
        "model": "tiny", "block_size": BS, "threads": 1, "num_blocks": 64, "profile": False, "port": 0,
        "prefill_chunk": 12, "pipeline_group": 2, "pipeline_stage": 1, "data_port": STAGE_PORT,
        "store": store_data}}))
    env.write_text("")
    unit = read_unit(UNITS / "mooncake-prefill-stage.service", {CONFIG_PATH: str(toml), ENV_PATH: str(env)})
    return local_command(unit.exec_start), unit.env


def test_head_and_stage_on_two_nodes(tmp_path):
    model_args = ("--model", "tiny", "--block-size", str(BS), "--threads", "1", "--num-blocks", "64", "--no-profile")
    group = (*model_args, "--prefill-chunk", "12", "--pipeline-group", "2")
    with Nodes.create(2, Link.parse("1gbit")) as nodes:
        near, far = nodes[0], nodes[1]
        store = nodes.start(near, "store", role(near, "store", "--data-port", "0", "--dram", "16MiB",
                                                "--slot-bytes", "64KiB"))
        stage_at = f"{far.address}:{STAGE_PORT}"
        # Started at once, in no particular order: the head dials its stage until it answers.
        head = nodes.start(near, "head", role(near, "prefill", *group, "--store", store.addresses["data"],
                                              "--stages", stage_at), timeout=None)
        argv, env = stage_unit(far, store.addresses["data"], tmp_path)
        nodes.start(far, "stage", argv, env=env, cwd=tmp_path, timeout=None)
        decode = nodes.start(near, "decode", role(near, "decode", *model_args), timeout=None)
        for proc in (head, decode):
            proc.wait_ready(120)
        asyncio.run(_requests(head, decode, store.out.url("http")))


async def _requests(head, decode, store_url: str) -> None:
    model = build_model("tiny", seed=0)
    shared = prompt(2 * BS, 41)
    urls = (head.out.url("http"), decode.out.url("http"), decode.addresses["data"])
    async with aiohttp.ClientSession() as session:
        toks = shared + prompt(5, 42)
        first = await generate(session, *urls, toks, 4)
        assert first.error is None and first.tokens == reference_greedy(model, toks, 4)
        for _ in range(100):     # write-back is asynchronous; the stage's half comes over the link
            if metric(store_url, "mooncake_store_blocks_assembled_total") >= 2:
                break
            await asyncio.sleep(0.1)
        assert metric(store_url, "mooncake_store_blocks_assembled_total") == 2
        toks = shared + prompt(6, 43)
        again = await generate(session, *urls, toks, 4)
        assert again.prefill["num_prefix_tokens"] == 2 * BS and again.tokens == reference_greedy(model, toks, 4)
