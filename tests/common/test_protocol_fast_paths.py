"""The protocol's fast decoders accept and refuse exactly what its strict ``loads`` does."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from mooncake_lite.common.protocol import (GenerateRequest, PrefillRequest, PrefillResult, ProtocolError, Sampling,
                                           TokenEvent, dumps, error_text, loads, parse_prefill_result,
                                           parse_token_event)

LINES = [b'{"token": 5}', b'{"finish_reason": "stop"}', b'{"finish_reason": "error", "error": "boom"}',
         b'{"token": 7, "finish_reason": "length"}', b'{}', b'{"token": null}',
         b'{"token": "5"}', b'{"token": true}', b'{"token": 1.5}', b'{"finish_reason": 3}', b'{"extra": 1}',
         b'[1]', b'{bad', b'"x"',
         # choices (n > 1) and log-probabilities (issue #32)
         b'{"token": 5, "index": 2}', b'{"finish_reason": "stop", "index": 1}', b'{"token": 5, "index": true}',
         b'{"token": 5, "index": "1"}', b'{"token": 5, "logprob": {"logprob": -0.5}}',
         b'{"token": 5, "logprob": {"logprob": -1}}', b'{"token": 5, "logprob": null}',
         b'{"token": 5, "logprob": {"logprob": -0.5, "top_ids": [5, 9], "top_logprobs": [-0.5, -2]}}',
         b'{"token": 5, "logprob": {"logprob": true}}', b'{"token": 5, "logprob": {"logprob": "x"}}',
         b'{"token": 5, "logprob": {"top_ids": [1]}}', b'{"token": 5, "logprob": {"logprob": 0, "x": 1}}',
         b'{"token": 5, "logprob": {"logprob": 0, "top_ids": [1.5]}}',
         b'{"token": 5, "logprob": {"logprob": 0, "top_logprobs": [false]}}', b'{"token": 5, "logprob": [1]}']
RESULTS = [b'{"request_id": "r", "first_token": 3, "num_prefix_tokens": 0, "num_computed_tokens": 9}',
           b'{"request_id": "r", "first_token": 3, "num_prefix_tokens": 0, "num_computed_tokens": 9, '
           b'"timings": {"a": 1.5}}',
           b'{"request_id": "r", "first_token": "3", "num_prefix_tokens": 0, "num_computed_tokens": 9}',
           b'{"request_id": "r", "first_token": 3, "num_prefix_tokens": 0}',
           b'{"request_id": "r", "first_token": 3, "num_prefix_tokens": 0, "num_computed_tokens": 9, "x": 0}',
           b'{"request_id": 1, "first_token": 3, "num_prefix_tokens": 0, "num_computed_tokens": 9}',
           b'{"request_id": "r", "first_token": true, "num_prefix_tokens": 0, "num_computed_tokens": 9}',
           b'nope']


def _outcome(fn, raw):
    try:
        return fn(raw)
    except ProtocolError:
        return "error"


@pytest.mark.parametrize("line", LINES)
def test_token_event_fast_path_matches_protocol(line):
    assert _outcome(parse_token_event, line) == _outcome(lambda r: loads(TokenEvent, r), line)


@pytest.mark.parametrize("body", RESULTS)
def test_prefill_result_fast_path_matches_protocol(body):
    assert _outcome(parse_prefill_result, body) == _outcome(lambda r: loads(PrefillResult, r), body)


def test_dumps_is_byte_identical_to_encoding_asdict():
    # dumps hands the dataclass to orjson directly instead of deep-copying every token id via asdict.
    s = Sampling(max_tokens=4, temperature=0.5, seed=3, stop_token_ids=(257,))
    for msg in (GenerateRequest("r", "t", 9, s), PrefillRequest("r", "t", (1, 2, 3), "h:1", s, ("ab",), "s:2", ("ab",),
                                                                pack_cap=7, placed=3, placer="c0")):
        assert dumps(msg) == orjson.dumps(dataclasses.asdict(msg))
    # no cap, no placement: those fields left off (what a prefill from before them reads)
    plain = PrefillRequest("r", "t", (1, 2, 3), "h:1", s)
    assert dumps(plain) == orjson.dumps({k: v for k, v in dataclasses.asdict(plain).items()
                                         if k not in ("pack_cap", "placed", "placer")})


@pytest.mark.parametrize("body, text", [
    (b'{"error": "full"}', "full"),
    (b'{"error": {"message": "bad prompt", "type": "invalid_request_error"}}', "bad prompt"),
    (b"upstream gone", "upstream gone"),
    (b"", "(empty body)"),
])
def test_error_text_names_the_message(body, text):
    assert error_text(body) == text
