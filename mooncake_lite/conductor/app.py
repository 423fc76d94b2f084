"""The conductor's aiohttp app: public API + internal endpoints on one port, the shared
:class:`Services` under an AppKey, one ClientSession and the dead-instance reaper in
``cleanup_ctx``, and its drain on SIGTERM (``flight/drain.py``: still listening, so heartbeats
keep arriving)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from mooncake_lite.common.auth import cluster_token_middleware
from mooncake_lite.common.service import DRAIN
from mooncake_lite.conductor.api import routes as api_routes
from mooncake_lite.conductor.api.body import MAX_BODY_BYTES
from mooncake_lite.conductor.api.errors import PARSER_FIELD_BYTES, json_errors_middleware
from mooncake_lite.conductor.api.state import API, ApiState
from mooncake_lite.conductor.api.structured import GrammarChecker
from mooncake_lite.conductor.cluster import cost_export, discovery, hot_replication, internal, status
from mooncake_lite.conductor.cluster.metrics import ConductorMetrics
from mooncake_lite.conductor.config import Config
from mooncake_lite.conductor.contexts import routes as context_routes
from mooncake_lite.conductor.cluster.costs import default_costs
from mooncake_lite.conductor.flight.arrivals import Arrivals
from mooncake_lite.conductor.flight.drain import Drain
from mooncake_lite.conductor.cluster.membership import Membership
from mooncake_lite.conductor.services import SERVICES, Services
from mooncake_lite.conductor.tenants import TenantGate, tenant_middleware
from mooncake_lite.model.args import ModelArgs
from mooncake_lite.model.checkpoint_config import model_args
from mooncake_lite.model.source import model_id
from mooncake_lite.model.tokenizer import load_tokenizer
from mooncake_lite.scheduler import Scheduler
from mooncake_lite.scheduler.hot import HotConfig, HotTracker

log = logging.getLogger(__name__)
DEFAULT_DTYPE_BYTES = 2   # until an instance reports its real kv_bytes_per_token


def make_app(cfg: Config) -> web.Application:
    """Build the conductor. Raises ValueError for an unknown model."""
    args = model_args(cfg.model)
    tokenizer = load_tokenizer(cfg.model, args.vocab_size)
    svc = make_services(cfg, args)
    drain = Drain(svc.membership)
    app = web.Application(
        # json_errors first (outermost): every error aiohttp itself raises answers OpenAI-style JSON.
        # The drain counts the public requests in flight (and refuses new ones once draining).
        middlewares=[json_errors_middleware,
                     tenant_middleware(svc.tenants, prefixes=("/v1/",)),
                     drain.middleware(),
                     cluster_token_middleware(cfg.cluster_token, prefixes=("/internal/",))],
        # A client that disconnects cancels its handler, which aborts the request upstream. The
        # parser's header limits are above the middleware's, so an oversized header gets its JSON 431;
        # compressed bodies are decoded by api/body.py (size-capped), not by the parser.
        handler_args={"handler_cancellation": True, "max_field_size": PARSER_FIELD_BYTES,
                      "max_line_size": PARSER_FIELD_BYTES, "auto_decompress": False},
        client_max_size=MAX_BODY_BYTES)
    app[SERVICES] = svc
    app[API] = ApiState(svc, tokenizer, served=tuple(dict.fromkeys((model_id(cfg.model), cfg.model))),
                        vocab_size=args.vocab_size, max_context=args.max_seq_len, created=int(time.time()),
                        reasoning=cfg.reasoning_parser == "think", tool_parser=cfg.tool_call_parser,
                        grammars=GrammarChecker(cfg.model, args.vocab_size))
    app[DRAIN] = drain.run    # serve_app runs it on SIGTERM before the listener closes; a 2nd signal hurries it
    _hot_replication(app, cfg)
    api_routes.add_routes(app)
    context_routes.add_routes(app, cfg)   # /v1/contexts: cached contexts (issue #18)
    internal.add_routes(app)
    status.add_routes(app)   # GET /internal/v1/status, for `mooncake status`
    app.router.add_get("/internal/v1/cost_model", cost_export.cost_model)   # `mooncake sim export-costs`
    app.cleanup_ctx.append(_client_session)
    app.cleanup_ctx.append(_reaper)
    discovery.setup(app, cfg.discovery, cfg.rebuild_wait, {"model": model_id(cfg.model), "block_size": cfg.block_size,
                                                           "hash_seed": cfg.hash_seed}, cfg.cluster_token, cfg.peer_urls)
    return app


def make_services(cfg: Config, args: ModelArgs) -> Services:
    """What the conductor holds, for a model of ``args``: the scheduler (with default cost models
    until instances register their own), the membership, the tenants and the metrics. Its HTTP
    session opens with the app (:func:`_client_session`)."""
    sched_cfg = cfg.scheduler_config()
    kv_bytes = 2 * args.num_layers * args.num_kv_heads * args.head_dim * DEFAULT_DTYPE_BYTES
    scheduler = Scheduler(sched_cfg, default_costs(args, kv_bytes), rng=random.Random(cfg.seed))
    spread = cfg.shared_instances == "on" or (cfg.shared_instances == "auto" and (cfg.discovery is not None or bool(cfg.peer_urls)))
    membership = Membership(cfg.model, cfg.block_size, cfg.hash_seed, cfg.dead_after, cfg.dead_after_failures,
                            tie_salt=os.urandom(16) if spread else None)
    # API keys name tenants (--api-key is one more, tenant "default"): limits, SLOs, priorities
    gate = TenantGate(cfg.tenants, sched_cfg, api_key=cfg.api_key)
    return Services(session=None, membership=membership, scheduler=scheduler,  # type: ignore[arg-type]
                    metrics=ConductorMetrics(), block_size=cfg.block_size, hash_seed=cfg.hash_seed,
                    cluster_token=cfg.cluster_token, upstream_timeout_s=cfg.upstream_timeout,
                    kv_timeout_s=cfg.kv_timeout, max_retries=cfg.dispatch_retries, tenants=gate,
                    migration_limit=cfg.migration_limit, arrivals=Arrivals(cfg.burst_window))


def _hot_replication(app: web.Application, cfg: Config) -> None:
    """Hot blocks copied ahead of need, in the background (off with --hot-replication-share 0)."""
    if cfg.hot_replication_share <= 0:
        return
    svc = app[SERVICES]
    tracker = HotTracker(HotConfig(threshold=cfg.hot_threshold, window_s=cfg.hot_window,
                                   share=cfg.hot_replication_share, period_s=cfg.hot_replication_period))
    hot = app[hot_replication.HOT] = hot_replication.HotReplication(svc, tracker)
    svc.on_placed = hot.note
    app.cleanup_ctx.append(hot_replication.run)


async def _client_session(app: web.Application) -> AsyncIterator[None]:
    svc = app[SERVICES]
    # No connection cap: every streaming request holds one connection to its decode instance.
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    svc.session = aiohttp.ClientSession(connector=connector)
    yield
    if svc.background:  # aborts still being delivered
        await asyncio.wait(list(svc.background), timeout=5)
    await svc.session.close()


async def _reaper(app: web.Application) -> AsyncIterator[None]:
    """Marks silent instances dead, and drops silent stores, a few times per ``dead_after`` period."""
    membership = app[SERVICES].membership
    period = min(1.0, membership.dead_after_s / 4)

    async def loop() -> None:
        clock = asyncio.get_running_loop().time
        last = clock()
        while True:
            await asyncio.sleep(period)
            now, was = clock(), last
            last = now
            if now - was > period + membership.dead_after_s / 2:
                # This loop itself was held up (seen at load 37: 24 s): the heartbeats sent
                # meanwhile wait unread in their sockets, and judging silence now would take every
                # instance out at once. Judge a period on, once they have been read.
                log.warning("the reaper ran %.1fs late: judging silence a period on", now - was - period)
                continue
            membership.reap(now)
            internal.drop_silent_stores(app, now)

    task = asyncio.get_running_loop().create_task(loop())
    yield
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass

