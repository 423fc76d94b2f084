"""Prompts for a trace that has no text: one fixed pseudo-random block per ``hash_id``.

Equal ids give equal blocks, and because trace ids are chained (equal id = equal prefix), two
requests sharing their first k ids share their first k blocks token for token — the prefix
sharing a cache can exploit is real. ``scale`` shrinks a 512-token trace block to
``round(512 * scale)`` tokens so a long trace fits a small model's context.

Lengths are counted in the served model's own tokenizer when one is given (``PromptSynth(cfg,
tokenizer)``; ``mooncake bench replay --tokenizer``):

* ``text`` (default) with a tokenizer: every block is a run of the tokenizer's own *word tokens*
  — vocabulary entries that decode to a space plus letters (`` the``, `` cake``) and come back as
  themselves when re-encoded, alone and side by side (``WordVocab``). A byte-level BPE's
  pre-tokenizer splits text before every such word, so the text of n drawn tokens re-encodes to
  exactly those n ids, and a shared trace prefix is a shared token prefix on the server. Each
  prompt is re-encoded to check it (``PromptSynth.mismatched`` counts any that are not exact).
* ``text`` without a tokenizer: printable ASCII, one character per token. For a byte-level model
  (the built-in presets) every byte *is* a token, so lengths are exact; for other tokenizers
  the text is still deterministic per block (sharing stays real) but lengths are approximate.
* ``tokens``: the prompt is sent as a list of token ids (``prompt: [ids]``, accepted by vLLM
  and by mooncake-lite): the tokenizer's word tokens when one is given, else ids drawn from
  ``[min_token_id, vocab_size)``; exact for any model.

Lengths are of the prompt's own tokens: a server whose tokenizer adds BOS counts one more
(``reserved_tokens`` keeps room for it in the context budget).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import numpy as np

from mooncake_lite.trace.format import TRACE_BLOCK_SIZE, TraceRequest

PRINTABLE = np.frombuffer(bytes(range(0x20, 0x7F)), dtype=np.uint8)  # space .. '~'


class TextTokenizer(Protocol):
    """What prompt synthesis needs of a tokenizer (``model.tokenizer.HFTokenizer`` has it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...


_WORD = re.compile(r" [A-Za-z]+")
MIN_WORDS = 256


class WordVocab:
    """A tokenizer's word tokens: ids whose text is a space plus ASCII letters and that encode
    back to themselves alone and doubled (so no merge crosses the boundary between two words)."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int):
        pieces = [tokenizer.decode([i]) for i in range(vocab_size)]
        ids = [i for i, p in enumerate(pieces) if _WORD.fullmatch(p)
               and tokenizer.encode(p + p, add_special_tokens=False) == [i, i]]
        if len(ids) < MIN_WORDS:
            raise ValueError(f"the tokenizer has only {len(ids)} word tokens (' ' + letters that re-encode to "
                             f"themselves; need {MIN_WORDS}): use --prompt-mode tokens")
        self.ids = np.asarray(ids, dtype=np.int64)
        self.pieces = pieces

    def text(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids)


def vocab_size_of(tokenizer: TextTokenizer, fallback: int) -> int:
    """The size of a ``tokenizers``-backed tokenizer's vocabulary (special tokens included)."""
    raw = getattr(tokenizer, "_tok", tokenizer)
    get = getattr(raw, "get_vocab_size", None)
    return int(get(with_added_tokens=True)) if callable(get) else fallback


@dataclass(frozen=True)
class PromptConfig:
    scale: float = 1.0                   # input length scale (and block size scale)
    output_scale: float | None = None    # None: same as scale
    max_output_tokens: int | None = None
    max_tokens_cap: int | None = None    # --max-tokens-policy cap:N: send N, stop reading at the output
    max_context: int | None = None       # prompt + output must fit; prompts are cut (prefix kept)
    mode: str = "text"                   # "text" | "tokens"
    vocab_size: int = 32000              # tokens mode: ids drawn from [min_token_id, vocab_size)
    min_token_id: int = 0
    reserved_tokens: int = 1             # room for tokens the server adds (BOS)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"--scale must be positive, got {self.scale}")
        if self.output_scale is not None and not self.output_scale > 0:
            raise ValueError(f"--output-scale must be positive, got {self.output_scale}")
        if self.mode not in ("text", "tokens"):
            raise ValueError(f"prompt mode must be 'text' or 'tokens', got {self.mode!r}")
        if not 0 <= self.min_token_id < self.vocab_size:
            raise ValueError("need 0 <= --min-token-id < --vocab-size")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError("--max-output-tokens must be at least 1")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError("a max_tokens cap must be at least 1")
        if self.max_context is not None and self.max_context < 2 + self.reserved_tokens:
            raise ValueError(f"--max-context {self.max_context} is too small")

    @property
    def block_tokens(self) -> int:
        return max(1, round(TRACE_BLOCK_SIZE * self.scale))


@dataclass(frozen=True)
class SynthRequest:
    """One request ready to send: ``prompt`` is a str (text mode) or a list of ids."""
    request_id: int
    arrival_s: float
    prompt: str | list[int]
    num_prompt_tokens: int
    max_tokens: int
    num_full_blocks: int
    is_truncated: bool
    # The trace's output length when max_tokens is a cap above it: the client reads this many
    # tokens and closes the stream (None: the server stops at max_tokens).
    stop_after: int | None = None


class PromptSynth:
    """``tokenizer``: the served model's (lengths then count its tokens); None: bytes / raw ids."""

    def __init__(self, cfg: PromptConfig, tokenizer: TextTokenizer | None = None, *,
                 words: WordVocab | None = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.words = words
        if words is None and tokenizer is not None:
            try:
                self.words = WordVocab(tokenizer, vocab_size_of(tokenizer, cfg.vocab_size))
            except ValueError:
                if cfg.mode == "text":
                    raise
                # tokens mode is exact for any ids: draw them from [min_token_id, vocab_size)
        self.mismatched = 0   # text prompts whose re-encoding was not the drawn ids (0 expected)
        self._block = lru_cache(maxsize=65536)(self._make_block)

    def _make_block(self, hash_id: int) -> np.ndarray:
        rng = np.random.default_rng([self.cfg.seed, hash_id & 0xFFFFFFFFFFFFFFFF])
        n = self.cfg.block_tokens
        if self.words is not None:
            return self.words.ids[rng.integers(0, len(self.words.ids), n)]
        if self.cfg.mode == "text":
            return PRINTABLE[rng.integers(0, len(PRINTABLE), n)]
        return rng.integers(self.cfg.min_token_id, self.cfg.vocab_size, n, dtype=np.int64)

    def lengths(self, req: TraceRequest) -> tuple[int, int, bool]:
        """(prompt tokens, output tokens, truncated?) after scaling and the context cap."""
        cfg, bt = self.cfg, self.cfg.block_tokens
        n_in = min(max(1, round(req.input_length * bt / TRACE_BLOCK_SIZE)), len(req.hash_ids) * bt)
        out_scale = cfg.scale if cfg.output_scale is None else cfg.output_scale
        n_out = max(1, round(req.output_length * out_scale))
        if cfg.max_output_tokens is not None:
            n_out = min(n_out, cfg.max_output_tokens)
        truncated = False
        if cfg.max_context is not None:
            n_out = min(n_out, cfg.max_context // 2)  # never let the output squeeze the prompt to nothing
            room = cfg.max_context - max(n_out, self.max_tokens(n_out)) - cfg.reserved_tokens
            if n_in > room:
                n_in, truncated = room, True
        return n_in, n_out, truncated

    def max_tokens(self, n_out: int) -> int:
        """What the client sends as max_tokens for an output of ``n_out`` tokens: the output
        itself, or the cap (within half the context, as outputs are)."""
        cap = self.cfg.max_tokens_cap
        if cap is None:
            return n_out
        return cap if self.cfg.max_context is None else min(cap, self.cfg.max_context // 2)

    def tokens(self, hash_ids: tuple[int, ...], num_tokens: int) -> np.ndarray:
        """The first ``num_tokens`` tokens of the blocks named by ``hash_ids``."""
        need = math.ceil(num_tokens / self.cfg.block_tokens)
        if need > len(hash_ids):
            raise ValueError(f"{num_tokens} tokens need {need} blocks but the request names {len(hash_ids)}")
        return np.concatenate([self._block(h) for h in hash_ids[:need]])[:num_tokens]

    def build(self, req: TraceRequest) -> SynthRequest:
        n_in, n_out, truncated = self.lengths(req)
        toks = self.tokens(req.hash_ids, n_in)
        if self.cfg.mode == "tokens":
            prompt: str | list[int] = toks.tolist()
        elif self.words is None:
            prompt = toks.tobytes().decode("ascii")
        else:
            prompt = self.words.text(toks.tolist())
            if self.tokenizer is not None:   # count it in the server's tokenizer, as it will
                got = self.tokenizer.encode(prompt, add_special_tokens=False)
                if len(got) != n_in or got != toks.tolist():
                    self.mismatched += 1
                    n_in = len(got)
        max_tokens = self.max_tokens(n_out)
        n_out = min(n_out, max_tokens)
        return SynthRequest(req.request_id, req.arrival_s, prompt, n_in, max_tokens,
                            n_in // self.cfg.block_tokens, truncated, n_out if n_out < max_tokens else None)


def auto_scale(requests: list[TraceRequest], max_context: int, fill: float = 0.9) -> float:
    """A scale that makes the longest request (prompt + output) fill ``fill`` of the context."""
    longest = max(r.input_length + r.output_length for r in requests)
    return min(1.0, fill * max_context / longest)
