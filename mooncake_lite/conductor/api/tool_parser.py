"""Tool calls parsed out of a model's text as it streams, in the format of ``tools.FORMATS``.

Fed text deltas, :class:`ToolCallStream` returns OpenAI chat deltas: ``{"content": ...}`` for text
outside calls (holding back what may be the start of a call's marker), and ``{"tool_calls": [...]}``
for a call: first its index, id and name with empty arguments, as soon as the name is complete,
then its arguments text as it grows (holding back what may be the call's closing brace). The
arguments streamed add up to the call's arguments JSON text exactly. A whole answer is parsed by
feeding it at once (:func:`parse_whole`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from mooncake_lite.conductor.api.tools import FORMATS, new_call_id

_HEADER = r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"%s"\s*:\s*'
_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""            # the JSON text streamed so far
    is_complete: bool = False

    def message(self) -> dict:
        """As ``message.tool_calls`` holds it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallStream:
    parser: str
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""              # all content text returned
    _buf: str = ""                 # text not resolved yet
    _mode: str = "text"            # text | call | after | plain
    _args_at: int | None = None    # where the current call's arguments start in _buf

    def __post_init__(self) -> None:
        self.fmt = FORMATS[self.parser]
        self._header = re.compile(_HEADER % self.fmt.args_key)

    def feed(self, text: str) -> list[dict]:
        self._buf += text
        out: list[dict] = []
        while True:
            before = (self._mode, len(self._buf))
            out += getattr(self, f"_{self._mode}")()
            if (self._mode, len(self._buf)) == before:
                return out

    def finish(self) -> list[dict]:
        """The held-back end: content, unless a call was cut short (its text is then lost to
        the stream, and :func:`parse_whole` keeps the whole answer as content)."""
        if self._mode in ("text", "plain") and self._buf:
            return self._emit_content(len(self._buf))
        return []

    # ---- the modes: each resolves what it can of _buf ---------------------------------------
    def _plain(self) -> list[dict]:
        return self._emit_content(len(self._buf))

    def _text(self) -> list[dict]:
        start = self.fmt.start
        if not start:   # llama3_json: calls only as the whole answer
            head = self._buf.lstrip()
            if not head:
                return []
            self._mode = "call" if head.startswith("{") and not self.content and not self.calls else "plain"
            return []
        at = self._buf.find(start)
        if at >= 0:
            out = self._emit_content(at)
            self._buf = self._buf[len(start):]
            self._mode = "call"
            return out
        return self._emit_content(len(self._buf) - _partial_suffix(self._buf, start))

    def _call(self) -> list[dict]:
        out: list[dict] = []
        if self._args_at is None:
            m = self._header.match(self._buf)
            if m is not None and m.end() < len(self._buf):   # the arguments' first character is in
                self._args_at = m.end()
                call = ToolCall(len(self.calls), new_call_id(), json.loads(f'"{m.group(1)}"'))
                self.calls.append(call)
                out.append(_call_delta(call, {"name": call.name, "arguments": ""}, header=True))
        done = _object_end(self._buf)
        if done is None:
            if self._args_at is not None:
                out += self._grow(_safe_end(self._buf, self._args_at))
            return out
        if self._args_at is None:   # a complete object whose keys came in another order
            out += self._whole_call(self._buf[:done])
        else:
            args_end = _object_end(self._buf, self._args_at)
            out += self._grow(args_end if args_end is not None else self._args_at)
        if self.calls and self.calls[-1].arguments:
            self.calls[-1].is_complete = True
        self._buf, self._args_at, self._mode = self._buf[done:], None, "after"
        return out

    def _after(self) -> list[dict]:
        end, sep = self.fmt.end, self.fmt.separator.strip()
        if end:
            at = self._buf.find(end.strip())
            if at >= 0:
                self._buf, self._mode = self._buf[at + len(end.strip()):], "text"
            return []
        head = self._buf.lstrip()
        if head.startswith(sep):
            self._buf, self._mode = head[len(sep):].lstrip(), "call"
        elif head:
            self._buf, self._mode = head, "plain"
        return []

    # ---- deltas ------------------------------------------------------------------------------
    def _emit_content(self, upto: int) -> list[dict]:
        text, self._buf = self._buf[:upto], self._buf[upto:]
        if self.calls and not text.strip():   # the blank lines between calls are no content
            return []
        self.content += text
        return [{"content": text}] if text else []

    def _grow(self, upto: int) -> list[dict]:
        call = self.calls[-1]
        piece = self._buf[self._args_at + len(call.arguments):upto]
        if not piece or upto < self._args_at + len(call.arguments):
            return []
        call.arguments += piece
        return [_call_delta(call, {"arguments": piece})]

    def _whole_call(self, text: str) -> list[dict]:
        obj = json.loads(text)
        args = obj.get(self.fmt.args_key, obj.get("arguments", obj.get("parameters")))
        if not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            self._mode = "plain"
            return []
        call = ToolCall(len(self.calls), new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))
        self.calls.append(call)
        return [_call_delta(call, {"name": call.name, "arguments": call.arguments}, header=True)]


def _call_delta(call: ToolCall, function: dict, header: bool = False) -> dict:
    entry = {"index": call.index, "function": function}
    if header:
        entry.update(id=call.id, type="function")
    return {"tool_calls": [entry]}


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _object_end(text: str, at: int | None = None) -> int | None:
    """Where the JSON value starting at ``at`` (the first non-blank) ends, if it is complete."""
    start = len(text) - len(text.lstrip()) if at is None else at
    try:
        return _DECODER.raw_decode(text, start)[1]
    except ValueError:
        return None


def _safe_end(text: str, args_at: int) -> int:
    """How much of a call's growing arguments can be sent: all but a trailing ``}`` and blanks
    (the call object's own end could be what they are)."""
    end = len(text.rstrip())
    if end > args_at and text[end - 1] == "}":
        end = len(text[:end - 1].rstrip())
    return max(end, args_at)


def parse_whole(text: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None when it is only calls) and its complete calls. An answer
    with a call cut short (``length``) is all content, as the model wrote it."""
    stream = ToolCallStream(parser)
    stream.feed(text)
    stream.finish()
    if any(not c.is_complete for c in stream.calls) or stream._mode == "call":
        return text, []
    return stream.content.strip() or None, stream.calls
