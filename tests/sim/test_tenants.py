"""Tenants in the simulator (sim/tenants.py): requests get tenants by share, the simulated
conductor applies each tenant's limits and the priority rule, and a low-priority flood is shed
so a high-priority tenant's TTFT stays near what it is without the flood."""

from __future__ import annotations

import orjson
import pytest

from mooncake_lite.scheduler import SchedulerConfig
from mooncake_lite.scheduler.tenants import parse_tenants
from mooncake_lite.sim.cli import main
from mooncake_lite.sim.config import SimConfig
from mooncake_lite.sim.metrics import quantile
from mooncake_lite.sim.tenants import TenantMix, TenantSim
from mooncake_lite.trace.format import write_trace
from mooncake_lite.trace.synth import SynthConfig, synthesize
from tests.sim.helpers import toy_hardware

FLOOD = """
[tenants.gold]
share = 0.25
priority = "high"

[tenants.flood]
share = 0.75
priority = "low"
"""


def trace(n: int = 400, rate: float = 4.0):
    # toy hardware: 1 ms per prompt token; 2 prefills take 2 x 1000 tokens/s of prompts, so 4
    # requests/s of ~1000-token prompts is a 2x overload, and a quarter of it (gold) half the capacity
    return synthesize(SynthConfig(num_requests=n, rate_per_s=rate, input_lengths=(512, 1536),
                                  input_dist="uniform", output_lengths=(8,), seed=5))


def mix(seed: int = 0) -> TenantMix:
    return TenantMix(parse_tenants({"gold": {"priority": "high"}, "flood": {"priority": "low"}}),
                     {"gold": 0.25, "flood": 0.75}, seed)


def sim(m: TenantMix) -> TenantSim:
    cfg = SimConfig(num_prefill=2, num_decode=2, scheduler=SchedulerConfig(
        admission="early", ttft_slo_s=30.0, tbt_slo_s=1.0, block_size=512))
    return TenantSim(cfg, m, toy_hardware())


def test_mix_draws_by_request_id_and_dropping_a_tenant_keeps_the_others():
    m, tr = mix(), trace(n=2000)
    names = [m.of(r.request_id) for r in tr]
    assert 0.2 < names.count("gold") / len(names) < 0.3
    assert names == [m.of(r.request_id) for r in tr]               # deterministic
    kept = list(m.without(tr, "flood"))
    assert [r.request_id for r in kept] == [r.request_id for r, n in zip(tr, names) if n == "gold"]
    assert [mix(seed=1).of(r.request_id) for r in tr] != names
    with pytest.raises(ValueError, match="sum to 1"):
        TenantMix(m.tenants, {"gold": 0.5, "flood": 0.4})


def test_a_low_priority_flood_is_shed_and_gold_keeps_its_ttft():
    m, tr = mix(), trace()
    both = sim(m).run(tr)
    alone = sim(m).run(list(m.without(tr, "flood")))
    rows = both.extra["tenants"]
    assert rows["flood"]["rejected_by"].get("priority", 0) > rows["flood"]["requests"] / 5
    assert "priority" not in rows["gold"]["rejected_by"]
    assert rows["flood"]["completed"] > 0                          # shed, not starved

    def gold_p90(res):
        ttfts = sorted(r.ttft for r in res.requests if r.ttft is not None and m.of(r.request_id) == "gold")
        return quantile(ttfts, 0.9)

    assert gold_p90(both) == pytest.approx(rows["gold"]["ttft_p90_s"])
    assert gold_p90(both) <= 1.2 * gold_p90(alone)                 # simulated seconds: deterministic


def test_same_trace_without_tenant_shedding_hurts_gold():
    # the control: both tenants at high priority, so nothing is shed and the flood queues ahead
    m = TenantMix(parse_tenants({"gold": {"priority": "high"}, "flood": {"priority": "high"}}),
                  {"gold": 0.25, "flood": 0.75})
    tr = trace()
    both, alone = sim(m).run(tr), sim(m).run(list(m.without(tr, "flood")))
    assert both.extra["tenants"]["gold"]["ttft_p90_s"] > 1.5 * alone.extra["tenants"]["gold"]["ttft_p90_s"]


def test_cli_tenants_compares_runs_with_and_without_the_flood(tmp_path, capsys):
    path, spec = tmp_path / "t.jsonl", tmp_path / "tenants.toml"
    write_trace(trace(n=120, rate=4.0), path)
    spec.write_text(FLOOD)
    assert main([str(path), "--prefill", "2", "--decode", "2", "--tenants", str(spec),
                 "--tenants-without", "flood", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "p90 w/o flood" in out and any(line.startswith("gold") for line in out.splitlines())
    assert main([str(path), "--prefill", "2", "--decode", "2", "--tenants", str(spec), "--json"]) == 0
    summary = orjson.loads(capsys.readouterr().out)
    assert sum(row["requests"] for row in summary["tenants"].values()) == 120
    assert main([str(path), "--tenants", str(spec), "--tenants-without", "nobody"]) == 2
