"""Incremental detokenization equals decoding everything at once, stop strings cut exactly."""

from __future__ import annotations

import random

from mooncake_lite.conductor.api.text import TextStream
from mooncake_lite.model.tokenizer import ByteTokenizer

TOK = ByteTokenizer(320)
# bytes that start, continue or break multi-byte UTF-8 characters, plus ASCII and dummy ids
TRICKY = [0xD0, 0x89, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0xFF]


def _random_ids(r: random.Random) -> list[int]:
    return [r.choice([r.randrange(320), r.randrange(128), r.choice(TRICKY)]) for _ in range(r.randrange(1, 30))]


def test_streamed_text_equals_whole_decode():
    r = random.Random(0)
    for _ in range(2000):
        ids = _random_ids(r)
        ts = TextStream(TOK)
        deltas = [ts.add(t) for t in ids] + [ts.flush()]
        assert "".join(deltas) == TOK.decode(ids), ids


def test_split_multibyte_character_is_held_back_until_complete():
    ts = TextStream(TOK)
    assert ts.add(0xE2) == "" and ts.add(0x82) == ""
    assert ts.add(0xAC) == "€"


def test_stop_strings_cut_before_the_stop_and_hold_back_partial_matches():
    r = random.Random(1)
    for _ in range(1000):
        ids = _random_ids(r)
        full = TOK.decode(ids)
        stop = full[3:5]
        if len(stop) < 2 or "\ufffd" in stop:
            continue
        ts = TextStream(TOK, ("zzzzzz", stop))
        out = "".join(ts.add(t) for t in ids) + ts.flush()
        assert out == full[:full.index(stop)] and ts.is_stopped
    ts = TextStream(TOK, ("END",))
    shown = "".join(ts.add(b) for b in b"abcEN")
    assert shown == "abc"      # "EN" might still become "END": held back
    assert ts.add(ord("D")) == "" and ts.is_stopped and ts.output_text == "abc"
