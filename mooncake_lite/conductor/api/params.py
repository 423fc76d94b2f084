"""Parsing and validating OpenAI request bodies into one :class:`ApiRequest`.

Every problem becomes a 400 with a message naming the field, before any instance is touched.
Supported: ``/v1/completions`` (prompt as a string, token ids, or a batch: a list of either) and
``/v1/chat/completions`` (messages rendered with :func:`chat_prompt`); ``max_tokens``
(``max_completion_tokens`` for chat; 0 in completions: the prompt alone, for ``echo``),
``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``, ``stream_options.include_usage``;
the sampling controls of ``controls.py`` (``n``, ``logprobs``, ``top_logprobs``, ``echo``, the
penalties, ``min_tokens``, ``logit_bias``); ``response_format``, vLLM's ``structured_outputs``,
``tools`` and ``tool_choice`` (``structured.py``, ``tools.py``); vLLM's ``ignore_eos`` and ``stop_token_ids``, and
``return_token_ids`` (non-streaming: the choice carries ``token_ids``, the body ``prompt_token_ids``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mooncake_lite.common.protocol import Sampling
from mooncake_lite.conductor.api import controls
from mooncake_lite.conductor.api.errors import ApiError, bad_request, short
from mooncake_lite.conductor.api.reasoning import opens_reasoning
from mooncake_lite.conductor.api.structured import Constraint, output_rules
from mooncake_lite.conductor.api.tools import ToolUse, message_fields, template_messages
from mooncake_lite.model.chat import ChatTemplateError
from mooncake_lite.model.tokenizer import Tokenizer, utf8_len

DEFAULT_COMPLETION_TOKENS = 16     # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = 256          # chat has no default in the spec; capped by the context
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_BATCH = 256                    # prompts in one /v1/completions request


@dataclass(frozen=True)
class ApiRequest:
    kind: str                      # "completion" | "chat"
    model: str
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool = False
    opens_reasoning: bool = False  # the rendered chat prompt ends in "<think>" (api/reasoning.py)
    echo_text: str | None = None   # echo: the prompt's text, put before each choice's
    is_prompt_only: bool = False   # max_tokens 0: one token is computed (the flight needs it), none returned
    # A batch of prompts: the ones after this one, each (token ids, text to echo); :meth:`each` splits it.
    more_prompts: tuple[tuple[tuple[int, ...], str | None], ...] = ()
    tools: ToolUse | None = None   # its tools and tool_choice (api/tools.py)
    constraint: Constraint | None = None   # the grammar its answer must match (api/structured.py)

    def each(self) -> list[ApiRequest]:
        """One request per prompt of a batch (this one alone when it is not a batch); the
        repetition penalty counts each prompt's own ids."""
        prompts = [(self.prompt_ids, self.echo_text), *self.more_prompts]
        return [dataclasses.replace(self, prompt_ids=ids, echo_text=text, more_prompts=(),
                                    sampling=_with_prompt(self.sampling, ids)) for ids, text in prompts]


def _with_prompt(sampling: Sampling, prompt_ids: tuple[int, ...]) -> Sampling:
    if sampling.repetition_penalty == 1.0:
        return sampling
    return dataclasses.replace(sampling, penalty_ids=tuple(sorted(set(prompt_ids))))


@dataclass(frozen=True)
class TextAfterIds:
    """A completion's text prompt that follows token ids already fixed (a context's, see
    ``conductor/contexts/``): the rewrite that puts it in the body runs on the event loop and
    must not tokenize, so the parser does, under the same bound and in the same thread as any
    text prompt, and without a second BOS."""
    prefix: tuple[int, ...]
    text: str


def chat_prompt(messages: list[dict[str, str]]) -> str:
    """The fallback chat template, for checkpoints without one of their own (the byte-level
    presets): one ``<|role|>`` header line per message, its content on the next line(s), then
    ``<|assistant|>`` and a newline for the reply."""
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


def _chat_ids(messages: list[dict[str, str]], tokenizer: Tokenizer, max_context: int,
              template_kwargs: dict[str, Any] | None = None, tools: ToolUse | None = None,
              tool_parser: str = "hermes") -> tuple[tuple[int, ...], bool]:
    """The conversation in the checkpoint's own chat format, and whether that format opened a
    reasoning block for the answer (``reasoning.opens_reasoning``). The rendered template already
    holds every special token the model expects (BOS included), so encoding adds none."""
    template = tokenizer.chat_template
    messages = template_messages(messages, tools, template.source if template else None, tool_parser)
    if template is None:
        return _encode(tokenizer, chat_prompt(messages), max_context), False
    try:
        text = template.render(messages, add_generation_prompt=True, extra=template_kwargs,
                               tools=list(tools.specs) if tools else None)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    return _encode(tokenizer, text, max_context, add_special_tokens=False), opens_reasoning(text)


def _encode(tokenizer: Tokenizer, text: str, max_context: int, add_special_tokens: bool = True) -> tuple[int, ...]:
    check_text_fits(tokenizer, text, max_context)
    return tuple(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def check_text_fits(tokenizer: Tokenizer, text: str, max_context: int) -> None:
    """Refuse, without tokenizing it, a prompt text that cannot fit the context. No token stands
    for more than ``tokenizer.max_token_bytes`` bytes of text, so text over (context − 1) × that
    is at least a context of tokens, with no room left for one of the answer. Tokenizing it first
    would cost time and memory in proportion to its length (50 MiB: a minute and GBs)."""
    per_token = getattr(tokenizer, "max_token_bytes", None)
    if per_token is None:   # a tokenizer that may drop text: no byte count bounds its tokens
        return
    limit = (max_context - 1) * per_token
    if 4 * len(text) <= limit:   # at most 4 bytes a character: fits, whatever it is
        return
    measure = getattr(tokenizer, "text_bytes", utf8_len)
    num_bytes = measure(text)
    if num_bytes > limit:
        raise bad_request(f"This model's maximum context length is {max_context} tokens. However, your prompt "
                          f"is {num_bytes} bytes of text, more than {max_context - 1} tokens can hold (no "
                          f"token of this model stands for more than {per_token} bytes). Please reduce the "
                          f"length of the prompt.", "prompt")


def parse_request(body: Any, kind: str, *, served: tuple[str, ...], tokenizer: Tokenizer,
                  vocab_size: int, max_context: int, tool_parser: str = "hermes") -> ApiRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise bad_request("'model' is required and must be a string", "model")
    if model not in served:
        raise unknown_model(model, served[0])
    opened = False
    tools, constraint = output_rules(body, kind, tool_parser, tokenizer)
    if kind == "chat":
        ids, opened = _chat_ids(_messages(body), tokenizer, max_context, _template_kwargs(body, tokenizer),
                                tools, tool_parser)
        prompts = [(ids, None)]
    else:
        prompts = _prompts(body, tokenizer, vocab_size, max_context)
    _check_unsupported(body)
    key, max_tokens = _max_tokens(body, kind, max(len(ids) for ids, _ in prompts), max_context)
    for ids, _ in prompts:
        _check_fits(ids, max(1, max_tokens), max_context, key)
    fields = controls.sampling_fields(body, kind, vocab_size, max(1, max_tokens), prompts[0][0])
    echo = controls.echo(body, kind)
    sampling = Sampling(max_tokens=max(1, max_tokens), temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                        top_p=_top_p(body), seed=_seed(body),
                        stop_token_ids=_stop_token_ids(body, tokenizer, vocab_size),
                        prompt_logprobs=fields["logprobs"] if echo else None,
                        grammar=constraint.grammar if constraint is not None else None, **fields)
    stream, include_usage = _stream(body)
    return_ids = body.get("return_token_ids", False)
    if not isinstance(return_ids, bool):
        raise bad_request("'return_token_ids' must be a boolean", "return_token_ids")
    texts = [(ids, _echo_text(text, ids, tokenizer) if echo else None) for ids, text in prompts]
    return ApiRequest(kind, model, prompts[0][0], sampling, _stop(body), stream, include_usage, return_ids, opened,
                      echo_text=texts[0][1], is_prompt_only=max_tokens == 0, more_prompts=tuple(texts[1:]),
                      tools=tools, constraint=constraint)


def _check_fits(prompt_ids: tuple[int, ...], max_tokens: int, max_context: int, key: str) -> None:
    if not prompt_ids:
        raise bad_request("the prompt is empty", "prompt")
    if len(prompt_ids) + max_tokens > max_context:
        raise bad_request(f"This model's maximum context length is {max_context} tokens. However, you "
                          f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the "
                          f"prompt, {max_tokens} for the completion). Please reduce the length of the "
                          f"prompt or the completion.", key if len(prompt_ids) < max_context else "prompt")


def _echo_text(text: str | None, ids: tuple[int, ...], tokenizer: Tokenizer) -> str:
    """What echo puts first: the prompt as sent, or its token ids decoded."""
    return text if text is not None else tokenizer.decode(list(ids))


def _stream(body: dict) -> tuple[bool, bool]:
    """``stream``, and ``stream_options.include_usage``; null stands for false in both. Stream
    options without a stream are a 400, as OpenAI's and vLLM's (the client meant to stream)."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    if options is None:
        options = {}
    elif not stream:
        raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                          "stream_options")
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    include_usage = options.get("include_usage", False)
    if include_usage is None:
        include_usage = False
    if not isinstance(include_usage, bool):
        raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options")
    return stream, include_usage


def unknown_model(model: str, served: str, *, status: int = 400) -> ApiError:
    # OpenAI answers an unknown model with 404 model_not_found; in a completion the issue asks for
    # 400, as vLLM does (404 stays for GET /v1/models/{model}). OpenAI's code lets clients tell.
    return ApiError(status, f"The model '{short(model)}' does not exist. This server serves '{served}'.",
                    code="model_not_found", param="model")


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required and must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise bad_request(f"messages[{i}] must be an object with 'role' one of {', '.join(CHAT_ROLES)}",
                              "messages")
        if m.get("content") is None and m["role"] != "assistant":
            # OpenAI's 400: only an assistant's content may be absent (its tool calls say it all);
            # a missing user message was a prompt with an empty turn, answered as if asked.
            raise bad_request(f"messages[{i}].content is required in a {m['role']} message", "messages")
        out.append(message_fields(m, i, _content(m.get("content"), i)))
    return out


def _template_kwargs(body: dict, tokenizer: Tokenizer) -> dict[str, Any] | None:
    """``chat_template_kwargs`` (as vLLM and SGLang take it): more variables for the model's chat
    template, e.g. ``{"enable_thinking": false}`` for Qwen3. Names must be identifiers and may not
    be one the server sets (``ChatTemplate.reserved``: the messages, the generation prompt, the
    special tokens, the template's functions)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    template = tokenizer.chat_template
    reserved = template.reserved() if template is not None else frozenset()
    for name in kwargs:
        if not name.isidentifier() or name in reserved:
            raise bad_request(f"chat_template_kwargs may not set '{short(name)}': a template variable the "
                              f"server sets, or not a name", "chat_template_kwargs")
    return kwargs


def _content(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _prompts(body: dict, tokenizer: Tokenizer, vocab_size: int,
             max_context: int) -> list[tuple[tuple[int, ...], str | None]]:
    """Each prompt's token ids, and its text when it came as text: one prompt, or a batch (a list
    of strings or of token-id lists)."""
    if "prompt" not in body:
        raise bad_request("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_BATCH:
            raise bad_request(f"a batch holds at most {MAX_BATCH} prompts, got {len(prompt)}", "prompt")
        return [_prompt(p, tokenizer, vocab_size, max_context) for p in prompt]
    return [_prompt(prompt, tokenizer, vocab_size, max_context)]


def _prompt(prompt: Any, tokenizer: Tokenizer, vocab_size: int, max_context: int) -> tuple[tuple[int, ...], str | None]:
    if isinstance(prompt, str):
        return _encode(tokenizer, prompt, max_context), prompt
    if isinstance(prompt, TextAfterIds):
        return (*prompt.prefix, *_encode(tokenizer, prompt.text, max_context, add_special_tokens=False)), None
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "prompt")
        return tuple(prompt), None
    raise bad_request("'prompt' must be a string, a list of token ids, or a list of either", "prompt")


UNSUPPORTED = ("suffix", "functions")


def _check_unsupported(body: dict) -> None:
    """Refuse what would be silently wrong (asked for, not done) rather than ignore it."""
    for key in UNSUPPORTED:
        if body.get(key) not in (None, False, 0, 0.0, {}, []):
            raise bad_request(f"'{key}' is not supported by this server", key)


def _max_tokens(body: dict, kind: str, num_prompt: int, max_context: int) -> tuple[str, int]:
    """The field that says how long the answer may be, and its value (0: a completion's prompt alone)."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(key)
    if value is None:
        default = DEFAULT_CHAT_TOKENS if kind == "chat" else DEFAULT_COMPLETION_TOKENS
        return key, max(1, min(default, max_context - num_prompt))
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer", key)
    least = 0 if kind == "completion" else 1
    if value < least:
        raise bad_request(f"'{key}' must be at least {least}, got {value}", key)
    return key, value


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise bad_request(f"'{key}' must be a number in [{lo:g}, {hi:g}], got {short(value)}", key)
    return float(value)


def _top_p(body: dict) -> float:
    value = _number(body, "top_p", 1.0, 0.0, 1.0)
    if value == 0.0:
        raise bad_request("'top_p' must be in (0, 1]", "top_p")
    return value


def _seed(body: dict) -> int | None:
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_request("'seed' must be an integer", "seed")
    return seed


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise bad_request("'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    return tuple(stop)


def _stop_token_ids(body: dict, tokenizer: Tokenizer, vocab_size: int) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        ids = []
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise bad_request(f"'stop_token_ids' must be a list of token ids in [0, {vocab_size})", "stop_token_ids")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request("'ignore_eos' must be a boolean", "ignore_eos")
    if not ignore_eos:   # every id the checkpoint says ends a turn, not only the first
        ids = [*ids, *(e for e in tokenizer.eos_token_ids if e not in ids)]
    return tuple(ids)
