"""``mooncake sim export-costs`` (issue #20 item 3): a running cluster's own cost models, read
from its conductor, written as a ``--cost-model`` file the simulator loads as is."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import orjson
import pytest

from mooncake_lite.common.auth import cluster_headers
from mooncake_lite.common.protocol import BlockEvents, Heartbeat, Register, StoreCapacity, dumps
from mooncake_lite.conductor.app import make_app
from mooncake_lite.conductor.config import Config
from mooncake_lite.scheduler.costs import PrefillCostModel
from mooncake_lite.sim.cli import main as sim_main
from mooncake_lite.sim.costs import load_profile

pytestmark = pytest.mark.timeout(60)
TOKEN = "s3cret"
KV_BYTES = 1024
PREFILLS = {"p0": {"c0": 0.010, "c1": 1e-4, "c2": 1e-8, "c3": 0.0},
            "p1": {"c0": 0.020, "c1": 3e-4, "c2": 3e-8, "c3": 1e-6},
            "p2": {"c0": 0.030, "c1": 2e-4, "c2": 2e-8, "c3": 2e-6}}
DECODES = {"d0": {"c0": 0.004, "c1": 1e-4, "c2": 1e-7}, "d1": {"c0": 0.006, "c1": 3e-4, "c2": 3e-7}}


def registration(role: str, iid: str, cost: dict, max_context: int) -> Register:
    return Register(role=role, instance_id=iid, http=f"127.0.0.1:{9000 + len(iid)}",
                    data="127.0.0.1:1" if role == "decode" else None, store="s:1" if role == "prefill" else None,
                    model="tiny", block_size=4, hash_seed=0, kv_bytes_per_token=KV_BYTES,
                    max_context=max_context, cost=cost)


async def export(url: str, out, *extra: str) -> int:
    # the command is synchronous (urllib): run it beside the loop that serves the conductor
    return await asyncio.get_running_loop().run_in_executor(
        None, sim_main, ["export-costs", "--conductor", url, "-o", str(out), *extra])


async def test_export_from_a_live_conductor_loads_back_in_the_simulator(aiohttp_server, tmp_path, capsys):
    server = await aiohttp_server(make_app(Config(model="tiny", block_size=4, cluster_token=TOKEN)))
    url = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession(headers=cluster_headers(TOKEN)) as s:
        async def post(path, msg):
            async with s.post(url + path, data=dumps(msg)) as r:
                assert r.status == 200, await r.text()
        for iid, cost in PREFILLS.items():
            await post("/internal/v1/register", registration("prefill", iid, cost, 4096))
        for (iid, cost), capacity in zip(DECODES.items(), (2048, 8192)):
            await post("/internal/v1/register", registration("decode", iid, cost, capacity))
        # p2's profile is refined by a heartbeat: the export has the current model, not the start-up one
        PREFILLS["p2"] = {"c0": 0.015, "c1": 2e-4, "c2": 2e-8, "c3": 0.0}
        await post("/internal/v1/heartbeat", Heartbeat("p2", {}, PREFILLS["p2"]))
        # the prefills' store says what it holds: the simulated store holds as many tokens
        await post("/internal/v1/block_events", BlockEvents("s:1", full=True, capacity=StoreCapacity(2465, 0, "lfu")))

    out = tmp_path / "costs.json"
    assert await export(url, out) == 2                  # the cluster token guards it
    assert "answered 403" in capsys.readouterr().err and not out.exists()
    assert await export(url, out, "--token", TOKEN) == 0
    assert "from 5 live instance(s)" in capsys.readouterr().out

    hw = load_profile(out)
    # the coefficient-wise median over the live instances of each role
    assert hw.prefill == PrefillCostModel(c0=0.015, c1=2e-4, c2=2e-8, c3=0.0)
    assert hw.decode.to_dict() == pytest.approx({"c0": 0.005, "c1": 2e-4, "c2": 2e-7})   # two: their mean
    assert hw.kv_bytes_per_token == KV_BYTES and hw.decode_max_context_tokens == 5120
    assert (hw.store_blocks_per_node, hw.ssd_blocks_per_node, hw.eviction) == (2465, 0, "lfu")
    assert hw.dram_blocks() == 2465 * 4 // hw.block_size     # slots of the cluster's 4-token blocks
    data = orjson.loads(out.read_bytes())
    # no instance measures its link yet: the conductor's prior, and the file says so
    assert data["network_bytes_per_s_measured"] is False and hw.network_bytes_per_s == data["network_bytes_per_s"] > 0
    assert {i["instance_id"]: i["cost"] for i in data["instances"]} == {**PREFILLS, **DECODES}
    assert all(i["reported"] for i in data["instances"])


def test_an_unreachable_conductor_is_a_clean_error(tmp_path, capsys):
    assert sim_main(["export-costs", "--conductor", "http://127.0.0.1:9", "-o", str(tmp_path / "x.json"),
                     "--timeout", "2"]) == 2
    assert "mooncake sim export-costs: error:" in capsys.readouterr().err


async def test_the_export_splits_a_decodes_steps_by_the_prefill_beside_it(aiohttp_server):
    """Co-location (issue #20 item 4): the conductor reads each instance's ``/v1/timeline`` and
    exports the decode's slowdown beside a computing prefill on its host, and the spread of its
    gaps alone; a prefill on another host does not count."""
    from aiohttp import web

    from tests.instance.test_colocation import timeline

    def role_app(body):
        async def answer(request):
            return web.json_response(body)
        app = web.Application()
        app.router.add_get("/v1/timeline", answer)
        return app
    model = {"c0": 0.01, "c1": 0.0, "c2": 0.0}
    decode = await aiohttp_server(role_app({"host": "box", "steps": timeline(busy=(0.5, 1.25), beside=0.03)}))
    here = await aiohttp_server(role_app({"host": "box", "forwards": [[0.5, 1.25]]}))
    elsewhere = await aiohttp_server(role_app({"host": "other", "forwards": [[0.0, 0.5]]}))
    conductor = await aiohttp_server(make_app(Config(model="tiny", block_size=4)))
    url = f"http://127.0.0.1:{conductor.port}"
    async with aiohttp.ClientSession() as s:
        for role, iid, srv in (("decode", "d0", decode), ("prefill", "p0", here), ("prefill", "p1", elsewhere)):
            reg = dataclasses.replace(registration(role, iid, model if role == "decode" else PREFILLS["p0"], 4096),
                                      http=f"127.0.0.1:{srv.port}")
            async with s.post(url + "/internal/v1/register", data=dumps(reg)) as r:
                assert r.status == 200, await r.text()
        async with s.get(url + "/internal/v1/cost_model") as r:
            profile = await r.json()
    assert profile["decode_colocated_slowdown"] == pytest.approx(3.0, rel=0.02)
    assert profile["decode_step_ratios"] == pytest.approx([1.0] * 10)          # the gaps alone
    split = profile["colocation"]["d0"]
    assert profile["decode_busy_step_ratios"] == split["busy_ratios"] == pytest.approx([3.0] * 10, rel=0.05)
    assert split["gaps_busy"] == 25 and split["gaps_idle"] == 74
