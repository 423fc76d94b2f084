"""``make_decision`` builds a Decision by keyword without NamedTuple's slow keyword call: its
parameters must stay the fields, in order, with the same defaults (a field added to Decision and
not to it would shift every later value)."""

from __future__ import annotations

import inspect

from mooncake_lite.scheduler.decision import Decision, make_decision


def test_parameters_are_the_fields_with_their_defaults():
    params = inspect.signature(make_decision).parameters
    assert tuple(params) == Decision._fields
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    defaults = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
    assert defaults == Decision._field_defaults


def test_the_same_value_as_the_keyword_call():
    values = dict(zip(Decision._fields, ["x" + str(i) for i in range(len(Decision._fields))]))
    built = make_decision(**values)
    assert type(built) is Decision and built == Decision(**values)
    assert make_decision(accepted=False, reason="r") == Decision(accepted=False, reason="r")
