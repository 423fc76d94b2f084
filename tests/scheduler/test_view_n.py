"""A decode view records a request of n choices (OpenAI's ``n``) as its n sequences: n batch
slots, each with the prompt's context, each progressed by its own choice's tokens, committed,
joined and left as one (scheduler/view.py), as admission priced it (test_n_sequences.py)."""

from __future__ import annotations

from mooncake_lite.scheduler import DecodeCostModel, DecodeView
from mooncake_lite.scheduler.view import sequence_id

COST = DecodeCostModel(c0=0.05, c1=1e-3, c2=1e-7)


def test_n_choices_are_n_sequences_from_commit_to_leave():
    v = DecodeView("d", COST)
    v.commit("one", 51, 16)
    v.commit("four", 101, 16, num_sequences=4)
    assert [(r.request_id, r.context_tokens) for r in v.state().incoming] == \
        [("one", 51), ("four", 101), ("four#1", 101), ("four#2", 101), ("four#3", 101)]
    v.join("four", 101, 1.0, 16)   # as committed: four sequences
    s = v.state()
    assert [r.request_id for r in s.incoming] == ["one"] and len(s.running) == 4
    assert s.tbt_s == COST.predict(4, 4 * 101)
    for _ in range(40):            # choice 2 ran ahead: its own record grows
        v.progress(sequence_id("four", 2))
    v.join("one", 51, 2.0, 16)
    contexts = {r.request_id: r.context_tokens for r in v.state().running}
    assert contexts == {"four": 101, "four#1": 101, "four#2": 141, "four#3": 101, "one": 51}
    assert v.leave("four") and [r.request_id for r in v.state().running] == ["one"]
    assert not v.leave("four") and v.leave("one") and v.state().running == ()


def test_a_request_of_n_leaving_before_its_kv_arrived_leaves_nothing_behind():
    v = DecodeView("d", COST)
    v.commit("a", 10, 8, num_sequences=3)
    assert v.leave("a") and v.state().incoming == () and v.state().running == ()
    v.join("b", 10, 0.0, 8, num_sequences=2)    # joined without a commit (a view rebuilt)
    assert len(v.state().running) == 2 and v.leave("b") and v.state().running == ()
