"""``--max-tokens-policy cap:N``: the client sends N and stops reading at the trace's output."""

import aiohttp
import pytest

from mooncake_lite.bench.replay.cli import build_parser
from mooncake_lite.bench.replay.client import request_body, stream_one
from mooncake_lite.bench.replay.workload import PromptConfig, PromptSynth, SynthRequest
from mooncake_lite.trace.format import TraceRequest
from tests.replay.fake_openai import FakeState, ThreadServer

pytestmark = pytest.mark.timeout(60)


def trace_req(n_out: int) -> TraceRequest:
    return TraceRequest(0, 0.0, 1024, n_out, (0, 1))


def test_a_cap_is_sent_as_max_tokens_and_the_output_becomes_where_to_stop():
    synth = PromptSynth(PromptConfig(scale=1 / 32, output_scale=1.0, max_tokens_cap=100))
    r = synth.build(trace_req(7))
    assert (r.max_tokens, r.stop_after) == (100, 7)
    r = synth.build(trace_req(300))                   # longer than the cap: stopped by it, as live
    assert (r.max_tokens, r.stop_after) == (100, None)
    plain = PromptSynth(PromptConfig(scale=1 / 32, output_scale=1.0)).build(trace_req(7))
    assert (plain.max_tokens, plain.stop_after) == (7, None)
    tight = PromptSynth(PromptConfig(scale=1 / 32, output_scale=1.0, max_tokens_cap=100, max_context=64))
    r = tight.build(trace_req(7))
    assert r.max_tokens == 32 and r.num_prompt_tokens <= 64 - 32 - 1 and r.stop_after == 7


def test_policy_flag_parses_and_refuses_bad_values(capsys):
    p = build_parser()
    assert p.parse_args(["--trace", "t"]).max_tokens_policy.cap is None
    assert p.parse_args(["--trace", "t", "--max-tokens-policy", "cap:4096"]).max_tokens_policy.cap == 4096
    with pytest.raises(SystemExit):
        p.parse_args(["--trace", "t", "--max-tokens-policy", "cap:0"])


async def test_the_client_stops_reading_at_the_output():
    req = SynthRequest(0, 0.0, "hello world!", 12, 50, 0, False, stop_after=2)
    with ThreadServer(FakeState()) as srv:
        async with aiohttp.ClientSession() as s:
            rec = await stream_one(s, srv.url + "/v1/completions", req,
                                   request_body(req, "fake-model", ignore_eos=True), scheduled_s=0.0)
    assert rec.is_ok and len(rec.chunk_s) == 2 and rec.output_tokens == 2
