"""Issue #15 (finding 3): every bad request is a clean 4xx in OpenAI's error format — including
the ones aiohttp answers on its own (404, 405, 413, oversized headers), compressed bodies, and
fields whose type is almost right. Nothing reaches an instance, and the server is unharmed."""

from __future__ import annotations

import gzip
import zlib

import orjson
import pytest

GOOD = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def _openai_error(body: dict) -> dict:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


async def _error_of(r) -> dict:
    assert 400 <= r.status < 500, (r.status, await r.text())
    assert r.content_type == "application/json", (r.content_type, await r.text())
    return _openai_error(await r.json())


async def _still_serves(cluster) -> None:
    async with cluster.session.post(cluster.url + "/v1/completions", json=GOOD) as r:
        assert r.status == 200, await r.text()


def _nothing_dispatched(cluster) -> None:
    assert all(not inst.requests for inst in cluster.instances.values())


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/nope", 404),
    ("POST", "/nope", 404),
    ("GET", "/v1/completions", 405),
    ("DELETE", "/v1/chat/completions", 405),
])
async def test_unknown_routes_answer_json(make_cluster, method, path, status):
    cluster = await make_cluster()
    async with cluster.session.request(method, cluster.url + path) as r:
        assert r.status == status
        err = await _error_of(r)
        if status == 405:
            assert "POST" in r.headers.get("Allow", "")
    assert err["type"] == "invalid_request_error"
    await _still_serves(cluster)


async def test_body_over_the_limit_is_413_json(make_cluster):
    cluster = await make_cluster()
    body = b'{"model": "tiny", "prompt": "' + b"x" * (64 * 2**20 + 10) + b'"}'
    async with cluster.session.post(cluster.url + "/v1/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as r:
        assert r.status == 413
        await _error_of(r)
    _nothing_dispatched(cluster)
    await _still_serves(cluster)


async def test_oversized_headers_are_431_json(make_cluster):
    cluster = await make_cluster()
    async with cluster.session.post(cluster.url + "/v1/completions", json=GOOD,
                                    headers={"X-Padding": "p" * 20_000}) as r:
        assert r.status == 431
        await _error_of(r)
    _nothing_dispatched(cluster)
    await _still_serves(cluster)


@pytest.mark.parametrize("encoding, compress", [
    ("gzip", gzip.compress),
    ("deflate", zlib.compress),
])
async def test_compressed_bodies_are_decoded(make_cluster, encoding, compress):
    cluster = await make_cluster()
    async with cluster.session.post(cluster.url + "/v1/completions", data=compress(orjson.dumps(GOOD)),
                                    headers={"Content-Type": "application/json",
                                             "Content-Encoding": encoding}) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_plain_body_labelled_compressed_is_400_json(make_cluster, encoding):
    cluster = await make_cluster()
    async with cluster.session.post(cluster.url + "/v1/completions", data=orjson.dumps(GOOD),
                                    headers={"Content-Type": "application/json",
                                             "Content-Encoding": encoding}) as r:
        assert r.status == 400
        err = await _error_of(r)
    assert encoding in err["message"]
    _nothing_dispatched(cluster)
    await _still_serves(cluster)


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "x-custom", "gzip, gzip"])
async def test_other_encodings_are_415_json(make_cluster, encoding):
    cluster = await make_cluster()
    async with cluster.session.post(cluster.url + "/v1/completions", data=b"{}",
                                    headers={"Content-Type": "application/json",
                                             "Content-Encoding": encoding}) as r:
        assert r.status == 415
        await _error_of(r)
    _nothing_dispatched(cluster)
    await _still_serves(cluster)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_zip_bomb_is_413_json(make_cluster, encoding):
    # ~100 KB on the wire, 80 MiB once decoded: over the 64 MiB body limit. Made before the
    # cluster starts (compressing blocks the loop that heartbeats the fake instances).
    body = b'{"model": "tiny", "prompt": "' + b" " * (80 * 2**20) + b'"}'
    bomb = gzip.compress(body, compresslevel=9) if encoding == "gzip" else zlib.compress(body, 9)
    del body
    assert len(bomb) < 2**20
    cluster = await make_cluster()
    async with cluster.session.post(cluster.url + "/v1/completions", data=bomb,
                                    headers={"Content-Type": "application/json", "Content-Encoding": encoding}) as r:
        assert r.status == 413
        await _error_of(r)
    _nothing_dispatched(cluster)
    await _still_serves(cluster)


@pytest.mark.parametrize("extra, param", [
    ({"best_of": True}, "best_of"),
    ({"best_of": 1.0}, "best_of"),
    ({"best_of": 2}, "best_of"),
    ({"n": 1.0}, "n"),
    ({"n": True}, "n"),
    ({"stop_token_ids": ""}, "stop_token_ids"),
    ({"stop_token_ids": 0}, "stop_token_ids"),
    ({"stop_token_ids": {}}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"stream": True, "stream_options": ""}, "stream_options"),
    ({"stream_options": {"include_usage": False}}, "stream_options"),   # without a stream, as OpenAI's
    ({"stream": False, "stream_options": {}}, "stream_options"),
])
async def test_almost_right_types_are_refused(make_cluster, extra, param):
    cluster = await make_cluster()
    async with cluster.session.post(cluster.url + "/v1/completions", json={**GOOD, **extra}) as r:
        assert r.status == 400
        err = await _error_of(r)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    _nothing_dispatched(cluster)


@pytest.mark.parametrize("extra", [{"best_of": 1}, {"n": 1}, {"n": None}, {"stop_token_ids": None},
                                   {"stop_token_ids": []}, {"stream_options": None},
                                   {"stream": True, "stream_options": {"include_usage": False}}])
async def test_right_types_still_accepted(make_cluster, extra):
    cluster = await make_cluster()
    async with cluster.session.post(cluster.url + "/v1/completions", json={**GOOD, **extra}) as r:
        assert r.status == 200, await r.text()


async def test_long_model_name_is_not_echoed_whole(make_cluster):
    cluster = await make_cluster()
    name = "m" * 100_000
    async with cluster.session.post(cluster.url + "/v1/completions", json={**GOOD, "model": name}) as r:
        assert r.status == 400
        err = await _error_of(r)
    assert err["code"] == "model_not_found"
    assert len(err["message"]) < 500 and "mmmm" in err["message"]


@pytest.mark.parametrize("field", ["temperature", "top_p"])
async def test_tiny_sampling_values_are_served(make_cluster, field):
    # The fake instances do not sample; what matters here is that the value reaches them intact
    # (tests/model/test_sampling.py checks the sampler itself is safe for it).
    cluster = await make_cluster()
    async with cluster.session.post(cluster.url + "/v1/completions", json={**GOOD, field: 1e-300}) as r:
        assert r.status == 200, await r.text()


def test_decode_body_formats_and_limits():
    from mooncake_lite.conductor.api.body import decode_body
    from mooncake_lite.conductor.api.errors import ApiError
    data = b'{"a": "' + b"x" * 1000 + b'"}'
    assert decode_body(gzip.compress(data), "gzip", 10_000) == data
    assert decode_body(gzip.compress(data[:10]) + gzip.compress(data[10:]), "gzip", 10_000) == data  # 2 members
    assert decode_body(zlib.compress(data), "deflate", 10_000) == data
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert decode_body(raw.compress(data) + raw.flush(), "deflate", 10_000) == data   # raw deflate
    assert decode_body(gzip.compress(data), "gzip", len(data)) == data                # exactly at the limit
    for bad, status in [(gzip.compress(data), 413), (gzip.compress(data)[:-12], 400), (data, 400)]:
        with pytest.raises(ApiError) as info:
            decode_body(bad, "gzip", len(data) - 1 if status == 413 else 10_000)
        assert info.value.status == status
    with pytest.raises(ApiError) as info:
        decode_body(zlib.compress(data) + b"junk", "deflate", 10_000)
    assert info.value.status == 400
