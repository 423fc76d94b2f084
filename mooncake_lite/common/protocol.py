"""Control-plane wire messages between conductor, prefill, decode and store (HTTP + JSON).

One frozen dataclass per message. Bulk KV never travels here: it goes as raw binary frames over
the transfer sockets (``mooncake_lite/transfer``). Keys travel as hex strings.

Request path (see docs/architecture.md):
  conductor --POST /v1/generate  GenerateRequest--> decode   (NDJSON stream of TokenEvent back)
  conductor --POST /v1/prefill   PrefillRequest --> prefill  (PrefillResult back once token 1 is sampled; the KV stream ends after)
  prefill   --KV frames (transfer_id)-----------> decode data port; the end frame carries the first token
  conductor --POST /v1/abort     AbortRequest   --> prefill / decode on client disconnect
Membership:
  prefill/decode --POST /internal/v1/register  Register  --> conductor (409 + error on mismatch)
  prefill/decode --POST /internal/v1/heartbeat Heartbeat --> conductor every heartbeat interval
  store          --POST /internal/v1/block_events BlockEvents --> conductor

``loads`` decodes any message strictly; ``parse_token_event`` and ``parse_prefill_result`` are its
fast paths for the conductor's per-token and per-request hot path.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from mooncake_lite.common.cost_report import CostReport, FlatCost
from mooncake_lite.common.heartbeat import (MAX_ID_CHARS, MAX_LEFT_S, Heartbeat, InstanceLoad,  # noqa: F401
                                            RunningPrefill)      # (the heartbeat's messages, decoded here)
from mooncake_lite.common.store_events import BlockEvents, StoreCapacity  # noqa: F401 (the stores' messages, decoded here)

M = TypeVar("M")
# The furthest ahead a decode takes a request's KV to be due (GenerateRequest.kv_in_s): an hour.
MAX_KV_IN_S = 3600.0
MAX_PLACER_CHARS = 64     # PrefillRequest.placer: a conductor's name
MAX_PACK_CAP = 1 << 24     # the largest PrefillRequest.pack_cap, Register.prefill_chunk: more than a forward holds
MAX_BUSY_SCALE = 16.0      # the largest Register.busy_scale: a correction factor's bound (CorrectionConfig.max_factor)


class ProtocolError(ValueError):
    """A message is malformed: wrong JSON, missing or mistyped fields."""


@dataclass(frozen=True)
class Sampling:
    """How a request's tokens are chosen (``model/sampling.py`` says what each field does)."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1                            # choices from one prefill; choice i draws from seed + i
    logprobs: int | None = None           # None: none; k: the token's and the k likeliest
    prompt_logprobs: int | None = None    # the same for every prompt position after the first
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias_ids: tuple[int, ...] = ()
    logit_bias_values: tuple[float, ...] = ()
    penalty_ids: tuple[int, ...] = ()     # the prompt's distinct ids, when repetition_penalty != 1
    # The grammar the output must match, as llguidance grammar text (model/grammar.py); None: free.
    grammar: str | None = None
    # A continued request (a decode died mid-stream): the last ``num_generated`` prompt ids are this
    # choice's output so far, already relayed to the client. Penalties, min/max_tokens, the grammar
    # and the seeded generator's position count them as output, not as prompt. ``max_tokens`` and
    # ``min_tokens`` stay the ORIGINAL request's (they count these ids; the decode reserves room for
    # max_tokens - num_generated more), so 0 <= num_generated < max_tokens and < the prompt's length;
    # ``penalty_ids`` may be the original prompt's or the whole new prompt's (output ids count anyway).
    # A choice i > 0 of an n > 1 request is continued alone as n = 1 with seed + i (draws come from
    # (seed + index, position)). The prefill's END frame hands the ids to the decode (kv_stream.py).
    num_generated: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the raw logits, and the ``top_ids`` likeliest ids' (best first)."""
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class GenerateRequest:
    """Conductor -> decode: reserve room for a request whose KV will arrive under ``transfer_id``,
    predicted in ``kv_in_s`` seconds (the decision's TTFT; None: unknown, judged as joining now)."""
    request_id: str
    transfer_id: str
    prompt_len: int
    sampling: Sampling
    kv_timeout_s: float = 30.0
    kv_in_s: float | None = None

    def __post_init__(self) -> None:
        if self.kv_in_s is not None and not 0.0 <= self.kv_in_s <= MAX_KV_IN_S:   # NaN fails both
            raise ValueError(f"kv_in_s must be within [0, {MAX_KV_IN_S:g}] seconds, got {self.kv_in_s}")


@dataclass(frozen=True)
class TokenEvent:
    """Decode -> conductor, one NDJSON line per event. ``token`` events start at the *second*
    generated token (the first comes from prefill); ``index`` is the choice (``Sampling.n``) it
    belongs to, ``logprob`` set when asked for. Each choice's last line has ``finish_reason``
    ("stop", "length", "abort", "error") and ``error`` when it failed; an abort or error ends
    every choice at once (one line, ``index`` 0)."""
    token: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    index: int = 0
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class PrefillRequest:
    """Conductor -> prefill. ``prefix_keys`` are the keys the conductor expects to be reusable
    (the instance verifies against its store); ``migrate_from`` names a peer store to pull
    ``migrate_keys`` from first (hot-spot migration)."""
    request_id: str
    transfer_id: str
    token_ids: tuple[int, ...]
    decode_data: str                      # "host:port" of the decode instance's data socket
    sampling: Sampling
    prefix_keys: tuple[str, ...] = ()
    migrate_from: str | None = None
    migrate_keys: tuple[str, ...] = ()
    pack_cap: int = 0     # its packed forward's most uncached tokens (its TTFT SLO's; 0: the budget's)
    # Where its conductor (``placer``: a name of that conductor process) placed it among its requests
    # (0: not said): a job placed earlier that reaches the instance later passes it uncounted
    # (scheduler/waiting.placed_after), as the conductor's view has it.
    placed: int = 0
    placer: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.pack_cap <= MAX_PACK_CAP:
            raise ValueError(f"pack_cap must be within [0, {MAX_PACK_CAP}] tokens, got {self.pack_cap}")
        if not 0 <= self.placed < 1 << 62 or len(self.placer) > MAX_PLACER_CHARS:
            raise ValueError(f"placed must be within [0, 2^62) and placer at most {MAX_PLACER_CHARS} characters, "
                             f"got {self.placed} and {len(self.placer)}")


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token: int
    num_prefix_tokens: int                # tokens whose KV was loaded instead of computed
    num_computed_tokens: int
    timings: dict[str, float] = field(default_factory=dict)
    first_tokens: tuple[int, ...] = ()    # n > 1: every choice's token 1 (first_token is choice 0's)
    first_logprobs: tuple[TokenLogprob, ...] = ()    # asked for: one per choice
    prompt_logprobs: tuple[TokenLogprob, ...] = ()   # asked for: prompt positions 1.. (of the tokens there)


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Register:
    role: str                             # "prefill" | "decode"
    instance_id: str
    http: str                             # "host:port"
    data: str | None                      # data socket "host:port" (decode: where KV streams to)
    store: str | None                     # the store data "host:port" this instance reads/writes
    model: str
    block_size: int
    hash_seed: int
    kv_bytes_per_token: int
    max_context: int
    # Its self-fitted cost models (an older instance's flat form: FlatCost, read with ``role``).
    cost: CostReport | FlatCost = field(default_factory=CostReport)
    pipeline_stages: int = 1
    # Prefill batching: uncached tokens a forward packs (--prefill-batch-tokens within the chunk; 0: none).
    pack_tokens: int = 0
    # Queue order: at most this many later, shorter prompts pass a queued one (queue_order.py; 0: FIFO).
    queue_overtakes: int = 0
    # Tensor-parallel ranks it runs on (--tensor-parallel; 1: one process); its cost model's degree.
    tensor_parallel: int = 1
    # A prefill's --prefill-chunk: a longer prompt runs (and is priced) as the sum of its chunks; 0: not
    # said (an older instance), priced as one pass.
    prefill_chunk: int = 0
    # A prefill that borrows idle CPUs: its chunks' time on its own threads over with the borrowed
    # ones, timed at start-up (prefill/profiling.busy_scale): what a busy decode beside it, taking
    # its CPUs back, costs its forwards before any was measured. 1: none (or not said).
    busy_scale: float = 1.0
    # A prefill that reads PrefillRequest.placed (and so may be sent it: an older one refuses it).
    reads_placed: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.prefill_chunk <= MAX_PACK_CAP:
            raise ValueError(f"prefill_chunk must be within [0, {MAX_PACK_CAP}] tokens, got {self.prefill_chunk}")
        if not 1.0 <= self.busy_scale <= MAX_BUSY_SCALE:     # (NaN fails both)
            raise ValueError(f"busy_scale must be within [1, {MAX_BUSY_SCALE:g}], got {self.busy_scale}")


def dumps(msg: Any) -> bytes:
    if isinstance(msg, Heartbeat):   # its load leaves out what the instance does not report
        return orjson.dumps(msg, default=_sparse_load, option=orjson.OPT_PASSTHROUGH_DATACLASS)
    if isinstance(msg, PrefillRequest) and not (msg.pack_cap and msg.placed):   # readable by an older prefill
        left_out = ("pack_cap",) * (not msg.pack_cap) + ("placed", "placer") * (not msg.placed)
        return orjson.dumps({k: v for k, v in msg.__dict__.items() if k not in left_out})
    return orjson.dumps(msg)  # orjson serialises dataclasses natively (no asdict copy)


def _sparse_load(obj: Any) -> dict[str, Any]:
    if isinstance(obj, InstanceLoad):
        return obj.reported()
    if isinstance(obj, Heartbeat) and obj.running is None:   # readable by a conductor from before the field
        return {k: v for k, v in obj.__dict__.items() if k != "running"}
    return obj.__dict__      # the Heartbeat itself, its running job


@functools.cache
def _fields(cls: type) -> tuple[tuple[dataclasses.Field, Any], ...]:
    # get_type_hints re-evaluates string annotations on every call; messages are decoded per token.
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls))


def from_dict(cls: type[M], data: Any) -> M:
    """Build ``cls`` from decoded JSON, checking field names and scalar types."""
    if not isinstance(data, dict):
        raise ProtocolError(f"{cls.__name__}: expected a JSON object")
    fields = _fields(cls)
    unknown = set(data) - {f.name for f, _ in fields}
    if unknown:
        raise ProtocolError(f"{cls.__name__}: unknown field(s) {sorted(unknown)}")
    kwargs = {}
    for f, hint in fields:
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{cls.__name__}: missing field {f.name!r}")
            continue
        kwargs[f.name] = _coerce(hint, data[f.name], f"{cls.__name__}.{f.name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{cls.__name__}: {exc}") from None


def loads(cls: type[M], raw: bytes | str) -> M:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"{cls.__name__}: invalid JSON: {exc}") from None
    return from_dict(cls, data)


# Fast paths of ``loads`` for the conductor's hot path: ``from_dict`` walks every field's type hint
# (~0.5 ms a message) and a streamed request decodes one TokenEvent line per token. Each accepts
# and refuses exactly what ``loads`` does (tests/common/test_protocol_fast_paths.py), handing
# anything unusual to ``from_dict`` so the error names the bad field.

_TOKEN_EVENT_FIELDS = frozenset(("token", "finish_reason", "error", "index", "logprob"))
_RESULT_INTS = ("first_token", "num_prefix_tokens", "num_computed_tokens")


def parse_token_event(line: bytes) -> TokenEvent:
    """``loads(TokenEvent, line)`` with the same checks, once per streamed token."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"TokenEvent: invalid JSON: {exc}") from None
    if not isinstance(data, dict) or not data.keys() <= _TOKEN_EVENT_FIELDS:
        return from_dict(TokenEvent, data)
    token, reason, error = data.get("token"), data.get("finish_reason"), data.get("error")
    index, logprob = data.get("index", 0), data.get("logprob")
    if (token is not None and (type(token) is not int)) or (reason is not None and type(reason) is not str) \
            or (error is not None and type(error) is not str) or type(index) is not int:
        return from_dict(TokenEvent, data)
    if logprob is not None:
        logprob = _fast_logprob(logprob)
        if logprob is None:
            return from_dict(TokenEvent, data)
    return TokenEvent(token, reason, error, index, logprob)


def _fast_logprob(data: object) -> TokenLogprob | None:
    """A TokenLogprob when ``data`` is exactly one (numbers where floats go); None: let from_dict say."""
    if not isinstance(data, dict) or not data.keys() <= {"logprob", "top_ids", "top_logprobs"}:
        return None
    value, ids, values = data.get("logprob"), data.get("top_ids", []), data.get("top_logprobs", [])
    if type(value) not in (float, int) or type(ids) is not list or type(values) is not list \
            or not set(map(type, ids)) <= {int} or not set(map(type, values)) <= {float, int}:
        return None
    return TokenLogprob(float(value), tuple(ids), tuple(map(float, values)))


def parse_prefill_result(body: bytes) -> PrefillResult:
    """``loads(PrefillResult, body)`` with the same checks, once per request."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"PrefillResult: invalid JSON: {exc}") from None
    if isinstance(data, dict) and data.keys() <= {"request_id", "timings", *_RESULT_INTS} \
            and type(data.get("request_id")) is str and all(type(data.get(k)) is int for k in _RESULT_INTS) \
            and isinstance(data.get("timings", {}), dict):
        return PrefillResult(data["request_id"], data["first_token"], data["num_prefix_tokens"],
                             data["num_computed_tokens"], data.get("timings", {}))
    return from_dict(PrefillResult, data)


def error_text(body: bytes) -> str:
    """The message of an error answer (``{"error": ...}``, OpenAI-style or plain text), shortened."""
    try:
        data = orjson.loads(body)
        if isinstance(data, dict):
            err = data.get("error", data)
            if isinstance(err, dict):
                return str(err.get("message", err))[:500]
            return str(err)[:500]
    except orjson.JSONDecodeError:
        pass
    return body[:500].decode("utf-8", "replace") or "(empty body)"


_EXACT_ITEMS = (int, str, bool)


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        decode = getattr(hint, "from_wire", None)   # a part with its own decoding (CostReport)
        if decode is None:
            return from_dict(hint, value)
        try:
            return decode(value, where)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
    if origin is tuple:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list")
        # Token ids and block keys come by the thousand: items all of the exact scalar type are
        # checked in one C pass; anything else goes item by item (and fails with the item's type).
        if args[0] in _EXACT_ITEMS and set(map(type, value)) <= {args[0]}:
            return tuple(value)
        return tuple(_coerce(args[0], v, where) for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected an object")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (not isinstance(value, hint) or
                                            (hint is int and isinstance(value, bool))):
        raise ProtocolError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
    return value
