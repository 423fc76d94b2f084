"""A continuation (a stream whose decode failed mid-answer, ``Sampling.num_generated`` > 0) is
served ahead of every new request in the prefill's own queue, behind earlier continuations, and
no new request passes it, however short (issue #37 item 4); its tokens are still the reference's."""

import asyncio

import pytest

from mooncake_lite.common.protocol import Sampling
from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.model.weights import build_model
from tests.pd.harness import cluster, prompt

pytestmark = pytest.mark.timeout(120)
BS = 8
N = 2          # tokens each request makes (a continuation: after its num_generated = 1)


async def _served(c, requests: list[tuple[int, bool]], overtakes: int, seed: int) -> list[str]:
    """Queue ``(length, is_continuation)`` requests (in this order) behind a hold; the order the
    instance's forwards took them in."""
    c.prefill.overtakes = overtakes
    forwards: list[str] = []
    run = c.prefill._run

    async def one(job):
        forwards.append(job.request_id)
        return await run(job)

    c.prefill._run = one
    await c.prefill.hold()
    prompts, tasks = [prompt(n, 100 * seed + i) for i, (n, _) in enumerate(requests)], []
    for i, (p, (_, cont)) in enumerate(zip(prompts, requests)):
        sampling = Sampling(max_tokens=N + cont, num_generated=int(cont))
        tasks.append(asyncio.ensure_future(c.request(f"{'c' if cont else 'r'}{i}", p, N + cont, sampling=sampling)))
        while len(c.prefill.queue) <= i:
            await asyncio.sleep(0.001)
    c.prefill.unhold()
    for p, (tokens, _, err) in zip(prompts, await asyncio.gather(*tasks)):
        assert err is None and tokens == reference_greedy(c.prefill.stage.runner.model, p, N)
    return forwards


async def test_continuations_go_ahead_of_new_requests():
    model = build_model("tiny", seed=3)
    async with cluster(model, block_size=BS, chunk=64) as c:
        reqs = [(20, False), (30, False), (40, True), (10, False), (35, True)]
        assert await _served(c, reqs, 0, seed=0) == ["c2", "c4", "r0", "r1", "r3"]        # FIFO otherwise
        # shortest first among the new ones; the long continuations still first, in arrival order
        reqs = [(40, False), (30, True), (5, False), (20, True), (9, False)]
        assert await _served(c, reqs, 4, seed=1) == ["c1", "c3", "r2", "r4", "r0"]
        assert c.prefill.queue == {} and c.prefill._waiting == [] and not c.prefill._busy
