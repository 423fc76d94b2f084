"""OpenAI-shaped errors. Raised anywhere on the request path, turned into a JSON response (or an
SSE error event once a stream has started) by the API layer; :func:`json_errors_middleware`
gives what aiohttp answers on its own (404, 405, 413, an undecodable body) the same shape."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from mooncake_lite.common.auth import openai_error

log = logging.getLogger(__name__)

# Request headers: aiohttp's parser is given room (PARSER_FIELD_BYTES per line, app.py) so that
# headers past these limits reach the middleware and get a JSON 431 instead of a plain-text 400.
MAX_HEADER_FIELD_BYTES = 8190
MAX_HEADER_BYTES = 16 * 1024
PARSER_FIELD_BYTES = 32 * 1024
# Public API bodies may come gzip- or deflate-compressed (api/body.py decodes them, capping the decoded
# size: a zip bomb is a 413); any other Content-Encoding, or one on another path, is a 415.
BODY_ENCODINGS = frozenset({"gzip", "deflate"})
DECODING_PREFIX = "/v1/"
MAX_ECHO_CHARS = 64
_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
          415: "unsupported_content_encoding", 431: "request_headers_too_large"}


class ApiError(Exception):
    """An error the client should see: HTTP ``status`` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, err_type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.code}}

    def response(self) -> web.Response:
        resp = web.json_response(self.body(), status=self.status)
        resp.headers.update(self.headers)
        return resp


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


class Rejected(ApiError):
    """429, OpenAI's rate-limit shape: the request is refused for now, to be retried after
    ``Retry-After`` seconds. ``cause`` is why, as the per-tenant rejections metric names it: a
    tenant's limit (``rate``, ``concurrency``, ``priority``), the SLOs (``ttft``, ``tbt``), no
    decode room (``no-decode``), or an instance that refused it (``upstream-refused``)."""

    def __init__(self, message: str, retry_after_s: int, cause: str, *,
                 code: str = "rate_limit_exceeded", headers: Mapping[str, str] | None = None) -> None:
        super().__init__(429, message, err_type="rate_limit_error", code=code,
                         headers={"Retry-After": str(retry_after_s), **(headers or {})})
        self.cause = cause


def unavailable(message: str) -> ApiError:
    """503: no live instance can take the request."""
    return ApiError(503, message, err_type="server_error", code="service_unavailable",
                    headers={"Retry-After": "1"})


def shutting_down(message: str) -> ApiError:
    """503: the conductor itself is stopping (its drain); not the instances' fault, so not a 502.
    ``Retry-After``: a restarted or another conductor can take the request."""
    return ApiError(503, message, err_type="server_error", code="conductor_shutting_down",
                    headers={"Retry-After": "1"})


def upstream_failed(message: str) -> ApiError:
    """502: a prefill or decode instance failed or died while serving the request."""
    return ApiError(502, message, err_type="server_error", code="upstream_error")


def short(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """``value`` for an error message: its repr for non-strings, cut to ``limit`` characters
    with the full length named (a client's 100 KB model name is not echoed back whole)."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    status = exc.status
    default_text = f"{status}: {exc.reason}"
    if exc.text and exc.text != default_text:
        message = exc.text
    else:
        message = f"{exc.reason}: {request.method} {short(request.path, 200)}"
    if status == 405 and isinstance(exc, web.HTTPMethodNotAllowed):
        message += f" (allowed: {', '.join(sorted(exc.allowed_methods))})"
    err = ApiError(status, message, err_type="invalid_request_error" if status < 500 else "server_error",
                   code=_CODES.get(status, exc.reason.lower().replace(" ", "_")),
                   headers={k: v for k, v in exc.headers.items()
                            if k.lower() not in ("content-type", "content-length")})
    return err.response()


def _header_problem(request: web.Request) -> str | None:
    total = 0
    for name, value in request.raw_headers:
        size = len(name) + len(value) + 4
        if size > MAX_HEADER_FIELD_BYTES:
            return f"header {short(name.decode('latin-1'))} is {size} bytes (at most {MAX_HEADER_FIELD_BYTES})"
        total += size
    if total > MAX_HEADER_BYTES:
        return f"the request headers are {total} bytes (at most {MAX_HEADER_BYTES})"
    return None


@web.middleware
async def json_errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost conductor middleware: every error aiohttp would answer in plain text (no route,
    wrong method, body too large, body not decodable) answers in OpenAI's JSON shape instead;
    oversized headers are a 431 and unsupported ``Content-Encoding`` a 415, before any handler."""
    problem = _header_problem(request)
    if problem is not None:
        return ApiError(431, problem, code=_CODES[431]).response()
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity") and \
            (encoding not in BODY_ENCODINGS or not request.path.startswith(DECODING_PREFIX)):
        allowed = "plain, gzip or deflate" if request.path.startswith(DECODING_PREFIX) else "plain"
        return ApiError(415, f"Content-Encoding {short(encoding)!r} is not supported here; send the body "
                             f"{allowed}", code=_CODES[415]).response()
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_error(request, exc)
    except web.RequestPayloadError as exc:   # e.g. broken chunked framing
        detail = " ".join(str(exc).split())
        log.info("refused %s %s: bad request body: %s", request.method, request.path, detail)
        return ApiError(400, f"the request body could not be read ({short(detail, 200)})",
                        code="invalid_body").response()


__all__ = ["ApiError", "Rejected", "bad_request", "json_errors_middleware", "openai_error", "short",
           "shutting_down", "unavailable", "upstream_failed"]
