"""Logging set-up shared by every role: plain text by default, one JSON object per line on request.

Every line logged while a request is being handled carries its id (``[cmpl-…]`` after the
logger name in text, ``"request_id"`` in JSON), so ``grep`` of one id across the roles' journals
tells that request's story. The id lives in a context variable: the handler where a request
enters a role calls :func:`set_request_id`, the tasks it starts inherit it, and
``common/service.py`` clears it when the handler returns (a keep-alive connection's next
request starts without one). Work that outlives its handler (a decode batch step) names the
request in the message, or passes ``extra={"request_id": rid}``.
"""

from __future__ import annotations

import contextvars
import logging
import sys

import orjson

_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("mooncake_request_id", default=None)


def set_request_id(request_id: str | None) -> contextvars.Token:
    """Tag this task's log lines (and those of tasks it starts from now on) with ``request_id``."""
    return _REQUEST_ID.set(request_id)


def reset_request_id(token: contextvars.Token) -> None:
    _REQUEST_ID.reset(token)


def current_request_id() -> str | None:
    return _REQUEST_ID.get()


class RequestIdFilter(logging.Filter):
    """Gives every record a ``request_id`` (an explicit ``extra`` wins over the context's) and
    ``request_tag``, the text format's ``" [id]"`` (empty without one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = getattr(record, "request_id", None) or _REQUEST_ID.get()
        record.request_id = rid
        record.request_tag = f" [{rid}]" if rid else ""
        return True


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": record.created, "level": record.levelname, "role": self.role,
                 "logger": record.name, "msg": record.getMessage()}
        rid = getattr(record, "request_id", None)
        if rid:
            entry["request_id"] = rid
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def setup_logging(role: str, level: str = "info", json_logs: bool = False) -> None:
    """Route all logs to stderr (stdout carries the machine-readable ready line)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    if json_logs:
        handler.setFormatter(JsonFormatter(role))
    else:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s {role} %(levelname)s %(name)s%(request_tag)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
