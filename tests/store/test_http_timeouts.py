"""Every role's HTTP server (common/service.py) cuts slow clients (issue #15, finding 7): headers
must arrive within the header timeout, a body within the body timeout, and a well-behaved client
on another connection is served meanwhile."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from aiohttp import web

from mooncake_lite.common.service import bound_port, start_site

pytestmark = pytest.mark.timeout(60)


async def echo(request: web.Request) -> web.Response:
    return web.Response(body=await request.read())


async def slow(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    resp = web.StreamResponse()
    await resp.prepare(request)
    for _ in range(4):          # a streaming answer longer than both timeouts is not cut
        await asyncio.sleep(0.3)
        await resp.write(body)
    await resp.write_eof()
    return resp


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_post("/slow", slow)
    return app


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> tuple[bool, bytes]:
    got = b""
    try:
        async with asyncio.timeout(seconds):
            while chunk := await reader.read(65536):
                got += chunk
        return True, got
    except ConnectionError:
        return True, got
    except asyncio.TimeoutError:
        return False, got


async def test_slow_headers_and_slow_bodies_are_cut_and_others_served(caplog):
    runner, site = await start_site(make_app(), "127.0.0.1", 0, header_timeout=0.5, body_timeout=0.5)
    port = bound_port(site)
    try:
        # Half a request line and headers, then nothing.
        r1, w1 = await asyncio.open_connection("127.0.0.1", port)
        w1.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Len")
        # Complete headers, then 10 of 100 body bytes.
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        w2.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"b" * 10)
        # Headers dripped so that each byte comes before the timeout: still cut.
        r3, w3 = await asyncio.open_connection("127.0.0.1", port)

        async def drip():
            for byte in b"POST /echo HTTP/1.1\r\nHost: x\r\n":
                if w3.is_closing():
                    return
                w3.write(bytes([byte]))
                await asyncio.sleep(0.1)

        dripper = asyncio.create_task(drip())
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/slow", data=b"s") as resp:
                assert await resp.read() == b"ssss"          # 1.2 s of streaming, not cut
            with caplog.at_level(logging.WARNING):
                results = await asyncio.gather(closed_within(r1, 3), closed_within(r2, 3), closed_within(r3, 3))
            assert [closed for closed, _ in results] == [True, True, True]
            async with session.post(f"http://127.0.0.1:{port}/echo", data=b"hello") as resp:
                assert await resp.read() == b"hello"
        dripper.cancel()
        assert "body" in caplog.text
        for w in (w1, w2, w3):
            w.close()
    finally:
        await runner.cleanup()
