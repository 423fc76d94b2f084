"""A ``tokenizers`` tokenizer rebuilt from a GGUF file's vocabulary, merges and token types.

GGUF stores a byte-level BPE vocabulary (``tokenizer.ggml.model = "gpt2"``: GPT-2, Llama 3,
Qwen2, SmolLM) as its tokens in the byte alphabet, the merges as ``"a b"`` strings, and a type
per token (3 = control, 4 = user-defined). From these we build the BPE model, the byte-level pre-
tokenizer (with the split pattern the vocabulary was learned with, named by
``tokenizer.ggml.pre``), control tokens as special tokens and user-defined ones as added tokens
— the same tokenizer ``transformers`` builds from the file, checked token for token in the tests.
"""

from __future__ import annotations

import logging

from mooncake_lite.model.errors import CheckpointError
from mooncake_lite.model.gguf_file import GGUFMeta

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4

# Split patterns by ``tokenizer.ggml.pre``. Vocabularies not listed use GPT-2's own pattern
# (the ByteLevel pre-tokenizer's built-in regex), as SmolLM and GPT-2 do.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
          "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
GPT2_SPLIT_NAMES = ("default", "gpt2", "gpt-2", "smollm")


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes: printable Latin-1 bytes stand for themselves,
    the others are shifted to code points from 256 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in keep}
    shifted = 256
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(shifted)
            shifted += 1
    return spelling


def build_gguf_tokenizer(meta: GGUFMeta):
    """The ``tokenizers.Tokenizer`` the file describes, and whether it adds BOS by itself."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{meta.path}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2', "
                              "byte-level BPE: GPT-2, Llama 3, Qwen2, SmolLM)")
    if not meta.tokens or not meta.merges:
        raise CheckpointError(f"{meta.path}: the GGUF file lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    vocab = _byte_level_vocab(meta.tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre")
    if pre in SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        if pre not in (None, *GPT2_SPLIT_NAMES):
            log.warning("%s: pre-tokenizer %r unknown; splitting text as GPT-2 does", meta.path, pre)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    alphabet = set(byte_alphabet().values())
    # A "control" token spelled outside the byte alphabet is a mislabel in the file; adding it
    # would grow the vocabulary past the model's.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(meta.tokens, meta.token_types)
                            if k == CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(meta.tokens, meta.token_types)
                    if k == USER_DEFINED and t in vocab])
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    adds_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
    if adds_bos:
        bos = meta.tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    return tok


def _byte_level_vocab(tokens: tuple[str, ...]) -> dict[str, int]:
    """Token -> id; a token the file spells in plain UTF-8 is respelled in the byte alphabet."""
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    return {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
            for i, t in enumerate(tokens)}


def special_token(meta: GGUFMeta, key: str) -> tuple[int | None, str | None]:
    """(id, text) of ``tokenizer.ggml.<key>_token_id``."""
    token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
    if token_id is None or not 0 <= int(token_id) < len(meta.tokens):
        return None, None
    return int(token_id), meta.tokens[int(token_id)]


def stop_ids(meta: GGUFMeta) -> tuple[int, ...]:
    """Every id the file says ends a turn: EOS, and end-of-turn / end-of-message where declared."""
    ids = [special_token(meta, k)[0] for k in ("eos", "eot", "eom")]
    return tuple(dict.fromkeys(i for i in ids if i is not None))
