"""The scheduler's state records keep dataclass semantics with their faster constructor."""

from dataclasses import FrozenInstanceError, dataclass, field, replace

import pytest

from mooncake_lite.scheduler.state import (DecodeInstanceState, DecodingRequest, PrefillInstanceState,
                                           QueuedPrefill, _slot_init)


def test_states_construct_like_dataclasses_and_stay_frozen():
    r = DecodingRequest("a", 10, 1.5)
    assert (r.request_id, r.context_tokens, r.joined_at, r.max_output_tokens) == ("a", 10, 1.5, None)
    d = DecodeInstanceState("d", (r,), max_context_tokens=100)
    assert (d.running, d.max_batch_size, d.max_context_tokens, d.cost, d.incoming) == ((r,), None, 100, None, ())
    assert d._leave is None and d._previous is None            # derived slots start empty
    assert d == DecodeInstanceState(instance_id="d", running=(DecodingRequest("a", 10, 1.5),), max_context_tokens=100)
    assert replace(d, max_batch_size=4).max_batch_size == 4
    assert repr(QueuedPrefill("q", 5)) == "QueuedPrefill(request_id='q', num_tokens=5, num_prefix_tokens=0, started_at=None)"
    with pytest.raises(FrozenInstanceError):
        d.running = ()
    with pytest.raises(TypeError):
        PrefillInstanceState("p")                               # store_id is required
    with pytest.raises(TypeError):
        PrefillInstanceState("p", "s", unknown=1)


def test_a_class_it_cannot_build_faithfully_is_refused():
    with pytest.raises(TypeError, match="__post_init__"):
        @_slot_init
        @dataclass(frozen=True, slots=True)
        class Checked:
            x: int

            def __post_init__(self) -> None:
                pass

    for spec in (dict(default_factory=list), dict(kw_only=True, default=()), dict(init=False)):
        with pytest.raises(TypeError, match=r"not \['xs'\]"):
            @_slot_init
            @dataclass(frozen=True, slots=True)
            class Unusual:
                xs: tuple = field(**spec)
