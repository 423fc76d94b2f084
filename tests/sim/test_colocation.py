"""A one-box cluster's decode steps slow while a prefill computes beside them (issue #20 item 4):
``Hardware.decode_colocated_slowdown``, measured and exported by the live cluster, is applied
by the simulator from the decode's next step boundary while any prefill computes; 1.0 (the
paper's separate nodes) changes nothing."""

from __future__ import annotations

import dataclasses

import pytest

from mooncake_lite.scheduler import PrefillCostModel, SchedulerConfig
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from mooncake_lite.sim.costs import load_profile
from tests.sim.helpers import req, toy_hardware


def run(hw, trace):
    cfg = SimConfig(num_prefill=1, num_decode=1, seed=0, store_blocks_per_node=100,
                    scheduler=SchedulerConfig(admission="none", ttft_slo_s=100.0, tbt_slo_s=10.0))
    return {r.request_id: r for r in MooncakeSim(cfg, hardware=hw).run(trace).requests}


def test_steps_beside_a_prefill_take_the_slowdown_from_the_next_boundary():
    hw = toy_hardware(prefill_per_token=1e-3, step_s=0.01)
    # A: prefilled 0-0.1 s, then 20 steps of 10 ms; B's 1000-token prefill runs 0.15-1.15 s.
    trace = [req(0, 0.0, 100, 21), req(1, 0.15, 1000, 3)]
    plain = run(hw, trace)
    assert plain[0].finish == pytest.approx(0.30)
    slow = run(dataclasses.replace(hw, decode_colocated_slowdown=2.0), trace)
    # The step running when B's prefill starts (0.15-0.16) keeps its time; the other 14 take 20 ms.
    assert slow[0].finish == pytest.approx(0.16 + 14 * 0.02)
    assert slow[0].tbt == pytest.approx(0.02) and plain[0].tbt == pytest.approx(0.01)
    assert slow[0].mean_gap == pytest.approx((0.44 - 0.10) / 20)
    # B decodes after the prefill is over: at the model's speed again, as without the slowdown.
    assert (slow[1].ttft, slow[1].tbt, slow[1].finish) == pytest.approx((plain[1].ttft, plain[1].tbt, plain[1].finish))


def test_no_prefill_beside_the_steps_no_change():
    hw = toy_hardware(step_s=0.01)
    trace = [req(0, 0.0, 100, 21), req(1, 5.0, 200, 11)]     # each decodes alone
    plain = run(hw, trace)
    slow = run(dataclasses.replace(hw, decode_colocated_slowdown=3.0), trace)
    assert [(r.ttft, r.tbt, r.finish) for r in slow.values()] == \
        [(r.ttft, r.tbt, r.finish) for r in plain.values()]


def test_the_profile_carries_the_slowdown_and_the_padding(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"prefill": {"c1": 0.001}, "decode_colocated_slowdown": 1.75}')
    hw = load_profile(path)
    assert hw.decode_colocated_slowdown == 1.75 and hw.to_dict()["decode_colocated_slowdown"] == 1.75
    path.write_text('{"prefill": {"c1": 0.001}}')
    assert load_profile(path).decode_colocated_slowdown == 1.0
    assert "decode_colocated_slowdown" not in load_profile(path).to_dict()
    path.write_text('{"prefill": {"c1": 0.001}, "decode_padding_s_per_token": 2e-6}')
    assert load_profile(path).decode_padding_s_per_token == 2e-6
    assert load_profile(path).to_dict()["decode_padding_s_per_token"] == 2e-6
    path.write_text('{"prefill": {"c1": 0.001}, "decode_kv_write_s_per_token": 3e-5}')
    assert load_profile(path).to_dict()["decode_kv_write_s_per_token"] == 3e-5
    path.write_text('{"prefill": {"c1": 0.001}, "decode_padding_s_per_token": -1}')
    with pytest.raises(ValueError, match="decode_padding_s_per_token"):
        load_profile(path)
    path.write_text('{"prefill": {"c1": 0.001}, "decode_colocated_slowdown": 0}')
    with pytest.raises(ValueError, match="decode_colocated_slowdown"):
        load_profile(path)


def test_a_padded_batch_pays_for_its_longest_context():
    """``decode_padding_s_per_token`` (a CPU decode's attention): a step costs batch × the longest
    context − the contexts' sum padding tokens more; one request alone pays nothing more."""
    hw = toy_hardware(step_s=0.01)
    padded = dataclasses.replace(hw, decode_padding_s_per_token=1e-5)
    alone = [req(0, 0.0, 2000, 11)]
    assert run(padded, alone)[0].finish == pytest.approx(run(hw, alone)[0].finish)
    # a 101-token context decodes beside a 2,001-token one: each step pays the 1,900 tokens the
    # short one is padded by (both grow by one a step), 19 ms at 10 us a token
    pair = [req(0, 0.0, 2000, 41), req(1, 2.1, 100, 11)]
    plain, slow = run(hw, pair), run(padded, pair)
    assert slow[1].mean_gap - plain[1].mean_gap == pytest.approx(1900e-5, rel=0.1)
    assert slow[1].tbt > plain[1].tbt + 0.015


def test_received_kv_is_written_while_its_prefill_runs_not_at_the_join():
    """``decode_kv_write_s_per_token``: a CPU decode writes a prompt's KV in its model thread
    frame by frame as the prefill streams it, so the steps beside that prefill stretch by the
    writes' share of it: the same time lost, no one long gap at the join."""
    hw = toy_hardware(prefill_per_token=1e-3, step_s=0.01)
    writes = dataclasses.replace(hw, decode_kv_write_s_per_token=1e-4)
    trace = [req(0, 0.0, 100, 101), req(1, 0.1, 500, 3)]  # 1 prefilled 0.1-0.6 s beside 0's steps
    plain, slow = run(hw, trace), run(writes, trace)
    assert slow[0].ttft == plain[0].ttft and slow[1].ttft == plain[1].ttft
    # 0's own 10 ms were written while the decode had nothing to run; 1's 50 ms cost 0's steps
    assert slow[0].finish == pytest.approx(plain[0].finish + 0.05, abs=2e-3)
    assert slow[0].tbt == pytest.approx(0.01 / 0.9)      # 10% of 0.5 s: each step x 1/0.9, none longer
    assert slow[1].tbt == pytest.approx(plain[1].tbt, abs=2e-3)   # 1 joins at once, its KV written
    # writes over half the forward (a prompt mostly cached, a short forward): the rest is written
    # after it and the join waits for it; the time lost is still the writes'
    trace = [req(0, 0.0, 100, 201), req(1, 0.3, 500, 3)]  # 1 prefilled 0.3-0.8 s with 0.5 s of writes
    plain, heavy = run(hw, trace), run(dataclasses.replace(hw, decode_kv_write_s_per_token=1e-3), trace)
    # 0's own 0.1 s: half while its 0.1 s prefill ran (nothing else to run), half before it joins;
    # 1's 0.5 s: 0's steps take 2x over 1's prefill (0.25 s lost), then 0.25 s at 1's join
    assert heavy[0].ttft == plain[0].ttft and heavy[1].ttft == plain[1].ttft
    assert heavy[0].finish == pytest.approx(plain[0].finish + 0.05 + 0.5, abs=0.012)
    assert heavy[1].tbt == pytest.approx(plain[1].tbt + 0.25, abs=0.021)     # its first gap


def test_steps_beside_a_prefill_draw_the_busy_spread_and_alone_the_idle_one():
    spread = dataclasses.replace(toy_hardware(step_s=0.01), decode_step_ratios=(0.99, 1.01),
                                 decode_colocated_slowdown=2.0)
    # A decodes 0.1-0.16 s alone, then beside B's 1000-token prefill (0.15-1.15 s); B decodes alone after.
    trace = [req(0, 0.0, 100, 41), req(1, 0.15, 1000, 21)]
    idle = run(spread, trace)
    busy = run(dataclasses.replace(spread, decode_busy_step_ratios=(0.5, 1.5)), trace)
    assert idle[0].tbt == pytest.approx(0.02 * 1.01)          # the idle tail × the slowdown
    assert busy[0].tbt == pytest.approx(0.02 * 1.5)           # the busy tail, over its mean 1.0
    assert busy[0].mean_gap == pytest.approx(idle[0].mean_gap, rel=0.15)   # the slowdown keeps the level
    assert busy[0].finish == idle[0].finish                   # only the replay draws differ
    assert (busy[1].tbt, busy[1].mean_gap, busy[1].finish) == (idle[1].tbt, idle[1].mean_gap, idle[1].finish)


def test_a_forward_runs_at_its_node_states_speed_as_it_starts():
    # The conductor prices every forward at 1.5 ms a token; the truth is 1 ms idle, 2 ms beside a decode.
    states = toy_hardware(prefill_per_token=1.5e-3, prefill_idle=PrefillCostModel(c1=1e-3),
                          prefill_busy=PrefillCostModel(c1=2e-3))
    # A prefills alone (0-0.1 s) and decodes 0.1-0.3 s; B starts at 0.15 beside A's decode; C at 5 s alone.
    trace = [req(0, 0.0, 100, 21), req(1, 0.15, 100, 3), req(2, 5.0, 100, 3)]
    got = run(states, trace)
    assert [got[i].ttft for i in range(3)] == pytest.approx([0.1, 0.2, 0.1])
    weighed = run(dataclasses.replace(states, prefill_idle=None, prefill_busy=None), trace)
    assert [weighed[i].ttft for i in range(3)] == pytest.approx([0.15, 0.15, 0.15])


def test_the_profile_carries_both_node_states_or_neither(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"prefill": {"c1": 0.0015}, "prefill_idle": {"c1": 0.001}, "prefill_busy": {"c1": 0.002}}')
    hw = load_profile(path).with_prefill_chunk(512)
    assert hw.in_state(busy=True).prefill.predict(256) == pytest.approx(0.512)
    assert hw.in_state(busy=False).prefill.predict(256) == pytest.approx(0.256)
    assert hw.to_dict()["prefill_busy"]["c1"] == pytest.approx(0.002)
    path.write_text('{"prefill": {"c1": 0.0015}, "prefill_busy": {"c1": 0.002}}')
    with pytest.raises(ValueError, match="come together"):
        load_profile(path)
    path.write_text('{"prefill": {"c1": 0.0015}}')
    plain = load_profile(path)
    assert plain.in_state(busy=True) is plain and "prefill_busy" not in plain.to_dict()


def test_a_job_placed_behind_another_runs_at_the_busy_speed_whatever_its_start_sees():
    # Live learns each state's speed from the requests it priced in it: a job queued behind
    # another is busy (show_node_states), though at its own start the decode of the one ahead may
    # not have joined yet. B comes while A prefills; A's single token leaves nothing decoding.
    states = toy_hardware(prefill_per_token=1.5e-3, prefill_idle=PrefillCostModel(c1=1e-3),
                          prefill_busy=PrefillCostModel(c1=2e-3))
    got = run(states, [req(0, 0.0, 100, 1), req(1, 0.01, 100, 1), req(2, 5.0, 100, 1)])
    assert got[0].ttft == pytest.approx(0.1)            # placed on an empty node: idle
    assert got[1].ttft == pytest.approx(0.09 + 0.2)     # placed behind A: busy for its whole forward
    assert got[2].ttft == pytest.approx(0.1)            # placed on an empty node again
