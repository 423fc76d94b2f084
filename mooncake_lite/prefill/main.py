"""``mooncake --role prefill``: prefix reuse, chunked and layer-wise prefill, KV streamed to decode.

The flags are in ``config.py``, the stage and app are built in ``app.py``; this module starts the
rest of a CPP group or dials it (``--stages``; ``stage_process.py``), then runs the app through
the roles' one lifecycle (``common/lifecycle.py``: serve, register, heartbeat, drain). A process
started as stage k > 0 of a group runs ``stage_process.run_stage``.
"""

from __future__ import annotations

import logging
import sys
import time

from mooncake_lite.common import sdnotify
from mooncake_lite.common.lifecycle import Listener, Membership, serve_role
from mooncake_lite.common.service import run as run_loop
from mooncake_lite.instance.profile import prefill_refiner, served_points
from mooncake_lite.model.checkpoint_config import model_args
from mooncake_lite.prefill.app import SERVICE, StoreUnfit, build_app, build_stage, registration, reported_cost, store_id
from mooncake_lite.prefill.config import Config, layer_slices
from mooncake_lite.prefill.engine import StageEngine
from mooncake_lite.prefill.pipeline import StageUnreachable
from mooncake_lite.prefill.profile_sink import profile_sink
from mooncake_lite.prefill.profiling import PACK_JOBS, PACK_TOKENS, busy_scale, profile_served, with_member_cost
from mooncake_lite.prefill.stage_process import GroupMismatch, StageGroup, connect_group, run_stage
from mooncake_lite.scheduler.costs import PrefillCostModel

# The head cannot serve as configured: it says why on stderr and exits 2 (not restarted in a loop).
REFUSALS = (StoreUnfit, StageUnreachable, GroupMismatch)

log = logging.getLogger(__name__)


async def _profile(cfg: Config, stage: StageEngine, downstream) -> tuple[PrefillCostModel | None, float]:
    """The start-up cost model, timed through the stage engine as it serves, its KV sent to a peer
    process (``profiling.py``, ``profile_sink.py``), and for a CPP head through all its stages; a
    lone instance's is then refined from every chunk it runs, and timed on its own threads too
    where it borrows CPUs (``busy_scale``).
    None (and 1) if that failed: it then registers none, as with --no-profile."""
    t0, stolen0 = time.monotonic(), stage.steal()
    try:
        async with profile_sink() as sink:
            cost, samples = await profile_served(stage, downstream, served_points(cfg.prefill_chunk), sink=sink)
            if downstream is None and min(cfg.prefill_batch_tokens, cfg.prefill_chunk) >= PACK_JOBS * PACK_TOKENS:
                cost = await with_member_cost(stage, cost, samples, sink=sink)   # packs: a CPP group never
            stolen = _stolen(stage, stolen0, t0)
            busy = await busy_scale(stage, sink=sink) if downstream is None else 1.0
            sent = "nowhere" if sink is None or sink.broken else "to a peer process"
    except Exception as exc:
        log.warning("start-up profiling skipped: %s", exc)
        return None, 1.0
    through = f"through its {cfg.pipeline_group} stages" if downstream else "through the stage engine"
    log.info("prefill cost model %s from %d timings %s, its KV %s (new on cached tokens: seconds %s%s); on its own threads "
             "%.2fx", cost.to_dict(), len(samples), through, sent,
             ", ".join(f"{t - p}+{p}: {s:.3f}" for t, p, s in samples), stolen, busy)
    if downstream is None:
        stage.refiner = prefill_refiner(cost)
    return cost, busy


def _stolen(stage: StageEngine, before: float | None, t0: float) -> str:
    """What the hypervisor took of the machine while the profile ran, for its log line: the
    served requests' steal (``steal_s``) is compared to it (docs/results/2026-12-01-zen3-admission.md §18)."""
    after = stage.steal() if before is not None else None
    elapsed = time.monotonic() - t0
    if after is None or elapsed <= 0.0:
        return ""
    return f"; the host stole {after - before:.2f} CPU-s of its {elapsed:.1f} s"


async def serve(cfg: Config, stage: StageEngine, group: StageGroup | None) -> int:
    """Check the store, reach the group's other stages, then serve (the exit status)."""
    # Before serving: a store whose slots cannot hold our blocks refuses every write-back, and
    # one that encodes blocks otherwise (--kv-compression) would have them misread.
    try:
        known_as = await store_id(cfg, stage.store, check=True)
    except StoreUnfit:
        await stage.store.close()
        raise
    try:
        if cfg.stage_addresses:
            sdnotify.notify(f"STATUS=prefill dialling CPP stages {cfg.stages}")
        downstream = await connect_group(cfg, group, known_as)
    except REFUSALS:
        close = getattr(stage.store, "close", None)   # a private store has nothing to close
        if close is not None:
            await close()
        raise
    cost, busy = await _profile(cfg, stage, downstream) if cfg.profile else (None, 1.0)
    app = build_app(cfg, stage, cost, downstream, busy)
    service = app[SERVICE]
    conductor = cfg.joins()
    membership = None if conductor is None else Membership(
        conductor, lambda addresses: registration(cfg, service, addresses, known_as), service.load,
        lambda: reported_cost(service), service.running, service.progressed)
    return await serve_role(app, Listener("prefill", cfg.host, cfg.port, cfg.advertise_host), membership)


def run(cfg: Config) -> int:
    if cfg.pipeline_stage > 0:
        return run_stage(cfg)
    sdnotify.notify(f"STATUS=prefill loading {cfg.model}")
    group = None
    if cfg.pipeline_group > 1 and not cfg.stage_addresses:   # no --stages: the head starts its stages
        group = StageGroup.spawn(cfg, layer_slices(model_args(cfg.model).num_layers, cfg.pipeline_group))
    try:
        stage = build_stage(cfg, cfg.layer_range)
        return run_loop(lambda: serve(cfg, stage, group))
    except REFUSALS as exc:
        sys.stderr.write(f"mooncake --role prefill: error: {exc}\n")
        return 2
    finally:
        if group is not None:
            group.stop()
