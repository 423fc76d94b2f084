"""What the public API's handlers share, one per app (``app[API]``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from mooncake_lite.conductor.api.body import max_body_bytes
from mooncake_lite.conductor.api.structured import GrammarChecker
from mooncake_lite.conductor.services import Services
from mooncake_lite.model.tokenizer import Tokenizer


@dataclass
class ApiState:
    svc: Services
    tokenizer: Tokenizer
    served: tuple[str, ...]        # model names accepted in requests; the first is advertised
    vocab_size: int
    max_context: int
    created: int
    # Rewrites a body naming a cached context (contexts/routes.py) before it is parsed.
    rewrite_body: Callable[[web.Request, object, str], object] | None = None
    reasoning: bool = False        # --reasoning-parser think: chat answers' reasoning apart (reasoning.py)
    tool_parser: str = "hermes"    # --tool-call-parser: the served model's tool-call format (tools.py)
    grammars: GrammarChecker | None = None   # compiles each new grammar once, bounded (structured.py)
    body_limit: int = field(init=False)   # the largest (decoded) body a request can need; 413 past it

    def __post_init__(self) -> None:
        self.body_limit = max_body_bytes(self.max_context, self.tokenizer)


API: web.AppKey[ApiState] = web.AppKey("api", ApiState)
