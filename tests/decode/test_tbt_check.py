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
