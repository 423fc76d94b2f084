"""A prefill's report of the job it runs alone (scheduler/progress.py, ``PrefillService.running``):
nothing before its first chunk is done, then the chunks left priced by how the done ones ran."""

import pytest

from mooncake_lite.model.weights import build_model
from mooncake_lite.scheduler.costs import PrefillCostModel
from mooncake_lite.scheduler.progress import RATIO_BOUND, LaterChunks
from tests.pd.harness import cluster, prompt

pytestmark = pytest.mark.timeout(120)


async def test_a_prefill_reports_its_job_after_each_chunk_priced_by_the_chunks_done():
    model = build_model("tiny", seed=3)
    async with cluster(model, block_size=8, chunk=16) as c:
        # priced at a second a token: the tiny model's chunks run thousands of times faster, so
        # the speed they measure moves the price of the rest as far as it may, RATIO_BOUND x
        c.prefill.cost = PrefillCostModel(c1=1.0)
        seen, run_chunk = [], c.prefill.stage.run_chunk

        async def watched(*args, **kwargs):
            seen.append(c.prefill.running())      # as a heartbeat would read it as the chunk starts
            return await run_chunk(*args, **kwargs)
        c.prefill.stage.run_chunk = watched
        nudges, fire = [], c.prefill.progressed.fire
        c.prefill.progressed.fire = lambda: (nudges.append(c.prefill.running()), fire())
        tokens, _, error = await c.request("r", prompt(100, 1), 2)
        assert error is None and len(tokens) == 2
        assert len(seen) == 7 and seen[0] is None          # 100 tokens, 16 a chunk; nothing done yet
        # its heartbeat is nudged as each chunk but the last ends, the report then already new
        assert [n.request_id for n in nudges] == ["r"] * 6 and nudges[0].left_s > nudges[-1].left_s
        for done, report in zip(range(16, 100, 16), seen[1:]):
            assert report.request_id == "r"
            assert report.left_s == pytest.approx((100 - done) * 1.0 / RATIO_BOUND, abs=0.05)
        assert c.prefill.running() is None                 # over: nothing to report
        # its later chunks ran thousands of times under their price: learned, as far as a factor may go
        assert c.prefill.later_chunks.ratio == pytest.approx(1 / 16)
        # after a first chunk alone the rest is priced at how later chunks ran lately, not as it ran
        c.prefill.later_chunks = LaterChunks()
        c.prefill.later_chunks.observe(1.0, 2.0)
        seen.clear()
        await c.request("t", prompt(100, 3), 2)
        assert seen[1].left_s == pytest.approx((100 - 16) * 1.0 * 2.0, abs=0.05)
        assert seen[2].left_s == pytest.approx((100 - 32) * 1.0 / RATIO_BOUND, abs=0.05)   # then its own
        c.prefill.cost = None                              # no model: nothing to price it with
        seen.clear()
        await c.request("s", prompt(40, 2), 2)
        assert seen == [None] * 3
