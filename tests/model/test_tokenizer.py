"""Tokenizers: a real ``tokenizer.json`` from the ``tokenizers`` library, and the byte fallback."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mooncake_lite.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

CORPUS = ["The moon is a loyal companion.", "Mooncake serves KV caches across the cluster.",
          "prefill and decode run on separate machines", "Ünïcödé and emoji 🌕 survive byte-level BPE."]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({"eos_token_id": tok.token_to_id("</s>")}))
    return path, tok


@pytest.mark.parametrize("text", CORPUS + ["unseen words: zebra quokka 42", ""])
def test_tokenizer_json_round_trips(tok_dir, text):
    path, reference = tok_dir
    tok = load_tokenizer(str(path), vocab_size=400)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(text)
    assert ids == reference.encode(text).ids
    assert tok.decode(ids) == text


def test_merges_are_used(tok_dir):
    tok = load_tokenizer(str(tok_dir[0]), vocab_size=400)
    text = CORPUS[1]
    assert len(tok.encode(text)) < len(text.encode())  # BPE merged, not raw bytes


def test_eos_from_checkpoint_config(tok_dir):
    path, reference = tok_dir
    assert load_tokenizer(str(path), 400).eos_token_id == reference.token_to_id("</s>")
    assert load_tokenizer(str(path), 400, eos_token_id=7).eos_token_id == 7


def test_byte_tokenizer_fallback(tmp_path):
    tok = load_tokenizer(str(tmp_path), vocab_size=320)  # a directory without tokenizer.json
    assert isinstance(tok, ByteTokenizer) and load_tokenizer("tiny", 320).eos_token_id == 257
    text = "héllo 🌕"
    ids = tok.encode(text)
    assert ids[0] == ByteTokenizer.bos_token_id and max(ids) < 320
    assert tok.decode(ids + [300]) == text
    with pytest.raises(ValueError, match="at least 258"):
        ByteTokenizer(100)
