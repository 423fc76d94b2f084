"""The prefill role's aiohttp app: ``/v1/prefill``, ``/v1/abort``, ``/health``, ``/v1/load``, ``/metrics``.

``POST /v1/prefill`` (PrefillRequest) answers PrefillResult as soon as the first token is known
(a single instance: before decode has answered the KV stream's END, which waits for the step decode
is running; a CPP group: once the stream has ended). A stream that fails after that answer is
logged, and decode drops the request (the conductor sees its token stream fail). Errors: 400
``{"error"}`` for a bad request (never retry as is), 502 when the KV stream to decode failed or
the request was aborted (decode gone, transfer refused).

Built here from the flags: ``build_stage(cfg, layers)`` (model slice, paged cache, store; the
start-up profile is ``profiling.py``'s), then ``build_app`` (its ``PrefillService`` and routes).
``store_id`` asks the store its id (refusing one whose slots are too small); ``registration`` is
what ``main.py`` tells the conductor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from mooncake_lite.common.cost_report import CostReport
from mooncake_lite.common.lifecycle import EXIT
from mooncake_lite.common.logs import set_request_id
from mooncake_lite.common.metrics import add_metrics_route
from mooncake_lite.common.protocol import PrefillRequest, PrefillResult, ProtocolError, Register, loads
from mooncake_lite.instance.handlers import error, instance_app
from mooncake_lite.instance.tp_ranks import watch_tensor_parallel
from mooncake_lite.instance.refine import cost_report
from mooncake_lite.instance.runner import build_runner
from mooncake_lite.model.checkpoint_config import model_args
from mooncake_lite.model.kv_codec import model_codec, stored_layer_bytes
from mooncake_lite.model.linear import PACK_PROBE_ROWS
from mooncake_lite.model.llama import Transformer
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.prefill.config import Config
from mooncake_lite.prefill.engine import PrefillAborted, StageEngine
from mooncake_lite.prefill.kv_sender import DecodeLinks
from mooncake_lite.prefill.pipeline import NextStage
from mooncake_lite.prefill.rank_store import follower_stores, remote_prefix_store
from mooncake_lite.prefill.service import PrefillRejected, PrefillService
from mooncake_lite.prefill.store_io import CompressedStore, MemoryStore, PrefixStore
from mooncake_lite.prefill.threads import BorrowingExecutor, ThreadBorrower
from mooncake_lite.prefill.writeback import WritebackFailuresCollector
from mooncake_lite.scheduler.costs import PrefillCostModel
from mooncake_lite.transfer.client import RemoteError
from mooncake_lite.transfer.kv_layout import LAYOUT_VERSION
from mooncake_lite.transfer.shm import host_identity

log = logging.getLogger(__name__)

SERVICE = web.AppKey("service", PrefillService)
# prefills answered at their first token, still ending their stream
ENDING: web.AppKey[set[asyncio.Task[PrefillResult]]] = web.AppKey("ending")


async def prefill(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    try:
        req = loads(PrefillRequest, await request.read())
        set_request_id(req.request_id)   # every log line from here on names the request
        result = await _first_result(service, req, request.app[ENDING])
    except (ProtocolError, PrefillRejected) as exc:
        return error(400, str(exc))
    except PrefillAborted as exc:
        log.warning("prefill %s abandoned: %s", req.request_id, exc)
        return error(502, f"prefill abandoned: {exc}")
    except (ConnectionError, OSError, asyncio.TimeoutError) as exc:
        # Decode (KV), the store or a downstream pipeline stage: the error names the address.
        detail = f"{exc}" or type(exc).__name__
        log.warning("prefill %s: lost a peer (KV to decode %s): %s", req.request_id, req.decode_data, detail)
        return error(502, f"lost a peer during the prefill (KV to decode {req.decode_data}): {detail}")
    except RemoteError as exc:   # decode, the store or a pipeline stage refused (e.g. its KV cache is full)
        who = exc.peer or "a peer"
        log.warning("prefill %s: %s refused: %s", req.request_id, who, exc)
        return error(502, f"{who} refused: {exc}")
    except Exception as exc:     # never take the server down; say what happened
        log.exception("prefill %s failed", req.request_id)
        return error(500, f"prefill failed: {type(exc).__name__}: {exc}")
    log.debug("prefilled for decode %s: %d token(s) loaded, %d computed, timings %s", req.decode_data,
              result.num_prefix_tokens, result.num_computed_tokens, result.timings)
    return web.json_response(dataclasses.asdict(result))


async def _first_result(service: PrefillService, req: PrefillRequest,
                        ending: set[asyncio.Task[PrefillResult]]) -> PrefillResult:
    """The result as soon as the first token is known; the prefill goes on to end the stream
    (held in ``ending`` until it has). Neither the conductor leaving nor an early answer cancels
    it (decode waits for this KV)."""
    first: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(service.prefill(req, on_first=lambda r: first.done() or first.set_result(r)))
    await asyncio.wait({task, first}, return_when=asyncio.FIRST_COMPLETED)
    if not first.done():
        return task.result()
    if not task.done():
        ending.add(task)
        task.add_done_callback(ending.discard)
    task.add_done_callback(lambda t, rid=req.request_id: _late_failure(rid, t))
    return first.result()


def _late_failure(request_id: str, task: asyncio.Task) -> None:
    """The prefill's stream failed after its first token was answered: decode drops the request."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("prefill %s: the KV stream failed after the first token was answered: %s",
                    request_id, task.exception())


def figures(service: PrefillService) -> dict[str, float]:
    return {**service.load().reported(), **service.totals, "requests_done_total": service.num_done,
            "requests_failed_total": service.num_failed, "blocks_stored_total": service.stage.num_blocks_stored,
            **service.stage.writebacks.figures(), **service.stage.fallback_figures(), **service.stage.steal_figures()}


async def load(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    # cost: the model it predicts its queue with and registered (a CPP group's: timed through its stages)
    return web.json_response({**service.load().reported(), "num_done": service.num_done,
                              "num_failed": service.num_failed,
                              "blocks_stored": service.stage.num_blocks_stored,
                              "cost": service.cost.to_dict() if service.cost is not None else None})


async def timeline(request: web.Request) -> web.Response:
    """The newest forwards on this host's monotonic clock (``StageEngine.timeline``): when this
    prefill computed, for the conductor's cost export to split the steps of a decode on the
    same host by (``instance/colocation.colocation_split``); and what its waiting list did
    (``scheduler/waiting.py``: the order it served in, for ``bench fidelity``'s judge)."""
    service = request.app[SERVICE]
    return web.json_response({"host": host_identity(), "clock": "monotonic",
                              "forwards": list(service.stage.timeline), "turns": list(service.turns.events)})


def build_app(cfg: Config, stage: StageEngine, cost: PrefillCostModel | None,
              downstream: NextStage | None = None, busy_scale: float = 1.0) -> web.Application:
    """The prefill app of this process's ``stage`` (a CPP group's other stages behind
    ``downstream``); ``busy_scale``: its registration's (``Register.busy_scale``)."""
    service = PrefillService(stage, DecodeLinks(cfg.cluster_token), block_size=cfg.block_size,
                             hash_seed=cfg.hash_seed, chunk_size=cfg.prefill_chunk,
                             downstream=downstream, cost=cost, keepalive_s=cfg.kv_keepalive,
                             batch_tokens=cfg.prefill_batch_tokens, block_bytes=stored_block_bytes(cfg),
                             overtakes=cfg.overtake_bound, busy_scale=busy_scale)
    return make_app(service, cfg.cluster_token)


def make_app(service: PrefillService, cluster_token: str | None = None) -> web.Application:
    app = instance_app(service.abort, cluster_token, client_max_size=256 << 20)
    watch_tensor_parallel(app, service.stage.runner)   # first: its group stops last
    app[SERVICE] = service
    app[ENDING] = set()
    app.router.add_post("/v1/prefill", prefill)
    app.router.add_get("/v1/load", load)
    app.router.add_get("/v1/timeline", timeline)
    add_metrics_route(app, "prefill", lambda: figures(service), service.stage.runner.device,
                      extra=[WritebackFailuresCollector(service.stage.writebacks)])
    app.cleanup_ctx.append(_lifetime)
    return app


async def _lifetime(app: web.Application):
    service = app[SERVICE]
    downstream = service.downstream   # a CPP group's next stage: without it the group cannot prefill
    watcher = None if downstream is None else asyncio.ensure_future(app[EXIT].fail_when_done(
        downstream.client.conn.closed, "the link to CPP stage 1 is gone; this group cannot prefill any more; "
        "exiting", log))
    yield
    if app[ENDING]:   # streams answered at their first token: let them end before the links close
        await asyncio.wait(set(app[ENDING]), timeout=service.links.request_timeout)
    await service.stage.drain_puts()
    await service.links.close()
    close_store = getattr(service.stage.store, "close", None)
    if close_store is not None:
        await close_store()
    if watcher is not None:   # shutting down closes the link on purpose
        watcher.cancel()
        await downstream.close()


def make_store(cfg: Config, runner: ModelRunner) -> PrefixStore:
    """The store this stage reads prefixes from and writes back to: ``--store``, else a private one.
    A TP instance whose followers have stores of their own (``prefill/rank_store.py``) reads and
    writes rank 0's heads here; one without writes one head slice per writing rank from rank 0."""
    model, args = runner.model, runner.args   # the whole model's KV heads, at any tensor-parallel degree
    if cfg.store is not None:
        own = runner.layout.kv_heads if runner.ranks_store else None
        return remote_prefix_store(cfg.store, cfg.cluster_token, cfg.kv_compression, args, runner.block_size,
                                   runner.dtype, own, None if own is not None else runner.kv_senders)
    codec = model_codec(cfg.kv_compression, args)
    store = MemoryStore((model.first_layer, model.end_layer),
                        stored_layer_bytes(codec, args, runner.block_size, runner.dtype), cfg.local_store_blocks)
    block_shape = (runner.block_size, args.num_kv_heads, args.head_dim)
    return store if codec is None else CompressedStore(store, codec, block_shape, runner.dtype)


def stored_block_bytes(cfg: Config) -> int:
    """Bytes of one whole KV block as the store keeps it: model dtype, or encoded (--kv-compression)."""
    args = model_args(cfg.model)
    return args.num_layers * stored_layer_bytes(model_codec(cfg.kv_compression, args), args, cfg.block_size, cfg.dtype)


def pack_weights(model: Transformer, mode: str, chunk: int) -> None:
    """``--pack-weights``: pack the model's weights (``Transformer.pack_``) on, off, or ``auto``:
    where they measure at least ``PACK_GAIN`` times faster on this CPU (docs/model.md, "CPU
    paths"). Every stage of a CPP group decides for its own slice. The log says what it
    chose and why."""
    gain, rows = None, min(chunk, PACK_PROBE_ROWS)
    if mode == "on":
        model.pack_()
    elif mode == "auto":
        gain = model.pack_if_faster_(rows)
    if gain is not None:
        why = f"packed products measured {gain:.2f}x the plain ones' speed at {rows} rows on this CPU"
    elif mode != "off" and not model.packed:
        why = f"--pack-weights {mode}, but nothing packs for this device and dtype"
    else:
        why = f"--pack-weights {mode}"
    log.info("prefill weights: %s (%s)", "oneDNN-packed" if model.packed else "plain", why)


def build_stage(cfg: Config, layer_range: tuple[int, int] | None) -> StageEngine:
    """The stage engine of ``layer_range`` (model slice, paged cache, store); its start-up cost
    model is timed through it once the loop runs (``profiling.py``), packed weights or not."""
    runner = build_runner(cfg, layer_range, follower_stores(cfg.store, cfg.cluster_token, cfg.kv_compression,
                                                            cfg.tensor_parallel))
    pack_weights(runner.model, cfg.pack_weights, cfg.prefill_chunk)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-model")
    if cfg.borrow_threads:   # the decodes' idle CPUs, lent by `mooncake up` (prefill/threads.py)
        import torch
        borrower = ThreadBorrower(torch.get_num_threads(), cfg.borrow_threads)
        executor = BorrowingExecutor(borrower, thread_name_prefix="prefill-model")
        log.info("torch threads %d, up to %d more while %d CPUs of this machine are idle", borrower.own,
                 cfg.borrow_threads, cfg.borrow_threads)
    return StageEngine(runner, make_store(cfg, runner), executor, write_back=cfg.write_back)


def reported_cost(service: PrefillService) -> CostReport | None:
    """The cost model this instance's heartbeats carry: the start-up one as refined since from
    the chunks it ran (None without one: --no-profile; and a CPP group, whose start-up group
    profile is registered and kept as is: its head sees only its own slice's chunk times). The
    queue figure of ``load()`` predicts with it too."""
    refiner = service.stage.refiner
    if refiner is None:
        return None
    service.cost = refiner.current()
    return cost_report(service.cost)


class StoreUnfit(RuntimeError):
    """The store cannot serve this instance's blocks: the prefill refuses to start."""


class StoreTooSmall(StoreUnfit):
    """The store cannot hold one of this instance's blocks: every write-back would be refused."""


def check_slot(cfg: Config, slot_bytes: int | None) -> None:
    """Raise StoreTooSmall when one whole KV block (all layers, even on a CPP head: the store keeps
    whole blocks) is larger than the store's slots. A store that does not say passes."""
    block_bytes = stored_block_bytes(cfg)
    if slot_bytes is not None and block_bytes > slot_bytes:
        how = cfg.dtype if cfg.kv_compression == "none" else f"{cfg.kv_compression} (--kv-compression)"
        raise StoreTooSmall(
            f"store {cfg.store} holds blocks of at most {slot_bytes} bytes (--slot-bytes) but one "
            f"{cfg.block_size}-token block of {cfg.model} in {how} is {block_bytes} bytes: start the "
            f"store with --slot-bytes >= {block_bytes} (or lower --block-size)")


class StoreEncodingMismatch(StoreUnfit):
    """The store keeps blocks encoded otherwise than this instance would write and read them."""


def check_encoding(cfg: Config, encoding: str | None, layout: object = LAYOUT_VERSION) -> None:
    """Raise StoreEncodingMismatch unless the store's --kv-compression is this instance's and it
    keeps blocks in this release's layout (``transfer/kv_layout.py``): blocks of another encoding
    or layout would be misread (a store that does not say holds plain, token-major blocks)."""
    if layout != LAYOUT_VERSION:
        raise StoreEncodingMismatch(
            f"store {cfg.store} keeps KV blocks in layout version {layout} but this instance reads and writes "
            f"version {LAYOUT_VERSION} (head-major): run the store of this instance's release")
    if (encoding or "none") != cfg.kv_compression:
        raise StoreEncodingMismatch(
            f"store {cfg.store} keeps KV blocks as {encoding or 'none'} (--kv-compression) but this instance "
            f"reads and writes {cfg.kv_compression}: every role of a cluster must use the same value")


async def store_id(cfg: Config, store, timeout_s: float = 10.0, check: bool = False) -> str | None:
    """The id the conductor knows this instance's store by: what the store itself says (its
    advertised data address) when it answers, else ``--store`` as given. With ``check``, also
    raise StoreTooSmall when the store answers with slots too small for this model's blocks."""
    if cfg.store is None:              # a private in-process store: no block events, nothing to ask
        return None
    try:
        canonical = await asyncio.wait_for(store.store_id(), timeout_s)
        slot_bytes = await asyncio.wait_for(store.slot_bytes(), timeout_s) if check else None
        ask = getattr(store, "kv_compression", None)    # a store adapter that cannot tell: plain blocks
        encoding = await asyncio.wait_for(ask(), timeout_s) if check and ask is not None else None
        ask = getattr(store, "kv_layout", None)         # likewise: one of this release
        layout = await asyncio.wait_for(ask(), timeout_s) if check and ask is not None else LAYOUT_VERSION
    except (ConnectionError, OSError, asyncio.TimeoutError, RemoteError) as exc:
        then = ("registering it as given; if it advertises another address, the conductor will not see "
                "this instance's cached blocks" if cfg.conductor else "going on")
        log.warning("store %s did not answer (%s): %s (its slot size is unchecked)", cfg.store, exc, then)
        return cfg.store
    if check:
        check_encoding(cfg, encoding, layout)     # first: block sizes compare only under one encoding
        check_slot(cfg, slot_bytes)
    if canonical and canonical != cfg.store:
        log.info("store %s calls itself %s: registering that (the id its block events carry)", cfg.store, canonical)
    return canonical or cfg.store


def registration(cfg: Config, service: PrefillService, addresses: dict[str, str], store: str | None) -> Register:
    """What this instance tells the conductor once its addresses are known."""
    runner = service.stage.runner
    args = runner.args
    return Register(role="prefill", instance_id=cfg.instance_id or f"prefill@{addresses['http']}",
                    http=addresses["http"], data=None, store=store, model=cfg.model,
                    block_size=cfg.block_size, hash_seed=cfg.hash_seed,
                    kv_bytes_per_token=args.kv_bytes_per_token(runner.dtype),
                    max_context=min(args.max_seq_len, runner.allocator.num_blocks * runner.block_size),
                    cost=cost_report(service.cost) or CostReport(), pipeline_stages=cfg.pipeline_group,
                    pack_tokens=service.pack_limit, queue_overtakes=service.overtakes,
                    tensor_parallel=cfg.tensor_parallel, prefill_chunk=cfg.prefill_chunk,
                    busy_scale=service.busy_scale, reads_placed=True)
