"""A request whose only decode fails before its first token waits for that decode to come back,
as a stream whose decode fails after it does (``conductor/flight/wait.py``), against the fake
instances; when none comes back in time the client reads the same 502 as before the wait."""

from __future__ import annotations

import asyncio
import time

import pytest

from mooncake_lite.common.protocol import GenerateRequest
from mooncake_lite.conductor.flight import wait
from tests.conductor.fakes import expected_tokens
from tests.conductor.test_api import TOK
from tests.conductor.test_continuation import _idle, _requests, restart_d0
from tests.conductor.test_dispatch import _wait_for
from tests.conductor.test_failover import _complete, _kill, _metrics

pytestmark = pytest.mark.timeout(60)
PROMPT = "abc"


@pytest.mark.parametrize("same_address", [True, False])
async def test_the_only_decode_restarted_takes_the_retry(make_cluster, same_address):
    """`mooncake up`'s one decode fails before token 1: it drops its stream after the reservation
    and registers again at the same address, or it is killed (the reservation refused) and comes
    back at another. The request waits for it and completes there, retried once."""
    cluster = await make_cluster(prefill=1, decode=1)
    d0 = cluster.instances["d0"]
    if same_address:
        d0.behaviour.die_before_kv = True
    else:
        await _kill(d0)

    async def restart() -> None:
        if same_address:
            await _wait_for(lambda: _requests(d0, GenerateRequest), timeout=20)
            await _wait_for(lambda: not d0._active, timeout=20)   # its stream broke: the retry waits
        await restart_d0(cluster, same_address)

    back = asyncio.ensure_future(restart())
    status, headers, body = await _complete(cluster, PROMPT, max_tokens=6)
    await back
    assert status == 200, body
    assert body["choices"][0]["text"] == TOK.decode(expected_tokens(TOK.encode(PROMPT), 6))
    (gen,) = [g for g in _requests(cluster.instances["d0"], GenerateRequest) if g.request_id.endswith("-retry1")]
    assert headers["X-Mooncake-Decode"] == "d0" and gen.prompt_len == len(TOK.encode(PROMPT))
    assert 'retries_total{reason="decode-unreachable"} 1.0' in await _metrics(cluster)
    await _wait_for(lambda: _idle(cluster))


async def test_a_retry_no_decode_comes_back_for_is_the_same_502_after_the_wait(make_cluster, monkeypatch):
    """The failed decode heartbeats on (the same registration, left out) and no other comes: the
    request waits max(WAIT_S, --dead-after) (here --dead-after, 2 s), then reads what it read at once
    before; nothing was placed meanwhile."""
    monkeypatch.setattr(wait, "WAIT_S", 0.0)
    cluster = await make_cluster(prefill=1, decode=1, dead_after=2.0)
    d0 = cluster.instances["d0"]
    d0.behaviour.die_before_kv = True
    began = time.monotonic()
    status, _, body = await _complete(cluster, PROMPT)
    assert time.monotonic() - began >= 2.0           # it waited for a decode, up to --dead-after
    assert status == 502
    assert body["error"]["message"] == ("decode instance d0 failed mid-stream (connection lost); the request was "
                                        "not completed; not retried: no live decode instance other than the one "
                                        "that failed; retry later")
    assert len(_requests(d0, GenerateRequest)) == 1 and "retries_total{" not in await _metrics(cluster)
    await _wait_for(lambda: _idle(cluster))
