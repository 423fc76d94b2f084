"""A tensor-parallel instance's ranks: rank 0 is the instance process itself; it starts ranks
1..N-1 as child processes, each loading its share of the model and then following rank 0's steps
(``model/tp_step.py``), and they start and stop as one.

Start: every rank loads its slices, the ranks meet (gloo or NCCL, waiting at most
``--tp-timeout`` for the slowest loader), and each tells the others what it holds (the model's
shapes, the degree, its own shapes, a checksum of its replicated weights): any difference and
every rank refuses to start, naming the shapes. Stop: rank 0 tells the followers to exit; its
children are also ended with it (they are daemonic), and a follower whose parent is gone exits
at once. A prefill's follower sends its heads of each computed layer to the decode on data
connections of its own (``transfer/rank_streams.py``) and, given a store (``RankPlan.rank_store``),
reads and writes its heads there on a connection of its own (``prefill/rank_store.py``). Failure is whole-instance: a follower
that exits makes rank 0's watchdog break the group, the instance reports unhealthy and exits 1
(``mooncake up`` restarts it whole), and every step from then on fails with the reason; a hung
rank does the same through the collectives' timeout.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import orjson
import torch
from aiohttp import web

from mooncake_lite.common.lifecycle import EXIT
from mooncake_lite.instance.config import ModelRoleConfig
from mooncake_lite.instance.handlers import UNHEALTHY
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.tensor_parallel import TPLayout
from mooncake_lite.common.ports import free_port
from mooncake_lite.model.tp_comms import GroupAddress, TPComms, backend_for
from mooncake_lite.model.tp_follower import Follower
from mooncake_lite.model.tp_step import TPLeaderRunner, build_rank_runner
from mooncake_lite.model.weights import model_args
from mooncake_lite.transfer.rank_streams import RankStreams

log = logging.getLogger(__name__)
WATCH_S = 0.2   # how often rank 0 looks at its followers, and a follower at its parent


@dataclass(frozen=True)
class RankPlan:
    """What every rank of one instance builds (sent to the followers at their start)."""
    model: str
    dtype: str
    seed: int
    devices: tuple[str, ...]           # rank r's torch device
    threads: int | None
    layer_range: tuple[int, int] | None
    num_blocks: int
    block_size: int
    address: GroupAddress
    expert_parallel: bool = False      # --moe-layout placed
    token: str | None = None           # the cluster's: a prefill rank's own data connections
    # How a follower opens its own store (a prefill's, ``prefill/rank_store.follower_stores``:
    # passed in, as this layer knows no store): called with the rank's runner and layout. None:
    # rank 0 reads and writes every rank's heads.
    rank_store: Callable[[ModelRunner, TPLayout], object] | None = None

    def runner(self, rank: int) -> tuple[ModelRunner, TPComms, TPLayout]:
        from mooncake_lite.model.args import DTYPES
        layout = TPLayout(model_args(self.model), self.address.size, rank, expert_parallel=self.expert_parallel)
        comms = TPComms(self.address, rank, self.devices[rank])
        runner = build_rank_runner(self.model, comms, layout, num_blocks=self.num_blocks, block_size=self.block_size,
                                   device=self.devices[rank], dtype=DTYPES[self.dtype], layer_range=self.layer_range,
                                   seed=self.seed)
        comms.join()
        check_same(comms, runner, layout)
        return runner, comms, layout


def rank_devices(cfg: ModelRoleConfig) -> tuple[str, ...]:
    """One device per rank: ``--devices 0,1`` on CUDA, else every rank on ``--device``."""
    n = cfg.tensor_parallel
    if cfg.devices is None:
        return (cfg.device,) * n
    return tuple(f"cuda:{d}" for d in cfg.devices[:n])


def describe(runner: ModelRunner, layout: TPLayout) -> dict:
    """What a rank holds: the model's shapes, the degree, its own shapes and a checksum of the
    weights every rank holds whole (the norms; the embedding on the first stage)."""
    model = runner.model
    whole = [p for n, p in model.named_parameters() if "norm" in n or n.startswith("tok_embeddings")]
    # A digest of the bytes, not a float sum: a sum's rounding depends on the threads summing it,
    # and ranks on different thread counts (a benchmark's rank 0) differed in the last digit.
    digest = hashlib.blake2b(digest_size=16)
    for p in whole:
        if p.device.type != "meta":
            digest.update(p.detach().contiguous().cpu().view(torch.uint8).numpy().data)
    return {"model": asdict(layout.args), "tp": layout.size, "local": asdict(runner.model.args),
            "checksum": digest.hexdigest()}


def check_same(comms: TPComms, runner: ModelRunner, layout: TPLayout) -> None:
    """Every rank's :func:`describe` against rank 0's; ValueError naming the first difference."""
    mine = describe(runner, layout)
    descriptions = [orjson.loads(comms.broadcast_bytes(orjson.dumps(mine) if r == comms.rank else None, src=r))
                    for r in range(comms.size)]
    for r, d in enumerate(descriptions[1:], start=1):
        for key in ("model", "tp", "checksum"):
            if d[key] != descriptions[0][key]:
                raise ValueError(f"tensor-parallel rank {r} holds {key} {d[key]}, rank 0 holds "
                                 f"{descriptions[0][key]}: the ranks must load the same model")


def _follower_main(plan: RankPlan, rank: int, threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    parent = os.getppid()

    def orphaned() -> None:   # rank 0 gone: nothing to follow, exit now rather than at a timeout
        while os.getppid() == parent:
            time.sleep(WATCH_S)
        os._exit(1)
    threading.Thread(target=orphaned, daemon=True).start()
    runner, comms, layout = plan.runner(rank)
    store = None if plan.rank_store is None else plan.rank_store(runner, layout)
    Follower(comms, runner, layout, RankStreams(plan.token), store).run()
    # Told to stop: exit now. Tearing the group down would wait on rank 0, which is joining us.
    logging.shutdown()
    os._exit(0)


class TPGroup:
    """Rank 0's handle on its followers: started with the instance, watched, stopped with it."""

    def __init__(self, plan: RankPlan):
        ctx = mp.get_context("spawn")   # a fresh interpreter: no forked torch or event-loop state
        self.procs = [ctx.Process(target=_follower_main, args=(plan, r, plan.threads), daemon=True,
                                  name=f"tp-rank-{r}") for r in range(1, plan.address.size)]
        for p in self.procs:
            p.start()
        try:
            self.runner, self.comms, _ = plan.runner(0)
        except BaseException:
            self.kill()
            raise
        assert isinstance(self.runner, TPLeaderRunner)
        self.runner.tp_group = self
        self.runner.ranks_store = plan.rank_store is not None
        self.leader = self.runner.leader
        self.leader.start_ticker()
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while self.leader.broken is None:
            for r, p in enumerate(self.procs, start=1):
                if not p.is_alive():
                    self.leader.break_(f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.exitcode}")
                    return
            time.sleep(WATCH_S)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def stop(self) -> None:
        self.leader.stop()
        for p in self.procs:
            p.join(timeout=5)
        self.kill()
        self.comms.close()


def start_group(cfg: ModelRoleConfig, layer_range: tuple[int, int] | None, num_blocks: int,
                threads: int, rank_store: Callable | None = None) -> TPGroup:
    """Rank 0 of ``cfg``'s instance, its followers started, each rank on ``threads`` threads
    (opening stores of their own with ``rank_store``, :attr:`RankPlan.rank_store`)."""
    plan = RankPlan(cfg.model, cfg.dtype, cfg.seed, rank_devices(cfg), threads, layer_range, num_blocks,
                    cfg.block_size, GroupAddress("127.0.0.1", free_port(), cfg.tensor_parallel, cfg.tp_timeout,
                                                 backend_for(rank_devices(cfg))), cfg.expert_parallel,
                    cfg.cluster_token, rank_store)
    log.info("tensor-parallel group of %d ranks on %s", cfg.tensor_parallel, ",".join(plan.devices))
    return TPGroup(plan)


def watch_tensor_parallel(app: web.Application, runner: ModelRunner) -> None:
    """A tensor-parallel instance's app: unhealthy once its group breaks, and then exiting 1 to
    be restarted whole; the group stopped last at shutdown. Nothing for a one-process instance."""
    group: TPGroup | None = getattr(runner, "tp_group", None)
    if group is None:
        return
    leader = group.leader
    app[UNHEALTHY] = lambda: leader.broken

    async def lifetime(app: web.Application):
        loop = asyncio.get_running_loop()

        def broken(reason: str) -> None:
            loop.call_soon_threadsafe(app[EXIT].fail, f"{reason}; exiting so the instance restarts whole", log)
        leader.on_broken = broken
        if leader.broken is not None:
            broken(leader.broken)
        yield
        leader.on_broken = None   # stopping on purpose from here on
        await loop.run_in_executor(None, group.stop)
    app.cleanup_ctx.append(lifetime)
