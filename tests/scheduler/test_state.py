"""The scheduler's state records are plain slotted values, hashable by their fields."""

import inspect
from dataclasses import MISSING, asdict, fields, replace

import pytest

from mooncake_lite.scheduler import (ClusterState, DecodeInstanceState, DecodingRequest, PrefillInstanceState,
                                     QueuedPrefill)


def test_states_are_plain_slotted_dataclasses():
    r = DecodingRequest("a", 10, 1.5)
    assert (r.request_id, r.context_tokens, r.joined_at, r.max_output_tokens) == ("a", 10, 1.5, None)
    d = DecodeInstanceState("d", (r,), max_context_tokens=100)
    assert (d.running, d.max_batch_size, d.max_context_tokens, d.cost, d.incoming, d.tbt_s) == \
        ((r,), None, 100, None, (), None)
    assert d == DecodeInstanceState(instance_id="d", running=(DecodingRequest("a", 10, 1.5),), max_context_tokens=100)
    assert replace(d, max_batch_size=4).max_batch_size == 4
    assert repr(QueuedPrefill("q", 5)) == ("QueuedPrefill(request_id='q', num_tokens=5, num_prefix_tokens=0, "
                                           "started_at=None, passed=0, pack_cap=0, ends_at=None)")
    # nothing but the fields: what the scheduler derives lives in its estimate cache
    assert asdict(ClusterState((), (d,))) == {"prefills": (), "decodes": (
        {"instance_id": "d", "running": ({"request_id": "a", "context_tokens": 10, "joined_at": 1.5,
                                          "max_output_tokens": None},),
         "max_batch_size": None, "max_context_tokens": 100, "cost": None, "incoming": (), "tbt_s": None,
         "tbt_spread": 1.0, "tbt_tail": 1.0,
         "incoming_shortest": 0.0},)}
    # hashable by value (equal records hash equal), and nothing but the fields can be set
    assert hash(d) == hash(DecodeInstanceState("d", (DecodingRequest("a", 10, 1.5),), max_context_tokens=100))
    with pytest.raises(AttributeError):
        d.derived = 1.0
    with pytest.raises(TypeError):
        PrefillInstanceState("p")                               # store_id is required
    with pytest.raises(TypeError):
        PrefillInstanceState("p", "s", unknown=1)


def test_decode_state_init_written_out_takes_the_fields():
    # DecodeInstanceState's __init__ is written out (mypyc compiles it; state.py says why): it
    # must take exactly the dataclass's fields, in order, with their defaults, and set each
    params = list(inspect.signature(DecodeInstanceState.__init__).parameters.values())[1:]
    assert [(p.name, p.default) for p in params] == \
        [(f.name, inspect.Parameter.empty if f.default is MISSING else f.default) for f in fields(DecodeInstanceState)]
    values = {f.name: object() for f in fields(DecodeInstanceState)}
    d = DecodeInstanceState(**values)
    assert all(getattr(d, name) is value for name, value in values.items())
