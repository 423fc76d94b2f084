"""Tokenizers: byte-level for dummy-weight presets; a checkpoint's own for real models.

A real checkpoint's tokenizer also carries what serving it correctly needs: every id that ends
a turn (``eos_token_ids``), whether encoding adds BOS, and the chat template with the special-
token strings it refers to. Sources: a GGUF file's metadata, or an HF directory's
``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``, ``config.json`` and
``generation_config.json``.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Protocol

from mooncake_lite.model.chat import ChatTemplate


class Tokenizer(Protocol):
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: ChatTemplate | None

    # The most bytes of (normalized) text one token can stand for; None when the tokenizer can
    # drop text and so no byte count bounds its tokens. A server refuses, before tokenizing it, a
    # prompt with more than context × this many bytes (text_bytes): it cannot fit.
    max_token_bytes: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...
    def text_bytes(self, text: str) -> int: ...


def utf8_len(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (a lone surrogate counted as the 3 bytes it would take)."""
    return len(text.encode("utf-8", "surrogatepass"))


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; id 256 is BOS, 257 EOS; higher ids (dummy vocab) decode to nothing."""

    bos_token_id = 256
    eos_token_id = 257
    eos_token_ids = (257,)
    chat_template = None
    max_token_bytes = 1     # one byte, one token

    text_bytes = staticmethod(utf8_len)

    def __init__(self, vocab_size: int = 320):
        if vocab_size < 258:
            raise ValueError("a byte tokenizer needs a vocabulary of at least 258 ids")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        body = list(text.encode("utf-8"))
        return [self.bos_token_id, *body] if add_special_tokens else body

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers`` tokenizer plus the checkpoint's stop ids and chat template. Decoding skips
    special tokens (an end-of-turn marker is not part of the answer), as OpenAI servers do."""

    def __init__(self, tok: Any, eos_token_ids: tuple[int, ...] = (), chat_template: ChatTemplate | None = None):
        self._tok = tok
        self.eos_token_ids = tuple(eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.chat_template = chat_template

    @classmethod
    def from_file(cls, path: str, eos_token_id: int | None = None) -> "HFTokenizer":
        from tokenizers import Tokenizer as _Tok
        return cls(_Tok.from_file(path), () if eos_token_id is None else (eos_token_id,))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < GIL_FREE_CHARS:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # encode holds the GIL throughout, encode_batch lets go of it: a long text tokenized in a
        # worker thread then leaves the caller's event loop running meanwhile.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        return max_token_bytes(self._tok)

    def text_bytes(self, text: str) -> int:
        """Bytes of ``text`` as the tokenizer's model sees it: after its normalizer, which may
        shrink it (NFC composes characters)."""
        norm = self._tok.normalizer
        return utf8_len(norm.normalize_str(text) if norm is not None else text)

    def decode(self, token_ids: list[int], keep: frozenset[int] = frozenset()) -> str:
        """The text of ``token_ids`` without the tokens flagged special, but for those in ``keep``
        (a tool-call marker some checkpoints flag special, which the call parser must read)."""
        if not keep:
            return self._tok.decode(list(token_ids), skip_special_tokens=True)
        special = self.special_ids
        return self._tok.decode([t for t in token_ids if t in keep or t not in special], skip_special_tokens=False)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids decoding skips: added tokens flagged special (not every added token: Qwen's
        ``<tool_call>`` and ``<think>`` are added but not special, and so are shown)."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def token_text(self, token_id: int) -> str:
        """One token's text, a special one's too (what logprobs name a token by, as vLLM)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def tokenizer_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what a grammar library builds its vocabulary from)."""
        return self._tok.to_str()


GIL_FREE_CHARS = 4096   # texts this long are encoded with the GIL released
# Pre-tokenizers that keep every byte of the text (Split and Punctuation unless "Removed").
_KEEPS_TEXT = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"})


def max_token_bytes(tok: Any) -> int | None:
    """The most bytes of normalized text one token of ``tok`` (a ``tokenizers.Tokenizer``) can
    stand for: its vocabulary's longest token, in the bytes it spells. None when the pipeline can
    drop text, so that no byte count bounds the tokens: a model other than BPE (WordPiece's unknown
    word), a BPE fusing unknown characters into one token, a pre-tokenizer removing text, an added
    token swallowing the whitespace beside it."""
    spec = json.loads(tok.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("fuse_unk") and model.get("unk_token") is not None
                                      and not model.get("byte_fallback")):
        return None
    kinds = _pre_tokenizer_kinds(spec.get("pre_tokenizer"))
    added = tok.get_added_tokens_decoder().values()
    if kinds is None or any(a.lstrip or a.rstrip for a in added):
        return None
    # A byte-level token spells each byte it stands for as one character. Any other spells its
    # text in at least as many bytes: sentencepiece's "▁" takes 3 for a space, "<0x0A>" 6 for 1.
    spelled = len if "ByteLevel" in kinds else utf8_len
    widths = [spelled(t) for t in tok.get_vocab(with_added_tokens=False)]
    widths += [utf8_len(a.content) for a in added]   # matched in the text as they are written
    return max(widths, default=None)


def _pre_tokenizer_kinds(spec: dict | None) -> set[str] | None:
    """The pre-tokenizers' types, or None if one of them may remove text."""
    if spec is None:
        return set()
    if spec.get("type") == "Sequence":
        kinds: set[str] = set()
        for part in spec.get("pretokenizers", []):
            got = _pre_tokenizer_kinds(part)
            if got is None:
                return None
            kinds |= got
        return kinds
    if spec.get("type") not in _KEEPS_TEXT or str(spec.get("behavior", "")).lower() == "removed":
        return None
    return {spec["type"]}


def load_tokenizer(model: str, vocab_size: int, eos_token_id: int | None = None) -> Tokenizer:
    """The tokenizer of preset, named model, GGUF file or checkpoint directory ``model``."""
    from mooncake_lite.model.source import resolve
    source = resolve(model)
    if source.kind == "gguf":
        return _gguf_tokenizer(source.path)
    if source.kind == "hf" and os.path.exists(os.path.join(model, "tokenizer.json")):
        return _dir_tokenizer(model, eos_token_id)
    return ByteTokenizer(vocab_size)


def _gguf_tokenizer(path: str) -> HFTokenizer:
    from mooncake_lite.model.gguf_file import read_meta
    from mooncake_lite.model.gguf_tokenizer import build_gguf_tokenizer, special_token, stop_ids
    meta = read_meta(path)
    source = meta.get("tokenizer.chat_template")
    specials = {f"{k}_token": special_token(meta, k)[1] for k in ("bos", "eos", "unknown", "padding")}
    specials["unk_token"], specials["pad_token"] = specials.pop("unknown_token"), specials.pop("padding_token")
    template = ChatTemplate(source, specials) if isinstance(source, str) and source else None
    return HFTokenizer(build_gguf_tokenizer(meta), stop_ids(meta), template)


def _dir_tokenizer(ckpt_dir: str, eos_token_id: int | None) -> HFTokenizer:
    from tokenizers import Tokenizer as _Tok
    tok = _Tok.from_file(os.path.join(ckpt_dir, "tokenizer.json"))
    config = _read_json(os.path.join(ckpt_dir, "tokenizer_config.json"))
    eos_ids = (eos_token_id,) if eos_token_id is not None else config_eos_ids(ckpt_dir)
    if not eos_ids:   # no config declares one: the tokenizer's own eos_token
        named = tok.token_to_id(_token_text(config.get("eos_token")) or "")
        eos_ids = (named,) if named is not None else ()
    return HFTokenizer(tok, eos_ids, _dir_template(ckpt_dir, config))


def _dir_template(ckpt_dir: str, config: dict) -> ChatTemplate | None:
    source = None
    jinja_path = os.path.join(ckpt_dir, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            source = f.read()
    elif isinstance(config.get("chat_template"), str):
        source = config["chat_template"]
    elif isinstance(config.get("chat_template"), list):  # named templates: the "default" one
        named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
        source = named.get("default")
    if not source:
        return None
    specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return ChatTemplate(source, specials)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def config_eos_ids(ckpt_dir: str) -> tuple[int, ...]:
    """Every end-of-sequence id a checkpoint declares, generation_config.json's first (it wins
    in HF), then config.json's; each may be one id or a list."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(os.path.join(ckpt_dir, name)).get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int) and not isinstance(i, bool):
                ids.append(i)
    return tuple(dict.fromkeys(ids))


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
