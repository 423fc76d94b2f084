"""A one-box cluster's decode steps slow while a prefill computes beside them (issue #20 item 4):
``Hardware.decode_colocated_slowdown``, measured and exported by the live cluster, is applied
by the simulator from the decode's next step boundary while any prefill computes; 1.0 (the
paper's separate nodes) changes nothing."""

from __future__ import annotations

import dataclasses

import pytest

from mooncake_lite.scheduler import SchedulerConfig
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


def test_received_kv_is_written_before_the_request_joins_and_the_batch_waits():
    """``decode_kv_write_s_per_token``: a CPU decode writes a received prompt's KV in its model
    thread, between steps: the joiner and every running request wait that long once."""
    hw = toy_hardware(prefill_per_token=1e-3, step_s=0.01)
    writes = dataclasses.replace(hw, decode_kv_write_s_per_token=1e-4)
    trace = [req(0, 0.0, 100, 101), req(1, 0.1, 500, 3)]  # 1 prefilled 0.1-0.6 s, joins mid-way through 0's steps
    plain, slow = run(hw, trace), run(writes, trace)
    assert slow[0].ttft == plain[0].ttft and slow[1].ttft == plain[1].ttft
    # 0 waits 10 ms for its own 100 tokens' KV, then 50 ms for 1's 500 beside its steps
    assert slow[0].finish == pytest.approx(plain[0].finish + 0.01 + 0.05)
    assert slow[0].tbt == pytest.approx((0.06 + 0.02 + 8 * 0.01) / 10) and plain[0].tbt == pytest.approx(0.01)
    assert slow[1].finish == pytest.approx(plain[1].finish + 0.05)
