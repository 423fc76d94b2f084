"""One choice of an answer as the relay builds it: its text (stop strings cut, ``TextStream``;
reasoning apart with ``--reasoning-parser think``), its token ids, and its log-probabilities in
the endpoint's format.

Formats (as OpenAI and vLLM write them; values are the raw model's, ``model/sampling.py``):

* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}, ...]}``, ``top_logprobs`` the k likeliest;
* completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, each
  ``top_logprobs`` entry an object from token text to logprob holding the k likeliest and the
  token itself; with ``echo`` the prompt's tokens come first, the very first with ``null``s.
"""

from __future__ import annotations

from mooncake_lite.common.protocol import TokenLogprob
from mooncake_lite.conductor.api.reasoning import ThinkSplitter, split_whole
from mooncake_lite.conductor.api.text import TextStream
from mooncake_lite.conductor.flight.events import Token
from mooncake_lite.model.tokenizer import Tokenizer

Entry = tuple[int, TokenLogprob | None]   # a token id and its logprobs (None: the prompt's first)


class Choice:
    """``add`` each of its tokens (text deltas out), ``flush`` at the end; ``logprobs`` and
    ``take_logprobs`` give its log-probabilities whole or as they come (streaming)."""

    def __init__(self, index: int, kind: str, tokenizer: Tokenizer, stop: tuple[str, ...], *,
                 reasoning: bool, opened: bool, echo_text: str | None, top_k: int | None) -> None:
        self.index, self.kind, self.tokenizer, self.top_k = index, kind, tokenizer, top_k
        self.text = TextStream(tokenizer, stop)
        self.thinking = ThinkSplitter(opened) if reasoning and kind == "chat" else None
        self.opened = opened
        self.echo_text = echo_text
        self.entries: list[Entry] = []       # with echo and logprobs, the prompt's first
        self.num_sent = 0                    # entries already streamed
        self.offset = 0                      # text offset of the next completions entry
        self.is_echoed = False               # the prompt's entries are in (or were not asked for)

    @property
    def is_stopped(self) -> bool:
        return self.text.is_stopped

    def echo_prompt(self, prompt_ids: tuple[int, ...], prompt_logprobs: tuple[TokenLogprob, ...]) -> None:
        """Echo with logprobs: the prompt's tokens lead the entries (the first has none)."""
        self.entries += [(prompt_ids[0], None), *zip(prompt_ids[1:], prompt_logprobs)]

    def add(self, token: Token) -> str:
        """One token: the text now safe to show (may be empty; a stop string ends the choice)."""
        if token.logprob is not None and not self.text.is_stopped:
            self.entries.append((token.token, token.logprob))
        return self.text.add(token.token)

    def flush(self) -> str:
        return self.text.flush()

    def split(self, delta: str | None) -> tuple[str, str]:
        """A text delta as (reasoning, content); ``None``: what the reasoning split held back."""
        if self.thinking is None:
            return "", delta or ""
        return self.thinking.flush() if delta is None else self.thinking.feed(delta)

    def message(self, text: str) -> dict:
        """The chat message of a whole answer."""
        if self.thinking is None:
            return {"role": "assistant", "content": text}
        reasoning, content = split_whole(text, self.opened)   # as vLLM: null for a part the answer lacks
        return {"role": "assistant", "content": content or None, "reasoning_content": reasoning}

    def logprobs(self) -> dict | None:
        """All of its log-probabilities (None when not asked for)."""
        return None if self.top_k is None else self._format(self.entries)

    def take_logprobs(self) -> dict | None:
        """Those not streamed yet (None when not asked for, or none is new)."""
        if self.top_k is None or self.num_sent == len(self.entries):
            return None
        fresh, self.num_sent = self.entries[self.num_sent:], len(self.entries)
        return self._format(fresh)

    def _format(self, entries: list[Entry]) -> dict:
        if self.kind == "chat":
            return {"content": [self._chat_entry(t, lp) for t, lp in entries]}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp in entries:
            text = self._piece(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append(None if lp is None else self._top_dict(token, lp))
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def _chat_entry(self, token: int, lp: TokenLogprob) -> dict:
        top = [_chat_item(self._piece(t), v) for t, v in zip(lp.top_ids, lp.top_logprobs)]
        return {**_chat_item(self._piece(token), lp.logprob), "top_logprobs": top}

    def _top_dict(self, token: int, lp: TokenLogprob) -> dict[str, float]:
        top = {self._piece(t): v for t, v in zip(lp.top_ids, lp.top_logprobs)}
        top.setdefault(self._piece(token), lp.logprob)   # the token itself is always there (vLLM)
        return top

    def _piece(self, token: int) -> str:
        text_of = getattr(self.tokenizer, "token_text", None)   # special tokens named too (HF tokenizers)
        return text_of(token) if text_of is not None else self.tokenizer.decode([token])


def _chat_item(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
