"""The prefill instance serves its queue in the registered order (scheduler/queue_order.py):
FIFO, or shortest uncached prompt first within the overtake bound, packs cut in that order."""

import asyncio

import pytest

from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.model.weights import build_model
from tests.pd.harness import cluster, prompt

pytestmark = pytest.mark.timeout(120)

BS = 8


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=3)


async def served_order(c, lengths, overtakes, batch_tokens=0, seed=0, passed=None, placed=None):
    """Queue prompts of ``lengths`` (r0 first) while the instance is held; the order the
    instance's forwards took them in (a pack as one tuple) and each request's outcome;
    ``passed``: filled with what each result says of the later arrivals served before it;
    ``placed``: each one's number in its conductor's order (None: not said)."""
    c.prefill.overtakes, c.prefill.batch_tokens = overtakes, batch_tokens
    forwards = []
    run, run_pack, prefill = c.prefill._run, c.prefill._run_pack, c.prefill.prefill

    async def told(req):
        result = await prefill(req)
        if passed is not None:
            passed[req.request_id] = result.timings.get("passed")
        return result

    async def one(job):
        forwards.append((job.request_id,))
        return await run(job)

    async def packed(pack):
        forwards.append(tuple(j.request_id for j in pack))
        return await run_pack(pack)

    c.prefill._run, c.prefill._run_pack, c.prefill.prefill = one, packed, told
    c.prefill.turns.events.clear()
    prompts = [prompt(n, 100 * seed + i) for i, n in enumerate(lengths)]   # no prefix in the store
    await c.prefill.hold()
    tasks = []
    for i, p in enumerate(prompts):      # one at a time: the arrival order is the index
        tasks.append(asyncio.ensure_future(c.request(f"r{i}", p, 2, placed=placed[i] if placed else 0)))
        while len(c.prefill.queue) <= i:
            await asyncio.sleep(0.001)
    c.prefill.unhold()
    results = await asyncio.gather(*tasks)
    del c.prefill.prefill     # (the class's again)
    for p, (tokens, _, err) in zip(prompts, results):
        assert err is None and tokens == reference_greedy(c.prefill.stage.runner.model, p, 2)
    assert_replayed(c, len(lengths) + 1)      # every request and the hold
    return forwards


def assert_replayed(c, num_grants):
    """The instance's record of turns, replayed by ``scheduler.waiting``'s rule, gives every turn
    to the job the instance gave it to: the order an offline judge rebuilds is the instance's."""
    from mooncake_lite.scheduler.waiting import replay
    replayed = replay(c.prefill.turns.events, c.prefill.overtakes)
    assert replayed.agreed == replayed.grants == num_grants


async def test_a_burst_reaching_the_instance_out_of_its_placed_order_counts_no_overtakes(model):
    """Placed shortest first (r4 #1 ... r0 #5) and reaching the instance longest first: each job
    passing one placed after it is no overtake, so with a bound of 1 the instance still serves
    them shortest first, as the conductor priced them; counted, r0's one pass goes to r1, r2's to
    r3, and the rest wait behind them."""
    async with cluster(model, block_size=BS, chunk=64) as c:
        placed = [5, 4, 3, 2, 1]
        assert await served_order(c, [40, 30, 20, 10, 5], 1, seed=2, placed=placed) == \
            [("r4",), ("r3",), ("r2",), ("r1",), ("r0",)]
        assert await served_order(c, [40, 30, 20, 10, 5], 1, seed=3) == \
            [("r1",), ("r0",), ("r3",), ("r2",), ("r4",)]


async def test_fifo_and_shortest_first_within_the_bound(model):
    async with cluster(model, block_size=BS, chunk=64) as c:
        assert await served_order(c, [40, 30, 20, 10, 5], 0) == [("r0",), ("r1",), ("r2",), ("r3",), ("r4",)]
        passed = {}
        assert await served_order(c, [40, 30, 20, 10, 5], 4, seed=1, passed=passed) == \
            [("r4",), ("r3",), ("r2",), ("r1",), ("r0",)]
        # each result says how many later arrivals were served before it (the conductor's queue factor)
        assert passed == {"r0": 4.0, "r1": 3.0, "r2": 2.0, "r3": 1.0, "r4": 0.0}
        # bound 2: r0 passed twice stops r3, which r4 then passes (scheduler/queue_order.py's example)
        assert await served_order(c, [40, 30, 20, 10, 5], 2, seed=2) == [("r2",), ("r1",), ("r0",), ("r4",), ("r3",)]
        # packs are cut from the queue in the new order: the three short ones together
        assert await served_order(c, [40, 30, 9, 7, 5], 4, batch_tokens=24, seed=3) == [("r4", "r3", "r2"), ("r1",), ("r0",)]
        assert c.prefill.queue == {} and c.prefill._waiting == [] and not c.prefill._busy


async def test_a_request_cancelled_while_queued_or_given_its_turn_frees_the_instance(model):
    async with cluster(model, block_size=BS, chunk=64) as c:
        c.prefill.overtakes = 4
        for given_its_turn in (False, True):
            await c.prefill.hold()
            waiter = asyncio.ensure_future(c.request(f"gone{given_its_turn}", prompt(9, 1), 2, kv_timeout_s=5.0))
            while not c.prefill.queue:
                await asyncio.sleep(0.001)
            if given_its_turn:
                c.prefill.unhold()      # its turn is given; cancelled before it takes it
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
            assert c.prefill._waiting == [] and c.prefill.queue == {}
            if not given_its_turn:
                c.prefill.unhold()
            assert not c.prefill._busy
            tokens, _, err = await c.request(f"next{given_its_turn}", prompt(9, 2), 2)
            assert err is None and not c.prefill._busy


def test_the_instance_registers_its_bound_and_bad_flags_are_refused():
    from mooncake_lite.common.config import ConfigError
    from mooncake_lite.prefill.config import Config
    assert (Config().queue_order, Config().overtake_bound) == ("fifo", 0)
    assert Config(queue_order="shortest").overtake_bound == Config().queue_overtakes > 0
    assert Config(queue_order="shortest", queue_overtakes=2).overtake_bound == 2
    with pytest.raises(ConfigError):
        Config(queue_order="longest")
    with pytest.raises(ConfigError):
        Config(queue_overtakes=-1)


def test_the_simulator_orders_its_prefill_queue_by_the_same_rule():
    """A burst on one simulated prefill instance (1 ms a token): the first starts alone, the
    four behind it go shortest first with the bound, in arrival order at 0 (the default)."""
    from mooncake_lite.scheduler import SchedulerConfig
    from mooncake_lite.sim.cluster import MooncakeSim
    from mooncake_lite.sim.config import SimConfig
    from tests.sim.helpers import req, toy_hardware

    trace = [req(i, 0.0, n, 2) for i, n in enumerate([500, 400, 300, 200, 100])]

    def ttfts(**order):
        cfg = SimConfig(num_prefill=1, num_decode=1, scheduler=SchedulerConfig(admission="none"), **order)
        return [r.ttft for r in MooncakeSim(cfg, hardware=toy_hardware()).run(trace).requests]

    assert ttfts() == pytest.approx([0.5, 0.9, 1.2, 1.4, 1.5])
    assert ttfts(prefill_queue_overtakes=4) == pytest.approx([0.5, 1.5, 1.1, 0.8, 0.6])
    # bound 2: r1, passed by r2 and r3, stops r4 (r0 had started: never passed)
    assert ttfts(prefill_queue_overtakes=2) == pytest.approx([0.5, 1.4, 1.0, 0.7, 1.5])


async def _queued(c, rid, n, seed):
    """Start request ``rid`` (``n`` tokens) and wait until it is in the instance's queue."""
    task = asyncio.ensure_future(c.request(rid, prompt(n, seed), 2, kv_timeout_s=5.0))
    while rid not in c.prefill.queue:
        await asyncio.sleep(0.001)
    return task


async def test_an_aborted_waiting_request_leaves_the_queue_at_once(model):
    """As it leaves the conductor's view: not counted in load() nor passed by later arrivals."""
    from mooncake_lite.prefill.engine import PrefillAborted
    async with cluster(model, block_size=BS, chunk=64) as c:
        c.prefill.overtakes = 4
        await c.prefill.hold()
        long, short = await _queued(c, "long", 40, 1), await _queued(c, "short", 9, 2)
        assert [j.request_id for j in c.prefill._waiting] == ["short", "long"]
        assert c.prefill.abort("long")
        assert [j.request_id for j in c.prefill._waiting] == ["short"]
        with pytest.raises(PrefillAborted):
            await asyncio.wait_for(long, 5)             # woken now, while the instance is still held
        c.prefill.stage.abort("long", "test")
        c.decode.abort("long")
        assert c.prefill.load().num_queued == 1.0 and "long" not in c.prefill.queue
        c.prefill.unhold()
        tokens, _, err = await short
        assert err is None and not c.prefill._busy and c.prefill._waiting == []
        assert_replayed(c, 2)                       # the hold's and short's: long left ungranted


async def test_arrivals_during_a_packs_store_matches_land_behind_its_members(model):
    """A leader choosing its pack awaits each member's store match; whoever arrives meanwhile
    lands behind the members already chosen (they are served now), passing none of them."""
    async with cluster(model, block_size=BS, chunk=64) as c:
        c.prefill.overtakes, c.prefill.batch_tokens = 4, 40
        uncached, seen, late = c.prefill._uncached, [], []

        async def match_with_an_arrival(job):
            if job.request_id == "m2" and not late:      # r0 leads, m1 is chosen; m2 is being matched
                late.append(await _queued(c, "late", 5, 9))
                seen.append([(j.request_id, j.passed) for j in c.prefill._waiting])
            return await uncached(job)

        c.prefill._uncached = match_with_an_arrival
        await c.prefill.hold()
        tasks = [await _queued(c, rid, 9, i) for i, rid in enumerate(["r0", "m1", "m2"])]
        c.prefill.unhold()
        for tokens, _, err in await asyncio.gather(*tasks, *late):
            assert err is None
        assert seen[0][0] == ("m1", 0)           # without: ("late", 0), m1 passed once
        assert not c.prefill._busy and c.prefill._waiting == []
        assert_replayed(c, 5)                    # the record knows m1 had started when late landed


async def test_a_packing_leader_skips_a_held_placeholder_and_a_cancelled_hold_leaves(model):
    async with cluster(model, block_size=BS, chunk=64) as c:
        c.prefill.batch_tokens = 40
        await c.prefill.hold()
        r0 = await _queued(c, "r0", 9, 1)
        holder = asyncio.ensure_future(c.prefill.hold())    # waits behind r0
        await asyncio.sleep(0)
        r1 = await _queued(c, "r1", 9, 2)
        c.prefill.unhold()
        tokens, _, err = await asyncio.wait_for(r0, 30)
        assert err is None                      # without: r0 fails matching the placeholder
        await asyncio.wait_for(holder, 30)      # r1 was in r0's pack, but returns at its turn
        c.prefill.unhold()
        tokens, _, err = await asyncio.wait_for(r1, 30)
        assert err is None and c.prefill.totals["packed_requests_total"] == 2
        await c.prefill.hold()
        gone = asyncio.ensure_future(c.prefill.hold())
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert c.prefill._waiting == []         # without: the placeholder stays for ever
        c.prefill.unhold()
        assert not c.prefill._busy
