"""An instance's cost report (``Register.cost``, ``Heartbeat.cost``): both wire forms, decoded
strictly with the message, and the flat form read with the sender's role."""

import pytest

from mooncake_lite.common.cost_report import CostReport, DecodeCost, FlatCost, PrefillCost
from mooncake_lite.common.protocol import Heartbeat, ProtocolError, Register, dumps, loads


def beat(cost: str) -> bytes:
    return b'{"instance_id": "d0", "cost": %s}' % cost.encode()


def test_the_nested_form_round_trips_and_every_part_is_optional():
    report = CostReport(prefill=PrefillCost(0.01, 1e-4, 1e-8, 0.0), bandwidth_bytes_per_s=2.5e9)
    assert loads(Heartbeat, dumps(Heartbeat("d0", cost=report))).cost == report
    reg = Register("decode", "d0", "h:1", "h:2", None, "tiny", 16, 0, 64, 128, cost=CostReport(decode=DecodeCost(c0=0.5)))
    assert loads(Register, dumps(reg)) == reg
    assert loads(Heartbeat, beat('{"decode": {"c0": 1}}')).cost == CostReport(decode=DecodeCost(c0=1.0))
    assert loads(Heartbeat, beat('{"prefill": null, "decode": null}')).cost == CostReport()
    assert loads(Heartbeat, beat("{}")).cost == CostReport()
    assert loads(Heartbeat, beat("null")).cost is None
    # a later chunk's fixed cost, where the instance measured one (instance/refine.py); null: none
    chunked = CostReport(prefill=PrefillCost(0.4, 3e-3, 8e-7, 0.0, later_c0=0.05))
    assert loads(Heartbeat, dumps(Heartbeat("p0", cost=chunked))).cost == chunked
    assert loads(Heartbeat, beat('{"prefill": {"c0": 1, "later_c0": null}}')).cost == \
        CostReport(prefill=PrefillCost(c0=1.0))
    # a pack member's part of c0, where the instance timed a pack (prefill/profiling.py)
    packing = CostReport(prefill=PrefillCost(0.4, 3e-3, 8e-7, 0.0, member_c0=0.1))
    assert loads(Heartbeat, dumps(Heartbeat("p0", cost=packing))).cost == packing


def test_the_flat_form_of_older_instances_is_read_with_the_role():
    flat = loads(Heartbeat, beat('{"c0": 0.5, "c2": 1}')).cost
    assert flat == FlatCost(c0=0.5, c2=1.0)
    assert flat.for_role("prefill") == CostReport(prefill=PrefillCost(c0=0.5, c2=1.0))
    assert flat.for_role("decode") == CostReport(decode=DecodeCost(c0=0.5, c2=1.0))
    with pytest.raises(ValueError, match=r"unknown coefficient\(s\) \['c3'\] of a decode instance"):
        FlatCost(c0=1.0, c3=0.0).for_role("decode")


@pytest.mark.parametrize("cost, needle", [
    ('{"c0": 1, "c9": 2}', r"Heartbeat.cost: unknown coefficient\(s\) \['c9'\]"),
    ('{"c0": -1}', "Heartbeat.cost.c0: must be a finite number >= 0, got -1"),
    ('{"prefill": {"c9": 1}}', r"Heartbeat.cost.prefill: unknown coefficient\(s\) \['c9'\]"),
    ('{"decode": {"c3": 1}}', r"Heartbeat.cost.decode: unknown coefficient\(s\) \['c3'\]"),
    ('{"decode": {"c0": "fast"}}', "Heartbeat.cost.decode.c0: must be a finite number >= 0, got 'fast'"),
    ('{"decode": {"c0": true}}', "Heartbeat.cost.decode.c0: must be a finite number"),
    ('{"decode": {"c0": null}}', "Heartbeat.cost.decode.c0: must be a finite number"),
    ('{"prefill": {"c1": -1e-9}}', "Heartbeat.cost.prefill.c1: must be a finite number >= 0"),
    ('{"prefill": {"later_c0": -0.1}}', "Heartbeat.cost.prefill.later_c0: must be a finite number >= 0"),
    ('{"prefill": {"later_c0": 1e5}}', "Heartbeat.cost.prefill.later_c0: 100000.0 s is absurd"),
    ('{"prefill": {"member_c0": -0.1}}', "Heartbeat.cost.prefill.member_c0: must be a finite number >= 0"),
    ('{"later_c0": 1}', r"Heartbeat.cost: unknown key\(s\) \['later_c0'\]"),
    ('{"prefill": [1, 2]}', "Heartbeat.cost.prefill: expected an object of coefficients"),
    ('{"prefill": {"c0": 1}, "c1": 2}', r"Heartbeat.cost: unknown key\(s\) \['c1'\]"),
    ('{"bandwidth": 1}', r"Heartbeat.cost: unknown key\(s\) \['bandwidth'\]"),
    ('{"bandwidth_bytes_per_s": 0}', "Heartbeat.cost.bandwidth_bytes_per_s: must be a finite positive number"),
    ('{"bandwidth_bytes_per_s": "fast"}', "Heartbeat.cost.bandwidth_bytes_per_s: must be a finite positive"),
    ("[1]", "Heartbeat.cost: expected an object"),
    ('{"decode": {"c0": 1e9}}', "Heartbeat.cost.decode.c0: 1000000000.0 s is absurd"),   # issue #36
    ('{"c2": 3601}', "Heartbeat.cost.c2: 3601 s is absurd"),
    ('{"bandwidth_bytes_per_s": 1e-3}', "Heartbeat.cost.bandwidth_bytes_per_s: 0.001 bytes/s is absurd"),
    ('{"bandwidth_bytes_per_s": 1e18}', "bytes/s is absurd"),
])
def test_a_malformed_report_is_refused_naming_the_field(cost, needle):
    with pytest.raises(ProtocolError, match=needle):
        loads(Heartbeat, beat(cost))


def test_non_finite_coefficients_are_refused():
    # JSON has no infinity or NaN; a report built in process is refused by the same rule.
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="must be a finite number"):
            CostReport.from_wire({"prefill": {"c0": bad}}, "Register.cost")
        with pytest.raises(ValueError, match="must be a finite positive number"):
            CostReport.from_wire({"bandwidth_bytes_per_s": bad}, "Register.cost")


def test_a_registration_needs_a_report_object():
    raw = dumps(Register("prefill", "p0", "h:1", None, None, "tiny", 16, 0, 64, 128)).replace(
        b'"cost":{"prefill":null,"decode":null,"bandwidth_bytes_per_s":null}', b'"cost":null')
    with pytest.raises(ProtocolError, match="Register.cost: expected an object"):
        loads(Register, raw)
