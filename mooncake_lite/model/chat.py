"""Rendering chat ``messages`` with a checkpoint's own Jinja chat template.

A model answers well only in the format it was trained on, which its checkpoint states as a
Jinja template (GGUF ``tokenizer.chat_template``, ``tokenizer_config.json``'s ``chat_template``
or ``chat_template.jinja``). Templates come from model files, so they run in Jinja's immutable
sandbox. The environment follows the conventions templates are written for (blocks trimmed,
``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text), so the output is
the same as ``transformers``' ``apply_chat_template(..., add_generation_prompt=True)``.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any


# The special-token variables templates are written against (HF's names).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
                       "unknown_token", "padding_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation (its ``raise_exception``) or failed to render."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        self.source = source
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self._template = _environment().from_string(source)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               extra: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """``extra``: more variables for the template (a request's ``chat_template_kwargs``, such
        as Qwen3's ``enable_thinking``); the caller keeps them off :meth:`reserved` names, and
        the messages, the generation prompt and the special tokens win over them regardless.
        ``tools``: the request's tools as OpenAI sends them (``{"type": "function", "function":
        {...}}``), the template's ``tools`` as ``apply_chat_template(..., tools=...)`` passes them;
        a template without a tools section ignores them."""
        from jinja2 import TemplateError
        variables = {**(extra or {}), "messages": messages, "add_generation_prompt": add_generation_prompt,
                     **self.special_tokens}
        if tools:
            variables["tools"] = tools
        try:
            return self._template.render(variables)   # one dict: no name can clash with render's own
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            # a template fed values it did not expect fails in Python's terms too: still a bad request
            raise ChatTemplateError(f"the model's chat template failed: {exc}") from None

    def reserved(self) -> frozenset[str]:
        """Names a request's variables may not set: what the server passes, the special tokens
        (whether or not this checkpoint has each) and the environment's functions (``namespace``,
        ``raise_exception``: a template calling one would fail on a client's value)."""
        return frozenset({"messages", "add_generation_prompt", "tools", *SPECIAL_TOKEN_NAMES, *self.special_tokens,
                          *_environment().globals})


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
