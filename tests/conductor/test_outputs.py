"""The conductor feeds finished requests' output lengths to the predictor and sizes later
requests' decode time (their membership records, so the scheduler's views) with it."""

from __future__ import annotations

import asyncio

from mooncake_lite.conductor.flight.output_lengths import OutputHistory
from tests.conductor.test_api import client


def test_history_predicts_from_shared_prefixes_and_measures_itself():
    h = OutputHistory()
    h.finished([b"a", b"b"], 10, 40, expected=100)
    assert h.expected([b"a", b"b", b"c"], 14, 4096) == 40       # the next turn of that conversation
    assert h.expected([b"a", b"b", b"c"], 14, 16) == 16         # never above max_tokens
    h.finished([b"x"], 10, 0, expected=5)                       # nothing generated: nothing learnt
    h.finished([b"a", b"b", b"c"], 14, 50, expected=40)
    assert h.stats() == {"finished": 2, "mae_tokens": 35.0, "underestimated": 0.5}


async def test_a_later_turn_is_sized_with_the_earlier_turns_output(make_cluster):
    cluster = await make_cluster(prefill=1, decode=1)
    c = client(cluster)
    first = "The moon is a bright round thing in the night sky"
    out = await c.completions.create(model="tiny", prompt=first, max_tokens=3)
    assert out.choices[0].finish_reason == "length"
    assert cluster.svc.outputs.stats()["finished"] == 1
    cluster.instances["d0"].behaviour.hang = True      # hold turn 2 on its decode to look at it
    task = asyncio.create_task(c.completions.create(model="tiny", prompt=first + " and more", max_tokens=500))
    try:
        async def joined():
            while not cluster.svc.membership.snapshot().decodes[0].running:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(joined(), 5.0)
        running = cluster.svc.membership.snapshot().decodes[0].running
        assert [r.max_output_tokens for r in running] == [3]     # the prediction, not max_tokens 500
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
