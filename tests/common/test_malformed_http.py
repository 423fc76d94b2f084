"""What aiohttp answers by itself (requests it cannot parse, uncaught exceptions) comes back as
OpenAI-style JSON from every role's server (``common/service.start_site``), over raw sockets."""

import asyncio

import orjson
import pytest
from aiohttp import web

from mooncake_lite.common.service import bound_port, start_site

pytestmark = pytest.mark.timeout(30)


async def boom(request: web.Request) -> web.Response:
    raise RuntimeError("a bug in a handler")


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


@pytest.fixture
async def port():
    app = web.Application()
    app.router.add_get("/ok", ok)
    app.router.add_get("/boom", boom)
    runner, site = await start_site(app, "127.0.0.1", 0)
    try:
        yield bound_port(site)
    finally:
        await runner.cleanup()


async def exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw``, read until the server closes; (status, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)   # EOF: the server closed the connection
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, body


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",                                          # bad request line
    b"GET /ok HTTP/9.9\r\n\r\n",                                  # bad version
    b"GET /ok HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",      # bad header
    b"GET /ok HTTP/1.1\r\nContent-Length: -5\r\n\r\n",            # bad length
    b"G\x00T /ok HTTP/1.1\r\n\r\n" + b"x" * 5000,                 # binary noise
])
async def test_unparseable_requests_get_json_400_and_a_closed_connection(port, raw):
    status, headers, body = await exchange(port, raw)
    assert status == 400
    assert headers["content-type"].startswith("application/json")
    error = orjson.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "bad_request"
    assert error["message"] and len(error["message"]) <= 200 and error["param"] is None
    # and exchange() read to EOF: the server closed the connection behind its answer


async def test_an_uncaught_exception_is_a_json_500_without_the_traceback(port):
    status, headers, body = await exchange(port, b"GET /boom HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 500 and headers["content-type"].startswith("application/json")
    error = orjson.loads(body)["error"]
    assert error["type"] == "server_error" and "a bug in a handler" not in error["message"]


async def test_well_formed_requests_are_untouched(port):
    status, headers, body = await exchange(port, b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 200 and orjson.loads(body) == {"ok": True}
