"""A stream continues when its decode fails mid-stream (issue #37), against the fake instances:
the request is placed again as prompt + the tokens already relayed, the client's stream goes on
(same id, no token repeated or missing, no error), bounded by --migration-limit, the failed
decode fenced off, and nothing left behind on any instance when the client leaves."""

from __future__ import annotations

import asyncio

import openai
import pytest

from mooncake_lite.common.config import ConfigError
from mooncake_lite.common.protocol import AbortRequest, GenerateRequest, PrefillRequest
from mooncake_lite.conductor.config import Config
from tests.conductor import fakes
from tests.conductor.fakes import expected_tokens
from tests.conductor.test_api import TOK, client
from tests.conductor.test_dispatch import _wait_for
from tests.conductor.test_failover import SLOW_DECODE, SLOW_PREFILL, _metrics

pytestmark = pytest.mark.timeout(60)
PROMPT = "abc"


async def _stream(cluster, max_tokens: int = 10, **extra) -> tuple[list, str]:
    """The chunks of one streamed completion, and its text."""
    c = client(cluster)
    stream = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, stream=True,
                                        stream_options={"include_usage": True}, **extra)
    chunks = [chunk async for chunk in stream]
    await c.close()
    return chunks, "".join(ch.choices[0].text for ch in chunks if ch.choices)


def _requests(inst, kind) -> list:
    return [r for r in inst.requests if isinstance(r, kind)]


def _idle(cluster) -> bool:
    """No instance holds any job of any request in the conductor's books."""
    return all(not (i.prefill_jobs or i.decode_jobs or i.incoming_jobs)
               for i in cluster.svc.membership.instances.values())


async def restart_d0(cluster, same_address: bool) -> None:
    """The only decode, d0, back a second later as `mooncake up` restarts it: a new registration
    at its address (behaving normally again), or a new instance at another."""
    await asyncio.sleep(1.0)
    if same_address:
        d0 = cluster.instances["d0"]
        d0.behaviour = fakes.Behaviour()
        assert (await fakes.register(cluster.session, cluster.url, d0))[0] == 200
    else:
        await cluster.add("decode", "d0")


async def test_a_broken_decode_stream_is_continued_on_another_decode(make_cluster):
    cluster = await make_cluster(prefill=1, decode=1)
    d1 = await cluster.add("decode", "d1", cost=SLOW_DECODE)   # the scheduler prefers d0
    cluster.instances["d0"].behaviour.break_after = 2          # token 1 (prefill's) + 2 from d0, then gone
    chunks, text = await _stream(cluster)
    want = expected_tokens(TOK.encode(PROMPT), 10)
    assert text == TOK.decode(want)                            # nothing repeated, nothing missing
    assert len({ch.id for ch in chunks}) == 1                  # one response id across the seam
    assert chunks[-1].usage.prompt_tokens == len(TOK.encode(PROMPT))
    assert chunks[-1].usage.completion_tokens == 10            # each token counted once, max_tokens kept
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    # the continuation: prompt + the 3 tokens relayed, counted as output, on the other decode
    (gen,) = _requests(d1, GenerateRequest)
    (pre,) = [r for r in _requests(cluster.instances["p0"], PrefillRequest) if r.request_id.endswith("-cont1")]
    assert list(pre.token_ids) == TOK.encode(PROMPT) + want[:3]
    assert pre.sampling.num_generated == 3 and gen.sampling.num_generated == 3
    assert gen.prompt_len == len(pre.token_ids) and gen.request_id == pre.request_id
    metrics = await _metrics(cluster)
    assert 'continuations_total{cause="decode-unreachable",outcome="continued"} 1.0' in metrics
    async with cluster.session.get(cluster.url + "/internal/v1/status") as r:
        (record,) = (await r.json())["continuations"]
    assert record["from_decode"] == "d0" and record["to_decode"] == "d1" and record["num_tokens"] == 3
    await _wait_for(lambda: _idle(cluster))


async def test_text_held_back_for_a_stop_string_carries_across_the_seam(make_cluster):
    """The relay (stop-string holdback, detokenizer) stays; only the upstream attempt changes."""
    cluster = await make_cluster(prefill=1, decode=1)
    await cluster.add("decode", "d1", cost=SLOW_DECODE)
    cluster.instances["d0"].behaviour.break_after = 2
    whole = TOK.decode(expected_tokens(TOK.encode(PROMPT), 10))
    stop = whole[2:5]                                          # begins before the seam, ends after it
    chunks, text = await _stream(cluster, stop=[stop])
    assert text == whole[:whole.index(stop)]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"


async def test_continuations_are_bounded_by_the_migration_limit(make_cluster):
    cluster = await make_cluster(prefill=1, decode=0, migration_limit=1)
    for i in range(3):
        (await cluster.add("decode", f"d{i}")).behaviour.break_after = 2
    c = client(cluster)
    stream = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, stream=True)
    got = []
    with pytest.raises(openai.APIError) as info:
        async for chunk in stream:
            got.append(chunk.choices[0].text)
    await c.close()
    assert "not continued: --migration-limit 1 reached" in info.value.message
    # 3 tokens, then the continuation's first (its prefill's) and 2 from its decode: each once, in order
    assert "".join(got) == TOK.decode(expected_tokens(TOK.encode(PROMPT), 6))
    metrics = await _metrics(cluster)
    assert 'continuations_total{cause="decode-unreachable",outcome="continued"} 1.0' in metrics
    assert 'continuations_total{cause="decode-unreachable",outcome="limit"} 1.0' in metrics
    await _wait_for(lambda: _idle(cluster))


@pytest.mark.parametrize("same_address", [True, False])
async def test_the_only_decode_restarted_takes_the_continuation(make_cluster, same_address):
    """`mooncake up`'s one decode killed mid-stream: the stream pauses until its supervisor has it
    back (a new registration, at the same address or another) and goes on there, token for token."""
    cluster = await make_cluster(prefill=1, decode=1)
    d0 = cluster.instances["d0"]
    d0.behaviour.break_after = 2

    async def restart() -> None:
        await _wait_for(lambda: _requests(d0, GenerateRequest), timeout=20)
        await _wait_for(lambda: not d0._active, timeout=20)   # its stream broke: the continuation waits
        await restart_d0(cluster, same_address)

    back = asyncio.ensure_future(restart())
    chunks, text = await _stream(cluster)
    await back
    want = expected_tokens(TOK.encode(PROMPT), 10)
    assert text == TOK.decode(want) and chunks[-1].usage.completion_tokens == 10
    (gen,) = [g for g in _requests(cluster.instances["d0"], GenerateRequest) if g.request_id.endswith("-cont1")]
    assert gen.sampling.num_generated == 3 and gen.prompt_len == len(TOK.encode(PROMPT)) + 3
    async with cluster.session.get(cluster.url + "/internal/v1/status") as r:
        (record,) = (await r.json())["continuations"]
    assert (record["from_decode"], record["to_decode"], record["outcome"]) == ("d0", "d0", "continued")
    await _wait_for(lambda: _idle(cluster))


async def test_a_continuation_no_instance_can_take_is_an_error_naming_why(make_cluster):
    """The failed decode heartbeats on (the same registration, fenced off): no other decode and
    no restart of it within max(CONTINUE_WAIT_S, --dead-after), then the client's error."""
    cluster = await make_cluster(prefill=1, decode=1)
    cluster.instances["d0"].behaviour.break_after = 2
    c = client(cluster)
    stream = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, stream=True)
    with pytest.raises(openai.APIError) as info:
        async for _ in stream:
            pass
    await c.close()
    assert "decode instance d0 failed mid-stream" in info.value.message
    assert "it could not be continued within 5s: no live decode instance other than the one that failed" \
        in info.value.message
    assert 'outcome="refused"} 1.0' in await _metrics(cluster)


async def test_a_continuation_waits_a_moment_for_a_decode_counted_dead_while_its_heartbeat_is_late(make_cluster):
    """On a busy box the only other decode may be counted dead for a moment (a late heartbeat):
    the continuation tries again for up to CONTINUE_WAIT_S instead of failing the stream."""
    cluster = await make_cluster(prefill=1, decode=1, dead_after=2.0)
    d1 = await cluster.add("decode", "d1", cost=SLOW_DECODE)
    d1.is_heartbeating = False
    await _wait_for(lambda: not cluster.svc.membership.instances["d1"].is_alive, timeout=20)
    cluster.instances["d0"].behaviour.break_after = 2

    async def heartbeat_again() -> None:
        d0 = cluster.instances["d0"]
        await _wait_for(lambda: _requests(d0, GenerateRequest), timeout=20)
        await _wait_for(lambda: not d0._active, timeout=20)   # its stream broke: the continuation is polling
        await asyncio.sleep(1.0)
        d1.is_heartbeating = True

    late = asyncio.ensure_future(heartbeat_again())
    _, text = await _stream(cluster)
    await late
    assert text == TOK.decode(expected_tokens(TOK.encode(PROMPT), 10))
    assert len(_requests(d1, GenerateRequest)) == 1
    assert 'continuations_total{cause="decode-unreachable",outcome="continued"} 1.0' in await _metrics(cluster)


async def test_each_of_n_choices_is_continued_from_its_own_tokens_and_seed(make_cluster):
    """n = 2 with a seed: every choice its own stream (seed + index). The choices go on one at a
    time, each as prompt + its own tokens with its own seed, and each client text equals its
    uninterrupted run's; usage counts every token once."""
    cluster = await make_cluster(prefill=1, decode=1)
    d1 = await cluster.add("decode", "d1", cost=SLOW_DECODE)
    cluster.instances["d0"].behaviour.break_after = 2
    c = client(cluster)
    stream = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, n=2, seed=7, stream=True,
                                        stream_options={"include_usage": True})
    texts, chunks = ["", ""], [chunk async for chunk in stream]
    await c.close()
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.text
    prompt = TOK.encode(PROMPT)
    assert texts == [TOK.decode(expected_tokens(prompt, 10, stream=7 + i)) for i in range(2)]
    assert texts[0] != texts[1] and chunks[-1].usage.completion_tokens == 20
    gens = _requests(d1, GenerateRequest)                      # choice 0, then choice 1: n = 1, seed + index
    assert [(g.sampling.n, g.sampling.seed, g.sampling.num_generated) for g in gens] == [(1, 7, 3), (1, 8, 3)]
    pres = [r for r in _requests(cluster.instances["p0"], PrefillRequest) if "-cont1" in r.request_id]
    assert [list(p.token_ids) for p in pres] == [prompt + expected_tokens(prompt, 3, stream=7 + i) for i in range(2)]
    assert 'continuations_total{cause="decode-unreachable",outcome="continued"} 1.0' in await _metrics(cluster)
    await _wait_for(lambda: _idle(cluster))


async def test_a_hung_decode_is_continued_once_declared_dead_and_fenced_when_it_resumes(make_cluster):
    """SIGSTOP as the conductor sees it: the stream goes silent and the heartbeats stop. The
    reaper's verdict (--dead-after) continues the request; the old decode is told to abort the old
    upstream id even though it is dead, and when it resumes nothing of it reaches the client."""
    cluster = await make_cluster(prefill=1, decode=1, dead_after=0.5)
    await cluster.add("decode", "d1", cost=SLOW_DECODE)
    d0 = cluster.instances["d0"]
    d0.behaviour.pause_after = 2

    async def hang_when_paused() -> None:
        await _wait_for(lambda: d0._active)
        d0.is_heartbeating = False

    hang = asyncio.ensure_future(hang_when_paused())
    chunks, text = await _stream(cluster)
    await hang
    assert text == TOK.decode(expected_tokens(TOK.encode(PROMPT), 10))
    rid = chunks[0].id
    assert rid in d0.aborts                                    # fenced: the old upstream id aborted
    assert 'continuations_total{cause="instance-dead",outcome="continued"} 1.0' in await _metrics(cluster)
    d0.behaviour.resume.set()                                  # the hang ends: its stream is already closed
    d0.is_heartbeating = True
    await _wait_for(lambda: cluster.svc.membership.instances["d0"].is_alive and not d0._active)
    await _wait_for(lambda: _idle(cluster))


async def test_a_client_leaving_during_a_continuation_frees_every_instance(make_cluster):
    cluster = await make_cluster(prefill=1, decode=1)
    d1 = await cluster.add("decode", "d1", cost=SLOW_DECODE)
    cluster.instances["d0"].behaviour.break_after = 2
    d1.behaviour.token_delay_s = 0.2                           # the continuation is still running...
    c = client(cluster)
    stream = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=50, stream=True)
    n = 0
    async for _ in stream:
        n += 1
        if n == 5:                                             # ... when the client walks away
            break
    await stream.close()
    await c.close()
    await _wait_for(lambda: d1.aborts and not d1._active)      # the continuation's decode dropped it
    assert d1.aborts[0].endswith("-cont1")
    await _wait_for(lambda: _idle(cluster))
    assert "mooncake_conductor_requests_in_flight 0.0" in await _metrics(cluster)


async def test_a_decode_aborting_the_request_itself_is_continued(make_cluster):
    """A decode that drops the request on its own (its drain aborts what it runs) sends an abort line."""
    cluster = await make_cluster(prefill=1, decode=1)
    await cluster.add("decode", "d1", cost=SLOW_DECODE)
    d0 = cluster.instances["d0"]
    d0.behaviour.pause_after = 2          # holds the request until it has been told to abort it
    c = client(cluster)
    stream = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, stream=True)
    text = []
    async for chunk in stream:
        text.append(chunk.choices[0].text)
        if len(text) == 3:
            status, _ = await fakes.post(cluster.session, f"http://{d0.http}/v1/abort", AbortRequest(chunk.id))
            assert status == 200
            d0.behaviour.resume.set()
    await c.close()
    assert "".join(text) == TOK.decode(expected_tokens(TOK.encode(PROMPT), 10))
    assert 'continuations_total{cause="decode-abort",outcome="continued"} 1.0' in await _metrics(cluster)


async def test_a_prefill_dying_after_sending_the_kv_but_before_its_result_completes_elsewhere(make_cluster):
    """Issue #37 item 5: the KV went to decode, the prefill's answer never came. The attempt is torn
    down (its decode told to abort what it still runs) and the request runs again on the other prefill: a
    completed response, each token once. (A KV stream cut midway frees the decode's pending
    blocks: tests/pd/test_inprocess.py, test_stream_stopping_midway_...)"""
    cluster = await make_cluster(prefill=1, decode=1)
    p1 = await cluster.add("prefill", "p1", store="store1:1", cost=SLOW_PREFILL)
    cluster.instances["p0"].behaviour.die_after_kv = True
    d0 = cluster.instances["d0"]
    chunks, text = await _stream(cluster)
    assert text == TOK.decode(expected_tokens(TOK.encode(PROMPT), 10))
    assert chunks[-1].usage.completion_tokens == 10
    first, second = _requests(d0, GenerateRequest)
    assert [r.request_id for r in _requests(p1, PrefillRequest)] == [second.request_id]
    assert first.request_id != second.request_id   # (the first, if its decode still ran it, was aborted)
    assert 'retries_total{reason="prefill-unreachable"} 1.0' in await _metrics(cluster)
    await _wait_for(lambda: _idle(cluster))


async def test_a_decode_dying_between_its_reservation_and_the_kv_completes_elsewhere(make_cluster):
    """Issue #37 item 5: decode answered the reservation, then its connection dropped before any KV
    (so before any token): the request runs again on the other decode, a completed response.
    (A prefill streaming to a decode that died gives up: test_inprocess.py, test_dead_decode_...)"""
    cluster = await make_cluster(prefill=1, decode=1)
    d1 = await cluster.add("decode", "d1", cost=SLOW_DECODE)
    cluster.instances["d0"].behaviour.die_before_kv = True
    chunks, text = await _stream(cluster)
    assert text == TOK.decode(expected_tokens(TOK.encode(PROMPT), 10))
    assert chunks[-1].usage.completion_tokens == 10 and len(_requests(d1, GenerateRequest)) == 1
    assert 'retries_total{reason="decode-unreachable"} 1.0' in await _metrics(cluster)
    await _wait_for(lambda: _idle(cluster))


def test_the_migration_limit_is_checked():
    assert Config(migration_limit=0).migration_limit == 0
    with pytest.raises(ConfigError, match="--migration-limit must be >= 0"):
        Config(migration_limit=-1)
