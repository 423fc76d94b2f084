import pytest

from mooncake_lite.bench.replay_prompts import PromptConfig, PromptSynth, auto_scale
from mooncake_lite.trace.format import TraceRequest


def req(i, n_in, n_out, ids, ts=0.0):
    return TraceRequest(i, ts, n_in, n_out, tuple(ids))


def test_equal_hash_ids_give_equal_blocks_and_shared_prefixes():
    synth = PromptSynth(PromptConfig(scale=1 / 32))       # 512-token trace blocks -> 16 tokens
    a = synth.build(req(0, 512 * 3, 10, [0, 1, 2]))
    b = synth.build(req(1, 512 * 2 + 100, 10, [0, 1, 7]))
    c = synth.build(req(2, 512, 10, [5]))
    assert a.prompt[:32] == b.prompt[:32] and a.prompt[32:48] != b.prompt[32:48]
    assert a.prompt[:16] != c.prompt[:16]
    assert (a.num_prompt_tokens, b.num_prompt_tokens) == (48, 16 * 2 + 3)   # 100 * 16/512 rounds to 3
    assert a.num_full_blocks == 3 and b.num_full_blocks == 2
    assert a.prompt.isprintable() and a.prompt.isascii() and len(a.prompt.encode()) == 48  # byte = token
    # same seed, same text on a fresh synthesizer; another seed changes it
    assert PromptSynth(PromptConfig(scale=1 / 32)).build(req(0, 1536, 10, [0, 1, 2])).prompt == a.prompt
    assert PromptSynth(PromptConfig(scale=1 / 32, seed=1)).build(req(0, 1536, 10, [0, 1, 2])).prompt != a.prompt


def test_token_mode_ids_in_range():
    synth = PromptSynth(PromptConfig(scale=1 / 16, mode="tokens", vocab_size=300, min_token_id=10))
    r = synth.build(req(0, 1024, 5, [3, 4]))
    assert isinstance(r.prompt, list) and len(r.prompt) == 64 and all(10 <= t < 300 for t in r.prompt)
    assert synth.build(req(1, 512, 5, [3])).prompt == r.prompt[:32]


def test_output_scaling_caps_and_context_truncation():
    cfg = PromptConfig(scale=1 / 8, max_output_tokens=50, max_context=200)
    synth = PromptSynth(cfg)
    n_in, n_out, cut = synth.lengths(req(0, 512 * 4, 1000, [0, 1, 2, 3]))
    assert (n_in, n_out, cut) == (200 - 50 - 1, 50, True)                # 256 prompt tokens cut to fit
    assert synth.lengths(req(0, 512, 80, [0])) == (64, 10, False)          # output scaled like input
    assert PromptSynth(PromptConfig(scale=1 / 8, output_scale=1.0)).lengths(req(0, 512, 80, [0]))[1] == 80


def test_auto_scale_and_bad_config():
    assert auto_scale([req(0, 9000, 1000, [0]), req(1, 100, 1, [1])], 1000) == pytest.approx(0.09)
    assert auto_scale([req(0, 10, 10, [0])], 4096) == 1.0
    for kw in ({"scale": 0}, {"mode": "words"}, {"max_context": 2}, {"min_token_id": 5, "vocab_size": 5}):
        with pytest.raises(ValueError):
            PromptConfig(**kw)
