"""Decisions with several conductors (issue #38 item 3's hooks): each conductor shows the work
other conductors sent an instance, from its heartbeats, and breaks ties in its own order."""

from __future__ import annotations

import os

from mooncake_lite.common.protocol import Heartbeat, InstanceLoad, Register
from mooncake_lite.conductor.cluster import others
from mooncake_lite.conductor.cluster.membership import DecodeJob, Membership, PrefillJob


def reg(role: str, iid: str) -> Register:
    return Register(role, iid, f"{iid}:1", f"{iid}:2" if role == "decode" else None,
                    "store:1" if role == "prefill" else None, "tiny", 4, 0, 64, 4096)


def membership(salt: bytes | None = b"s" * 16) -> Membership:
    m = Membership("tiny", 4, 0, 10.0, tie_salt=salt)
    m.register(reg("prefill", "p0"), 0.0)
    m.register(reg("decode", "d0"), 0.0)
    return m


def beat(m: Membership, iid: str, now: float, **load) -> None:
    inst = m.heartbeat(Heartbeat(iid, InstanceLoad(**load)), now)
    others.show(inst, now)


def test_a_prefill_shows_the_tokens_others_queued_there_until_its_heartbeat_says_they_are_done():
    m = membership()
    m.add_prefill("p0", PrefillJob("r1", 100, 0, "d0"), 1.0)
    beat(m, "p0", 1.1, queued_tokens=100.0 + 700.0)   # ours + 700 tokens of the other conductors
    queue = m.snapshot().prefills[0].queue
    assert [(j.request_id, j.num_tokens) for j in queue] == [("r1", 100), (others.OTHERS, 700)]
    assert queue[0].started_at == 1.0
    beat(m, "p0", 1.3, queued_tokens=100.0)            # theirs ended
    assert [j.request_id for j in m.snapshot().prefills[0].queue] == ["r1"]
    m.prefill_done("p0", "r1", 1.4)
    beat(m, "p0", 1.5, queued_tokens=300.0)            # only theirs: the stand-in is the running head
    (head,) = m.snapshot().prefills[0].queue
    assert head.request_id == others.OTHERS and head.started_at == 1.5


def test_a_decode_shows_the_requests_others_run_there_with_their_context():
    m = membership()
    m.add_prefill("p0", PrefillJob("r1", 50, 0, "d0"), 1.0)
    m.add_decode("d0", DecodeJob("r1", 51, 1.2, 16))
    beat(m, "d0", 1.3, num_running=3.0, num_waiting=0.0, context_tokens=51.0 + 2 * 400)
    running = m.snapshot().decodes[0].running
    assert sorted((r.request_id, r.context_tokens) for r in running) == \
        [("(other conductors) 0", 400), ("(other conductors) 1", 400), ("r1", 51)]
    beat(m, "d0", 1.5, num_running=1.0, num_waiting=0.0, context_tokens=52.0)
    assert [r.request_id for r in m.snapshot().decodes[0].running] == ["r1"]


def test_conductors_order_equal_instances_each_their_own_way():
    """With the same view, ties go to a snapshot's first instance: salted conductors disagree on
    it (so a burst seen by all is spread), one without a salt keeps registration order."""
    firsts = set()
    for _ in range(16):
        m = Membership("tiny", 4, 0, 10.0, tie_salt=os.urandom(16))
        for i in range(4):
            m.register(reg("prefill", f"p{i}"), 0.0)
        firsts.add(m.snapshot().prefills[0].instance_id)
    assert len(firsts) >= 2
    m = Membership("tiny", 4, 0, 10.0)
    for i in (3, 1, 2, 0):
        m.register(reg("prefill", f"p{i}"), 0.0)
    assert [p.instance_id for p in m.snapshot().prefills] == ["p3", "p1", "p2", "p0"]


def test_contexts_follow_etcd_and_a_malformed_entry_is_skipped():
    from mooncake_lite.conductor.contexts.book import Context, ContextBook
    from mooncake_lite.conductor.contexts.shared import SharedContexts, to_entry

    book = ContextBook()
    shared = SharedContexts(None, "tok", book)   # follow() reads no etcd
    ctx = Context("ctx-1", "default", "prompt", "tiny", (1, 2, 3, 4), (), (b"\x01" * 16,), "s:1", 5, 4e9,
                  cached_tokens=4)
    shared.follow({"ctx-1": to_entry(ctx), "ctx-bad": {"context_id": "ctx-bad", "keys": ["zz"]}})
    assert set(book.contexts) == {"ctx-1"} and book.contexts["ctx-1"].keys == ctx.keys
    book.contexts["ctx-local"] = ctx   # made here, its entry not read back yet: kept
    shared.follow({})                  # ctx-1 deleted on another conductor
    assert set(book.contexts) == {"ctx-local"} and "ctx-1" not in book.expired
