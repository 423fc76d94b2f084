"""The start-up cost model is timed as the instance serves: chunks through its stage engine, so a
cost of the served path that the model's forward does not have (on a GPU, the per-layer hop
between the event loop and the model thread) is in the model the conductor is first given."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mooncake_lite.instance.profile import profile_prefill
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.engine import StageEngine
from mooncake_lite.prefill.profiling import busy_scale, profile_served
from mooncake_lite.prefill.store_io import MemoryStore
from mooncake_lite.prefill.threads import BorrowingExecutor, ThreadBorrower

HOP_S = 0.01   # per layer and chunk: what the served path adds here, and only here


@pytest.fixture
def stage():
    runner = ModelRunner(build_model("tiny", seed=3), num_blocks=200, block_size=16)
    layer_bytes = runner.cache.kv[0].numel() // runner.cache.num_blocks * runner.cache.kv.element_size()
    engine = StageEngine(runner, MemoryStore((0, runner.args.num_layers), layer_bytes), ThreadPoolExecutor(1),
                         write_back=False)
    yield engine
    engine.executor.shutdown(wait=True)


def test_the_profile_prices_the_served_path_not_the_forward(stage, monkeypatch):
    layer = StageEngine._layer

    def slow_layer(self, *args):
        time.sleep(HOP_S)
        return layer(self, *args)
    monkeypatch.setattr(StageEngine, "_layer", slow_layer)
    served, samples = asyncio.run(profile_served(stage, repeats=1))
    forward, _ = profile_prefill(stage.runner, repeats=1)
    layers = stage.runner.args.num_layers
    # every chunk paid the hop in each layer: the fixed cost holds it, the forward's does not
    assert served.c0 >= 0.8 * layers * HOP_S > forward.c0
    assert all(s >= layers * HOP_S for *_, s in samples)
    assert len(stage.timeline) == 0 and not stage.jobs      # nothing left of the profile's requests
    assert stage.runner.allocator.num_free == stage.runner.cache.num_blocks


def test_a_borrowing_stage_times_its_chunks_on_its_own_threads_too(stage, monkeypatch):
    """busy_scale: the chunks' time on the stage's own threads over with the borrowed ones (here a
    hop per layer twice as long on one thread: (c + 2h) / (c + h) for a layer's compute c, which
    nears 2 as h outgrows c); 1 where it borrows none. (h = 10 ms gave 1.46 on a Zen 3 under the
    whole suite: its compute was past h.)"""
    assert asyncio.run(busy_scale(stage)) == 1.0
    borrower = ThreadBorrower(1, 1, num_cpus=2, busy=lambda: None, apply=lambda n: None)
    stage.executor.shutdown(wait=True)
    stage.executor = BorrowingExecutor(borrower)
    layer = StageEngine._layer

    def layer_by_threads(self, *args):
        time.sleep(3 * HOP_S * (2 if borrower.threads == borrower.own else 1))
        return layer(self, *args)
    monkeypatch.setattr(StageEngine, "_layer", layer_by_threads)
    scale = asyncio.run(busy_scale(stage, repeats=1))
    assert 1.25 < scale <= 2.0   # above 1.25 while a layer computes in under 3 h
    assert len(stage.timeline) == 0 and not stage.jobs


def test_the_start_up_shapes_include_a_full_chunk_alone_and_after_two():
    """A long prompt runs as full chunks at a growing prefix: the profile times that shape, so the
    fitted model's growth with the prefix is measured, not extrapolated from short forwards."""
    from mooncake_lite.instance.profile import QUICK_PREFILL, served_points
    assert served_points(512)[:len(QUICK_PREFILL)] == QUICK_PREFILL
    assert served_points(512)[len(QUICK_PREFILL):] == ((512, 0), (512, 1024))
    assert served_points(0) == QUICK_PREFILL          # no chunk said: the quick shapes


def test_one_slow_full_chunk_does_not_price_short_prompts_short():
    """The start-up fit weighs each timing's error relative to it: a full chunk after two timed at
    1.8x (other work on the machine) moves what the model says of a long prompt, but not a short
    prompt's price (fitted in plain seconds it took c1 to 0.36x and priced 192 tokens at 0.82x,
    as a Zen 3 start-up did: docs/results/2026-12-01-zen3-admission.md §16)."""
    from mooncake_lite.instance.profile import fit_prefill, served_points
    from mooncake_lite.scheduler.costs import PrefillCostModel
    true = PrefillCostModel(0.09, 0.0013, 5.1e-7, 1e-5)     # Zen 3's default model, quiet
    samples = [(n + p, p, true.predict(n + p, p) * (1.8 if (n, p) == (512, 1024) else 1.0))
               for n, p in served_points(512)]
    fitted = fit_prefill(samples)
    for n in (32, 96, 192):
        assert fitted.predict(n) == pytest.approx(true.predict(n), rel=0.06)
    assert fitted.c1 == pytest.approx(true.c1, rel=0.2)


def test_other_work_for_two_timings_in_a_row_slows_no_shape_s_best(stage, monkeypatch):
    """Each shape's best is over passes of all the shapes: a disturbance as long as two timings
    falls on two shapes' first pass, not on both timings of one shape."""
    import mooncake_lite.prefill.profiling as profiling
    calls = []

    async def timed(stage, downstream, rid, n, p, sender):
        calls.append((n, p))
        slow = 3.0 if len(calls) in (6, 7) else 1.0      # after the three warm-ups: timings 3 and 4
        return slow * (0.01 + 1e-4 * n + 1e-6 * n * (n + p))
    monkeypatch.setattr(profiling, "_time_chunk", timed)
    _, samples = asyncio.run(profile_served(stage, repeats=2))
    assert [s for *_, s in samples] == [0.01 + 1e-4 * (t - p) + 1e-6 * (t - p) * t for t, p, _ in samples]


def test_a_packs_member_cost_is_timed_at_start_up(stage, monkeypatch):
    """``member_c0``: a pack of four short prompts against the same prompts alone. Each job's own
    frames cost here ``HOP_S`` a layer (what a member of a pack pays and the pack does not share):
    the member cost holds them, and the fixed cost the pack shares does not."""
    import mooncake_lite.prefill.engine as engine
    from mooncake_lite.prefill.profiling import with_member_cost
    send = engine.send_frame

    def slow_send(*args):
        time.sleep(HOP_S)
        return send(*args)
    monkeypatch.setattr(engine, "send_frame", slow_send)
    cost, samples = asyncio.run(profile_served(stage, repeats=1))
    priced = asyncio.run(with_member_cost(stage, cost, samples, repeats=1))
    layers = stage.runner.args.num_layers
    assert priced.member_c0 >= 0.8 * layers * HOP_S and priced.shared_c0 < cost.c0
    assert (priced.c0, priced.c1) == (cost.c0, cost.c1)
    assert len(stage.timeline) == 0 and not stage.jobs
    assert stage.runner.allocator.num_free == stage.runner.cache.num_blocks
