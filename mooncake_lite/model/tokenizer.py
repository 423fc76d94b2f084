"""Tokenizers: byte-level for dummy-weight presets, Hugging Face ``tokenizer.json`` for checkpoints."""

from __future__ import annotations

import json
import os
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; id 256 is BOS, 257 EOS; higher ids (dummy vocab) decode to nothing."""

    bos_token_id = 256
    eos_token_id = 257

    def __init__(self, vocab_size: int = 320):
        if vocab_size < 258:
            raise ValueError("a byte tokenizer needs a vocabulary of at least 258 ids")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id, *text.encode("utf-8")]

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """Wraps a ``tokenizers`` tokenizer loaded from ``tokenizer.json``."""

    def __init__(self, path: str, eos_token_id: int | None = None):
        from tokenizers import Tokenizer as _Tok
        self._tok = _Tok.from_file(path)
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(list(token_ids))


def load_tokenizer(model: str, vocab_size: int, eos_token_id: int | None = None) -> Tokenizer:
    """``tokenizer.json`` from a checkpoint directory when present, else byte-level."""
    path = os.path.join(model, "tokenizer.json") if os.path.isdir(model) else None
    if path and os.path.exists(path):
        return HFTokenizer(path, eos_token_id if eos_token_id is not None else _config_eos(model))
    return ByteTokenizer(vocab_size)


def _config_eos(ckpt_dir: str) -> int | None:
    """The end-of-sequence id a checkpoint declares (generation_config.json wins, as in HF)."""
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(ckpt_dir, name), encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(eos, list):  # several stop ids: the first is the canonical EOS
            eos = eos[0] if eos else None
        if isinstance(eos, int):
            return eos
    return None
