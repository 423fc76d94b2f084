"""The continuous batcher's decisions: who runs each step, when blocks come back, admission."""

import pytest

from mooncake_lite.decode.batcher import AdmissionError, DecodeBatcher
from mooncake_lite.model.kv_cache import BlockAllocator
from mooncake_lite.scheduler.costs import DecodeCostModel

BS = 4


def make(num_blocks=32, **kw) -> DecodeBatcher:
    return DecodeBatcher(BlockAllocator(num_blocks), BS, **kw)


def test_reserve_holds_prompt_plus_outputs_and_finish_frees():
    b = make()
    b.reserve("a", prompt_len=5, max_tokens=4)          # 9 tokens -> 3 blocks
    assert b.allocator.num_free == 29
    assert b.plan() is None                              # waiting for KV: not in the batch
    assert b.join("a", 7) is None
    for expected_pos in (5, 6, 7):
        plan = b.plan()
        assert plan.request_ids == ("a",) and plan.positions == (expected_pos,)
        outs = b.commit(plan, [expected_pos])
    assert outs[-1].finish_reason == "length"
    assert b.seqs == {} and b.allocator.num_free == 32


def test_sequences_join_and_leave_between_steps():
    b = make()
    b.reserve("a", 3, 3)
    b.reserve("b", 6, 5)
    b.join("a", 1)
    p1 = b.plan()
    assert p1.request_ids == ("a",) and p1.token_ids == (1,)
    b.commit(p1, [2])
    b.join("b", 9)                                      # joins at the next step
    p2 = b.plan()
    assert p2.request_ids == ("a", "b") and p2.positions == (4, 6) and p2.token_ids == (2, 9)
    outs = b.commit(p2, [3, 10])
    assert [o.finish_reason for o in outs] == ["length", None]   # a leaves after 3 tokens
    assert b.plan().request_ids == ("b",)


def test_stop_token_finishes_and_first_token_can_finish():
    b = make()
    b.reserve("a", 3, 10, stop_token_ids=(5,))
    assert b.join("a", 5) == "stop"                     # first token (from prefill) is a stop token
    assert b.allocator.num_free == 32
    b.reserve("b", 3, 1)
    assert b.join("b", 0) == "length"                   # max_tokens 1: prefill's token was all
    b.reserve("c", 3, 10, stop_token_ids=(5,))
    b.join("c", 1)
    assert b.commit(b.plan(), [5])[0].finish_reason == "stop"
    assert b.allocator.num_free == 32


def test_abort_while_in_flight_keeps_blocks_until_commit():
    b = make()
    b.reserve("a", 4, 8)
    b.join("a", 1)
    plan = b.plan()
    free = b.allocator.num_free
    assert b.abort("a")
    assert b.allocator.num_free == free                 # the step still writes a's KV slot
    assert b.commit(plan, [3]) == []                    # no token for an aborted request
    assert b.allocator.num_free == 32 and b.seqs == {}
    assert not b.abort("a")


def test_abort_waiting_frees_at_once():
    b = make()
    b.reserve("a", 4, 8)
    assert b.abort("a") and b.allocator.num_free == 32


def test_admission_refuses_with_reasons():
    b = make(num_blocks=4)
    assert "only 4" in b.check_admit(20, 1)             # can never fit
    b.reserve("a", 8, 4)                                # 3 blocks
    assert "KV cache full" in b.check_admit(4, 4)
    with pytest.raises(AdmissionError, match="KV cache full"):
        b.reserve("b", 4, 4)
    c = make(max_batch_size=1)
    c.reserve("a", 2, 2)
    assert "batch full" in c.check_admit(2, 2)


def test_tbt_prediction_refuses_over_slo():
    cost = DecodeCostModel(c0=0.010, c1=0.001, c2=0.0001)   # 10 ms + 1 ms/seq + 0.1 ms per context token
    b = make(num_blocks=256, cost=cost, tbt_slo_s=0.020)
    assert b.check_admit(10, 4) is None                      # 10 + 1 + 1 = 12 ms
    b.reserve("a", 40, 4)                                    # context 40
    # with b: batch 2, context 40 + 50 = 90 -> 10 + 2 + 9 = 21 ms > 20 ms
    reason = b.check_admit(50, 4)
    assert reason is not None and "predicted TBT 21.00 ms" in reason and "SLO 20.00 ms" in reason
    assert b.check_admit(40, 4) is None                      # 10 + 2 + 8 = 20 ms: allowed


def test_relative_tbt_check_against_a_step_alone():
    cost = DecodeCostModel(c0=0.010, c1=0.001, c2=0.0001)
    assert make(num_blocks=256, cost=cost).check_admit(10, 4) is None      # off by default
    b = make(num_blocks=256, cost=cost, tbt_slo_factor=2.0)
    b.reserve("a", 100, 4)                                   # context 100: 10 ms of attention
    # 50 tokens alone: 10 + 1 + 5 = 16 ms, SLO 32 ms; with a: 10 + 2 + 15 = 27 ms -> admitted
    assert b.check_admit(50, 4) is None
    b.reserve("b", 100, 4)
    # with a and b: 10 + 3 + 25 = 38 ms > 32 ms
    reason = b.check_admit(50, 4)
    assert reason is not None and "predicted TBT 38.00 ms" in reason and "SLO 32.00 ms (2x a step alone)" in reason
    # an absolute SLO replaces the factor
    b.tbt_slo_s = 0.040
    assert b.check_admit(50, 4) is None


def test_no_leak_over_many_random_lifecycles():
    import random
    rng = random.Random(0)
    b = make(num_blocks=64)
    live: list[str] = []
    for i in range(3000):
        rid = f"r{i}"
        prompt_len, max_tokens = rng.randint(1, 12), rng.randint(1, 6)
        if b.check_admit(prompt_len, max_tokens) is None:
            b.reserve(rid, prompt_len, max_tokens)
            live.append(rid)
        action = rng.random()
        if live and action < 0.3:
            b.abort(live.pop(rng.randrange(len(live))))
        elif live and action < 0.7:
            rid = live[rng.randrange(len(live))]
            if not b.seqs[rid].is_running and b.join(rid, rng.randint(0, 9)) is not None:
                live.remove(rid)
        plan = b.plan()
        if plan is not None:
            if rng.random() < 0.2 and live:
                b.abort(live.pop(rng.randrange(len(live))))   # abort during the step
            for out in b.commit(plan, [rng.randint(0, 9) for _ in plan.request_ids]):
                if out.finish_reason is not None:
                    live.remove(out.request_id)
        live = [r for r in live if r in b.seqs]
    for rid in list(b.seqs):
        b.abort(rid)
    assert b.allocator.num_free == 64 and b.seqs == {}


# --- n choices from one prefill (issue #32) ---------------------------------------------------

def test_choices_share_the_prompts_full_blocks_and_copy_its_partial_one():
    b = make()
    seq = b.reserve("r", prompt_len=9, max_tokens=4, n=3)   # 13 tokens: 4 blocks, 2 of them full prompt blocks
    assert b.allocator.num_free == 32 - (2 + 3 * 2)         # the full ones once, the rest per choice
    tables = [b.seqs[k].block_ids for k in ("r", "r#1", "r#2")]
    assert seq.block_ids is tables[0] and all(t[:2] == tables[0][:2] for t in tables)
    assert len({t[2] for t in tables} | {t[3] for t in tables}) == 6   # the rest is each one's own
    reasons, copies = b.join_all("r", [5, 6, 7])
    assert reasons == [None, None, None]
    assert copies == [(tables[0][2], tables[1][2]), (tables[0][2], tables[2][2])]   # the prompt's tail block
    plan = b.plan()
    assert plan.request_ids == ("r",) * 3 and plan.indices == (0, 1, 2) and plan.token_ids == (5, 6, 7)
    assert plan.positions == (9, 9, 9)
    outs = b.commit(plan, [1, 2, 3])
    assert [(o.index, o.token) for o in outs] == [(0, 1), (1, 2), (2, 3)]
    b.abort("r")
    assert b.seqs == {} and b.allocator.num_free == 32


def test_shared_blocks_return_with_the_last_choice_only():
    b = make()
    b.reserve("r", prompt_len=8, max_tokens=3, n=2, stop_token_ids=(99,))   # 2 full prompt blocks shared
    assert b.allocator.num_free == 32 - (2 + 2 * 1)
    reasons, copies = b.join_all("r", [99, 4])     # choice 0 stops at once; the prompt fills its blocks
    assert reasons == ["stop", None] and copies == []
    assert b.allocator.num_free == 32 - 3          # choice 0's own block back, the shared ones kept
    plan = b.plan()
    assert plan.keys == ("r#1",)
    b.commit(plan, [5])
    outs = b.commit(b.plan(), [6])
    assert outs[-1].finish_reason == "length" and outs[-1].index == 1
    assert b.seqs == {} and b.allocator.num_free == 32


def test_admission_counts_every_choice():
    b = make(num_blocks=8)
    assert "KV cache" in b.check_admit(8, 8, n=4) or "blocks" in b.check_admit(8, 8, n=4)   # 2 + 4 * 2 = 10 > 8
    assert b.check_admit(8, 8, n=3) is None                                                 # 2 + 3 * 2 = 8
