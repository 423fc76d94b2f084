"""Tenants and priorities, the pure half (scheduler/tenants.py): TOML parsing, token buckets,
concurrency, the priority-aware shedding rule and weighted fair share."""

from __future__ import annotations

import pytest

from mooncake_lite.common.config import ConfigError
from mooncake_lite.scheduler import Scheduler
from mooncake_lite.scheduler.tenants import (DEFAULT_TENANT, Tenant, TenantLedger, Tenants, TenantSpec, TokenBucket,
                                             default_shed_at, default_weight, parse_tenants)
from tests.scheduler.clusters import COSTS, cfg, cluster, decode, prefill, queued, request

TOML = {
    "anonymous": "free",
    "gold": {"api_keys": ["k-gold"], "priority": "high", "ttft_slo": "2s", "weight": 3},
    "free": {"priority": "low", "rate": 2, "burst": 3, "max_concurrency": 2, "tbt_slo_factor": 2},
    "batch": {"api_keys": ["k-b1", "k-b2"], "priority": -1, "shed_at": 0.3},
}


def test_parse_maps_keys_to_tenants_and_the_anonymous_one():
    t = parse_tenants(TOML)
    assert t.by_key("k-gold").name == "gold" and t.by_key("k-b2").name == "batch"
    assert t.by_key(None).name == "free" and t.by_key("nope") is None
    gold, free, batch = t.get("gold"), t.get("free"), t.get("batch")
    assert (gold.priority, free.priority, batch.priority) == (2, 0, -1)
    assert gold.ttft_slo_s == 2.0 and gold.weight == 3.0
    assert (free.rate, free.bucket_size, free.max_concurrency) == (2.0, 3.0, 2)
    assert batch.shed_threshold == 0.3 and free.shed_threshold == default_shed_at(0) == 0.05
    assert default_shed_at(2) == 1.0 and default_shed_at(1) == 0.25 and default_shed_at(-1) < 0.05
    assert (gold.share_weight, free.share_weight, batch.share_weight) == (3.0, 1.0, 0.25)   # given, 4**p
    assert t.get("gold").share_weight == 3.0 and default_weight(2) == 16.0
    assert parse_tenants({"x": {}}).by_key(None) is None      # no anonymous tenant: 401


@pytest.mark.parametrize("table, words", [
    ({"a": {"prority": "high"}}, "unknown key(s) prority"),
    ({"a": {"priority": "urgent"}}, "tenants.a.priority"),
    ({"a": {"api_keys": ["k"]}, "b": {"api_keys": ["k"]}}, "also tenant"),
    ({"a": {"rate": 0}}, "rate must be a positive"),
    ({"a": {"burst": 3}}, "burst needs a rate"),
    ({"a": {"ttft_slo": "soon"}}, "not a duration"),
    ({"a": {"ttft_slo_factor": 0.5}}, "ttft_slo_factor must be >= 1"),
    ({"a": {"shed_at": 1.5}}, "shed_at must be in"),
    ({"bad name": {}}, "a name is"),
    ({"anonymous": "ghost", "a": {}}, "names no configured tenant"),
    ({"a": "high"}, "must be a table"),
])
def test_parse_refuses_bad_tables_naming_what(table, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_tenants(table)


def test_tenant_slos_replace_the_conductors():
    base = cfg(ttft_slo_s=1.0, tbt_slo_s=0.1)
    assert TenantSpec("a").scheduler_config(base) is base
    c = TenantSpec("a", ttft_slo_s=5.0, tbt_slo_factor=3.0).scheduler_config(base)
    assert (c.ttft_slo_s, c.tbt_slo_s, c.tbt_slo_factor) == (5.0, None, 3.0)


def test_with_key_adds_the_conductors_api_key_as_default():
    t = Tenants().with_key("k")
    assert t.by_key("k").name == DEFAULT_TENANT
    t2 = parse_tenants(TOML).with_key("k-gold")
    assert t2.by_key("k-gold").name == "gold"              # already a tenant's key: unchanged


def test_token_bucket_refills_at_its_rate_up_to_its_size():
    b = TokenBucket(rate=2.0, size=3.0, tokens=3.0)
    assert [b.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(0.0) == pytest.approx(0.5)               # one token takes 1/rate
    assert b.take(0.5) == 0.0
    assert b.take(100.0) == 0.0 and b.tokens == pytest.approx(2.0)   # capped at size


def test_concurrency_then_rate_and_a_refused_request_takes_no_token():
    t = parse_tenants(TOML)
    led, free = TenantLedger(t), t.get("free")
    assert led.admit(free, 0.0) is None and led.admit(free, 0.0) is None
    r = led.admit(free, 0.0)
    assert r.limit == "concurrency" and "max_concurrency 2" in r.message
    led.end("free")
    assert led.admit(free, 0.0) is None                    # the third token of the burst
    led.end("free")
    r = led.admit(free, 0.0)
    assert r.limit == "rate" and "2 requests/s" in r.message and r.retry_after_s == pytest.approx(0.5)
    assert led.admit(free, 0.5) is None and led.in_flight == {"free": 2}


def test_low_is_shed_before_normal_before_high_when_over_share():
    t = Tenants((TenantSpec("hi", priority=2, weight=1), TenantSpec("mid", priority=1, weight=1),
                 TenantSpec("lo", priority=0, weight=1)))
    led = TenantLedger(t)
    for name in ("hi", "mid", "lo"):
        for _ in range(5):
            led.admit(t.get(name), 0.0)                    # everyone at its share

    def refused(name: str, load: float) -> bool:
        led.admit(t.get(name), 0.0)                        # the one judged: 6 of 16 > a third
        try:
            return led.priority_refusal(t.get(name), load, 0.0) is not None
        finally:
            led.end(name)

    verdicts = {load: [refused(n, load) for n in ("hi", "mid", "lo")] for load in (0.01, 0.1, 0.3, 0.99)}
    assert verdicts == {0.01: [False, False, False], 0.1: [False, False, True],
                        0.3: [False, True, True], 0.99: [False, True, True]}
    led.admit(t.get("lo"), 0.0)
    r = led.priority_refusal(t.get("lo"), 0.1, 0.0)
    assert r.limit == "priority" and "low priority" in r.message


def test_a_tenant_under_its_fair_share_is_never_shed_for_anothers_flood():
    t = Tenants((TenantSpec("flood", priority=0), TenantSpec("light", priority=0)))
    led = TenantLedger(t)
    led.admit(t.get("light"), 0.0)
    for _ in range(20):
        led.admit(t.get("flood"), 0.0)
    assert led.priority_refusal(t.get("light"), 0.9, 0.0) is None       # 1 of 21 < its half
    assert led.priority_refusal(t.get("flood"), 0.9, 0.0) is not None
    # weights: a tenant of weight 3 is within its share at 3 of 5 in flight, one of weight 1 at 2 is not
    t = Tenants((TenantSpec("big", weight=3.0, priority=0), TenantSpec("small", priority=0)))
    led = TenantLedger(t)
    for name, n in (("big", 3), ("small", 2)):
        for _ in range(n):
            led.admit(t.get(name), 0.0)
    assert not led.over_share(t.get("big"), 0.0) and led.over_share(t.get("small"), 0.0)


def test_a_tenant_alone_is_judged_by_its_slos_and_activity_expires():
    t = Tenants((TenantSpec("a", priority=0), TenantSpec("b", priority=2)))
    led = TenantLedger(t, active_window_s=10.0)
    for _ in range(5):
        led.admit(t.get("a"), 0.0)
    assert led.priority_refusal(t.get("a"), 0.9, 0.0) is None           # nobody else to protect
    led.admit(t.get("b"), 0.0)
    led.end("b")                                                        # b came and went: a is over its half
    assert led.priority_refusal(t.get("a"), 0.9, 0.5) is not None
    assert led.priority_refusal(t.get("a"), 0.9, 11.0) is None          # b quiet for > the window


def test_a_shed_tenant_gets_one_request_through_per_starve_interval():
    t = Tenants((TenantSpec("lo", priority=0), TenantSpec("hi", priority=2)))
    led = TenantLedger(t, starve_after_s=1.0)
    for _ in range(8):
        led.admit(t.get("hi"), 0.0)
    led.admit(t.get("lo"), 0.0)                                         # first seen at 0
    passed = [now for now in (0.0, 0.4, 0.8, 1.0, 1.2, 1.9, 2.0, 2.5)
              if led.priority_refusal(t.get("lo"), 0.9, now) is None]
    assert passed == [1.0, 2.0]                                         # one per second, the rest shed
    led.admit(t.get("lo"), 3.5)                                         # the one let through is in flight...
    assert led.priority_refusal(t.get("lo"), 0.9, 3.5) is not None       # ...so no second one
    assert led.priority_refusal(t.get("hi"), 0.9, 2.1) is None          # high: never shed


def test_shed_reads_the_decisions_load_against_the_tenants_own_slo():
    # one prefill with 300 tokens queued (0.3 s), a 100-token request (0.1 s): TTFT 0.4 s
    clus = cluster([prefill("p0", queue=queued(300))], [decode("d0")])
    req = request(10)
    lo = TenantSpec("lo", priority=0, ttft_slo_s=1.0, tbt_slo_s=10.0)
    other = TenantSpec("other", priority=2)
    t = Tenants((lo, other))
    led = TenantLedger(t)
    led.admit(other, 0.0)
    led.admit(lo, 0.0)
    led.admit(lo, 0.0)                                                  # 2 of 3: over its half
    sched = Scheduler(lo.scheduler_config(cfg()), COSTS)
    d = sched.schedule(req, clus, 0.0)
    assert d.accepted and d.predicted_ttft_s == pytest.approx(0.4)
    r = led.shed(lo, d, req, clus, sched.config, COSTS, 0.0)             # 0.4 of 1 s > 0.05
    assert r is not None and "0.40" in r.message
    looser = TenantSpec("lo", priority=0, ttft_slo_s=10.0, tbt_slo_s=10.0)
    assert led.shed(looser, d, req, clus, looser.scheduler_config(cfg()), COSTS, 0.0) is None   # 0.04
    # relative SLO: 10x this prompt alone (0.1 s) = 1 s, same load
    rel = TenantSpec("lo", priority=0, ttft_slo_factor=10.0, tbt_slo_s=10.0)
    assert "0.40" in led.shed(rel, d, req, clus, rel.scheduler_config(cfg()), COSTS, 0.0).message


def test_the_scheduler_sheds_a_tenants_request_itself():
    # as above: lo holds 2 of 3 requests in flight, its decision's load 0.4 of its 1 s SLO
    clus = cluster([prefill("p0", queue=queued(300))], [decode("d0")])
    req = request(10)
    lo, other = TenantSpec("lo", priority=0, ttft_slo_s=1.0, tbt_slo_s=10.0), TenantSpec("other", priority=2)
    led = TenantLedger(Tenants((lo, other)))
    for spec in (other, lo, lo):
        led.admit(spec, 0.0)
    sched = Scheduler(cfg(), COSTS)
    plain = sched.schedule(req, clus, 0.0)
    shed = sched.schedule(req, clus, 0.0, Tenant(lo, lo.scheduler_config(cfg()), led))
    assert plain.accepted and not shed.accepted and shed.reject_cause == "priority"
    assert shed.reason.startswith("rejected: ") and "0.40" in shed.reason and shed.migration is None
    assert (shed.prefill_id, shed.decode_id) == (plain.prefill_id, plain.decode_id)
    # high priority is never shed: the decision without a tenant, under the same config
    assert sched.schedule(req, clus, 0.0, Tenant(other, other.scheduler_config(cfg()), led)) == plain
