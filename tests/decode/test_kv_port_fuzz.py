"""The decode KV data port fuzzed over real sockets (issue #15): random KV frames (real ops, metas
naming a reserved transfer or not, announced lengths up to 2^64, truncated anywhere) after a valid
or missing HELLO never grow the decode's memory beyond a bound, and a well-behaved prefill's
request completes after every one."""

from __future__ import annotations

import itertools
import socket

import aiohttp
import orjson
import pytest
import torch
from hypothesis import strategies as st

from mooncake_lite.model.args import PRESETS
from mooncake_lite.transfer.client import FrameClient
from mooncake_lite.transfer.framing import HEADER, MAGIC, VERSION
from mooncake_lite.transfer.kv_stream import OP_KV_END, OP_KV_LAYER, layer_frame_meta
from tests.transfer.peers import fuzz_peak_rss

pytestmark = pytest.mark.timeout(180)

ARGS = PRESETS["tiny"]
TOKEN_BYTES = 2 * ARGS.num_kv_heads * ARGS.head_dim * 4    # float32
METAS = st.fixed_dictionaries({}, optional={
    "tid": st.one_of(st.just("victim"), st.just("victim"), st.text(max_size=8), st.integers(-2**63, 2**63 - 1)),
    "layer": st.one_of(st.integers(-1, ARGS.num_layers), st.text(max_size=2)),
    "start": st.integers(-1, 40),
    "n": st.one_of(st.integers(-1, 40), st.integers(-1, 40), st.integers(0, 2**40)),
    "first_token": st.one_of(st.none(), st.integers(-1, 400), st.booleans()),
    "reason": st.text(max_size=20),
})
@st.composite
def frames(draw) -> bytes:
    """One KV frame, mostly well-formed enough to reach the receiver's checks: its payload length
    is usually what its "n" says (or a little off, or gigabytes), its meta length usually true."""
    op = draw(st.sampled_from([20, 20, 20, 20, 21, 22, 23, 0, 99]))
    meta_dict = draw(METAS)
    meta = orjson.dumps(meta_dict)
    n = meta_dict.get("n")
    exact = n * TOKEN_BYTES if isinstance(n, int) and 0 <= n < 1 << 20 else 0
    announced = draw(st.one_of(st.just(exact), st.just(exact), st.integers(0, 2 * exact + 10),
                               st.sampled_from([8 << 30, 2**64 - 1, 1 << 20, 64 << 20])))
    meta_len = draw(st.one_of(st.just(len(meta)), st.just(len(meta)), st.just(len(meta)),
                              st.integers(0, 2**32 - 1), st.sampled_from([4 << 20, 65 << 10])))
    sent = draw(st.one_of(st.just(announced), st.integers(0, 200_000)))
    return HEADER.pack(MAGIC, VERSION, op, 0, 9, meta_len, announced) + meta + b"\xab" * min(sent, announced, 1 << 20)


FRAMES = frames()
STREAMS = st.tuples(st.sampled_from(["hello", "hello", "hello", "none", "wrong"]), st.lists(FRAMES, min_size=1, max_size=4))


async def generate(session: aiohttp.ClientSession, url: str, rid: str, prompt_len: int) -> aiohttp.ClientResponse:
    body = {"request_id": rid, "transfer_id": rid, "prompt_len": prompt_len, "sampling": {"max_tokens": 2},
            "kv_timeout_s": 10}
    resp = await session.post(f"{url}/v1/generate", data=orjson.dumps(body),
                              headers={"X-Mooncake-Token": "tok"})
    assert resp.status == 200, await resp.text()
    return resp


async def good_request(session, url: str, data: str, rid: str) -> None:
    """A prefill's whole job for one request: reserve, stream every layer, END, read the tokens."""
    resp = await generate(session, url, rid, 12)
    host, port = data.rsplit(":", 1)
    client = await FrameClient.connect(host, int(port), token="tok", name="prefill")
    try:
        for layer in range(ARGS.num_layers):
            kv = torch.randn(2, 12, ARGS.num_kv_heads, ARGS.head_dim)
            await client.request(OP_KV_LAYER, layer_frame_meta(rid, layer, 0, 12), [kv.numpy().tobytes()])
        await client.request(OP_KV_END, {"tid": rid, "first_layer": 0, "end_layer": ARGS.num_layers,
                                         "first_token": 5})
    finally:
        await client.close()
    lines = [orjson.loads(line) for line in (await resp.read()).splitlines() if line.strip()]
    assert lines[-1]["finish_reason"] in ("length", "stop"), lines


def reserve_victim(url: str) -> socket.socket:
    """POST /v1/generate for transfer "victim" on a plain socket kept open for the whole test, so
    the fuzzer's frames that name it reach the real checks (the request lives while we hold it)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = orjson.dumps({"request_id": "victim", "transfer_id": "victim", "prompt_len": 40,
                         "sampling": {"max_tokens": 2}, "kv_timeout_s": 300})
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nX-Mooncake-Token: tok\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert sock.recv(4096).startswith(b"HTTP/1.1 200"), "victim not reserved"
    return sock


def test_random_kv_frames_never_grow_the_decode_nor_stop_a_good_prefill(role_procs):
    decode = role_procs("decode", "--port", "0", "--data-port", "0", "--model", "tiny", "--num-blocks", "64",
                        "--block-size", "8", "--no-profile", "--cluster-token", "tok")
    url, data = decode.url(), decode.addresses["data"]
    host, port = data.rsplit(":", 1)
    ids = itertools.count()

    async def good() -> None:
        async with aiohttp.ClientSession() as session:
            await good_request(session, url, data, f"good-{next(ids)}")

    victim = reserve_victim(url)
    try:
        peak = fuzz_peak_rss(STREAMS, host, int(port), decode.pid, good)
    finally:
        victim.close()
    assert peak < 50 << 20, f"decode RSS grew by {peak >> 20} MiB"
    assert "Traceback" not in decode.logs()
