"""Membership bookkeeping as the scheduler sees it (pure: no IO, time passed in)."""

from __future__ import annotations

from mooncake_lite.common.protocol import Heartbeat, Register
from mooncake_lite.conductor.membership import DecodeJob, Membership, PrefillJob, model_id


def _reg(role: str, iid: str, **kw) -> Register:
    base = dict(role=role, instance_id=iid, http=f"h-{iid}:1", data="d:1" if role == "decode" else None,
                store="s:1" if role == "prefill" else None, model="tiny", block_size=16, hash_seed=0,
                kv_bytes_per_token=64, max_context=1000)
    return Register(**{**base, **kw})


def test_prefill_queue_is_fifo_and_the_head_gets_a_start_time():
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(_reg("prefill", "p"), now=0)
    m.add_prefill("p", PrefillJob("a", 100, 0, "d"), now=1.0)
    m.add_prefill("p", PrefillJob("b", 50, 16, "d"), now=2.0)
    q = m.snapshot().prefills[0].queue
    assert [(j.request_id, j.started_at) for j in q] == [("a", 1.0), ("b", None)]
    m.prefill_done("p", "a", now=3.5)
    q = m.snapshot().prefills[0].queue
    assert [(j.request_id, j.started_at, j.num_prefix_tokens) for j in q] == [("b", 3.5, 16)]


def test_decode_batch_grows_with_tokens_and_release_forgets_everything():
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(_reg("prefill", "p"), now=0)
    m.register(_reg("decode", "d"), now=0)
    m.add_prefill("p", PrefillJob("a", 100, 0, "d"), now=0)
    m.watch("p", "a", lambda reason: None)
    m.prefill_done("p", "a", now=1)
    m.add_decode("d", DecodeJob("a", 101, 1.0, 8))
    m.decode_progress("d", "a")
    m.decode_progress("d", "a")
    d = m.snapshot().decodes[0]
    assert [(r.context_tokens, r.joined_at, r.max_output_tokens) for r in d.running] == [(103, 1.0, 8)]
    assert d.max_context_tokens == 1000         # Register.max_context: the decode's KV capacity
    m.release("a", ("p", "d"), now=2)
    snap = m.snapshot()
    assert snap.decodes[0].running == () and snap.prefills[0].queue == ()
    assert not m.instances["p"].watchers


def test_a_dispatched_request_is_incoming_on_its_decode_until_its_kv_arrives():
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(_reg("prefill", "p"), now=0)
    m.register(_reg("decode", "d0"), now=0)
    m.register(_reg("decode", "d1"), now=0)
    m.add_prefill("p", PrefillJob("a", 100, 0, "d0", max_output_tokens=8), now=0)
    m.add_prefill("p", PrefillJob("b", 50, 0, "d1"), now=0)
    m.add_prefill("p", PrefillJob("c", 70, 0, "d0"), now=0)
    d0, d1 = m.snapshot().decodes
    assert [(r.request_id, r.context_tokens, r.max_output_tokens) for r in d0.incoming] == \
        [("a", 101, 8), ("c", 71, None)]
    assert [r.request_id for r in d1.incoming] == ["b"] and d0.running == ()
    m.prefill_done("p", "a", now=1)                 # KV arrived: running, no longer incoming
    m.add_decode("d0", DecodeJob("a", 101, 1.0, 8))
    d0 = m.snapshot().decodes[0]
    assert [r.request_id for r in d0.incoming] == ["c"] and [r.request_id for r in d0.running] == ["a"]
    m.release("c", ("p", "d0"), now=2)              # failed or aborted before its KV came
    m.release("b", ("p", "d1"), now=2)
    assert all(d.incoming == () for d in m.snapshot().decodes)


def test_reap_marks_silent_instances_dead_and_tells_their_requests():
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(_reg("prefill", "p"), now=0)
    m.register(_reg("decode", "d"), now=0)
    told = []
    m.watch("d", "r1", told.append)
    m.heartbeat(Heartbeat("p"), now=4)
    assert m.reap(now=5.5) == [m.instances["d"]]
    assert len(told) == 1 and "stopped heartbeating" in told[0]
    assert [d.instance_id for d in m.snapshot().decodes] == [] and len(m.snapshot().prefills) == 1
    m.heartbeat(Heartbeat("d"), now=6)         # back again
    assert [d.instance_id for d in m.snapshot().decodes] == ["d"]


def test_model_ids_compare_checkpoint_directories_by_name():
    assert model_id("tiny") == "tiny"
    assert model_id("/models/Qwen2-0.5B/") == "Qwen2-0.5B" == model_id("/mnt/other/Qwen2-0.5B")
