"""The delivery jitter (issue #36 item 4): what the path from a decode's step to the client moves a
token gap by, measured by ``bench fidelity`` from the client's chunks against the decode's step
timeline, and drawn per gap by the simulated decode — TBT rises, the mean gap and every decision
stay, and nothing changes without it."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from mooncake_lite.bench.fidelity import delivery
from mooncake_lite.common.tbt import slowest_count
from mooncake_lite.scheduler import SchedulerConfig
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from tests.sim.helpers import req, toy_hardware

STEP = 0.01
LATE = (-0.006,) + (0.0,) * 8 + (0.006,)    # one gap in ten 6 ms longer, one shorter: mean 0


def run(hw, jitter=()):
    cfg = SimConfig(num_prefill=1, num_decode=1, seed=0, store_blocks_per_node=100,
                    scheduler=SchedulerConfig(admission="none", ttft_slo_s=100.0, tbt_slo_s=10.0))
    sim = MooncakeSim(cfg, hardware=hw)
    for d in sim.decodes:
        d.batch.deliver_with(jitter)
    return sim.run([req(i, 0.05 * i, 600 + 37 * i, 40 + 3 * i) for i in range(12)]).requests


def outcome(results):
    return [(r.status, r.prefill_id, r.decode_id, r.ttft, r.tbt, r.mean_gap, r.finish) for r in results]


@pytest.mark.parametrize("ratios", [(), (0.9,) * 8 + (1.0, 3.0)])
def test_jitter_raises_tbt_keeps_decisions_mean_gap_and_the_step_draws(ratios):
    hw = dataclasses.replace(toy_hardware(step_s=STEP), decode_step_ratios=ratios)
    plain, late, again = run(hw), run(hw, LATE), run(hw, LATE)
    assert outcome(late) == outcome(again)                     # seeded: a run repeats
    assert outcome(run(hw, ())) == outcome(plain)              # none: as before
    for p, j in zip(plain, late):
        assert (j.status, j.prefill_id, j.decode_id, j.ttft, j.finish) == \
               (p.status, p.prefill_id, p.decode_id, p.ttft, p.finish)
        assert j.mean_gap == pytest.approx(p.mean_gap, abs=0.0025)
    # a late token's gap is what TBT reads
    assert np.mean([j.tbt for j in late]) > np.mean([p.tbt for p in plain]) + 0.001
    assert np.mean([j.mean_gap for j in late]) == pytest.approx(np.mean([p.mean_gap for p in plain]), rel=0.03)


def test_jitter_never_makes_a_gap_negative():
    for r in run(toy_hardware(step_s=STEP), (-1.0,)):   # every gap but the first comes to 0, none below
        gaps = r.output_length - 1
        assert r.tbt * slowest_count(gaps) == pytest.approx(r.mean_gap * gaps)


def _timeline(n=40, start=100.0):
    """A decode's steps, one every 10 ms: (start, seconds, batch, context, waited, longest)."""
    return {"steps": [[start + STEP * i, STEP * 0.9, 1, 100, 0, 100] for i in range(n)]}


def test_request_jitter_is_the_client_gap_less_the_step_end_gap():
    ends = delivery.step_ends(_timeline())
    lags = [0.0005, 0.0005, 0.0125, 0.0005, 0.0005, 0.0005]   # token 4 held past the next step's end
    tokens = [ends[4] - 0.003] + [ends[5 + k] + lag for k, lag in enumerate(lags)]
    assert delivery.first_step(tokens, ends) == 5
    assert delivery.request_jitter(tokens, ends) == pytest.approx([0.0, 0.012, -0.012, 0.0, 0.0])
    assert delivery.request_jitter([t - 1.0 for t in tokens], ends) is None   # before the timeline
    spread = [ends[5], ends[7] + 0.001, ends[9] + 0.001, ends[11] + 0.001]   # not one token a step: not ours
    assert delivery.request_jitter(spread, ends) is None


def _record(tokens, ok=True):
    return SimpleNamespace(is_ok=ok, chunk_s=(*tokens, tokens[-1] + 1e-4), output_tokens=len(tokens))


def test_delivery_jitter_pools_requests_done_by_until_in_equal_mass_bins():
    lines = {"http://decode": _timeline(400), "http://prefill": {"forwards": [[100.0, 101.0]]}}
    ends = delivery.step_ends(lines["http://decode"])
    records = [_record([ends[10 * i]] + [ends[10 * i + 1 + k] + (0.004 if k % 4 == 1 else 0.0) for k in range(9)])
               for i in range(25)]
    jitter = delivery.delivery_jitter(records, lines)
    assert len(jitter) == delivery.BINS and list(jitter) == sorted(jitter)
    assert np.mean(jitter) == pytest.approx(0.0, abs=1e-9)    # late then on time: the mean stays
    assert jitter[-1] == pytest.approx(0.004) and jitter[0] == pytest.approx(-0.004)
    assert len(delivery.delivery_jitter(records, lines, until=ends[100])) == 80   # the 10 done by then, 8 gaps each
    assert delivery.delivery_jitter(records, lines, until=ends[50]) == ()   # too few gaps known by then
    failed = [_record(r.chunk_s[:-1], ok=False) for r in records]
    assert delivery.delivery_jitter(failed, lines) == ()


def test_the_bench_runs_without_the_jitter_beside_the_other_ablations_and_prints_it():
    from mooncake_lite.bench.fidelity import cli, report
    hw = dataclasses.replace(toy_hardware(step_s=STEP), decode_step_ratios=(0.9,) * 8 + (1.0, 3.0))
    live = report.Side(ttft=(1.0,), tbt=(0.02,), completed=1, rejected=frozenset(), failed=0,
                       prefix_hit_tokens=0, prompt_tokens=0)
    calls = []

    def simulated(costs, jitter=None):
        calls.append((costs.decode_step_ratios, jitter))
        return SimpleNamespace(requests=run(costs, jitter))
    rows = cli.without_each(live, hw, simulated, LATE, 1)
    assert set(rows) == {"sim_without_step_spread", "sim_without_delivery_jitter"}
    assert calls == [((), LATE), (hw.decode_step_ratios, ())]   # each without one thing, the rest kept
    assert "sim_without_delivery_jitter" not in cli.without_each(live, hw, simulated, (), 1)
    assert report.jitter_lines(()) == []
    assert "highest 6.00" in report.jitter_lines(LATE)[0]
