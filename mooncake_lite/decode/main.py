"""``mooncake --role decode``: receive KV from prefill, continuous batching, stream tokens."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import ClassVar


from mooncake_lite.common.config import option, require
from mooncake_lite.common.protocol import Register
from mooncake_lite.common.service import run as run_loop
from mooncake_lite.common.service import serve_app
from mooncake_lite.instance.config import ModelRoleConfig, optional_duration
from mooncake_lite.instance.runner import build_runner

log = logging.getLogger(__name__)

DESCRIPTION = ("Decode instance: receives each request's KV stream from prefill into its paged cache, "
               "runs continuous batching, streams tokens; refuses requests that would break the TBT SLO.")



@dataclass(frozen=True)
class Config(ModelRoleConfig):
    ADVERTISES: ClassVar[bool] = True   # registers its HTTP and KV data addresses
    data_port: int = option(0, "KV data socket port prefill streams into (0 = pick a free one)")
    tbt_slo: float | None = option(None, "refuse requests whose predicted TBT exceeds this (seconds, 200ms); "
                                   "replaces --tbt-slo-factor", parse=optional_duration)
    tbt_slo_factor: float | None = option(None, "refuse requests whose predicted TBT exceeds this many times "
                                          "one decode step of the request alone (e.g. 5; default: off)")
    max_batch_size: int | None = option(None, "most sequences decoding at once")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.data_port < 65536, f"--data-port out of range: {self.data_port}")
        require(self.tbt_slo is None or self.tbt_slo > 0, "--tbt-slo must be positive")
        require(self.tbt_slo_factor is None or self.tbt_slo_factor >= 1, "--tbt-slo-factor must be >= 1")
        require(self.max_batch_size is None or self.max_batch_size > 0, "--max-batch-size must be positive")


def build_engine(cfg: Config):
    from mooncake_lite.decode.app import make_executor
    from mooncake_lite.decode.batcher import DecodeBatcher
    from mooncake_lite.decode.engine import DecodeEngine
    from mooncake_lite.instance.profile import profile_decode

    runner = build_runner(cfg)
    cost = None
    if cfg.profile:
        try:
            cost, samples = profile_decode(runner)
            log.info("decode cost model %s from %d timings", cost.to_dict(), len(samples))
        except ValueError as exc:
            log.warning("startup profiling skipped: %s", exc)
    batcher = DecodeBatcher(runner.allocator, runner.block_size, max_batch_size=cfg.max_batch_size,
                            cost=cost, tbt_slo_s=cfg.tbt_slo, tbt_slo_factor=cfg.tbt_slo_factor)
    if (cfg.tbt_slo is not None or cfg.tbt_slo_factor is not None) and cost is None:
        log.warning("--tbt-slo/--tbt-slo-factor is set but no cost model was fitted (--no-profile): "
                    "TBT is not checked")
    elif cfg.tbt_slo is not None and cost.predict(1, 1) > cfg.tbt_slo:
        log.error("one decode step alone (batch 1) takes %.3g s by this instance's profile, above --tbt-slo "
                  "%.3g s: every request will be refused here; raise --tbt-slo or use --tbt-slo-factor",
                  cost.predict(1, 1), cfg.tbt_slo)
    return DecodeEngine(runner, batcher, make_executor())


def registration(cfg: Config, engine, addresses: dict[str, str]) -> Register:
    args = engine.runner.args
    return Register(role="decode", instance_id=cfg.instance_id or f"decode@{addresses['http']}",
                    http=addresses["http"], data=addresses["data"], store=None, model=cfg.model,
                    block_size=cfg.block_size, hash_seed=cfg.hash_seed,
                    kv_bytes_per_token=args.kv_bytes_per_token(engine.runner.dtype),
                    max_context=engine.runner.allocator.num_blocks * engine.runner.block_size,
                    cost=engine.batcher.cost.to_dict() if engine.batcher.cost else {})


def run(cfg: Config) -> int:
    from mooncake_lite.decode.app import RUNTIME, DecodeAppSettings, make_app
    from mooncake_lite.common.membership import exit_process, keep_membership

    engine = build_engine(cfg)
    app = make_app(engine, DecodeAppSettings(cfg.host, cfg.data_port, cfg.cluster_token,
                                             advertise_host=cfg.advertise_host))
    state = {"exit": 0}
    tasks: list[asyncio.Task] = []

    def on_ready(addresses: dict[str, str]) -> None:
        if cfg.conductor:
            msg = registration(cfg, engine, addresses)
            tasks.append(asyncio.ensure_future(keep_membership(
                cfg.conductor, msg, engine.load, cfg.heartbeat_interval, cfg.cluster_token,
                exit_process(state, "exit"))))

    async def main() -> None:
        try:
            await serve_app(app, cfg.host, cfg.port, role="decode", advertise_host=cfg.advertise_host,
                            extra_addresses=lambda: {"data": app[RUNTIME]["data"]}, on_ready=on_ready)
        finally:
            for t in tasks:
                t.cancel()

    run_loop(main)
    return state["exit"]
