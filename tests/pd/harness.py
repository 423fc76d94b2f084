"""In-process prefill + decode over real loopback sockets (cheap enough for thousands of requests)."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from mooncake_lite.common.protocol import GenerateRequest, PrefillRequest, Sampling
from mooncake_lite.decode.batcher import DecodeBatcher
from mooncake_lite.decode.engine import DecodeEngine
from mooncake_lite.decode.kv_receiver import start_kv_server
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.prefill.engine import StageEngine
from mooncake_lite.prefill.kv_sender import DecodeLinks
from mooncake_lite.prefill.service import PrefillService
from mooncake_lite.prefill.store_io import MemoryStore
from mooncake_lite.prefill.pipeline import NextStage, StageServer
from mooncake_lite.transfer.client import FrameClient
from mooncake_lite.transfer.server import server_address, start_server


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids drawn from a fixed seed (the tiny model's 256-token vocabulary)."""
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class Cluster:
    decode: DecodeEngine
    prefill: PrefillService
    data: str
    server: asyncio.Server

    async def request(self, rid: str, token_ids: list[int], max_tokens: int, kv_timeout_s: float = 30.0,
                      sampling: Sampling | None = None, pack_cap: int = 0,
                      placed: int = 0) -> tuple[list[int], str | None, str | None]:
        """(tokens, finish_reason, error) the way the conductor would collect them; ``placed``:
        its number in one conductor's order (0: not said)."""
        sampling = sampling or Sampling(max_tokens=max_tokens)
        events = self.decode.add_request(GenerateRequest(rid, f"t-{rid}", len(token_ids), sampling, kv_timeout_s))
        result = await self.prefill.prefill(PrefillRequest(rid, f"t-{rid}", tuple(token_ids), self.data, sampling,
                                                           pack_cap=pack_cap, placed=placed,
                                                           placer="c0" if placed else ""))
        tokens = [result.first_token]
        while True:
            ev = await events.get()
            if ev.token is not None:
                tokens.append(ev.token)
            if ev.finish_reason is not None:
                return tokens, ev.finish_reason, ev.error


@contextlib.asynccontextmanager
async def cluster(model, *, block_size: int = 8, chunk: int = 16, decode_blocks: int = 256,
                  prefill_blocks: int = 128, store: MemoryStore | None = None, stage_models=None,
                  prefill_runner: ModelRunner | None = None):
    """``stage_models``: layer slices of ``model`` for an in-process CPP group (stage 0 first);
    ``prefill_runner``: stage 0 computes on it (a TP leader's) instead of a runner of its own."""
    decode_runner = ModelRunner(model, num_blocks=decode_blocks, block_size=block_size)
    engine = DecodeEngine(decode_runner, DecodeBatcher(decode_runner.allocator, block_size),
                          ThreadPoolExecutor(1))
    server = await start_kv_server(engine, "127.0.0.1", 0, None)
    step_task = asyncio.create_task(engine.run())
    links = DecodeLinks(None)

    def make_stage(m, runner=None):
        runner = runner or ModelRunner(m, num_blocks=prefill_blocks, block_size=block_size)
        layer_bytes = 2 * block_size * m.args.num_kv_heads * m.args.head_dim * runner.cache.kv.element_size()
        return StageEngine(runner, store or MemoryStore((m.first_layer, m.end_layer), layer_bytes),
                           ThreadPoolExecutor(1))

    stage_models = stage_models or [model]
    stage = make_stage(stage_models[0], prefill_runner)
    downstream, servers, extra_stages = None, [], []
    for m in reversed(stage_models[1:]):     # last stage first, so each knows its next
        extra_stages.insert(0, StageServer(make_stage(m), links, downstream))
        servers.append(await start_server(extra_stages[0], "127.0.0.1", 0, name="stage"))
        host, port = server_address(servers[-1]).rsplit(":", 1)
        downstream = NextStage(await FrameClient.connect(host, int(port)))
    service = PrefillService(stage, links, block_size=block_size, hash_seed=0, chunk_size=chunk,
                             downstream=downstream)
    try:
        c = Cluster(engine, service, server_address(server), server)
        c.stages = extra_stages
        yield c
    finally:
        for srv in servers:
            srv.close()
        step_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await step_task
        await stage.drain_puts()
        await links.close()
        server.close()
