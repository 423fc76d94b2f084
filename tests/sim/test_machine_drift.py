"""bench fidelity's measure of the machine's own drift through a replay (bench/fidelity/drift.py):
live forwards and decode steps over the exported model's price, by third of the replay."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from mooncake_lite.bench.fidelity import drift
from mooncake_lite.bench.fidelity.report import report_text
from mooncake_lite.scheduler.costs import DecodeCostModel, PrefillCostModel

IDLE, BUSY = PrefillCostModel(c0=0.05, c1=1e-3), PrefillCostModel(c0=0.05, c1=1.5e-3)
STEP = DecodeCostModel(c0=0.01, c1=1e-3, c2=1e-6)


@dataclass(frozen=True)
class Box:
    """The exported hardware as drift.py reads it: a weighed prefill, one per node state, a decode."""
    prefill: PrefillCostModel = PrefillCostModel(c0=0.05, c1=1.3e-3)
    decode: DecodeCostModel = STEP
    decode_padding_s_per_token: float = 0.0

    def in_state(self, busy: bool):
        return Box(BUSY if busy else IDLE, self.decode)


@dataclass
class Record:
    request_id: int
    send_s: float
    chunk_s: list = field(default_factory=list)
    cached_tokens: int = 0
    is_ok: bool = True


def replay(slow_from: float | None, factor: float = 1.4, decode_beside: bool = False, slow_until: float = 1e9):
    """Thirty 200-token prompts, one every 10 s, each forward alone on one prefill, its first
    token 10 ms after it; a decode steps 50 times in every 10 s. From ``slow_from`` on the
    machine runs ``factor`` times slower (until ``slow_until``). ``decode_beside``: the steps overlap the forwards
    (the forwards then run at the busy price), else they fall between them."""
    records, forwards, steps = [], [], []
    for i in range(30):
        t = 100.0 + 10 * i
        scale = factor if slow_from is not None and slow_from <= t < slow_until else 1.0
        seconds = (BUSY if decode_beside else IDLE).predict(200) * scale
        forwards.append([t, t + seconds])
        records.append(Record(i, t, [t + seconds + 0.01, t + seconds + 0.05]))
        first = t + (0.0 if decode_beside else seconds + 0.1)
        for k in range(50):
            steps.append([first + 0.1 * k, STEP.predict(2, 400) * scale, 2, 400, 0, 201])
    return records, {i: 200 for i in range(30)}, {"p": {"forwards": forwards}, "d": {"steps": steps}}


def test_a_steady_machine_reads_its_model_in_every_third():
    out = drift.machine_drift(*replay(None), Box())
    assert out["prefill_by_part"] == pytest.approx([1.0] * 3)
    assert out["decode_by_part"] == pytest.approx([1.0] * 3)
    assert not out["drifted"] and out["prefill_spread"] == pytest.approx(0.0)


def test_a_machine_slower_in_its_last_third_is_called_drifted():
    out = drift.machine_drift(*replay(slow_from=300.0), Box())
    assert out["prefill_by_part"][0] == pytest.approx(1.0) and out["prefill_by_part"][2] == pytest.approx(1.4)
    assert out["decode_by_part"][2] == pytest.approx(1.4)
    assert out["drifted"] and out["decode_spread"] == pytest.approx(0.4)
    # within the noted drift it is steady
    assert not drift.machine_drift(*replay(slow_from=300.0, factor=1.1), Box())["drifted"]


def test_a_forward_beside_decode_steps_is_priced_in_the_busy_state():
    # each forward at the busy price while the decode steps: 1.0, where the weighed price reads
    # 1.5/1.3 and the idle one 1.5
    out = drift.machine_drift(*replay(None, decode_beside=True), Box())
    assert out["prefill_by_part"] == pytest.approx([1.0] * 3)


def test_packs_long_prompts_and_thin_parts_show_nothing():
    records, tokens, lines = replay(None)
    tokens = {i: 5000 for i in tokens}           # past the 256-token bound: their last chunk only
    assert drift.machine_drift(records, tokens, lines, Box())["prefill_by_part"] == [None] * 3
    assert drift.by_part([(0.5, 1.0)] * 4 + [(2.5, 2.0)] * 5, 0.0, 3.0) == [None, None, 2.0]
    assert drift.by_part([(3.0, 1.2)] * 5, 0.0, 3.0) == [None, None, 1.2]     # the end is in the last part
    assert drift.by_part([(1.0, 1.0)] * 5, 2.0, 2.0) == [None] * 3
    assert drift.spread([None, 1.0, None]) is None and drift.machine_drift([], {}, {}, Box()) == {}


def test_the_report_says_the_hour_drifted():
    out = drift.machine_drift(*replay(slow_from=300.0), Box())
    line = drift.drift_line(out)
    assert "prefill 1.00 1.00 1.40" in line and "drifted" in line
    assert drift.drift_line({}) is None
    assert "steady" in drift.drift_line(drift.machine_drift(*replay(None), Box()))
    assert line in report_text(_minimal_report(out))


def _minimal_report(drift_figures: dict) -> dict:
    rows = {k: {"live": 1.0, "sim": 1.0, "rel_error": 0.0} for k in
            ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "tbt_mean_s", "tbt_p50_s", "tbt_p90_s")}
    return {"rows": rows, "rejections": {"both": 0, "live_only": 0, "sim_only": 0, "differ_share": 0.0},
            "goals": {}, "slos": {"ttft_slo_s": 1.0, "tbt_slo_s": 0.1, "how": "test"}, "simrejected_by": {},
            "live_failed": 0, "gaps": {}, "cost_model": {}, "drift": drift_figures, "plot": "cdf.png"}


def test_a_slow_half_minute_hides_in_the_thirds_but_not_in_the_stretch():
    out = drift.machine_drift(*replay(slow_from=160.0, slow_until=210.0), Box())   # five forwards of thirty
    assert not out["drifted"] and out["prefill_by_part"] == pytest.approx([1.0] * 3)
    assert out["prefill_slowest_stretch"] == pytest.approx(1.4) and out["prefill_stretch_at_s"] == pytest.approx(60.0)
    assert "1.40x the run's median, around 60 s (a slow stretch" in drift.drift_line(out)
    steady = drift.machine_drift(*replay(None), Box())
    assert steady["prefill_slowest_stretch"] == pytest.approx(1.0) and "slow stretch" not in drift.drift_line(steady)
    assert drift.slowest_stretch([(0.0, 1.0)] * 9) is None


@dataclass(frozen=True)
class PaddedBox(Box):
    """A CPU decode's export: each padding token of a step (batch × longest − context) costs this."""
    decode_padding_s_per_token: float = 1e-4


def test_decode_steps_are_priced_with_their_padding_as_the_simulator_prices_them():
    records, tokens, lines = replay(None)
    # batch 2, context 400, longest 300: 200 padding tokens, 20 ms more than the model's step
    lines["d"]["steps"] = [[s[0], STEP.predict(2, 400) + 0.02, 2, 400, 0, 300] for s in lines["d"]["steps"]]
    assert drift.machine_drift(records, tokens, lines, PaddedBox())["decode_by_part"] == pytest.approx([1.0] * 3)
    assert drift.machine_drift(records, tokens, lines, Box())["decode_by_part"][0] > 1.5   # read as slowness


def test_a_forward_shared_by_two_prompts_or_past_the_chunk_is_not_a_point():
    records, tokens, lines = replay(None)
    # request 30 arrives with 0 and shares its forward: that forward is a pack, priced otherwise
    records.append(Record(30, 100.0, list(records[0].chunk_s)))
    tokens[30] = 200
    out = drift.machine_drift(records, tokens, lines, Box())
    assert out["prefill_by_part"][0] == pytest.approx(1.0)
    with_pack = _points(records, tokens, lines, Box())
    assert len(with_pack) == 29 and 100.0 not in [at for at, _ in with_pack]

    @dataclass(frozen=True)
    class Chunked:
        c0: float = IDLE.c0
        c1: float = IDLE.c1
        chunk: int = 128            # the 200-token prompts run in two forwards: none is a point

        def predict(self, n, prefix=0):
            return IDLE.predict(n, prefix)
    assert drift.machine_drift(records, tokens, lines, Box(prefill=Chunked()))["prefill_by_part"] == [None] * 3


def _points(records, tokens, lines, hw):
    served = [(r.request_id, r.send_s, r.chunk_s[0], tokens[r.request_id], r.cached_tokens) for r in records]
    jobs, _ = drift.jobs_of(served, {"p": lines["p"]["forwards"]})
    return drift.prefill_points(jobs, lambda n, prefix, busy: hw.in_state(busy).prefill.predict(n, prefix),
                                drift.stepping(lines), 256)


def test_forwards_before_a_cut_decode_timeline_are_left_out():
    records, tokens, lines = replay(None, decode_beside=True)
    steps = lines["d"]["steps"]
    # the decode kept only its newest TIMELINE_LEN steps: those from 200 s on
    kept = [s for s in steps if s[0] >= 200.0]
    lines["d"]["steps"] = (kept * (drift.TIMELINE_LEN // len(kept) + 1))[:drift.TIMELINE_LEN]
    lines["d"]["steps"].sort(key=lambda s: s[0])
    out = drift.machine_drift(records, tokens, lines, Box())
    # the first third's forwards (busy, but no step kept to say so) would read 1.5x idle
    assert out["prefill_by_part"][0] is None and out["prefill_by_part"][1:] == pytest.approx([1.0, 1.0])
    assert drift.complete_from({"d": {"steps": steps}}) == float("-inf")


def test_a_point_a_hair_inside_the_end_falls_in_the_last_part():
    # a span of a third rounds so that the last ulp before the end divides to 3
    start, end = 22.32, 87.206
    hair = math.nextafter(end, -math.inf)
    assert int((hair - start) // ((end - start) / 3)) == 3
    assert drift.by_part([(hair, 1.1)] * 5, start, end) == [None, None, 1.1]
