"""The decode role's aiohttp app: ``/v1/generate`` (NDJSON token stream), ``/v1/abort``, load, ``/metrics``.

``POST /v1/generate`` (GenerateRequest) reserves KV room and answers at once: either 429 with
``{"error": reason}`` when the local check refuses (TBT SLO, memory, batch size), or 200 with an
``application/x-ndjson`` stream whose headers go out immediately — the caller should wait for them
before starting the prefill, so the KV never arrives before its request. Lines are TokenEvents
from the *second* token on; the last carries ``finish_reason``. A client that disconnects aborts
the request and frees its KV.

Built here from the flags: ``build_engine(cfg)`` (model, paged cache, start-up profile, batcher),
then ``make_app(engine, settings)``; ``registration`` is what ``main.py`` tells the conductor.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from mooncake_lite.common import tracing
from mooncake_lite.common.cost_report import CostReport
from mooncake_lite.common.logs import set_request_id
from mooncake_lite.common.metrics import add_metrics_route
from mooncake_lite.common.protocol import GenerateRequest, ProtocolError, Register, TokenEvent, loads
from mooncake_lite.decode.batcher import AdmissionError, DecodeBatcher
from mooncake_lite.decode.config import Config
from mooncake_lite.decode.engine import DecodeEngine
from mooncake_lite.decode.kv_receiver import start_kv_server
from mooncake_lite.decode.writeback import GeneratedBlocks, StorePuts
from mooncake_lite.instance.handlers import error, instance_app
from mooncake_lite.instance.tp_ranks import watch_tensor_parallel
from mooncake_lite.instance.profile import decode_refiner, profile_decode
from mooncake_lite.instance.refine import cost_report
from mooncake_lite.instance.runner import build_runner
from mooncake_lite.model.cuda_graphs import DecodeGraphs, graph_buckets
from mooncake_lite.model.kv_codec import model_codec, stored_layer_bytes
from mooncake_lite.transfer.kv_layout import BlockLayout
from mooncake_lite.transfer.server import server_address
from mooncake_lite.transfer.shm import host_identity

log = logging.getLogger(__name__)

ENGINE = web.AppKey("engine", DecodeEngine)


@dataclass
class DataPort:
    """The KV data socket's address peers dial ("host:port"), once the app's startup opened it."""
    address: str | None = None


@dataclass
class Refusals:
    """Requests the local admission check refused (429), for /v1/load and /metrics."""
    count: int = 0


DATA = web.AppKey("data", DataPort)
REFUSALS = web.AppKey("refusals", Refusals)


@dataclass(frozen=True)
class DecodeAppSettings:
    host: str = "127.0.0.1"
    data_port: int = 0
    cluster_token: str | None = None
    disconnect_poll_s: float = 0.5
    advertise_host: str | None = None   # the data address given to peers (default: host)
    # KV data connections (the --data-* flags): handshake and stall deadlines, idle close
    # (None = never), the receive memory all of them may hold for frames still arriving.
    data_handshake_timeout: float = 5.0
    data_stall_timeout: float = 30.0
    data_idle_timeout: float | None = None
    data_inflight: int = 1 << 30


SETTINGS = web.AppKey("settings", DecodeAppSettings)


async def generate(request: web.Request) -> web.StreamResponse:
    """Admit the request here (or answer 429/400 at once), then stream its tokens."""
    engine = request.app[ENGINE]
    span = None     # decode.request: a child of the conductor's span (traceparent header; tracing on)
    try:
        req = loads(GenerateRequest, await request.read())
        set_request_id(req.request_id)   # every log line from here on names the request
        if req.kv_timeout_s <= 0:
            raise ProtocolError("GenerateRequest.kv_timeout_s must be positive")
        span = tracing.start_span("decode.request", kind="server", request_id=req.request_id,
                                  transfer_id=req.transfer_id, prompt_tokens=req.prompt_len)
        events = engine.add_request(req, span)
    except AdmissionError as exc:
        request.app[REFUSALS].count += 1
        log.info("refused request %s: %s", getattr(req, "request_id", "?"), exc)
        tracing.end_span(span, f"refused: {exc}")
        return error(429, str(exc))
    except (ProtocolError, ValueError) as exc:
        tracing.end_span(span, str(exc))
        return error(400, str(exc))
    log.debug("admitted: %d prompt token(s), KV to come as transfer %s", req.prompt_len, req.transfer_id)
    return await _stream(request, req, events, span)


async def _stream(request: web.Request, req: GenerateRequest, events: asyncio.Queue[TokenEvent],
                  span: Any) -> web.StreamResponse:
    """An admitted request's NDJSON token stream, until it finishes; the caller gone aborts it."""
    engine = request.app[ENGINE]
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    finished, num_open = False, req.sampling.n
    try:
        await resp.prepare(request)
        while True:
            try:
                event = await asyncio.wait_for(events.get(), request.app[SETTINGS].disconnect_poll_s)
            except asyncio.TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("client went away")
                continue
            await resp.write(orjson.dumps(_event_dict(event)) + b"\n")
            if event.finish_reason is not None:
                num_open -= 1   # each choice ends with a line of its own; an abort or error ends all
            if num_open == 0 or event.finish_reason in ("abort", "error"):
                finished = True
                tracing.end_span(span, event.error, finish_reason=event.finish_reason)
                log.debug("finished: %s%s", event.finish_reason, f" ({event.error})" if event.error else "")
                break
        await resp.write_eof()
    except (ConnectionResetError, asyncio.CancelledError) as exc:
        # The conductor closed the stream (a stop string it saw, its client gone, its shutdown):
        # normal, so a reset ends the handler quietly (raised on, aiohttp logs an ERROR traceback).
        if not finished:
            log.info("client of request %s disconnected; aborting it", req.request_id)
        if isinstance(exc, asyncio.CancelledError):
            raise
    finally:
        if not finished:
            engine.abort(req.request_id)
            tracing.end_span(span, "the conductor went away")
    return resp


def _event_dict(event: TokenEvent) -> dict:
    return {k: v for k, v in (("token", event.token), ("finish_reason", event.finish_reason),
                              ("error", event.error), ("index", event.index or None),
                              ("logprob", event.logprob)) if v is not None}


async def load(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.json_response({**engine.load().reported(), "num_steps": engine.num_steps,
                              "pending_transfers": len(engine.pending), "rejected": request.app[REFUSALS].count})


async def timeline(request: web.Request) -> web.Response:
    """The newest steps on this host's monotonic clock (``DecodeEngine.timeline``), for the
    conductor's cost export to set beside the forwards of the prefills on the same host, and
    the newest joins with the seconds their KV writes took (``DecodeEngine.intake``)."""
    engine = request.app[ENGINE]
    return web.json_response({"host": host_identity(), "clock": "monotonic", "steps": list(engine.timeline),
                              "kv_intake": list(engine.intake),
                              "padded_attention": pads_decode_attention(engine.runner.device)})


def pads_decode_attention(device) -> bool:
    """Whether this decode's attention runs every sequence of a batch to the longest one's
    context (the torch reference, kernels/attention.py: CPU, or a GPU without the Triton
    kernel), so a step costs batch × the longest context rather than the contexts' sum."""
    import torch

    from mooncake_kernels.dispatch import fast_module
    probe = torch.empty(0, device=device)
    return fast_module("triton_attention", probe) is None


def figures(app: web.Application) -> dict[str, float]:
    engine = app[ENGINE]
    return {**engine.load().reported(), "steps_total": engine.num_steps, "step_seconds_total": engine.step_seconds,
            "pending_transfers": len(engine.pending),
            "rejected_total": app[REFUSALS].count, **(engine.writeback.figures() if engine.writeback else {})}


def make_app(engine: DecodeEngine, settings: DecodeAppSettings) -> web.Application:
    """The decode app around a ready engine; the step loop and the KV data socket live in
    ``cleanup_ctx`` (started with the app, stopped on shutdown)."""
    app = instance_app(engine.abort, settings.cluster_token, client_max_size=64 << 20)
    watch_tensor_parallel(app, engine.runner)   # first: its group stops last
    app[ENGINE] = engine
    app[SETTINGS] = settings
    app[REFUSALS] = Refusals()
    app[DATA] = DataPort()
    app.router.add_post("/v1/generate", generate)
    app.router.add_get("/v1/load", load)
    app.router.add_get("/v1/timeline", timeline)
    add_metrics_route(app, "decode", lambda: figures(app), engine.runner.device)
    app.cleanup_ctx.append(_background)
    return app


async def _background(app: web.Application):
    engine, settings = app[ENGINE], app[SETTINGS]
    server = await start_kv_server(engine, settings.host, settings.data_port, settings.cluster_token,
                                   handshake_timeout=settings.data_handshake_timeout,
                                   stall_timeout=settings.data_stall_timeout, idle_timeout=settings.data_idle_timeout,
                                   max_inflight_bytes=settings.data_inflight)
    app[DATA].address = server_address(server, settings.advertise_host)
    loop_task = asyncio.create_task(engine.run(), name="decode-steps")
    yield
    loop_task.cancel()
    server.close()
    for rid in list(engine.requests):
        engine.abort(rid, "abort", "decode instance shutting down")
    try:
        await loop_task
    except asyncio.CancelledError:
        pass
    if engine.writeback is not None:
        await engine.writeback.drain()
        await engine.writeback.puts.close()


def make_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-model")


def build_engine(cfg: Config) -> DecodeEngine:
    """The model, its paged cache and the batcher the flags describe (profiled unless --no-profile)."""
    runner = build_runner(cfg)
    # Batched steps run their matmuls on oneDNN-packed weights (CPU float32 only; a second copy
    # of the weights; docs/model.md, "CPU paths"), profiled below as they will run.
    runner.model.pack_()
    graphs = None
    if cfg.cuda_graphs and runner.device.type == "cuda":   # before the batcher: it takes a pad block
        graphs = DecodeGraphs(runner, graph_buckets(cfg.max_batch_size), capture=True)
    cost = None
    if cfg.profile:
        try:
            cost, samples = profile_decode(runner, step=graphs.decode if graphs is not None else None)
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
    refiner = decode_refiner(cost) if cost is not None else None   # refined from every step run
    executor = make_executor()
    return DecodeEngine(runner, batcher, executor, refiner=refiner,
                        decode_step=graphs.decode if graphs is not None else None,
                        writeback=generated_blocks(cfg, runner, executor))


def generated_blocks(cfg: Config, runner, executor) -> GeneratedBlocks | None:
    """The write-back of generated blocks to ``--store`` (none without one), encoded as the
    prefill's under --kv-compression."""
    if cfg.store is None:
        return None
    args = runner.args
    codec = model_codec(cfg.kv_compression, args)     # as the prefill's: an MLA rope key scaled apart
    layer_bytes = stored_layer_bytes(codec, args, runner.block_size, runner.dtype)
    layout = BlockLayout(args.num_layers, args.num_kv_heads, layer_bytes // args.num_kv_heads)
    return GeneratedBlocks(runner, executor, StorePuts(cfg.store, cfg.cluster_token, layout, cfg.kv_compression),
                           cfg.hash_seed, codec=codec)


def reported_cost(engine: DecodeEngine) -> CostReport | None:
    """The cost model this instance's heartbeats carry: the start-up one as refined since from
    the steps it ran (None without one: --no-profile). The local TBT check uses it too, so a
    pessimistic start-up profile stops refusing requests here as well."""
    if engine.refiner is None:
        return None
    engine.batcher.cost = engine.refiner.current()
    return cost_report(engine.batcher.cost)


def registration(cfg: Config, engine: DecodeEngine, addresses: dict[str, str]) -> Register:
    """What this instance tells the conductor once its addresses are known."""
    args = engine.runner.args
    return Register(role="decode", instance_id=cfg.instance_id or f"decode@{addresses['http']}",
                    http=addresses["http"], data=addresses["data"], store=None, model=cfg.model,
                    block_size=cfg.block_size, hash_seed=cfg.hash_seed,
                    kv_bytes_per_token=args.kv_bytes_per_token(engine.runner.dtype),
                    max_context=engine.runner.allocator.num_blocks * engine.runner.block_size,
                    cost=cost_report(engine.batcher.cost) or CostReport(), tensor_parallel=cfg.tensor_parallel)
