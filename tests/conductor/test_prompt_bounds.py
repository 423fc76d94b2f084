"""A request can cost the conductor only what a prompt that fits the context costs: text longer than
any context's worth of tokens is refused before it is tokenized, a body larger than any request
needs (a gzip bomb) before it is decoded, and a long legal prompt is tokenized off the event loop."""

from __future__ import annotations

import asyncio
import gzip
import threading

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from mooncake_lite.conductor.api.body import OFF_LOOP_BYTES
from mooncake_lite.conductor.api.state import API
from mooncake_lite.model.tokenizer import GIL_FREE_CHARS, ByteTokenizer, HFTokenizer

CONTEXT = 4096   # tiny's; its byte tokenizer: one byte one token, plus BOS


class CountingTokenizer(ByteTokenizer):
    """tiny's tokenizer, noting the length of every text it is asked to encode."""

    def __init__(self) -> None:
        super().__init__(320)
        self.encoded: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded.append(len(text))
        return super().encode(text, add_special_tokens)


class GatedTokenizer(ByteTokenizer):
    """Holds a long text's encoding until the test lets it go (having been served meanwhile)."""

    def __init__(self) -> None:
        super().__init__(320)
        self.inside, self.release = threading.Event(), threading.Event()
        self.waited_out = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > 1000:
            self.inside.set()
            self.waited_out = not self.release.wait(5)   # on the event loop: nobody can release it
        return super().encode(text, add_special_tokens)


async def _post(cluster, path: str, body: dict) -> tuple[int, dict]:
    async with cluster.session.post(cluster.url + path, json=body) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 200_000}),
    ("/v1/completions", {"model": "tiny", "prompt": ["x" * CONTEXT], "max_tokens": 1}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 200_000}]}),
])
async def test_text_past_the_context_is_refused_untokenized(make_cluster, path, body):
    cluster = await make_cluster()
    tok = cluster.app[API].tokenizer = CountingTokenizer()
    status, out = await _post(cluster, path, body)
    assert status == 400 and "maximum context length is 4096" in out["error"]["message"]
    assert out["error"]["param"] == "prompt"
    assert all(n < CONTEXT for n in tok.encoded), tok.encoded   # the long text never reached it
    assert all(not inst.requests for inst in cluster.instances.values())


async def test_text_just_under_the_bound_is_tokenized_and_served(make_cluster):
    cluster = await make_cluster()
    tok = cluster.app[API].tokenizer = CountingTokenizer()
    # 4095 bytes + BOS = the whole context, no room for an answer: tokenized, then the usual 400
    status, out = await _post(cluster, "/v1/completions", {"model": "tiny", "prompt": "x" * (CONTEXT - 1)})
    assert status == 400 and "4096 in the prompt" in out["error"]["message"]
    assert tok.encoded == [CONTEXT - 1]
    status, out = await _post(cluster, "/v1/completions",
                              {"model": "tiny", "prompt": "x" * (CONTEXT - 2), "max_tokens": 1})
    assert status == 200 and out["usage"]["prompt_tokens"] == CONTEXT - 1


async def test_gzip_bomb_within_the_parser_limit_is_413(make_cluster):
    # 10 MiB once decoded (~10 KB sent): under the HTTP parser's 64 MiB, far over what tiny needs
    bomb = gzip.compress(b'{"model": "tiny", "prompt": "' + b"x" * (10 * 2**20) + b'"}', compresslevel=9)
    cluster = await make_cluster()
    tok = cluster.app[API].tokenizer = CountingTokenizer()
    assert len(bomb) < cluster.app[API].body_limit < 10 * 2**20
    async with cluster.session.post(cluster.url + "/v1/completions", data=bomb,
                                    headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}) as r:
        assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"
    assert tok.encoded == []
    status, _ = await _post(cluster, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert status == 200


async def test_long_prompt_is_tokenized_off_the_event_loop(make_cluster):
    cluster = await make_cluster()
    tok = cluster.app[API].tokenizer = GatedTokenizer()
    body = {"model": "tiny", "prompt": "x" * 3000, "max_tokens": 2, "user": "u" * OFF_LOOP_BYTES}
    pending = asyncio.create_task(_post(cluster, "/v1/completions", body))
    assert await asyncio.to_thread(tok.inside.wait, 10)
    async with cluster.session.get(cluster.url + "/health") as r:   # answered while it tokenizes
        assert r.status == 200
    tok.release.set()
    status, _ = await pending
    assert status == 200 and not tok.waited_out


def _tokenizer(pre, normalizer=None, vocab=None) -> HFTokenizer:
    tok = Tokenizer(models.BPE(vocab=vocab or {}, merges=[]))
    tok.pre_tokenizer = pre
    if normalizer is not None:
        tok.normalizer = normalizer
    return HFTokenizer(tok)


def test_longest_token_bounds_the_text_a_token_stands_for():
    # byte-level: "ĠĠĠĠ" is 4 characters, 8 bytes of UTF-8, and stands for 4 spaces
    vocab = {"Ġ": 0, "ĠĠ": 1, "ĠĠĠĠ": 2, "a": 3}
    assert _tokenizer(pre_tokenizers.ByteLevel(), vocab=vocab).max_token_bytes == 4
    assert _tokenizer(pre_tokenizers.Metaspace(), vocab={"▁the": 0}).max_token_bytes == 6
    # pipelines that can drop text have no bound
    assert _tokenizer(pre_tokenizers.Whitespace(), vocab=vocab).max_token_bytes is None
    split = pre_tokenizers.Split(" ", behavior="removed")
    assert _tokenizer(pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel()]), vocab=vocab).max_token_bytes is None
    # the bytes measured are the normalized text's: NFC composes e + U+0301 (3 bytes) into é (2)
    assert _tokenizer(pre_tokenizers.ByteLevel(), normalizers.NFC(), vocab).text_bytes("e\u0301") == 2


def test_trained_byte_level_bpe_keeps_its_bound_and_ids():
    corpus = ["the moon is a loyal companion     ", "mooncake serves kv caches\n\n\n    across the cluster"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(corpus * 8, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>"],
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    ours = HFTokenizer(tok)
    text = "".join(corpus) * (GIL_FREE_CHARS // 40) + "<|end|> ünïcödé 🌕"
    assert len(text) > GIL_FREE_CHARS   # encoded with the GIL released: the same ids
    ids = ours.encode(text)
    assert ids == tok.encode(text).ids
    assert len(ids) * ours.max_token_bytes >= ours.text_bytes(text)   # the bound holds
    assert ours.max_token_bytes == max(len(t) for t in tok.get_vocab())
