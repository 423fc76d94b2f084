"""Prefill batching (issue #17 item 4): several prompts packed into one forward give exactly the
logits and tokens of prefilling each alone, and stream/store the same KV."""

import asyncio

import pytest
import torch

from mooncake_lite.common.protocol import Sampling
from mooncake_lite.model.generate import full_recompute_logits, reference_greedy
from mooncake_lite.model.kv_cache import blocks_needed
from mooncake_lite.model.runner import ModelRunner, PackedPass
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.engine import PrefillAborted
from mooncake_lite.scheduler.costs import PrefillCostModel, pack_sizes, packed_durations
from mooncake_lite.scheduler import SchedulerConfig
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from tests.pd.harness import cluster
from tests.sim.helpers import req, toy_hardware

pytestmark = pytest.mark.timeout(120)

BS = 8
ATOL = 1e-4   # float32: packing changes only the matmul's row count, i.e. summation blocking


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=3)


def tokens_of(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("lengths", [[1], [BS, 3 * BS + 5, 1, BS - 1, 2, 40]])
def test_packed_logits_equal_each_prompt_alone(model, lengths):
    runner = ModelRunner(model, num_blocks=64, block_size=BS)
    prompts = [tokens_of(n, 10 + i) for i, n in enumerate(lengths)]
    seqs = [(runner.allocator.allocate(blocks_needed(len(p), BS)), 0, p) for p in prompts]
    logits = runner.prefill_packed(seqs)
    assert logits.shape == (len(prompts), model.args.vocab_size)
    for row, p in zip(logits, prompts):
        ref = full_recompute_logits(model, p)[-1]
        torch.testing.assert_close(row, ref, atol=ATOL, rtol=0)
        assert int(row.argmax()) == int(ref.argmax())


def test_packed_chunks_with_cached_prefixes_and_kv_slots(model):
    """Sequences resume at different positions (a reused prefix, an earlier chunk): each attends
    to its own cached context only, and the KV written for each equals a lone prefill's."""
    runner = ModelRunner(model, num_blocks=64, block_size=BS)
    alone = ModelRunner(model, num_blocks=64, block_size=BS)
    prompts = [tokens_of(n, 30 + n) for n in (2 * BS + 3, 9, 3 * BS)]
    starts = [2 * BS, 0, BS + 4]            # tokens already in the cache before the packed pass
    seqs = []
    for p, s in zip(prompts, starts):
        table = runner.allocator.allocate(blocks_needed(len(p), BS))
        if s:
            runner.prefill(p[:s], table, 0)
        seqs.append((table, s, p[s:]))
    piece = PackedPass(runner, seqs)
    for layer in model.layer_ids:
        piece.run_layer(layer)
    logits = piece.output()
    for i, (p, (table, s, new)) in enumerate(zip(prompts, seqs)):
        torch.testing.assert_close(logits[i], full_recompute_logits(model, p)[-1], atol=ATOL, rtol=0)
        lone_table = alone.allocator.allocate(blocks_needed(len(p), BS))
        alone.prefill(p, lone_table, 0)
        lone_slots = torch.tensor([lone_table[q // BS] * BS + q % BS for q in range(s, len(p))])
        assert piece.slots_of(i).tolist() == [table[q // BS] * BS + q % BS for q in range(s, len(p))]
        for layer in model.layer_ids:
            k, v = runner.cache.layer(layer)
            lk, lv = alone.cache.layer(layer)
            flat = lambda c: c.reshape(-1, *c.shape[2:])
            torch.testing.assert_close(flat(k)[piece.slots_of(i)], flat(lk)[lone_slots], atol=ATOL, rtol=0)
            torch.testing.assert_close(flat(v)[piece.slots_of(i)], flat(lv)[lone_slots], atol=ATOL, rtol=0)


def test_packed_pass_refuses_empty_input(model):
    runner = ModelRunner(model, num_blocks=8, block_size=BS)
    with pytest.raises(ValueError):
        PackedPass(runner, [])
    with pytest.raises(ValueError):
        PackedPass(runner, [(runner.allocator.allocate(1), 0, [])])


# --- the prefill instance packing a burst (in-process prefill and decode over loopback) ---------
def assert_clean(c):
    assert c.decode.runner.allocator.num_free == c.decode.runner.allocator.num_blocks
    assert c.decode.pending == {} and c.decode.requests == {}
    assert c.prefill.stage.runner.allocator.num_free == c.prefill.stage.runner.allocator.num_blocks
    assert c.prefill.stage.jobs == {} and c.prefill.queue == {}


async def queued_burst(c, prompts, max_tokens, caps=None, **gather):
    """Send every prompt while the instance is held, so the whole burst is queued before its
    first pack is cut; the requests' outcomes in prompt order."""
    await c.prefill.hold()
    caps = caps or [0] * len(prompts)
    tasks = [asyncio.ensure_future(c.request(f"r{i}", p, max_tokens, pack_cap=cap))
             for i, (p, cap) in enumerate(zip(prompts, caps))]
    while len(c.prefill.queue) < len(prompts):
        await asyncio.sleep(0.001)
    c.prefill.unhold()
    return await asyncio.gather(*tasks, **gather)


async def test_a_burst_is_packed_and_every_request_gets_its_reference_tokens(model):
    shared = tokens_of(2 * BS, 50)
    prompts = [tokens_of(3 + 5 * i, 60 + i) for i in range(6)] + [shared + tokens_of(3, 70), shared + [1, 2],
                                                                  tokens_of(3 * BS + 1, 71)]
    async with cluster(model, block_size=BS, chunk=32) as c:
        c.prefill.batch_tokens = 48
        await c.request("warm", shared + [5], 2)    # the shared prefix in the store: packed with a hit
        await c.prefill.stage.drain_puts()
        seeded = Sampling(max_tokens=5, temperature=0.8, seed=7)
        burst = [c.request(f"r{i}", p, 5) for i, p in enumerate(prompts)]
        burst += [c.request(f"s{i}", p, 5, sampling=seeded) for i, p in enumerate(prompts[:2])]
        results = await asyncio.gather(*burst)
        for p, (tokens, reason, err) in zip(prompts, results):
            assert err is None and tokens == reference_greedy(model, p, 5)
        assert c.prefill.totals["packed_forwards_total"] >= 2       # 11 prompts, 48 tokens a forward: several packs
        assert c.prefill.totals["prefix_tokens_total"] >= 2 * 2 * BS   # both shared-prefix prompts hit
        # seeded sampling: packed, a request draws exactly what it draws alone
        c.prefill.batch_tokens = 0
        for i, p in enumerate(prompts[:2]):
            assert results[len(prompts) + i] == await c.request(f"a{i}", p, 5, sampling=seeded)
        await c.prefill.stage.drain_puts()
        assert_clean(c)


async def test_a_member_aborted_in_the_queue_fails_alone(model):
    prompts = [tokens_of(5 + i, 80 + i) for i in range(5)]
    async with cluster(model, block_size=BS, chunk=64) as c:
        c.prefill.batch_tokens = 64
        tasks = [asyncio.ensure_future(c.request(f"r{i}", p, 3)) for i, p in enumerate(prompts)]
        while len(c.prefill.queue) < len(prompts):
            await asyncio.sleep(0.001)
        assert c.prefill.abort("r2") and c.decode.abort("r2")    # as the conductor does, to both
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert c.prefill.totals["packed_forwards_total"] >= 1
        for i, (p, res) in enumerate(zip(prompts, results)):
            if i == 2:
                assert isinstance(res, Exception) or res[2] is not None
            else:
                assert res[0] == reference_greedy(model, p, 3)
        await c.prefill.stage.drain_puts()
        assert_clean(c)


# --- the rule as a cost (scheduler.costs), and the instance following it ------------------------
def test_pack_sizes_cut_a_fifo_queue_within_the_budget():
    assert pack_sizes([100] * 6, 512) == [5, 1]
    assert pack_sizes([600, 10, 10], 512) == [1, 2]          # oversize runs alone, takes nobody
    assert pack_sizes([10, 600, 10], 512) == [1, 1, 1]       # FIFO: no one jumps the big one
    assert pack_sizes([300, 300, 200, 12], 512) == [1, 3]
    assert pack_sizes([5, 5, 5], 0) == [1, 1, 1]
    assert pack_sizes([], 512) == []


def test_packed_durations_pay_the_fixed_cost_once_per_pack():
    model = PrefillCostModel(c0=0.05, c1=1e-3, c2=1e-6, c3=1e-5)
    jobs = [(100, 0), (120, 64), (90, 0), (700, 0), (30, 16), (40, 0)]
    alone = [model.predict(n, p) for n, p in jobs]
    assert packed_durations(model, jobs, 0) == alone
    got = packed_durations(model, jobs, 512)
    # packs: jobs 0-2 (100+56+90 uncached), job 3 alone (700), jobs 4-5
    assert got[:2] == [0.0, 0.0] and got[4] == 0.0
    assert got[2] == pytest.approx(sum(alone[:3]) - 2 * model.c0)
    assert got[3] == pytest.approx(alone[3])
    assert got[5] == pytest.approx(alone[4] + alone[5] - model.c0)
    assert sum(got) == pytest.approx(sum(alone) - 3 * model.c0)


def recording_packs(c) -> list[int]:
    """The sizes of the packs the instance forms from now on, as it forms them."""
    packs, real_pack = [], c.prefill._pack

    async def record(lead):
        pack = await real_pack(lead)
        packs.append(len(pack))
        return pack

    c.prefill._pack = record
    return packs


async def test_the_instance_packs_a_queue_the_way_the_rule_cuts_it(model):
    prompts = [tokens_of(n, 90 + i) for i, n in enumerate([20, 20, 30, 70, 5, 5, 40, 3])]
    async with cluster(model, block_size=BS, chunk=64) as c:
        c.prefill.batch_tokens = 48
        packs = recording_packs(c)
        for p, (tokens, _, err) in zip(prompts, await queued_burst(c, prompts, 2)):
            assert err is None and tokens == reference_greedy(model, p, 2)
        assert packs == pack_sizes([len(p) for p in prompts], 48) == [2, 1, 1, 2, 2]
        await c.prefill.stage.drain_puts()
        assert_clean(c)


async def test_the_instance_keeps_each_members_cap_as_the_rule_does(model):
    """Caps from the decisions (a short prompt's TTFT SLO): the same cut as ``pack_sizes`` with
    them, every request still its reference tokens."""
    lengths, caps = [5, 20, 20, 10, 10, 30], [0, 30, 0, 0, 25, 0]
    prompts = [tokens_of(n, 140 + i) for i, n in enumerate(lengths)]
    async with cluster(model, block_size=BS, chunk=64) as c:
        c.prefill.batch_tokens = 64
        packs = recording_packs(c)
        for p, (tokens, _, err) in zip(prompts, await queued_burst(c, prompts, 2, caps)):
            assert err is None and tokens == reference_greedy(model, p, 2)
        assert packs == pack_sizes(lengths, 64, caps) == [2, 2, 1, 1] != pack_sizes(lengths, 64)
        await c.prefill.stage.drain_puts()
        assert_clean(c)


async def test_a_pack_takes_no_more_than_the_cache_holds(model):
    """Members hold their blocks at once: with room for two prompts, packs are of two, nobody is refused."""
    prompts = [tokens_of(2 * BS, 120 + i) for i in range(5)]
    async with cluster(model, block_size=BS, chunk=64, prefill_blocks=4) as c:
        c.prefill.batch_tokens = 64
        for p, (tokens, _, err) in zip(prompts, await queued_burst(c, prompts, 2)):
            assert err is None and tokens == reference_greedy(model, p, 2)
        assert c.prefill.totals["packed_requests_total"] == 4 and c.prefill.totals["packed_forwards_total"] == 2
        assert_clean(c)


def test_the_simulator_packs_by_the_same_rule():
    """A burst on one simulated prefill instance: the first runs alone (nothing else has arrived
    when it starts), the five behind it share one forward and its one fixed cost."""
    hw = toy_hardware(prefill=PrefillCostModel(c0=0.05, c1=1e-3))
    trace = [req(i, 0.0, 100, 2) for i in range(6)]

    def ttfts(budget):
        cfg = SimConfig(num_prefill=1, num_decode=1, prefill_batch_tokens=budget,
                        scheduler=SchedulerConfig(admission="none"))
        return [r.ttft for r in MooncakeSim(cfg, hardware=hw).run(trace).requests]

    assert ttfts(0) == pytest.approx([0.15 * (i + 1) for i in range(6)])
    assert ttfts(512) == pytest.approx([0.15] + [0.15 + 5 * 0.15 - 4 * 0.05] * 5)
    assert ttfts(250) == pytest.approx([0.15, 0.40, 0.40, 0.65, 0.65, 0.80])   # packs of 2 (200 tokens)


async def test_a_member_aborted_midway_through_the_packed_forward_fails_alone(model):
    prompts = [tokens_of(6 + i, 140 + i) for i in range(4)]
    async with cluster(model, block_size=BS, chunk=64) as c:
        c.prefill.batch_tokens = 64
        loop, real_layer = asyncio.get_running_loop(), c.prefill.stage._packed_layer

        def layer(piece, i):
            if i == 1:     # while layer 1 computes, the conductor aborts r1 (prefill and decode)
                loop.call_soon_threadsafe(lambda: (c.prefill.abort("r1"), c.decode.abort("r1")))
            return real_layer(piece, i)

        c.prefill.stage._packed_layer = layer
        results = await queued_burst(c, prompts, 3, return_exceptions=True)
        assert c.prefill.totals["packed_requests_total"] == 4
        assert isinstance(results[1], PrefillAborted)
        for i in (0, 2, 3):
            assert results[i][0] == reference_greedy(model, prompts[i], 3)
        await c.prefill.stage.drain_puts()
        assert_clean(c)
