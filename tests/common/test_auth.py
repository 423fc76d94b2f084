import pytest
from aiohttp import web

from mooncake_lite.common.auth import (TOKEN_HEADER, api_key_headers, api_key_middleware, cluster_headers,
                                       cluster_token_middleware, token_matches)


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"path": request.path})


def make_app(*middlewares) -> web.Application:
    app = web.Application(middlewares=list(middlewares))
    for path in ("/health", "/metrics", "/v1/completions", "/internal/v1/register", "/v1/generate"):
        app.router.add_route("*", path, _ok)
    return app


async def test_api_key_refuses_missing_and_wrong_keys_openai_style(aiohttp_client):
    client = await aiohttp_client(make_app(api_key_middleware("sk-good")))
    for headers, needle in (({}, "didn't provide"), ({"Authorization": "Bearer sk-bad"}, "Incorrect"),
                            ({"Authorization": "Basic sk-good"}, "didn't provide"),
                            ({"Authorization": "Bearer "}, "didn't provide")):
        resp = await client.post("/v1/completions", headers=headers, json={})
        assert resp.status == 401, headers
        body = await resp.json()
        assert body["error"]["code"] == "invalid_api_key" and needle in body["error"]["message"]
        assert body["error"]["type"] == "invalid_request_error"
    resp = await client.post("/v1/completions", headers=api_key_headers("sk-good"), json={})
    assert resp.status == 200 and (await resp.json())["path"] == "/v1/completions"


async def test_health_is_exempt_and_none_means_open(aiohttp_client):
    client = await aiohttp_client(make_app(api_key_middleware("k"), cluster_token_middleware("t")))
    assert (await client.get("/health")).status == 200
    assert (await client.get("/metrics")).status == 200
    open_client = await aiohttp_client(make_app(api_key_middleware(None), cluster_token_middleware(None)))
    assert (await open_client.post("/v1/completions")).status == 200


async def test_cluster_token_refuses_with_403(aiohttp_client):
    client = await aiohttp_client(make_app(cluster_token_middleware("s3cret")))
    for headers in ({}, {TOKEN_HEADER: "nope"}, {TOKEN_HEADER: ""}, {"Authorization": "Bearer s3cret"}):
        resp = await client.post("/v1/generate", headers=headers)
        assert resp.status == 403
        assert (await resp.json())["error"]["code"] == "invalid_cluster_token"
    assert (await client.post("/v1/generate", headers=cluster_headers("s3cret"))).status == 200


async def test_conductor_layout_scopes_each_secret_to_its_paths(aiohttp_client):
    app = make_app(api_key_middleware("k", prefixes=("/v1/",)),
                   cluster_token_middleware("t", prefixes=("/internal/",)))
    client = await aiohttp_client(app)
    # internal endpoint: the token alone is enough, the API key alone is not
    assert (await client.post("/internal/v1/register", headers=cluster_headers("t"))).status == 200
    assert (await client.post("/internal/v1/register", headers=api_key_headers("k"))).status == 403
    # public endpoint: the API key alone is enough, the token alone is not
    assert (await client.post("/v1/completions", headers=api_key_headers("k"))).status == 200
    assert (await client.post("/v1/completions", headers=cluster_headers("t"))).status == 401


async def test_server_survives_a_burst_of_refusals(aiohttp_client):
    client = await aiohttp_client(make_app(cluster_token_middleware("t")))
    for i in range(50):
        resp = await client.post("/v1/generate", headers={TOKEN_HEADER: f"guess-{i}"}, data=b"\x00" * 64)
        assert resp.status == 403
    assert (await client.post("/v1/generate", headers=cluster_headers("t"))).status == 200


def test_token_helpers():
    assert cluster_headers(None) == {} and cluster_headers("t") == {TOKEN_HEADER: "t"}
    assert api_key_headers("k") == {"Authorization": "Bearer k"} and api_key_headers(None) == {}
    assert token_matches(None, None) and token_matches("a", b"a") and token_matches("a", "a")
    assert not token_matches("a", None) and not token_matches("a", "b") and not token_matches("a", "aa")
    with pytest.raises(ValueError):
        api_key_middleware("")
    with pytest.raises(ValueError):
        cluster_token_middleware("")
