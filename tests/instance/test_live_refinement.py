"""The real instances' refinement path: the engines time what they run, the refiner heals a
pessimistic start-up profile, and what the heartbeats carry (``reported_cost``) is the healed
model — which decode's own TBT check and prefill's queue figure use too."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from mooncake_lite.decode.app import reported_cost as decode_cost
from mooncake_lite.decode.batcher import DecodeBatcher
from mooncake_lite.decode.engine import DecodeEngine
from mooncake_lite.instance.profile import decode_refiner, prefill_refiner
from mooncake_lite.instance.refine import cost_report
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.app import reported_cost as prefill_cost
from mooncake_lite.prefill.engine import StageEngine
from mooncake_lite.prefill.service import PrefillService
from mooncake_lite.scheduler.costs import DecodeCostModel, PrefillCostModel
from tests.prefill.test_stage import run_prompt, tokens_of

pytestmark = pytest.mark.timeout(120)

# Start-up profiles no CPU this test runs on could be as slow as: 5 s a decode step, 5 s a chunk.
BAD_DECODE = DecodeCostModel(c0=5.0, c1=0.5, c2=1e-3)
BAD_PREFILL = PrefillCostModel(c0=5.0, c1=0.05, c2=1e-4, c3=0.0)


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=3)


async def test_decode_steps_heal_the_profile_and_the_local_tbt_check(model):
    runner = ModelRunner(model, num_blocks=32, block_size=8)
    batcher = DecodeBatcher(runner.allocator, 8, cost=BAD_DECODE, tbt_slo_s=1.0)
    engine = DecodeEngine(runner, batcher, ThreadPoolExecutor(1), refiner=decode_refiner(BAD_DECODE))
    assert decode_cost(engine) == cost_report(BAD_DECODE)
    assert "exceeds the TBT SLO" in batcher.check_admit(8, 4)     # refused, on an idle instance
    batcher.tbt_slo_s = None          # let two requests in to run steps (what an SLO-less decode does)
    for rid in ("a", "b"):
        batcher.reserve(rid, 16, 24)
        batcher.join(rid, 1)
    batcher.tbt_slo_s = 1.0
    steps = asyncio.create_task(engine.run())
    try:
        while batcher.num_running:
            await asyncio.sleep(0.01)
    finally:
        steps.cancel()
    assert engine.refiner.num_samples == engine.num_steps == 23
    healed = decode_cost(engine)
    assert healed != cost_report(BAD_DECODE) and healed == cost_report(batcher.cost)
    assert batcher.cost.predict(2, 80) < BAD_DECODE.predict(2, 80) / 20
    assert batcher.check_admit(8, 4) is None                       # the local check admits again


async def test_prefill_chunks_heal_the_profile_the_heartbeats_carry(model):
    stage = StageEngine(ModelRunner(model, num_blocks=16, block_size=8), None, ThreadPoolExecutor(1))
    stage.refiner = prefill_refiner(BAD_PREFILL)
    service = PrefillService(stage, None, block_size=8, hash_seed=0, chunk_size=16, cost=BAD_PREFILL)
    assert prefill_cost(service) == cost_report(BAD_PREFILL)
    for seed in range(6):             # chunks (16 on 0), (16 on 16), (8 on 32), 6 of each
        await run_prompt(stage, tokens_of(40, seed), chunk=16)
    assert stage.refiner.num_samples == 18
    healed = prefill_cost(service)
    assert healed == cost_report(service.cost)
    assert service.cost.predict(40) < BAD_PREFILL.predict(40) / 20
    assert service.cost.later_c0 is not None     # the chunks after the first, fitted as their own kind
