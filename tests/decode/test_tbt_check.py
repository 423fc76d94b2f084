"""The decode's own TBT double check: on by default with the conductor's default SLO, and the
same code (scheduler/admission.tbt_refusal) the simulator runs."""

from __future__ import annotations

from mooncake_lite.common.config import load_config
from mooncake_lite.conductor.config import Config as ConductorConfig
from mooncake_lite.decode.batcher import DecodeBatcher
from mooncake_lite.decode.config import Config
from mooncake_lite.model.kv_cache import BlockAllocator
from mooncake_lite.scheduler.admission import tbt_refusal
from mooncake_lite.scheduler.costs import DecodeCostModel

COST = DecodeCostModel(c0=0.01, c1=0.002, c2=1e-6)


def _load(cls, *argv: str):
    return load_config(cls, list(argv), prog="mooncake", section="x", env={})


def test_on_by_default_with_the_conductors_default_slo():
    decode, conductor = _load(Config), _load(ConductorConfig)
    assert decode.tbt_slo is None and conductor.tbt_slo is None
    assert decode.tbt_slo_factor == conductor.tbt_slo_factor == 5.0
    assert _load(Config, "--tbt-slo-factor", "none").tbt_slo_factor is None
    assert _load(Config, "--tbt-slo", "80ms").tbt_slo == 0.08


def test_batcher_refuses_exactly_when_the_shared_check_does():
    # Every reserved sequence counts, running or still waiting for its KV.
    b = DecodeBatcher(BlockAllocator(10_000), 4, cost=COST, tbt_slo_factor=2.0)
    held = 0
    while b.check_admit(100, 8) is None:
        b.reserve(f"r{held}", 100, 8)
        held += 1
    context = sum(s.context_len for s in b.seqs.values())
    assert tbt_refusal(COST, held - 1, context - 100, 100, None, 2.0) is None
    reason = tbt_refusal(COST, held, context, 100, None, 2.0)
    assert reason is not None and b.check_admit(100, 8) == reason and "2x a step alone" in reason
    assert held == 6        # batch b of 100 tokens each: 0.01 + 0.0021 b ≤ 2 × 0.0121 for b ≤ 6


def test_absolute_slo_wins_and_no_slo_means_no_check():
    assert tbt_refusal(COST, 100, 10_000, 100, None, None) is None
    assert tbt_refusal(COST, 1, 100, 100, 0.5, 1.0) is None          # absolute 500 ms, factor ignored
    assert "exceeds the TBT SLO 5.00 ms" in tbt_refusal(COST, 1, 100, 100, 0.005, None)


def test_a_reservation_is_judged_with_what_still_decodes_when_its_kv_is_due():
    # Six running sequences of 8 tokens left (~23 ms a step: gone in 0.2 s) fill the SLO now; a
    # request whose KV is due in 10 s joins an idle decode, and one due now is refused as before.
    b = DecodeBatcher(BlockAllocator(10_000), 4, cost=COST, tbt_slo_factor=2.0)
    for i in range(6):
        b.reserve(f"r{i}", 100, 9, now=0.0)
        b.join(f"r{i}", 1)
    today = b.check_admit(100, 8, now=1.0)
    assert today is not None and today == tbt_refusal(COST, 6, 6 * 101, 100, None, 2.0)
    assert b.check_admit(100, 8, now=1.0, kv_in_s=10.0) is None
    refused = b.check_admit(100, 8, now=1.0, kv_in_s=0.1)         # they are still decoding then
    assert refused is not None and refused.startswith(today) and "due in 0.10 s (6 sequences held)" in refused
    # reserved ahead, each counts from when its own KV is due: one due with it is beside it
    b.reserve("x", 100, 8, now=1.0, kv_in_s=10.0)
    assert b.seqs["x"].held(1.0) == (11.0, 8, 100)
    due_with_x = DecodeBatcher(BlockAllocator(10_000), 4, cost=COST, tbt_slo_s=COST.predict(1, 100))
    due_with_x.reserve("x", 100, 8, now=1.0, kv_in_s=10.0)
    assert due_with_x.check_admit(100, 8, now=1.0, kv_in_s=20.0) is None
    assert "with batch 2" in due_with_x.check_admit(100, 8, now=1.0, kv_in_s=10.05)
