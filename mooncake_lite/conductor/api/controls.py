"""The sampling controls of an OpenAI body, checked into the wire ``Sampling`` fields they set:
``n``, ``logprobs`` / ``top_logprobs`` (and ``echo``'s prompt logprobs), ``presence_penalty``,
``frequency_penalty``, vLLM's ``repetition_penalty`` and ``min_tokens``, ``logit_bias``.
Each bad value is a 400 naming its field (``params.py`` parses the rest of the body)."""

from __future__ import annotations

from typing import Any

from mooncake_lite.conductor.api.errors import bad_request, short

MAX_N = 128                  # choices per prompt (vLLM has no bound; each holds its own KV)
MAX_TOP_LOGPROBS = 20        # OpenAI's bound (model/sampling.MAX_TOP_LOGPROBS says the same)
MAX_LOGIT_BIAS = 300         # entries, as OpenAI
MAX_REPETITION_PENALTY = 10.0


def choices(body: dict) -> int:
    """``n``: an integer in [1, MAX_N]; ``best_of`` other than 1 (or n, when it changes nothing) is refused."""
    n = body.get("n")
    if n is None:
        n = 1
    if type(n) is not int or not 1 <= n <= MAX_N:
        raise bad_request(f"'n' must be an integer in [1, {MAX_N}], got {short(n)}", "n")
    best_of = body.get("best_of")
    if best_of is not None and not (type(best_of) is int and best_of in (1, n)):
        raise bad_request(f"'best_of' is not supported (only 1, or n itself), got {short(best_of)}", "best_of")
    return n


def logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives each token's logprobs list (None: no logprobs). Chat: ``logprobs``
    a boolean, ``top_logprobs`` an integer in [0, 20] that needs it; completions: ``logprobs``
    an integer in [0, 20]."""
    value = body.get("logprobs")
    if kind == "chat":
        top = body.get("top_logprobs")
        if value is not None and not isinstance(value, bool):
            raise bad_request("'logprobs' must be a boolean", "logprobs")
        if top is not None and (type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise bad_request(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {short(top)}",
                              "top_logprobs")
        if top and not value:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if value else None
    if value is None or value is False:
        return None
    if type(value) is not int or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {short(value)}",
                          "logprobs")
    return value


def echo(body: dict, kind: str) -> bool:
    value = body.get("echo")
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request("'echo' must be a boolean", "echo")
    if value and kind == "chat":
        raise bad_request("'echo' is supported in /v1/completions only", "echo")
    return value


def penalties(body: dict) -> dict[str, float]:
    """``presence_penalty`` and ``frequency_penalty`` in [-2, 2] (OpenAI), ``repetition_penalty``
    in (0, 10] (vLLM's, ``transformers``' rule)."""
    out = {}
    for key in ("presence_penalty", "frequency_penalty"):
        value = body.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise bad_request(f"'{key}' must be a number in [-2, 2], got {short(value)}", key)
            out[key] = float(value)
    value = body.get("repetition_penalty")
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 < value <= MAX_REPETITION_PENALTY:
            raise bad_request(f"'repetition_penalty' must be a number in (0, {MAX_REPETITION_PENALTY:g}], "
                              f"got {short(value)}", "repetition_penalty")
        out["repetition_penalty"] = float(value)
    return out


def min_tokens(body: dict, max_tokens: int) -> int:
    value = body.get("min_tokens")
    if value is None:
        return 0
    if type(value) is not int or not 0 <= value <= max_tokens:
        raise bad_request(f"'min_tokens' must be an integer in [0, max_tokens = {max_tokens}], got {short(value)}",
                          "min_tokens")
    return value


def logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """``logit_bias``: token ids (as JSON object keys, strings) to a bias in [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return (), ()
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids", "logit_bias")
    ids, values = [], []
    for key, value in bias.items():
        if not key.isdecimal() or not 0 <= int(key) < vocab_size:
            raise bad_request(f"logit_bias key {short(key)} is not a token id in [0, {vocab_size})", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"logit_bias[{key}] must be a number in [-100, 100], got {short(value)}",
                              "logit_bias")
        ids.append(int(key))
        values.append(float(value))
    return tuple(ids), tuple(values)


def sampling_fields(body: dict, kind: str, vocab_size: int, max_tokens: int,
                    prompt_ids: tuple[int, ...]) -> dict[str, Any]:
    """Every ``Sampling`` field these controls set (``prompt_logprobs`` is the caller's: echo)."""
    bias_ids, bias_values = logit_bias(body, vocab_size)
    fields = {"n": choices(body), "logprobs": logprobs(body, kind), "min_tokens": min_tokens(body, max_tokens),
              "logit_bias_ids": bias_ids, "logit_bias_values": bias_values, **penalties(body)}
    if fields.get("repetition_penalty", 1.0) != 1.0:   # decode never sees the prompt's ids otherwise
        fields["penalty_ids"] = tuple(sorted(set(prompt_ids)))
    return fields
