"""A conductor app (in-process, 127.0.0.1) with fake prefill/decode instances around it."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import pytest

from mooncake_lite.conductor.app import make_app
from mooncake_lite.conductor.config import Config
from tests.conductor import fakes
from tests.conductor.fakes import FakeInstance


@dataclasses.dataclass
class Cluster:
    url: str
    app: object
    session: aiohttp.ClientSession
    instances: dict[str, FakeInstance]
    aiohttp_server: object

    @property
    def svc(self):
        from mooncake_lite.conductor.api.state import API
        return self.app[API].svc

    async def add(self, role: str, instance_id: str, *, register: bool = True, **kw) -> FakeInstance:
        inst = FakeInstance(role, instance_id, **kw)
        inst.server = await self.aiohttp_server(inst.make_app())
        self.instances[instance_id] = inst
        if register:
            status, body = await fakes.register(self.session, self.url, inst)
            assert status == 200, body
        return inst


@pytest.fixture
async def make_cluster(aiohttp_server):
    """``cluster = await make_cluster(prefill=1, decode=1, **config_overrides)``."""
    made: list[tuple[Cluster, asyncio.Task]] = []

    async def _make(prefill: int = 1, decode: int = 1, **overrides) -> Cluster:
        cfg = Config(**{"model": "tiny", "block_size": 4, "dead_after": 2.0, "admission": "none", **overrides})
        app = make_app(cfg)
        server = await aiohttp_server(app)
        session = aiohttp.ClientSession()
        cluster = Cluster(f"http://127.0.0.1:{server.port}", app, session, {}, aiohttp_server)
        for i in range(prefill):
            await cluster.add("prefill", f"p{i}", store=f"store{i}:1")
        for i in range(decode):
            await cluster.add("decode", f"d{i}")

        async def beat() -> None:
            while True:
                for inst in list(cluster.instances.values()):
                    if inst.is_heartbeating:
                        await fakes.heartbeat(session, cluster.url, inst)
                await asyncio.sleep(0.05)

        made.append((cluster, asyncio.get_running_loop().create_task(beat())))
        return cluster

    yield _make
    # aiohttp_server tears the servers down; stop our loops first
    for cluster, task in made:
        task.cancel()
        await cluster.session.close()
