"""``mooncake --role prefill``: prefix reuse, chunked and layer-wise prefill, KV streamed to decode."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

from mooncake_lite.common.config import option, require
from mooncake_lite.common.protocol import Register
from mooncake_lite.common.service import run as run_loop
from mooncake_lite.common.service import serve_app
from mooncake_lite.common.units import parse_duration
from mooncake_lite.instance.config import ModelRoleConfig
from mooncake_lite.transfer.client import RemoteError

log = logging.getLogger(__name__)

DESCRIPTION = ("Prefill instance: loads the cached prefix KV layer by layer from its store, computes the "
               "new tokens in chunks, streams each layer's KV to the decode instance as soon as it is "
               "done, writes new blocks back to the store. --pipeline-group X runs X processes as one "
               "Chunked Pipeline Parallel group.")


@dataclass(frozen=True)
class Config(ModelRoleConfig):
    ADVERTISES: ClassVar[bool] = True   # registers its HTTP address with the conductor
    prefill_chunk: int = option(512, "tokens per prefill chunk")
    store: str | None = option(None, "store data address HOST:PORT (default: a private in-process store)")
    local_store_blocks: int = option(4096, "blocks the private in-process store keeps when --store is not given")
    write_back: bool = option(True, "write new full blocks to the store")
    pipeline_group: int = option(1, "stages of the Chunked Pipeline Parallel group this process leads")
    pipeline_stage: int = option(0, "internal: this process's stage in a group (set by the group head)")
    next_stage: str | None = option(None, "internal: HOST:PORT of the next stage's socket")
    data_port: int = option(0, "stage socket port of a CPP stage > 0 (0 = pick a free one)")
    kv_keepalive: float = option(1.0, "while a request waits in the queue, tell its decode instance it is "
                                 "alive this often (keep it below the conductor's kv_timeout_s)",
                                 parse=parse_duration)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.prefill_chunk > 0, f"--prefill-chunk must be positive, got {self.prefill_chunk}")
        require(self.local_store_blocks > 0, "--local-store-blocks must be positive")
        require(self.pipeline_group >= 1, f"--pipeline-group must be >= 1, got {self.pipeline_group}")
        require(0 <= self.pipeline_stage < self.pipeline_group,
                f"--pipeline-stage must be in [0, {self.pipeline_group})")
        require(self.store is None or ":" in self.store, f"--store must be HOST:PORT, got {self.store!r}")
        require(0 <= self.data_port < 65536, f"--data-port out of range: {self.data_port}")
        require(self.kv_keepalive > 0, "--kv-keepalive must be positive")
        from mooncake_lite.model.weights import model_args
        num_layers = model_args(self.model).num_layers
        require(self.pipeline_group <= num_layers,
                f"--pipeline-group {self.pipeline_group} exceeds the model's {num_layers} layers")


def layer_slices(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal layer ranges, one per stage."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    bounds = [round(i * num_layers / num_stages) for i in range(num_stages + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def make_store(cfg: Config, runner):
    from mooncake_lite.prefill.store_io import MemoryStore
    model = runner.model
    layer_bytes = runner.cache.kv[0].numel() // runner.cache.num_blocks * runner.cache.kv.element_size()
    if cfg.store is None:
        return MemoryStore((model.first_layer, model.end_layer), layer_bytes, cfg.local_store_blocks)
    from mooncake_lite.prefill.remote_store import RemoteStore
    return RemoteStore(cfg.store, cfg.cluster_token, model.args.num_layers, layer_bytes)


def build_stage(cfg: Config, layer_range: tuple[int, int] | None):
    from mooncake_lite.prefill.engine import StageEngine
    from mooncake_lite.instance.profile import profile_prefill
    from mooncake_lite.instance.runner import build_runner

    runner = build_runner(cfg, layer_range)
    cost = None
    if cfg.profile and cfg.pipeline_group == 1:
        try:
            cost, samples = profile_prefill(runner)
            log.info("prefill cost model %s from %d timings", cost.to_dict(), len(samples))
        except ValueError as exc:
            log.warning("startup profiling skipped: %s", exc)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-model")
    return StageEngine(runner, make_store(cfg, runner), executor, write_back=cfg.write_back), cost


class StoreTooSmall(RuntimeError):
    """The store cannot hold one of this instance's blocks: every write-back would be refused."""


def check_slot(cfg: Config, slot_bytes: int | None) -> None:
    """Raise StoreTooSmall when one whole KV block (all layers, even on a CPP head: the store keeps
    whole blocks) is larger than the store's slots. A store that does not say passes."""
    from mooncake_lite.model.weights import model_args
    block_bytes = model_args(cfg.model).kv_block_bytes(cfg.block_size, cfg.dtype)
    if slot_bytes is not None and block_bytes > slot_bytes:
        raise StoreTooSmall(
            f"store {cfg.store} holds blocks of at most {slot_bytes} bytes (--slot-bytes) but one "
            f"{cfg.block_size}-token block of {cfg.model} in {cfg.dtype} is {block_bytes} bytes: start the "
            f"store with --slot-bytes >= {block_bytes} (or lower --block-size)")


async def store_id(cfg: Config, store, timeout_s: float = 10.0, check: bool = False) -> str | None:
    """The id the conductor knows this instance's store by: what the store itself says (its
    advertised data address) when it answers, else ``--store`` as given. With ``check``, also
    raise StoreTooSmall when the store answers with slots too small for this model's blocks."""
    if cfg.store is None:              # a private in-process store: no block events, nothing to ask
        return None
    try:
        canonical = await asyncio.wait_for(store.store_id(), timeout_s)
        slot_bytes = await asyncio.wait_for(store.slot_bytes(), timeout_s) if check else None
    except (ConnectionError, OSError, asyncio.TimeoutError, RemoteError) as exc:
        then = ("registering it as given; if it advertises another address, the conductor will not see "
                "this instance's cached blocks" if cfg.conductor else "going on")
        log.warning("store %s did not answer (%s): %s (its slot size is unchecked)", cfg.store, exc, then)
        return cfg.store
    if check:
        check_slot(cfg, slot_bytes)
    if canonical and canonical != cfg.store:
        log.info("store %s calls itself %s: registering that (the id its block events carry)", cfg.store, canonical)
    return canonical or cfg.store


def registration(cfg: Config, service, addresses: dict[str, str], store: str | None) -> Register:
    runner = service.stage.runner
    args = runner.args
    return Register(role="prefill", instance_id=cfg.instance_id or f"prefill@{addresses['http']}",
                    http=addresses["http"], data=None, store=store, model=cfg.model,
                    block_size=cfg.block_size, hash_seed=cfg.hash_seed,
                    kv_bytes_per_token=args.kv_bytes_per_token(runner.dtype),
                    max_context=min(args.max_seq_len, runner.allocator.num_blocks * runner.block_size),
                    cost=service.cost.to_dict() if service.cost else {}, pipeline_stages=cfg.pipeline_group)


async def _watch_stage_link(downstream, state: dict) -> None:
    """A CPP group without its next stage cannot serve: exit non-zero so a supervisor restarts it."""
    import os
    import signal
    await asyncio.shield(downstream.client.conn.closed)   # cancelling us must not cancel the future
    log.error("the link to CPP stage 1 is gone; this group cannot prefill any more; exiting")
    state["exit"] = 1
    os.kill(os.getpid(), signal.SIGTERM)


def run(cfg: Config) -> int:
    if cfg.pipeline_stage > 0:
        from mooncake_lite.prefill.stage_process import run_stage
        return run_stage(cfg)
    from mooncake_lite.model.weights import model_args
    from mooncake_lite.prefill.app import EXTRA_CLEANUP, make_app
    from mooncake_lite.prefill.kv_sender import DecodeLinks
    from mooncake_lite.common.membership import exit_process, keep_membership
    from mooncake_lite.prefill.service import PrefillService

    slices = layer_slices(model_args(cfg.model).num_layers, cfg.pipeline_group)
    group = None
    if cfg.pipeline_group > 1:
        from mooncake_lite.prefill.stage_process import StageGroup
        group = StageGroup.spawn(cfg, slices)
    try:
        stage, cost = build_stage(cfg, slices[0])
    except BaseException:
        if group is not None:
            group.stop()
        raise
    state = {"exit": 0}
    tasks: list[asyncio.Task] = []

    async def main() -> None:
        # Before serving: a store whose slots cannot hold our blocks refuses every write-back.
        try:
            known_as = await store_id(cfg, stage.store, check=True)
        except StoreTooSmall:
            await stage.store.close()
            raise
        downstream = await group.connect(cfg.cluster_token) if group is not None else None
        service = PrefillService(stage, DecodeLinks(cfg.cluster_token), block_size=cfg.block_size,
                                 hash_seed=cfg.hash_seed, chunk_size=cfg.prefill_chunk,
                                 downstream=downstream, cost=cost, keepalive_s=cfg.kv_keepalive)
        app = make_app(service, cfg.cluster_token)
        if downstream is not None:
            watcher = asyncio.ensure_future(_watch_stage_link(downstream, state))

            async def stop_watching() -> None:   # shutting down closes the link on purpose
                watcher.cancel()
            app[EXTRA_CLEANUP] += [stop_watching, downstream.close]

        def on_ready(addresses: dict[str, str]) -> None:
            if cfg.conductor:
                msg = registration(cfg, service, addresses, known_as)
                tasks.append(asyncio.ensure_future(keep_membership(
                    cfg.conductor, msg, service.load, cfg.heartbeat_interval, cfg.cluster_token,
                    exit_process(state, "exit"))))
        try:
            await serve_app(app, cfg.host, cfg.port, role="prefill", on_ready=on_ready,
                            advertise_host=cfg.advertise_host)
        finally:
            for t in tasks:
                t.cancel()

    refused = None
    try:
        run_loop(main)
    except StoreTooSmall as exc:
        refused = exc
    finally:
        if group is not None:
            group.stop()
    if refused is not None:
        import sys
        sys.stderr.write(f"mooncake --role prefill: error: {refused}\n")
        return 2
    return state["exit"]
