"""No oracle: the simulated conductor and decodes see what live ones see (max_tokens by the
client's policy, a prediction); only the simulated model reads the true output length, and
only to end the request."""

from __future__ import annotations

import sys

import pytest

from mooncake_lite.scheduler import Scheduler, SchedulerConfig
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.colocated import ColocatedSim
from mooncake_lite.sim.config import ColocatedConfig, SimConfig
from mooncake_lite.sim.costs import llama2_70b_a800
from mooncake_lite.sim.request import MaxTokensPolicy, OracleError, SimRequest
from tests.sim.helpers import req, toy_hardware
from tests.sim.test_fidelity import small_trace

# The simulated model: the batch plans the step of each request's last token, and a request
# whose model stops at its first token ends at prefill. Nothing else may read the truth.
MODEL_READERS = {"Batch.add", "MooncakeSim._prefill_done", "ColocatedInstance._prefill_done"}


@pytest.fixture
def truth_readers(monkeypatch):
    """Who read a request's true output length, and whether that request had ended then."""
    seen: list[tuple[str, bool]] = []
    true_read = SimRequest.tokens_to_generate

    def spy(self):
        seen.append((sys._getframe(1).f_code.co_qualname, self.status is not None))
        return true_read(self)
    monkeypatch.setattr(SimRequest, "tokens_to_generate", spy)
    return seen


def test_output_length_raises_until_the_request_ends():
    r = SimRequest(req(0, 0.0, 1000, 7), 512)
    with pytest.raises(OracleError):
        _ = r.output_length
    r.status = "completed"
    assert r.output_length == 7


@pytest.mark.parametrize("policy, predict", [("output", False), ("cap:4096", False), ("cap:4096", True)])
def test_only_the_model_reads_the_true_output_length(truth_readers, monkeypatch, policy, predict):
    # A run that completes proves no component read ``output_length`` before its request ended
    # (it raises); the spy shows who read the truth through the model's own accessor.
    asked: list[int] = []
    schedule = Scheduler.schedule

    def spy_schedule(self, request, state, now):
        asked.append(request.max_output_tokens)
        return schedule(self, request, state, now)
    monkeypatch.setattr(Scheduler, "schedule", spy_schedule)
    trace = small_trace(n=150, rate=6.0)
    cfg = SimConfig(num_prefill=3, num_decode=2, store_blocks_per_node=200, max_tokens_policy=policy,
                    predict_output=predict,
                    scheduler=SchedulerConfig(admission="predictive", tbt_slo_s=0.08, ttft_slo_s=20.0))
    res = MooncakeSim(cfg, hardware=llama2_70b_a800()).run(trace)
    assert res.counters["completed"] > 0
    assert {who for who, _ in truth_readers} <= MODEL_READERS
    assert len(truth_readers) >= res.counters["completed"]
    if policy == "output":
        assert asked == [r.output_length for r in trace]
    else:
        assert set(asked) == {4096}


def test_the_conductor_sizes_t_d_with_max_tokens_or_the_prediction(monkeypatch):
    # Every t_d input the conductor's decode snapshots carry is the request's max_tokens (the
    # cap), never its true output; with the predictor on it is the prediction instead.
    trace = small_trace(n=150, rate=6.0)
    for predict in (False, True):
        cfg = SimConfig(num_prefill=3, num_decode=2, store_blocks_per_node=200, max_tokens_policy="cap:4096",
                        predict_output=predict,
                        scheduler=SchedulerConfig(admission="predictive", tbt_slo_s=0.08, ttft_slo_s=20.0))
        sim = MooncakeSim(cfg, hardware=llama2_70b_a800())
        shown: list[int] = []
        state = sim.cluster_state

        def spy_state():
            s = state()
            shown.extend(r.max_output_tokens for d in s.decodes for r in d.running + d.incoming)
            return s
        sim.cluster_state = spy_state
        res = sim.run(trace)
        assert shown
        if predict:
            assert max(shown) < 4096 and res.extra["output_prediction"]["mae_tokens"] < 4096 - 200
        else:
            assert set(shown) == {4096}
            assert res.extra["output_prediction"]["underestimated"] == 0.0


def test_a_cap_stops_long_outputs_and_reserves_prompt_plus_cap():
    hw = toy_hardware(decode_max_context_tokens=3000)
    cfg = SimConfig(num_prefill=1, num_decode=1, max_tokens_policy="cap:1500",
                    scheduler=SchedulerConfig(admission="none", tbt_slo_s=1.0))
    d = MooncakeSim(cfg, hardware=hw).decodes[0]
    first, second = SimRequest(req(0, 0.0, 1000, 50), 512), SimRequest(req(1, 0.0, 1000, 5), 512)
    for r in (first, second):
        r.send_with(MaxTokensPolicy(1500))
    # 1000 + 1500 held for the first leaves no room for a second 2500 on a 3000-token decode,
    # however short either output really is (as the live decode's block reservation)
    assert d.refusal(second, 1.0) is None
    d.hold(first, 0.0)
    assert d.refusal(second, 1.0) == "reserve-kv"
    d.release(first)
    assert d.refusal(second, 1.0) is None and d.reserved_tokens == 0
    res = MooncakeSim(cfg, hardware=hw).run([req(0, 0.0, 1000, 2000)])
    assert res.requests[0].output_length == 1500                # stopped at max_tokens, as live


def test_colocated_baseline_reads_the_truth_only_in_its_model(truth_readers):
    res = ColocatedSim(ColocatedConfig(num_instances=2), hardware=llama2_70b_a800()).run(small_trace(n=60))
    assert res.counters["completed"] == 60
    assert {who for who, _ in truth_readers} <= MODEL_READERS


@pytest.mark.parametrize("text, cap", [("output", None), ("cap:4096", 4096), ("cap:1", 1)])
def test_max_tokens_policy_parses(text, cap):
    p = MaxTokensPolicy.parse(text)
    assert p.cap == cap and str(p) == text
    assert p.max_tokens(300) == (300 if cap is None else cap)


@pytest.mark.parametrize("bad", ["", "cap", "cap:0", "cap:-5", "cap:x", "max:10"])
def test_bad_max_tokens_policy_is_refused(bad):
    with pytest.raises(ValueError, match="max-tokens policy"):
        MaxTokensPolicy.parse(bad)
    with pytest.raises(ValueError):
        SimConfig(max_tokens_policy=bad)
