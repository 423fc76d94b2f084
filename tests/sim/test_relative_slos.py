"""Relative SLOs in the simulator (issue #36, fidelity): the live conductor's defaults (TTFT ≤
factor × the prompt's prefill alone, TBT ≤ factor × one step alone) judged per request by every
check the simulator runs — the conductor's, the decode's own at reservation or at KV arrival,
the local TTFT check — and ``bench fidelity``'s simulated side given the live factors."""

from __future__ import annotations

import orjson
import pytest

from mooncake_lite.bench.fidelity import report as fidelity_report
from mooncake_lite.bench.fidelity import sim as fidelity_sim
from mooncake_lite.scheduler import DecodeCostModel, SchedulerConfig
from mooncake_lite.scheduler.admission import tbt_refusal
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from mooncake_lite.sim.metrics import summarize
from tests.sim.helpers import req, toy_hardware

RELATIVE = {"ttft_slo_s": None, "tbt_slo_s": None}


def by_id(res):
    return {r.request_id: r for r in res.requests}


# A 3000-token prompt takes the one prefill for 3 s (1 ms a token); at 0.1 s a short prompt
# (200 tokens: limit 10 x 0.2 s = 2 s) and a long one (1000 tokens: limit 10 s) arrive behind it.
QUEUED = [req(0, 0.0, 3000, 3), req(1, 0.1, 200, 3), req(2, 0.1, 1000, 3)]


@pytest.mark.parametrize("admission", ["early", "predictive"])
def test_each_prompt_is_judged_by_its_own_limit_as_the_live_conductor(admission):
    cfg = SimConfig(num_prefill=1, num_decode=1, scheduler=SchedulerConfig(admission=admission, **RELATIVE))
    sim = MooncakeSim(cfg, toy_hardware())
    sim.decisions = []
    r = by_id(sim.run(QUEUED))
    # the short one waits 2.9 s + its 0.2 s: over its 2 s limit; the long one's 3.9 s is under its 10 s
    assert (r[1].status, r[1].reject_stage, r[1].reject_cause) == ("rejected", "conductor", "ttft")
    assert r[0].status == r[2].status == "completed"
    why = sim.decisions[1].reason
    assert "SLO 2s" in why and "10x the 0.2s of this prompt alone" in why   # slo_violation's own words
    assert sim.slo_limits(200) == pytest.approx((2.0, 0.05)) and sim.slo_limits(1000)[0] == pytest.approx(10.0)
    # one absolute SLO for all (what bench fidelity gave before) turns it round: the short one in, the long one out
    absolute = SimConfig(num_prefill=1, num_decode=1,
                         scheduler=SchedulerConfig(admission=admission, ttft_slo_s=3.5, tbt_slo_s=1.0))
    r = by_id(MooncakeSim(absolute, toy_hardware()).run(QUEUED))
    assert [r[i].status for i in range(3)] == ["completed", "completed", "rejected"]


def test_the_local_ttft_check_and_the_attainment_take_each_prompts_limit():
    cfg = SimConfig(num_prefill=1, num_decode=1, local_ttft_check=True,
                    scheduler=SchedulerConfig(admission="none", **RELATIVE))
    sim = MooncakeSim(cfg, toy_hardware())
    res = sim.run(QUEUED)
    r = by_id(res)
    assert (r[1].reject_stage, r[1].reject_cause) == ("prefill", "ttft") and r[2].status == "completed"
    s = summarize(res, None, None, sim.slo_limits)
    assert s["slo_attainment"] == pytest.approx(2 / 3)   # both served met their own limits
    with pytest.raises(ValueError, match="relative SLOs"):
        summarize(res, None, None)
    assert all(row["prefill_load"] >= 0 and row["decode_held_load"] >= 0 for row in res.timeline)


# one step: 10 ms + 10 ms a sequence; alone 20 ms, limit 5 x that = 100 ms: the 5th sequence (110 ms) is over
STEP = DecodeCostModel(c0=0.01, c1=0.01)


def test_the_decodes_own_check_with_a_factor():
    assert tbt_refusal(STEP, 3, 300, 100, None, 5.0) is None                     # batch 4: 50 ms
    assert "5x a step alone" in tbt_refusal(STEP, 9, 900, 100, None, 5.0)         # batch 10: 110 ms
    trace = [req(i, 0.001 * i, 100, 50) for i in range(12)]
    for check, stage_cause in (("reserve", "reserve-tbt"), ("arrival", "tbt")):
        cfg = SimConfig(num_prefill=1, num_decode=1, decode_check=check,
                        scheduler=SchedulerConfig(admission="none", **RELATIVE))
        res = MooncakeSim(cfg, toy_hardware(decode=STEP, prefill_per_token=1e-6)).run(trace)
        served = [r for r in res.requests if r.status == "completed"]
        refused = {r.reject_cause for r in res.requests if r.status == "rejected"}
        assert refused == {stage_cause} and 1 <= len(served) <= 9, check   # never a 10th at once
        if check == "reserve":
            assert len(served) == 9   # nine held at once: 100 ms <= the limit, the tenth refused


def test_fidelity_gives_the_simulated_conductor_the_live_factors():
    hw = toy_hardware()
    res = fidelity_sim.simulate(QUEUED, hw, prefill=1, decode=1, admission="predictive", ttft_slo_s=None,
                                tbt_slo_s=None, block=512, slo_factors=(10.0, 5.0))
    sched = res.config["scheduler"]
    assert (sched["ttft_slo_s"], sched["tbt_slo_s"], sched["ttft_slo_factor"], sched["tbt_slo_factor"]) == \
        (None, None, 10.0, 5.0)
    assert fidelity_sim.sim_side(res).rejected == {1}
    # what the report shows for people: the limits' median, labelled relative
    slos = fidelity_sim.converted_slos([t.input_length for t in QUEUED], hw, 10.0, 5.0)
    assert slos["ttft_slo_s"] == pytest.approx(10.0) and slos["how"].startswith("relative on both sides")


def test_prefix_hits_are_also_compared_over_the_requests_both_completed():
    def side(hits, rejected):
        return fidelity_report.Side(ttft=(1.0,) * len(hits), tbt=(), completed=len(hits), rejected=frozenset(rejected),
                                    failed=0, prefix_hit_tokens=sum(hits.values()), prompt_tokens=0, hit_tokens=hits)
    rows = fidelity_report.compare(side({1: 100, 2: 50}, {3}), side({1: 80, 3: 500}, {2}), 3)["rows"]
    assert rows["prefix_hit_tokens"]["sim"] == 580                       # each side's own completed
    both = rows["prefix_hit_tokens_both"]
    assert (both["live"], both["sim"], both["requests"]) == (100, 80, 1)
    assert both["rel_error"] == pytest.approx(-0.2)


def test_mooncake_sim_takes_slo_factors_without_an_absolute_slo(tmp_path, capsys):
    from mooncake_lite.sim.cli import main
    from mooncake_lite.trace.format import write_trace
    path = tmp_path / "t.jsonl"
    write_trace(QUEUED, path)
    base = [str(path), "--prefill", "1", "--decode", "1", "--admission", "early", "--cost-model", "llama2-70b-a800",
            "--no-progress"]
    assert main([*base, "--ttft-slo-factor", "10", "--tbt-slo-factor", "5", "--json"]) == 0
    s = orjson.loads(capsys.readouterr().out)
    assert s["slo"] == {"ttft_s": None, "tbt_s": None} and s["completed"] + s["rejected"] == 3
    assert main([*base, "--ttft-slo-factor", "10", "--tbt-slo-factor", "5"]) == 0
    assert "TTFT SLO 10x prefill alone, TBT SLO 5x a step alone" in capsys.readouterr().out
    assert main([*base, "--ttft-slo-factor", "0.5"]) == 2 and "ttft_slo_factor" in capsys.readouterr().err
    assert main([*base, "--tbt-slo-factor", "5", "--baseline"]) == 2 and "absolute SLOs" in capsys.readouterr().err


def test_the_live_decodes_check_by_the_conductors_slo(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from mooncake_lite.bench.fidelity import live as fidelity_live
    monkeypatch.setattr(fidelity_live, "UpCluster", lambda args, **kw: args)
    ns = SimpleNamespace(model="m", prefill=1, decode=1, block_tokens=16, admission="predictive", ttft_slo_factor=10.0,
                         tbt_slo_factor=3.0, burst_window=0.02, ttft_slo=None, tbt_slo=None, prefill_args="",
                         token=None, output_dir=str(tmp_path), ready_timeout=1.0, ttft_admit_margin=0.1)
    args = fidelity_live.start_cluster(ns)
    assert args[args.index("--decode-args") + 1] == "--tbt-slo-factor 3.0"
    assert "--ttft-admit-margin 0.1" in args[args.index("--conductor-args") + 1]   # the conductor's, as the sim's
    args = fidelity_live.start_cluster(SimpleNamespace(**{**vars(ns), "tbt_slo": 0.5}))
    assert args[args.index("--decode-args") + 1] == "--tbt-slo-factor 3.0 --tbt-slo 0.5s"
