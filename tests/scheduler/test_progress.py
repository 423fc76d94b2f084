"""A started prefill job priced from its progress (scheduler/progress.py): the instance's reported
end replaces the prediction made before the job ran, in every path that prices a queue, and
admission then takes a request it would have refused behind a job nearly done."""

import pytest

from mooncake_lite.scheduler import BlockIndex, PrefillCostModel, PrefillView, QueuedPrefill, schedule
from mooncake_lite.scheduler.estimate import backlog_of, queues_at
from mooncake_lite.scheduler.progress import RATIO_BOUND, LaterChunks, seconds_left
from tests.scheduler.clusters import COSTS, cfg, cluster, prefill, request

MODEL = PrefillCostModel(c1=1e-3)      # 1 ms a token, nothing else: chunks price exactly


def test_seconds_left_scales_the_chunks_left_by_how_the_done_ones_ran():
    # 4,000 tokens, 1,000 cached: 3,000 to compute, priced 3 s
    assert seconds_left(MODEL, 4000, 1000, 0, 0.0, 0.4) == pytest.approx(2.6)      # no chunk done: the price
    assert seconds_left(MODEL, 4000, 1000, 1000, 1.0, 0.0) == pytest.approx(2.0)   # as priced
    assert seconds_left(MODEL, 4000, 1000, 1000, 0.5, 0.0) == pytest.approx(1.0)   # twice as fast
    assert seconds_left(MODEL, 4000, 1000, 1000, 2.0, 0.5) == pytest.approx(3.5)   # half as fast, one in flight
    assert seconds_left(MODEL, 4000, 1000, 3000, 9.0, 0.0) == 0.0                  # every token computed
    assert seconds_left(MODEL, 4000, 1000, 1000, 0.1, 5.0) == 0.0                  # never below nothing


def test_the_chunks_left_are_priced_as_later_ones():
    # 1,000 cached, 3,000 to compute in three chunks: the first loads the prefix and takes the
    # request in (c0), the later ones neither (later_c0, no c3 load)
    model = PrefillCostModel(c0=0.5, c1=1e-3, c3=1e-4, later_c0=0.1).with_chunk(1000)
    first = model.predict(2000, 1000)
    assert first == pytest.approx(0.5 + 1.0 + 0.1)
    assert model.chunk_after(3000, 2000) == model.chunk_after(4000, 3000) == pytest.approx(1.1)
    assert seconds_left(model, 4000, 1000, 1000, first, 0.0) == pytest.approx(2.2)     # as priced
    assert model.predict(4000, 1000) == pytest.approx(first + 2.2)


def test_the_measured_speed_moves_the_price_within_its_bound():
    # a first chunk 100x off either way (a burst beside it, a stall) moves the rest RATIO_BOUND x at most
    assert seconds_left(MODEL, 2000, 0, 1000, 100.0, 0.0) == pytest.approx(1.0 * RATIO_BOUND)
    assert seconds_left(MODEL, 2000, 0, 1000, 0.01, 0.0) == pytest.approx(1.0 / RATIO_BOUND)


def test_later_chunks_price_the_rest_in_place_of_the_done_ones_and_learn_within_bounds():
    # the first chunk ran at its price (1 s), the later ones lately at half theirs: the rest at half
    assert seconds_left(MODEL, 4000, 1000, 1000, 1.0, 0.0, later=0.5) == pytest.approx(1.0)
    assert seconds_left(MODEL, 4000, 1000, 1000, 1.0, 0.0, later=100.0) == pytest.approx(2.0 * RATIO_BOUND)
    later = LaterChunks()
    assert later.ratio is None                                    # nothing observed: the caller's own rule
    assert later.observe(2.0, 1.0) is None and later.ratio == pytest.approx(0.5)   # the first taken as is
    for _ in range(3):
        later.observe(1.0, 1.0)                                    # back at the price: bounded steps toward 1
    assert 0.5 < later.ratio < 1.0
    was = later.ratio
    for bad in (float("nan"), -1.0, float("inf")):
        assert later.observe(1.0, bad) is not None                 # refused, moves nothing
    assert later.observe(1.0, 1e6) is not None and later.ratio == was
    later.observe(1.0, 900.0)                                      # absurd but a number: one bounded step
    assert later.ratio / was == pytest.approx(1.1618, rel=1e-3)


@pytest.mark.xfail(strict=True, reason="the later chunks' factor is kept against the model of the day (results §17)")
def test_a_refined_model_leaves_what_a_later_chunk_is_priced_at():
    # learned against one model, the instance refines it to twice its level (Zen 3's first
    # refinement): a later chunk's price times the factor should stay what the chunk took. Kept
    # against the model of the day, the factor prices a job's rest after one chunk 2x long until
    # bounded steps wear it off. Fixed twice (c0c10f3, a rebase; 4765728, the median of the last
    # 32 re-priced: live, the rest's p90 error 1.54 -> 0.52 s) and reverted: with the rest priced
    # right, the first 50's TTFT error was 16.7-24.5% in four runs of four (controls 12.8-14.9%),
    # the long rest having hidden the served chunk's 1.23x over its start-up price. Fix that first.
    old, new = PrefillCostModel(c1=1e-3), PrefillCostModel(c1=2e-3)
    later = LaterChunks()
    later.observe(old.chunk_after(1024, 512), 0.6)                 # 0.512 s priced, 0.6 s taken
    # the instance now prices with `new`: the rest of a job, one chunk in, at what its chunks take
    assert seconds_left(new, 2048, 0, 1024, 1.0, 0.0, later=later.ratio) == pytest.approx(1.2, rel=0.02)


@pytest.mark.parametrize("pack_tokens", [0, 512])
def test_a_reported_end_replaces_the_predicted_duration_of_the_started_head(pack_tokens):
    # the head: 5,000 tokens priced 5 s, started at 0; behind it 300 tokens (0.3 s)
    head, behind = QueuedPrefill("h", 5000, 0, 0.0), QueuedPrefill("b", 300)
    p = prefill("p0", (head, behind), pack_tokens=pack_tokens)
    assert queues_at([backlog_of(p, MODEL)], 1.0).queue_s[0] == pytest.approx(4.3)     # 5 - 1 + 0.3
    for ends_at, at_1 in ((1.5, 0.8), (7.0, 6.3)):      # nearly done / running late
        reported = prefill("p0", (QueuedPrefill("h", 5000, 0, 0.0, ends_at=ends_at), behind), pack_tokens=pack_tokens)
        assert queues_at([backlog_of(reported, MODEL)], 1.0).queue_s[0] == pytest.approx(at_1)
    # a report on a job not running says nothing
    waiting = prefill("p0", (QueuedPrefill("h", 5000, ends_at=1.0), behind), pack_tokens=pack_tokens)
    assert queues_at([backlog_of(waiting, MODEL)], 1.0).queue_s[0] == pytest.approx(5.3)


def test_admission_takes_a_short_prompt_behind_a_long_job_its_instance_says_is_nearly_done():
    """The Zen 3 burst (docs/results/2026-12-01-zen3.md §7): a long job priced seconds from its
    end was 1.4 s from it, and the short prompts behind it were refused."""
    view = PrefillView("p0", "s-p0", 10_000, None)
    view.price_with(COSTS.prefill)
    view.add("long", 5000, 0, started_at=0.0)
    config = cfg(ttft_slo_s=2.0)

    def decide(now):
        return schedule(request(10, rid=f"r{now}"), cluster([view.state()]), index=BlockIndex(), config=config,
                        costs=COSTS, now=now)
    refused = decide(1.0)                       # 4 s left by the prediction, + 0.1 s of its own
    assert not refused.accepted and refused.reject_cause == "ttft"
    assert view.report_end("long", 2.4)         # its chunks say 1.4 s left
    admitted = decide(1.0)
    assert admitted.accepted and admitted.predicted_ttft_s == pytest.approx(1.5)
    assert not view.report_end("other", 2.0)    # not the head here: the view's price stands
    assert decide(1.0).predicted_ttft_s == pytest.approx(1.5)


def test_a_view_behind_its_instance_follows_the_job_the_instance_says_it_runs():
    """Live on Zen 3 (docs/results/2026-12-01-zen3-admission.md §11) a view started the next job
    of its own order when one ended, while the instance ran another: a long one the view still
    priced whole behind the started short one. Told which job runs (``now`` given: the live
    conductor's heartbeat), the view puts it first, started, and the short one waits again."""
    view = PrefillView("p0", "s-p0", 10_000, None)
    view.price_with(COSTS.prefill)
    view.add("short", 200, 0, started_at=0.0)   # the view's guess: the short one runs
    view.add("long", 5000, 0)
    assert view.report_end("long", 3.0, 2.5)    # the instance: the long one runs, 0.5 s left
    queue = view.state().queue
    assert [j.request_id for j in queue] == ["long", "short"]
    assert queue[0].started_at == 2.5 and queue[0].ends_at == 3.0 and queue[1].started_at is None
    waited = queues_at([backlog_of(view.state(), COSTS.prefill)], 2.5).queue_s[0]
    assert waited == pytest.approx(0.5 + COSTS.prefill.predict(200))
    assert not view.report_end("gone", 3.0, 2.5)    # a job this view does not hold: another conductor's
