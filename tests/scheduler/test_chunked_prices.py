"""A prompt longer than its prefill instance's chunk is priced as the sum of its chunks (issue #36,
"predictions that hold"): the instance runs it chunk by chunk, each chunk one forward over the
keys before it, and its refiner fits the model on those chunks. The closed form
(``PrefillCostModel._chunked``) against the explicit sum; the common case exactly ``predict``;
the chunk reaching the conductor from a registration (an older instance's none: one pass, a
hostile one refused), the simulator from its config and the fidelity bench from the live flags."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from mooncake_lite.bench.fidelity.sim import live_profile
from mooncake_lite.common.cost_report import CostReport, PrefillCost
from mooncake_lite.common.protocol import ProtocolError, Register, dumps, loads
from mooncake_lite.conductor.cluster.membership import Membership, PrefillJob
from mooncake_lite.scheduler import (BlockIndex, ClusterState, CostModels, DecodeCostModel, DecodeInstanceState,
                                     FromScratch, PrefillCostModel, ScheduleRequest, Scheduler, SchedulerConfig)
from mooncake_lite.scheduler.costs import scaled
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from tests.sim.helpers import req, toy_hardware

MODEL = PrefillCostModel(c0=0.005, c1=2e-4, c2=1e-7, c3=1e-5)


def chunk_by_chunk(model: PrefillCostModel, num_tokens: int, prefix: int, chunk: int) -> float:
    """The instance's loop (prefill/service.py ``_chunks``), each chunk priced as its own forward:
    the first loads the cached prefix, a later one has its own fixed cost and loads nothing."""
    start = min(prefix, num_tokens - 1)
    end = min(start + chunk, num_tokens)
    total, start = model.predict(end, start), end
    while start < num_tokens:
        end = min(start + chunk, num_tokens)
        total += model.chunk_after(end, start)
        start = end
    return total


coefficient = st.floats(0.0, 1.0, allow_nan=False, allow_infinity=False)


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 40_000), st.integers(0, 40_000), st.integers(1, 5_000),
       st.tuples(coefficient, coefficient, coefficient, coefficient, st.none() | coefficient))
def test_the_closed_form_is_the_sum_of_the_chunks(num_tokens, prefix, chunk, scales):
    later = None if scales[4] is None else scales[4] * 0.01
    model = PrefillCostModel(*(s * c for s, c in zip(scales, (0.01, 1e-4, 1e-8, 1e-6))), later)
    got = model.with_chunk(chunk).predict(num_tokens, prefix)
    assert got == pytest.approx(chunk_by_chunk(model, num_tokens, prefix, chunk), rel=1e-12, abs=1e-15)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 20_000), st.integers(-5, 20_000), st.integers(1, 20_000))
def test_a_prompt_within_its_chunk_is_priced_exactly_as_one_pass(num_tokens, prefix, chunk):
    uncached = num_tokens - min(max(prefix, 0), num_tokens - 1)
    if uncached <= chunk:
        assert MODEL.with_chunk(chunk).predict(num_tokens, prefix) == MODEL.predict(num_tokens, prefix)


def test_a_long_prompt_costs_about_half_the_attention_of_one_pass():
    attention = PrefillCostModel(c2=1e-8)
    one_pass, chunked = attention.predict(64_000), attention.with_chunk(512).predict(64_000)
    assert 0.5 < chunked / one_pass < 0.51


def test_the_chunk_never_travels_and_survives_a_correction():
    chunked = MODEL.with_chunk(512)
    assert chunked.to_dict() == MODEL.to_dict()                    # an older peer's from_dict reads it
    assert PrefillCostModel.from_dict(chunked.to_dict()) == MODEL
    with pytest.raises(ValueError, match="unknown coefficient"):
        PrefillCostModel.from_dict({**MODEL.to_dict(), "chunk": 512})
    assert MODEL.with_chunk(0) is MODEL and chunked.with_chunk(512) is chunked
    assert chunked.with_chunk(0) == MODEL
    assert scaled(chunked, 2.0).predict(4000) == pytest.approx(2.0 * chunked.predict(4000))
    with pytest.raises(ValueError, match="negative"):
        MODEL.with_chunk(-1)


def _reg(chunk: int | None) -> Register:
    extra = {} if chunk is None else {"prefill_chunk": chunk}
    return Register(role="prefill", instance_id="p", http="h-p:1", data=None, store="s:1", model="tiny",
                    block_size=16, hash_seed=0, kv_bytes_per_token=64, max_context=100_000,
                    cost=CostReport(prefill=PrefillCost(MODEL.c0, MODEL.c1, MODEL.c2, MODEL.c3)), **extra)


def _priced_at_conductor(reg: Register, num_tokens: int) -> tuple[float, float]:
    """(the decision's predicted prefill of a prompt, the queued job's price in the view's row)."""
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(reg, now=0)
    costs = CostModels(PrefillCostModel(c0=1.0), DecodeCostModel(c0=0.01), kv_bytes_per_token=64)
    state = m.snapshot()
    d = Scheduler(SchedulerConfig(block_size=16, admission="none"), costs, BlockIndex(), cache=FromScratch()).schedule(
        ScheduleRequest("x", (), num_tokens, 8), ClusterState(state.prefills, (DecodeInstanceState("d"),)), 0.0)
    m.add_prefill("p", PrefillJob("r", num_tokens, 0, "d"), now=0.0)
    view = m.instances["p"].view
    view.price_with(costs.prefill)
    view.state()
    return d.predicted_prefill_s, view.row.total_s


def test_an_instance_registering_its_chunk_has_long_prompts_priced_chunk_by_chunk():
    assert _priced_at_conductor(_reg(512), 4000) == pytest.approx((chunk_by_chunk(MODEL, 4000, 0, 512),) * 2)
    assert _priced_at_conductor(_reg(512), 500) == (MODEL.predict(500),) * 2


def test_an_older_instance_without_a_chunk_is_priced_in_one_pass():
    assert _priced_at_conductor(_reg(None), 4000) == pytest.approx((MODEL.predict(4000),) * 2)
    assert _priced_at_conductor(_reg(0), 4000) == pytest.approx((MODEL.predict(4000),) * 2)


@pytest.mark.parametrize("bad", [-1, 1 << 30, 512.5, "512", True, None])
def test_a_hostile_chunk_is_refused_when_the_registration_is_decoded(bad):
    raw = orjson.loads(dumps(_reg(512)))
    assert loads(Register, orjson.dumps(raw)).prefill_chunk == 512
    raw["prefill_chunk"] = bad
    with pytest.raises(ProtocolError, match="prefill_chunk"):
        loads(Register, orjson.dumps(raw))


def test_the_simulator_runs_and_prices_a_long_prompt_chunk_by_chunk():
    hw = toy_hardware(prefill=MODEL)
    cfg = SimConfig(num_prefill=1, num_decode=1, prefill_chunk=512, prefill_chunked=True,
                    scheduler=SchedulerConfig(admission="none"))
    sim = MooncakeSim(cfg, hardware=hw)
    sim.decisions = decisions = []
    done = sim.run([req(0, 0.0, 4000, 2)]).requests[0]
    chunked = chunk_by_chunk(MODEL, 4000, 0, 512)
    assert decisions[0].predicted_prefill_s == pytest.approx(chunked)
    assert done.ttft == pytest.approx(chunked)               # its prefill, run chunk by chunk too
    one_pass = MooncakeSim(SimConfig(num_prefill=1, num_decode=1, prefill_chunk=512), hardware=hw)
    one_pass.decisions = decisions = []
    one_pass.run([req(0, 0.0, 4000, 2)])
    assert decisions[0].predicted_prefill_s == pytest.approx(MODEL.predict(4000))


def test_the_fidelity_bench_simulates_the_live_prefills_chunk(tmp_path):
    path = tmp_path / "costs.json"
    path.write_bytes(orjson.dumps({"prefill": MODEL.to_dict()}))
    assert live_profile(path, "").prefill == MODEL.with_chunk(512)            # the role's default
    assert live_profile(path, "--queue-order fifo --prefill-chunk 1024").prefill == MODEL.with_chunk(1024)
