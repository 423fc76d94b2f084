import pytest

from mooncake_lite.bench.replay.workload import PromptConfig, PromptSynth, auto_scale
from mooncake_lite.trace.format import TraceRequest
from tests.real_model import SMOLLM, needs_smollm


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


class WordTokenizer:
    """A toy word-level tokenizer: id i is the word ' w<letters of i>', plus a few non-words."""

    def __init__(self, num_words=300, merge=None):
        self.words = [" w" + "".join(chr(97 + int(d)) for d in str(i)) for i in range(num_words)]
        self.vocab = self.words + ["<s>", "!", "  "]
        self.index = {w: i for i, w in enumerate(self.vocab)}
        self.merge = merge   # (word id, word id) that re-encode as one id: a merge across words

    def encode(self, text, add_special_tokens=True):
        import re
        ids = [self.index[w] for w in re.findall(r" [a-z]+", text)]
        if self.merge:
            a, b = self.merge
            out = []
            for t in ids:
                if out and (out[-1], t) == (a, b):
                    out[-1] = 0
                else:
                    out.append(t)
            ids = out
        return ([len(self.words)] if add_special_tokens else []) + ids

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids if 0 <= i < len(self.vocab))


def test_tokenizer_words_give_exact_lengths_and_shared_prefixes():
    tok = WordTokenizer()
    synth = PromptSynth(PromptConfig(scale=1 / 32), tok)
    assert len(synth.words.ids) == 300                   # '<s>', '!' and '  ' are not word tokens
    a = synth.build(req(0, 512 * 3, 10, [0, 1, 2]))
    b = synth.build(req(1, 512 * 2 + 100, 10, [0, 1, 7]))
    ia, ib = tok.encode(a.prompt, False), tok.encode(b.prompt, False)
    assert (len(ia), len(ib)) == (a.num_prompt_tokens, b.num_prompt_tokens) == (48, 35)
    assert ia[:32] == ib[:32] and ia[32:35] != ib[32:35] and b.prompt.startswith(a.prompt[:len(tok.decode(ia[:32]))])
    assert synth.mismatched == 0
    ids = PromptSynth(PromptConfig(scale=1 / 32, mode="tokens"), tok).build(req(0, 1024, 5, [0, 1])).prompt
    assert ids == ia[:32]                                # tokens mode sends the very same ids


def test_a_prompt_that_does_not_re_encode_is_counted_and_measured():
    tok = WordTokenizer()
    block = PromptSynth(PromptConfig(scale=1 / 128), tok)._block(0).tolist()   # 4 tokens
    synth = PromptSynth(PromptConfig(scale=1 / 128), WordTokenizer(merge=(block[0], block[1])))
    r = synth.build(req(0, 512, 5, [0]))
    assert synth.mismatched == 1 and r.num_prompt_tokens == 3


def test_a_tokenizer_without_word_tokens_is_refused():
    with pytest.raises(ValueError, match="word tokens"):
        PromptSynth(PromptConfig(), WordTokenizer(num_words=10))
    # token ids need no round trip: tokens mode falls back to the configured id range
    synth = PromptSynth(PromptConfig(scale=1 / 32, mode="tokens", vocab_size=13), WordTokenizer(num_words=10))
    assert synth.words is None and all(0 <= t < 13 for t in synth.build(req(0, 512, 5, [1])).prompt)


@needs_smollm
def test_lengths_in_the_real_tokenizer_equal_the_requested_ones():
    from mooncake_lite.model.tokenizer import load_tokenizer
    tok = load_tokenizer(SMOLLM, 320)
    synth = PromptSynth(PromptConfig(scale=1 / 8, max_context=2048), tok)   # 64-token blocks, one KV block each
    reqs = [req(0, 512 * 3, 10, [0, 1, 2]), req(1, 512 * 2 + 100, 10, [0, 1, 7]), req(2, 300, 10, [9]),
            req(3, 512 * 40, 10, range(40))]
    built = [synth.build(r) for r in reqs]
    ids = [tok.encode(b.prompt, add_special_tokens=False) for b in built]
    assert [len(i) for i in ids] == [b.num_prompt_tokens for b in built] == [192, 140, 38, 2048 - 1 - 1]   # 100 trace tokens -> 12; output 10 -> 1
    assert tok.encode(built[0].prompt) == ids[0]        # the server's own encoding adds nothing here
    assert ids[0][:128] == ids[1][:128] and ids[0][128:140] != ids[1][128:140]   # shared blocks, shared tokens
    assert ids[3][:128] == ids[0][:128] and ids[2][:38] != ids[0][:38]
    assert synth.mismatched == 0 and built[3].is_truncated
    assert all(b.prompt.isascii() and b.prompt.isprintable() for b in built)
    assert tok.decode(ids[1]) == built[1].prompt
