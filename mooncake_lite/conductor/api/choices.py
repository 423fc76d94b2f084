"""One choice of an answer as the relay builds it: its text (stop strings cut, ``TextStream``;
reasoning apart with ``--reasoning-parser think``; tool calls parsed out with ``tools``,
``tool_parser.py``), its token ids, and its log-probabilities in the endpoint's format.

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
from mooncake_lite.conductor.api.tool_parser import ToolCallStream, parse_whole
from mooncake_lite.conductor.api.tools import special_markers
from mooncake_lite.conductor.flight.events import Token
from mooncake_lite.model.tokenizer import Tokenizer

Entry = tuple[int, TokenLogprob | None]   # a token id and its logprobs (None: the prompt's first)


class Choice:
    """``add`` each of its tokens (text deltas out), ``flush`` at the end; ``logprobs`` and
    ``take_logprobs`` give its log-probabilities whole or as they come (streaming)."""

    def __init__(self, index: int, kind: str, tokenizer: Tokenizer, stop: tuple[str, ...], *,
                 reasoning: bool, opened: bool, echo_text: str | None, top_k: int | None,
                 tool_parser: str | None = None) -> None:
        self.index, self.kind, self.tokenizer, self.top_k = index, kind, tokenizer, top_k
        self.text = TextStream(tokenizer, stop, special_markers(tokenizer, tool_parser) if tool_parser else frozenset())
        self.thinking = ThinkSplitter(opened) if reasoning and kind == "chat" else None
        # Tool calls parsed out of the answer (a request with tools, tool_choice not "none").
        self.calls = ToolCallStream(tool_parser) if tool_parser is not None else None
        self.has_calls = False               # the answer held complete calls: it finishes "tool_calls"
        self.opened = opened
        self.echo_text = echo_text
        self.entries: list[Entry] = []       # with echo and logprobs, the prompt's first
        self.num_sent = 0                    # entries already streamed
        self.offset = 0                      # text offset of the next completions entry
        self.is_echoed = False               # the prompt's entries are in (or were not asked for)
        self.num_echoed = 0                  # of the entries, the echoed prompt's (they lead)

    @property
    def is_stopped(self) -> bool:
        return self.text.is_stopped

    def echo_prompt(self, prompt_ids: tuple[int, ...], prompt_logprobs: tuple[TokenLogprob, ...]) -> None:
        """Echo with logprobs: the prompt's tokens lead the entries (the first has none)."""
        self.entries += [(prompt_ids[0], None), *zip(prompt_ids[1:], prompt_logprobs)]
        self.num_echoed = len(prompt_ids)

    def add(self, token: Token) -> str:
        """One token: the text now safe to show (may be empty; a stop string ends the choice)."""
        if token.logprob is not None and not self.text.is_stopped:
            self.entries.append((token.token, token.logprob))
        return self.text.add(token.token)

    def flush(self) -> str:
        return self.text.flush()

    def deltas(self, delta: str | None) -> list[str | dict]:
        """A text delta as the stream's deltas: content text, or with --reasoning-parser think a
        reasoning part first, or with tools content and ``tool_calls`` deltas; ``None``: what
        the reasoning split or the call parser held back."""
        if self.calls is not None:
            out = self.calls.finish() if delta is None else self.calls.feed(delta)
            self.has_calls = bool(self.calls.calls)
            return out
        if self.thinking is None:
            return [delta] if delta else []
        reasoning, content = self.thinking.flush() if delta is None else self.thinking.feed(delta)
        return ([{"reasoning_content": reasoning}] if reasoning else []) + ([content] if content else [])

    def message(self, text: str) -> dict:
        """The chat message of a whole answer."""
        out = {"role": "assistant", "content": text}
        if self.thinking is not None:   # as vLLM: null for a part the answer lacks
            reasoning, content = split_whole(text, self.opened)
            out["content"], out["reasoning_content"] = content or None, reasoning
        if self.calls is not None:
            out["content"], calls = parse_whole(text, self.calls.parser)
            if calls:
                out["tool_calls"] = [c.message() for c in calls]
                self.has_calls = True
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """The flight's reason for this choice, as the client sees it: a "stop" after calls is "tool_calls"."""
        return "tool_calls" if reason == "stop" and self.has_calls else reason

    def logprobs(self) -> dict | None:
        """All of its log-probabilities (None when not asked for)."""
        return None if self.top_k is None else self._format(self.entries)

    def take_logprobs(self, upto: int | None = None) -> dict | None:
        """Those not streamed yet, up to entry ``upto`` (None when not asked for, or none is new)."""
        end = len(self.entries) if upto is None else min(upto, len(self.entries))
        if self.top_k is None or self.num_sent >= end:
            return None
        fresh, self.num_sent = self.entries[self.num_sent:end], end
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
