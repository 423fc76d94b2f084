"""Structured outputs: a request's ``response_format`` or vLLM's ``structured_outputs`` as the
grammar its answer must match (llguidance grammar text, ``model/grammar.py``), and the bounded
compile check every new grammar passes before any instance sees it.

JSON is compact: no whitespace between tokens (``whitespace_flexible`` off, forced over a
schema's own ``x-guidance``), so a model cannot pad an answer until ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from mooncake_lite.conductor.api.errors import bad_request, short
from mooncake_lite.conductor.api.tools import ToolUse, call_grammar, marker_ids, parse_tools

COMPILE_TIMEOUT_S = 0.8           # CPU seconds: a grammar not compiled by then is refused (400), its child killed
MAX_WAIT_S = 10.0                 # and the wall clock's bound, however busy the machine
CHILD_MEMORY_BYTES = 4 << 30      # the checking child's address space
STARTUP_TIMEOUT_S = 120.0         # the child's imports and vocabulary, on a loaded machine
NUM_CHECKED = 1024                # grammars whose verdict is remembered
JSON_OPTIONS = {"whitespace_flexible": False}
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend")


@dataclass(frozen=True)
class Constraint:
    """A grammar, and the request field it came from (named in a 400)."""
    grammar: str
    field: str


def output_rules(body: dict, kind: str, tool_parser: str,
                 tokenizer: Any = None) -> tuple[ToolUse | None, Constraint | None]:
    """A request's tools (chat only) and the grammar its answer must match: its structured output,
    or the tool call ``tool_choice`` ``required`` or a named function forces (its markers as
    ``tokenizer``'s tokens where it has them)."""
    for key in GUIDED:   # vLLM's older fields: refused, not ignored
        if body.get(key) is not None:
            raise bad_request(f"'{key}' is not supported; use 'structured_outputs' or 'response_format'", key)
    if kind != "chat":   # refused, not ignored as vLLM does: the caller would think tools are offered
        for key in ("tools", "tool_choice", "parallel_tool_calls"):
            if body.get(key) is not None:
                raise bad_request(f"'{key}' is not supported on /v1/completions: a raw prompt has no chat "
                                  f"template to show tools to the model, and a completion no message to "
                                  f"return tool_calls in; use /v1/chat/completions", key)
    tools = parse_tools(body, tool_parser) if kind == "chat" else None
    constraint = parse_structured(body)
    if tools is not None and tools.is_forced:
        if constraint is not None:
            raise bad_request(f"'{constraint.field}' cannot be combined with a tool_choice that forces a call",
                              constraint.field)
        constraint = Constraint(call_grammar(tools, marker_ids(tokenizer, tool_parser)), "tool_choice")
    return tools, constraint


def parse_structured(body: dict) -> Constraint | None:
    """The grammar ``response_format`` or ``structured_outputs`` asks for, if any; 400 on a
    malformed one, or on both at once."""
    fmt, outputs = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and outputs is not None:
        raise bad_request("give either 'response_format' or 'structured_outputs', not both", "structured_outputs")
    if fmt is not None:
        return _response_format(fmt)
    if outputs is not None:
        return _structured_outputs(outputs)
    return None


def json_grammar(schema: Any, field: str) -> str:
    import llguidance
    if not isinstance(schema, dict):
        raise bad_request(f"'{field}' must be a JSON Schema object", field)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise bad_request(f"'{field}' is not a JSON Schema this server can use: {exc}", field) from None


def _response_format(fmt: Any) -> Constraint | None:
    field = "response_format"
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("'response_format.type' must be one of text, json_object, json_schema", field)
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return Constraint(json_grammar({"type": "object"}, field), field)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad_request("'response_format.json_schema' must be an object with a 'name' and a 'schema'", field)
    # ``strict`` is checked but changes nothing: the schema is enforced either way, as vLLM does.
    # OpenAI's strict: false (its default) only tries to follow the schema, so an answer that
    # matches it is one strict: false allows; and a server that can guarantee it should.
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("'response_format.json_schema.strict' must be a boolean", field)
    # OpenAI's default schema when none is given: any JSON object.
    return Constraint(json_grammar(spec.get("schema", {"type": "object"}), "response_format.json_schema.schema"),
                      field)


def _structured_outputs(spec: Any) -> Constraint | None:
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, or its text), ``regex``,
    ``choice`` (a list of strings), ``json_object`` (true)."""
    import llguidance
    field = "structured_outputs"
    if not isinstance(spec, dict):
        raise bad_request("'structured_outputs' must be an object", field)
    kinds = [k for k in ("json", "regex", "choice", "json_object") if spec.get(k) not in (None, False)]
    unknown = sorted(set(spec) - {"json", "regex", "choice", "json_object"})
    if unknown:
        raise bad_request(f"structured_outputs.{short(unknown[0])} is not supported (json, regex, choice, "
                          f"json_object are)", field)
    if len(kinds) != 1:
        raise bad_request("'structured_outputs' must set exactly one of json, regex, choice, json_object", field)
    kind, value = kinds[0], spec[kinds[0]]
    name = f"{field}.{kind}"
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(f"'{name}' is not valid JSON", name) from None
        return Constraint(json_grammar(value, name), name)
    if kind == "json_object":
        return Constraint(json_grammar({"type": "object"}, name), name)
    if kind == "regex":
        if not isinstance(value, str):
            raise bad_request(f"'{name}' must be a string", name)
        return Constraint(llguidance.LLMatcher.grammar_from_regex(value), name)
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad_request(f"'{name}' must be a non-empty list of non-empty strings", name)
    lark = "start: " + " | ".join(json.dumps(c) for c in value)
    return Constraint(llguidance.LLMatcher.grammar_from_lark(lark), name)


class GrammarChecker:
    """Compiles each grammar it has not seen in a child process (``model/grammar_check.py``), one
    at a time, and remembers the verdict (bounded). A compile past ``COMPILE_TIMEOUT_S`` kills the
    child (a fresh one starts for the next check) and is refused; the event loop only waits, so
    every other request goes on meanwhile. The child starts at the first check, or :meth:`warm`."""

    def __init__(self, model: str, vocab_size: int) -> None:
        self.model, self.vocab_size = model, vocab_size
        self._verdicts: OrderedDict[str, str] = OrderedDict()   # grammar -> "" (fine) or the error
        self._lock: asyncio.Lock | None = None   # made on the loop that first checks
        self._child: asyncio.subprocess.Process | None = None

    async def check(self, constraint: Constraint) -> None:
        """Returns when the grammar compiles; else a 400 naming the field."""
        error = await self.error_of(constraint.grammar)
        if error:   # the library's first line says why; the rest dumps its parser's state
            raise bad_request(f"'{constraint.field}' cannot be used: {error.splitlines()[0]}", constraint.field)

    async def error_of(self, grammar: str) -> str:
        verdict = self._verdicts.get(grammar)
        if verdict is None:
            self._lock = self._lock or asyncio.Lock()
            async with self._lock:
                verdict = self._verdicts.get(grammar)
                if verdict is None:
                    verdict = await self._compile(grammar)
                    self._verdicts[grammar] = verdict
                    while len(self._verdicts) > NUM_CHECKED:
                        self._verdicts.popitem(last=False)
        self._verdicts.move_to_end(grammar)
        return verdict

    async def warm(self) -> None:
        """Start the child now (its imports and the vocabulary take ~1 s), not at the first check."""
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            await self._started()

    async def _started(self) -> asyncio.subprocess.Process:
        if self._child is not None and self._child.returncode is None:
            return self._child
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "mooncake_lite.model.grammar_check", self.model, str(self.vocab_size),
            str(CHILD_MEMORY_BYTES), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        try:   # start-up is not the grammar's time: waited for apart
            await asyncio.wait_for(child.stdout.readline(), STARTUP_TIMEOUT_S)
        except BaseException:
            child.kill()
            raise
        self._child = child
        return child

    async def _compile(self, grammar: str) -> str:
        child = await self._started()
        child.stdin.write(json.dumps(grammar).encode() + b"\n")
        # The limit is the child's CPU time, not the wall clock: on a busy machine a benign
        # grammar may wait its turn for a CPU, while a hostile one burns its budget and dies.
        read, loop = asyncio.ensure_future(child.stdout.readline()), asyncio.get_running_loop()
        budget, give_up = _cpu_seconds(child.pid) + COMPILE_TIMEOUT_S, loop.time() + MAX_WAIT_S
        while not (await asyncio.wait({read}, timeout=COMPILE_TIMEOUT_S / 8))[0]:
            if _cpu_seconds(child.pid) >= budget or loop.time() >= give_up:
                read.cancel()
                await self.close()
                return f"it did not compile within {COMPILE_TIMEOUT_S:g} s (too complex)"
        line = read.result()
        if not line:   # the child died: out of memory, most likely, on this grammar
            await self.close()
            return "compiling it ran out of memory"
        return json.loads(line)

    async def close(self) -> None:
        child, self._child = self._child, None
        if child is not None and child.returncode is None:
            child.kill()
            await child.wait()


def _cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` has used (Linux ``/proc``; elsewhere 0, and the wall clock's
    ``MAX_WAIT_S`` is the only limit)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
