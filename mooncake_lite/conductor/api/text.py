"""Token ids → text deltas for streaming, with OpenAI ``stop`` strings.

Decoding one token at a time can split a UTF-8 character (byte tokenizer) or lose a leading
space (sentencepiece), so each step decodes the ids since the last point where the text was
final and emits only what grew past what was already shown, holding back a trailing
incomplete character. With stop
strings, the last ``len(longest stop) - 1`` characters are held back too, since they might be
the start of a stop string; when one appears, the text is cut before it and the request stops.
"""

from __future__ import annotations

import functools

from mooncake_lite.model.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), keep: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        # Special tokens shown all the same (``HFTokenizer.decode``): a tool-call marker.
        self._decode = functools.partial(tokenizer.decode, keep=keep) if keep else tokenizer.decode
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""               # everything decoded so far (before any stop cut)
        self.num_emitted = 0         # characters of ``text`` already returned
        self.is_stopped = False
        self._start = 0              # ids before this are final ...
        self._base = ""              # ... and decode to this

    def add(self, token_id: int) -> str:
        """Append one token; returns the text now safe to show (may be empty)."""
        if self.is_stopped:
            return ""
        self.token_ids.append(token_id)
        self._decode_window()
        if self.stop:
            cut = self._find_stop()
            if cut is not None:
                self.is_stopped = True
                return self._emit_upto(cut)
        return self._emit_upto(len(self.text) - self.hold)

    def flush(self) -> str:
        """At the end: whatever was held back (a stop string never appeared)."""
        if self.is_stopped:
            return ""
        self._decode_window(force=True)
        return self._emit_upto(len(self.text))

    def _decode_window(self, force: bool = False) -> None:
        # Ids before ``_start`` decode to ``_base`` for good. Of the rest, only a trailing
        # U+FFFD can still change (an incomplete character whose next bytes have not come);
        # everything before it is final, so ``text`` only ever grows.
        tail = self._decode(self.token_ids[self._start:])
        if force or not tail.endswith("\ufffd"):
            self._base += tail
            self._start = len(self.token_ids)
            self.text = self._base
        else:
            self.text = self._base + tail[:-1]

    def _find_stop(self) -> int | None:
        start = max(0, self.num_emitted - self.hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _emit_upto(self, end: int) -> str:
        if end <= self.num_emitted:
            return ""
        delta = self.text[self.num_emitted:end]
        self.num_emitted = end
        return delta

    @property
    def output_text(self) -> str:
        """The final text as the client sees it (cut before a stop string)."""
        return self.text[:self.num_emitted] if self.is_stopped else self.text
