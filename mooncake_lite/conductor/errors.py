"""OpenAI-shaped errors. Raised anywhere on the request path, turned into a JSON response (or an
SSE error event once a stream has started) by the API layer."""

from __future__ import annotations

from aiohttp import web

from mooncake_lite.common.auth import openai_error


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


def rejected(message: str, retry_after_s: int) -> ApiError:
    """429: the cluster cannot meet the SLOs for this request now (or decode refused it)."""
    return ApiError(429, message, err_type="rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(retry_after_s)})


def unavailable(message: str) -> ApiError:
    """503: no live instance can take the request."""
    return ApiError(503, message, err_type="server_error", code="service_unavailable",
                    headers={"Retry-After": "1"})


def upstream_failed(message: str) -> ApiError:
    """502: a prefill or decode instance failed or died while serving the request."""
    return ApiError(502, message, err_type="server_error", code="upstream_error")


__all__ = ["ApiError", "bad_request", "openai_error", "rejected", "unavailable", "upstream_failed"]
