"""Security basics: the public API key and the shared cluster token, as aiohttp middlewares.

Two secrets, two audiences:

* ``--api-key`` guards the public OpenAI-compatible API. Clients send
  ``Authorization: Bearer KEY``; anything else gets a 401 with an OpenAI-style JSON error, so
  the official ``openai`` client raises ``AuthenticationError`` as it would against OpenAI.
* ``--cluster-token`` guards every internal connection. Internal HTTP clients send
  ``X-Mooncake-Token: TOKEN`` (build the headers with :func:`cluster_headers`); anything else
  gets a 403. Data sockets run their own handshake and compare with :func:`token_matches`.

Both factories accept ``None`` (no secret configured) and then return a pass-through
middleware, so a role can always install them. ``/health`` and ``/metrics`` stay open by
default (load balancers and Prometheus probe them; they carry no request data). ``prefixes``
limits a middleware to some paths: the conductor serves the public API under ``/v1/`` and its
internal endpoints under ``/internal/`` on one port, so it scopes each secret to its paths.

A refused request never reaches a handler and never raises inside the server.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

log = logging.getLogger(__name__)

TOKEN_HEADER = "X-Mooncake-Token"
DEFAULT_EXEMPT = ("/health", "/metrics")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


def token_matches(expected: str | None, presented: str | bytes | None) -> bool:
    """Constant-time comparison; no secret configured means everyone matches."""
    if expected is None:
        return True
    if presented is None:
        return False
    if isinstance(presented, str):
        presented = presented.encode()
    return hmac.compare_digest(expected.encode(), presented)


def cluster_headers(token: str | None) -> dict[str, str]:
    """Headers an internal HTTP client adds to every request (empty without a token)."""
    return {TOKEN_HEADER: token} if token else {}


def api_key_headers(key: str | None) -> dict[str, str]:
    """Headers a public API client adds (empty without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def _is_guarded(path: str, exempt: Sequence[str], prefixes: Sequence[str] | None) -> bool:
    if path in exempt:
        return False
    return prefixes is None or any(path.startswith(p) for p in prefixes)


def bearer_key(request: web.Request) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header; None when there is none."""
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def openai_error(status: int, message: str, *, err_type: str, code: str | None) -> web.Response:
    """A JSON error body shaped like OpenAI's: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    return web.json_response(body, status=status)


def api_key_middleware(key: str | None, *, exempt: Sequence[str] = DEFAULT_EXEMPT,
                       prefixes: Sequence[str] | None = None) -> Middleware:
    """Require ``Authorization: Bearer KEY`` on guarded paths; 401 (OpenAI-style JSON) otherwise."""
    if key is not None and not key:
        raise ValueError("an API key must not be empty (use None for no key)")

    def refusal(presented: str | None) -> web.Response:
        message = ("You didn't provide an API key. Send it as 'Authorization: Bearer KEY'."
                   if presented is None else "Incorrect API key provided.")
        resp = openai_error(401, message, err_type="invalid_request_error", code="invalid_api_key")
        resp.headers["WWW-Authenticate"] = "Bearer"
        return resp

    return _secret_middleware(key, "API key", bearer_key, refusal, exempt, prefixes)


def cluster_token_middleware(token: str | None, *, exempt: Sequence[str] = DEFAULT_EXEMPT,
                             prefixes: Sequence[str] | None = None) -> Middleware:
    """Require the ``X-Mooncake-Token`` header on guarded paths; 403 (JSON error) otherwise."""
    if token is not None and not token:
        raise ValueError("a cluster token must not be empty (use None for no token)")

    def refusal(presented: str | None) -> web.Response:
        return openai_error(403, f"this endpoint needs the cluster token in the {TOKEN_HEADER} header",
                            err_type="permission_error", code="invalid_cluster_token")

    return _secret_middleware(token, "cluster token", lambda request: request.headers.get(TOKEN_HEADER),
                              refusal, exempt, prefixes)


def _secret_middleware(secret: str | None, what: str, presented_by: Callable[[web.Request], str | None],
                       refusal: Callable[[str | None], web.Response], exempt: Sequence[str],
                       prefixes: Sequence[str] | None) -> Middleware:
    """Pass a request on a guarded path only if ``presented_by(request)`` matches ``secret``
    (None: nothing is guarded); else log it and answer ``refusal(what was presented)``."""
    exempt, prefixes = tuple(exempt), tuple(prefixes) if prefixes is not None else None

    @web.middleware
    async def check_secret(request: web.Request, handler: Handler) -> web.StreamResponse:
        if secret is None or not _is_guarded(request.path, exempt, prefixes):
            return await handler(request)
        presented = presented_by(request)
        if token_matches(secret, presented):
            return await handler(request)
        log.warning("refused %s %s from %s: %s %s", request.method, request.path, request.remote,
                    "missing" if presented is None else "wrong", what)
        return refusal(presented)

    return check_secret
