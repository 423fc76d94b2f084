"""Tokenizers: byte-level for dummy-weight presets; a checkpoint's own for real models.

A real checkpoint's tokenizer also carries what serving it correctly needs: every id that ends
a turn (``eos_token_ids``), whether encoding adds BOS, and the chat template with the special-
token strings it refers to. Sources: a GGUF file's metadata, or an HF directory's
``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``, ``config.json`` and
``generation_config.json``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Protocol

from mooncake_lite.model.chat import ChatTemplate


class Tokenizer(Protocol):
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: ChatTemplate | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; id 256 is BOS, 257 EOS; higher ids (dummy vocab) decode to nothing."""

    bos_token_id = 256
    eos_token_id = 257
    eos_token_ids = (257,)
    chat_template = None

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
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


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
