"""Tool calling: a chat request's ``tools`` and ``tool_choice``, the grammar that enforces
``required`` and a named function, and the tool calls parsed out of the model's text.

The calls' text format is the served model's (``--tool-call-parser``):
- ``hermes`` (Hermes, Qwen2.5/3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call, text before the first block is the message's content;
- ``llama3_json`` (Llama 3.1+): the answer is ``{"name": ..., "parameters": {...}}`` objects,
  separated by ``;``; an answer not starting with ``{`` is plain content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from mooncake_lite.conductor.api.errors import bad_request, short


@dataclass(frozen=True)
class CallFormat:
    start: str        # what opens a call ("" : the answer itself starts with the object)
    end: str          # what closes one ("" : the object's own end)
    separator: str    # between calls
    args_key: str     # the key of the arguments in the call's object


FORMATS = {"hermes": CallFormat("<tool_call>\n", "\n</tool_call>", "\n", "arguments"),
           "llama3_json": CallFormat("", "", "; ", "parameters")}
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class ToolUse:
    """What a request allows: its functions (name → parameters schema), and ``choice``: "auto",
    "none", "required", or the name of the one function it must call."""
    functions: tuple[tuple[str, dict], ...]
    specs: tuple[dict, ...]        # the tools as sent, for the chat template
    choice: str
    parallel: bool
    parser: str

    @property
    def is_forced(self) -> bool:
        return self.choice not in ("auto", "none")


def parse_tools(body: dict, parser: str) -> ToolUse | None:
    """The request's tools (400 naming the field on a malformed one), or None without any."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of function tools", "tools")
    functions = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [n for n, _ in functions]
    if len(set(names)) != len(names):
        raise bad_request("the names in 'tools' must be distinct", "tools")
    return ToolUse(functions, tuple(tools), _choice(choice, names), parallel, parser)


def _function(tool: Any, i: int) -> tuple[str, dict]:
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.fullmatch(fn["name"]):
        raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}} with a name "
                          f"of letters, digits, _ . - (at most 64)", "tools")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise bad_request(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
    return fn["name"], params


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request("'tool_choice' must be none, auto, required or {'type': 'function', 'function': "
                          "{'name': ...}}", "tool_choice")
    if fn["name"] not in names:
        raise bad_request(f"tool_choice names '{short(fn['name'])}', which is not among 'tools'", "tool_choice")
    return fn["name"]


def call_grammar(use: ToolUse, markers: dict[str, int] | None = None) -> str:
    """The llguidance grammar of the answer ``required`` or a named ``tool_choice`` allows: one
    call (several when parallel calls are allowed) in the parser's format, each an object whose
    name is an allowed function and whose arguments match its parameters. A call marker the
    tokenizer holds as one token (``markers``, :func:`marker_ids`) is that token, by id: the model
    writes the token it was trained on, never the marker spelled out in text pieces."""
    import llguidance
    fmt, markers = FORMATS[use.parser], markers or {}
    wanted = [(n, p) for n, p in use.functions if use.choice in ("required", n)]
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, fmt.args_key: p},
                         "required": ["name", fmt.args_key], "additionalProperties": False} for n, p in wanted],
              "x-guidance": {"whitespace_flexible": False}}
    call = " ".join([*_lark_text(fmt.start, markers), f"%json {json.dumps(schema)}", *_lark_text(fmt.end, markers)])
    more = f" ({json.dumps(fmt.separator)} call)*" if use.parallel and use.choice == "required" else ""
    return llguidance.LLMatcher.grammar_from_lark(f"start: call{more}\ncall: {call}")


def _lark_text(text: str, markers: dict[str, int]) -> list[str]:
    """``text`` as lark items: each marker in it as its token (``<[id]>``), the rest quoted."""
    for marker, token in markers.items():
        if marker in text:
            before, after = text.split(marker, 1)
            return [*_lark_text(before, markers), f"<[{token}]>", *_lark_text(after, markers)]
    return [json.dumps(text)] if text else []


def marker_ids(tokenizer: Any, parser: str) -> dict[str, int]:
    """The parser's call markers (``<tool_call>``, ``</tool_call>``) that ``tokenizer`` holds as
    one token each, special or not (Hermes 2 Pro, Qwen2.5/3), with their ids."""
    to_id = getattr(tokenizer, "token_to_id", None)
    if to_id is None:
        return {}
    fmt = FORMATS[parser]
    found = {m.strip(): to_id(m.strip()) for m in (fmt.start, fmt.end) if m.strip()}
    return {m: i for m, i in found.items() if i is not None}


def special_markers(tokenizer: Any, parser: str) -> frozenset[int]:
    """The ids of the parser's call markers that ``tokenizer`` flags special (``<tool_call>`` in
    Hermes 2 Pro, or in a conversion of Qwen's that marks it a control token), which decoding
    would drop: the answer's text keeps them so the parser reads the calls, as vLLM decodes with
    ``skip_special_tokens`` off for a tool parser. Qwen2.5/3's own tokenizer.json adds
    ``<tool_call>`` unflagged, so its text shows it anyway."""
    specials = getattr(tokenizer, "special_ids", frozenset())
    return frozenset(i for i in marker_ids(tokenizer, parser).values() if i in specials)


def template_messages(messages: list[dict], use: ToolUse | None, template_source: str | None,
                      parser: str) -> list[dict]:
    """The messages as the chat template gets them: an assistant's ``tool_calls`` arguments as
    objects (templates index them; OpenAI sends JSON strings), as vLLM passes them. A template
    that renders no ``tool_calls`` (SmolLM2's) gets the calls written into the assistant's
    content in the parser's format instead, so the model still sees what it called."""
    renders_calls = template_source is not None and "tool_calls" in template_source
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(m)
            continue
        calls = [{**c, "function": {**c["function"], "arguments": _as_object(c["function"]["arguments"])}}
                 for c in calls]
        if renders_calls:
            out.append({**m, "tool_calls": calls})
        else:
            out.append({**m, "content": (m.get("content") or "") + calls_text(calls, parser)})
    return out


def _as_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def calls_text(calls: list[dict], parser: str) -> str:
    fmt = FORMATS[parser]
    parts = [fmt.start + json.dumps({"name": c["function"]["name"], fmt.args_key: c["function"]["arguments"]},
                                    ensure_ascii=False) + fmt.end for c in calls]
    return fmt.separator.join(parts)


def message_fields(m: dict, i: int, content: str) -> dict:
    """A chat message's fields the template may use, checked: role, content and, for an assistant,
    ``tool_calls`` (``content`` may be null then); for a tool result, ``tool_call_id``."""
    out: dict[str, Any] = {"role": m["role"], "content": content}
    calls = m.get("tool_calls")
    if calls is not None and m["role"] == "assistant":
        if not isinstance(calls, list) or not all(_is_call(c) for c in calls):
            raise bad_request(f"messages[{i}].tool_calls must be a list of function calls with a name and "
                              f"arguments (a JSON string)", "messages")
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def _is_call(c: Any) -> bool:
    fn = c.get("function") if isinstance(c, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)
