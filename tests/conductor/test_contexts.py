"""Cached contexts (issue #18) through a live cluster of real processes on 127.0.0.1: create ->
use (cached_tokens covers the context, tokens equal the reference) -> list -> extend -> delete ->
use fails cleanly; the held blocks survive eviction pressure on both store tiers and a kill -9
of the store; quota, expiry and unknown ids answer clear errors."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from mooncake_lite.common.ports import free_port
from mooncake_lite.conductor.contexts.book import Context, ContextBook
from mooncake_lite.conductor.api.errors import ApiError
from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.model.weights import build_model
from mooncake_lite.store.client import StoreClient
from tests.store.helpers import block, chain

pytestmark = pytest.mark.slow   # a whole cluster of real processes

BLOCK = 16
COMMON = ("--block-size", str(BLOCK), "--log-level", "warning")
SLOT = 16 << 10     # one block of the tiny preset (4 layers x 2 x 16 tokens x 2 heads x 16 x fp32)
KEY = "sk-tenant-a"


def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            if json.load(resp).get("ready"):
                return
        time.sleep(0.1)
    raise AssertionError("cluster not ready")


@pytest.fixture
def cluster(role_procs, tmp_path):
    conductor = role_procs("conductor", "--port", "0", "--model", "tiny", "--admission", "none",
                           "--api-key", KEY, "--context-quota", str(6 * BLOCK), *COMMON)
    url = conductor.url()
    # 16 DRAM slots and an SSD of about 30 blocks: a few dozen other blocks overflow both tiers.
    store_args = ("--port", str(free_port()), "--data-port", str(free_port()), "--dram", str(16 * SLOT),
                  "--slot-bytes", str(SLOT), "--ssd-dir", str(tmp_path), "--ssd", str(30 * (SLOT + 64)),
                  "--no-ssd-fsync", "--conductor", url, "--event-interval", "0.05", *COMMON)
    store = role_procs("store", *store_args)
    instance = ("--conductor", url, "--model", "tiny", "--threads", "1", "--heartbeat-interval", "0.5",
                "--no-profile", *COMMON)
    with ThreadPoolExecutor(2) as pool:
        started = [pool.submit(role_procs, "prefill", "--store", store.addresses["data"], *instance),
                   pool.submit(role_procs, "decode", "--data-port", "0", *instance)]
        for f in started:
            f.result()
    _wait_ready(url)
    return url, store, store_args


def _complete(client: openai.OpenAI, prompt: list[int], **extra) -> tuple[list[int], int]:
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    return out.choices[0].model_extra["token_ids"], out.usage.prompt_tokens_details.cached_tokens


async def _pressure(store_data: str, num_blocks: int) -> None:
    """Other blocks put straight into the store, more than both tiers hold."""
    client = await StoreClient.connect(store_data)
    try:
        for key in chain(num_blocks, seed=99):
            await client.put([key], [block(key, SLOT)], num_layers=4)
    finally:
        await client.close()


def test_tenants_see_only_their_own_contexts():
    book = ContextBook()
    book.contexts["ctx-1"] = Context("ctx-1", "key-a", "prompt", "tiny", (1,) * BLOCK, (), (b"k" * 16,), "s:1",
                                     0, expires_at=100.0, cached_tokens=BLOCK)
    assert book.get("key-a", "ctx-1", now=50.0).context_id == "ctx-1"
    assert [c.context_id for c in book.of("key-b", now=50.0)] == [] and book.used_tokens("key-b") == 0
    with pytest.raises(ApiError) as other:
        book.get("key-b", "ctx-1", now=50.0)
    assert other.value.status == 404 and other.value.code == "context_not_found"
    with pytest.raises(ApiError) as expired:
        book.get("key-a", "ctx-1", now=100.0)
    assert expired.value.status == 410 and book.used_tokens("key-a") == 0
    with pytest.raises(ApiError) as still_other:   # an expired context of another tenant stays unknown
        book.get("key-b", "ctx-1", now=100.0)
    assert still_other.value.status == 404
    book.reserve("key-b", 32)                      # a creation in flight counts against the quota
    assert book.used_tokens("key-b") == 32
    book.reserve("key-b", 32, -1)
    assert book.used_tokens("key-b") == 0 and book.creating == {}


def test_context_lifecycle_pins_and_errors(cluster, role_procs):
    url, store, store_args = cluster
    model = build_model("tiny", seed=0)
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    doc = [(7 * i + 3) % 300 + 10 for i in range(5 * BLOCK + 5)]      # 5 full blocks and a bit
    question = [42, 43, 44, 45, 46]

    # create: prefilled once (no decode), its 5 full blocks held (the calls docs/contexts.md shows)
    ctx = client.post("/contexts", cast_to=object, body={"model": "tiny", "prompt": doc, "ttl": 60, "name": "doc"})
    assert ctx["object"] == "context" and ctx["num_tokens"] == len(doc) and ctx["cached_tokens"] == 5 * BLOCK

    # use by id: the context's tokens go first, and prefill reuses every held block
    want = reference_greedy(model, doc + question, 6)
    tokens, cached = _complete(client, question, context_id=ctx["id"])
    assert tokens == want and cached >= ctx["cached_tokens"]
    tokens, cached = _complete(client, doc + question)                 # the same prefix, no id
    assert tokens == want and cached >= ctx["cached_tokens"]
    stream = client.completions.create(model="tiny", prompt=question, max_tokens=2, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"context_id": ctx["id"]})
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens >= ctx["cached_tokens"]

    # list, get, extend
    assert [c["id"] for c in client.get("/contexts", cast_to=object)["data"]] == [ctx["id"]]
    assert client.get(f"/contexts/{ctx['id']}", cast_to=object)["name"] == "doc"
    longer = client.patch(f"/contexts/{ctx['id']}", cast_to=object, body={"ttl": 600})
    assert longer["expires_at"] >= ctx["expires_at"] + 500

    # over the quota (6 blocks): a second context of 2 blocks is refused, clearly
    with pytest.raises(openai.RateLimitError) as over:
        client.post("/contexts", cast_to=object, body={"model": "tiny", "prompt": question * 7})
    assert over.value.code == "context_quota_exceeded"

    # eviction pressure on both tiers, then kill -9 of the store and a restart on its ports
    asyncio.run(_pressure(store.addresses["data"], 60))
    tokens, cached = _complete(client, question, context_id=ctx["id"])
    assert tokens == want and cached >= ctx["cached_tokens"]
    store.send(signal.SIGKILL)
    assert store.stop() != 0
    role_procs("store", *store_args)
    asyncio.run(_pressure(store.addresses["data"], 60))
    deadline = time.monotonic() + 20      # the prefill notices the new store on its next request
    while True:
        tokens, cached = _complete(client, question, context_id=ctx["id"])
        if cached >= ctx["cached_tokens"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert tokens == want and cached >= ctx["cached_tokens"]

    # delete: gone for good
    gone = client.delete(f"/contexts/{ctx['id']}", cast_to=object)
    assert gone == {"id": ctx["id"], "object": "context.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError) as unknown:
        _complete(client, question, context_id=ctx["id"])
    assert unknown.value.code == "context_not_found"
    with pytest.raises(openai.NotFoundError):
        client.patch(f"/contexts/{ctx['id']}", cast_to=object, body={"ttl": 5})

    # chat: a context of messages, used by a chat completion; then it expires
    system = {"role": "system", "content": "You answer questions about this text."}
    chat = client.post("/contexts", cast_to=object, body={"model": "tiny", "ttl": 1.5, "messages": [system]})
    assert chat["kind"] == "messages" and chat["cached_tokens"] >= BLOCK, chat
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Why?"}],
                                         max_tokens=2, extra_body={"context_id": chat["id"]})
    assert out.usage.prompt_tokens_details.cached_tokens >= chat["cached_tokens"]
    with pytest.raises(openai.BadRequestError, match="made from messages"):
        _complete(client, question, context_id=chat["id"])
    time.sleep(1.6)
    with pytest.raises(openai.APIStatusError) as expired:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Why?"}],
                                       max_tokens=2, extra_body={"context_id": chat["id"]})
    assert expired.value.status_code == 410 and expired.value.code == "context_expired"
    client.close()


async def test_a_request_naming_a_context_goes_where_its_blocks_are(make_cluster):
    """Algorithm 1 prices the held blocks: with two idle prefill instances, the one whose store
    holds the context's blocks serves a request naming it (a local hit on every block). Another
    tenant (another API key) neither sees nor uses it."""
    from mooncake_lite.common.hashing import prefix_hash
    from mooncake_lite.conductor.contexts.routes import CONTEXTS
    from mooncake_lite.scheduler.tenants import parse_tenants
    from tests.conductor import fakes

    tenants = parse_tenants({"a": {"api_keys": ["k-a"]}, "b": {"api_keys": ["k-b"]}})
    cluster = await make_cluster(prefill=2, decode=1, tenants=tenants)
    ids = tuple(range(10, 22))                                  # 3 blocks of 4
    keys = tuple(prefix_hash(ids, 4, 0))
    cluster.app[CONTEXTS].book.contexts["ctx-x"] = Context("ctx-x", "a", "prompt", "tiny", ids, (), keys,
                                                           "store1:1", 0, time.time() + 60, cached_tokens=12)
    status, _ = await fakes.block_events(cluster.session, cluster.url, "store1:1", stored=keys, full=True)
    assert status == 200
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "context_id": "ctx-x"}
    async with cluster.session.post(cluster.url + "/v1/completions", json=body,
                                    headers={"Authorization": "Bearer k-a"}) as resp:
        assert resp.status == 200, await resp.text()
        out = await resp.json()
        assert resp.headers["X-Mooncake-Prefill"] == "p1" and resp.headers["X-Mooncake-Route"] == "local-hit"
        assert resp.headers["X-Mooncake-Reused-Blocks"] == "3"
    assert out["usage"]["prompt_tokens"] == len(ids) + 3
    other = {"Authorization": "Bearer k-b"}
    async with cluster.session.post(cluster.url + "/v1/completions", json=body, headers=other) as resp:
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "context_not_found"
    async with cluster.session.get(cluster.url + "/v1/contexts", headers=other) as resp:
        assert (await resp.json())["data"] == []
    async with cluster.session.get(cluster.url + "/v1/contexts", headers={"Authorization": "Bearer k-a"}) as resp:
        assert [c["id"] for c in (await resp.json())["data"]] == ["ctx-x"]


async def test_the_kv_sink_takes_every_stages_frames_and_ends_on_the_first_token():
    """A prefill-only job's KV goes to the conductor's sink: each CPP stage streams its own layers
    and ends with an END; the transfer completes on the END carrying the first token. Frames of
    a transfer nobody expects are refused, as decode refuses them."""
    from mooncake_lite.conductor.contexts.kv_sink import KVSink
    from mooncake_lite.transfer.client import FrameClient, RemoteError
    from mooncake_lite.transfer.kv_stream import OP_KV_END, OP_KV_LAYER, layer_frame_meta

    sink = KVSink()
    await sink.start("127.0.0.1", None, token="secret")
    host, port = sink.address.rsplit(":", 1)
    stages = [await FrameClient.connect(host, int(port), token="secret") for _ in range(2)]
    try:
        done = sink.expect("t1")
        payload = bytes(3 << 20)                    # larger than the sink's scratch buffer
        for layer, stage in enumerate(stages):
            await stage.request(OP_KV_LAYER, layer_frame_meta("t1", layer, 0, 4), [payload])
        await stages[0].request(OP_KV_END, {"tid": "t1", "first_layer": 0, "end_layer": 1, "first_token": None})
        assert not done.done()
        await stages[1].request(OP_KV_END, {"tid": "t1", "first_layer": 1, "end_layer": 2, "first_token": 7})
        assert (await done)["first_token"] == 7 and sink.num_bytes == 2 * len(payload)
        sink.forget("t1")
        with pytest.raises(RemoteError, match="unknown_transfer"):
            await stages[0].request(OP_KV_LAYER, layer_frame_meta("t1", 0, 0, 4), [payload])
    finally:
        for stage in stages:
            await stage.close()
        await sink.stop()


def _prompt_context(cluster, ids: tuple[int, ...] = tuple(range(10, 22))) -> None:
    from mooncake_lite.common.hashing import prefix_hash
    from mooncake_lite.conductor.contexts.routes import CONTEXTS
    cluster.app[CONTEXTS].book.contexts["ctx-x"] = Context("ctx-x", "default", "prompt", "tiny", ids, (),
                                                           tuple(prefix_hash(ids, 4, 0)), "store0:1", 0,
                                                           time.time() + 60, cached_tokens=len(ids))


@pytest.mark.parametrize("prompt", ["x" * 200_000, ["x" * 4096]])
async def test_a_text_too_long_after_a_context_is_refused_untokenized(make_cluster, prompt):
    """The prompt of a request naming a context has the main path's bound: text that cannot fit
    the context is the context-length 400 before the tokenizer sees it."""
    from mooncake_lite.conductor.api.state import API
    from tests.conductor.test_prompt_bounds import CountingTokenizer

    cluster = await make_cluster()
    _prompt_context(cluster)
    tok = cluster.app[API].tokenizer = CountingTokenizer()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "context_id": "ctx-x"}
    async with cluster.session.post(cluster.url + "/v1/completions", json=body) as resp:
        out = await resp.json()
        assert resp.status == 400 and "maximum context length is 4096" in out["error"]["message"], out
    assert out["error"]["param"] == "prompt" and all(n < 4096 for n in tok.encoded), tok.encoded
    assert all(not inst.requests for inst in cluster.instances.values())
    # a short text after the context is still tokenized (without a second BOS) and served
    body["prompt"] = "hi"
    async with cluster.session.post(cluster.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200 and (await resp.json())["usage"]["prompt_tokens"] == 12 + 2
    assert tok.encoded[-1] == 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/contexts"])
async def test_a_long_text_is_tokenized_off_the_event_loop(make_cluster, path):
    """A long body naming a context, or creating one, is tokenized in a thread: /health answers
    meanwhile (on the event loop, the gate would hold it 5 s and the test would see that)."""
    from mooncake_lite.conductor.api.body import OFF_LOOP_BYTES
    from mooncake_lite.conductor.api.state import API
    from tests.conductor.test_prompt_bounds import GatedTokenizer

    cluster = await make_cluster()
    _prompt_context(cluster)
    tok = cluster.app[API].tokenizer = GatedTokenizer()
    body = {"model": "tiny", "prompt": "x" * 3000, "max_tokens": 2, "user": "u" * OFF_LOOP_BYTES}
    # a completion naming the context is served; a creation is refused on its ttl, after tokenizing
    body.update({"context_id": "ctx-x"} if path == "/v1/completions" else {"ttl": -1})
    pending = asyncio.create_task(cluster.session.post(cluster.url + path, json=body))
    assert await asyncio.to_thread(tok.inside.wait, 10)
    async with cluster.session.get(cluster.url + "/health") as resp:
        assert resp.status == 200
    tok.release.set()
    async with await pending as resp:
        out = await resp.json()
        assert resp.status == 200 if path == "/v1/completions" else out["error"]["param"] == "ttl", out
    assert not tok.waited_out


@pytest.mark.parametrize("body", [{"prompt": "x" * 200_000},
                                  {"messages": [{"role": "user", "content": "x" * 200_000}]}])
async def test_a_context_too_long_to_fit_is_refused_untokenized(make_cluster, body):
    """Creating a context whose text cannot fit the model's context is the context-length 400
    before the tokenizer sees the text (the main path's bound)."""
    from mooncake_lite.conductor.api.state import API
    from tests.conductor.test_prompt_bounds import CountingTokenizer

    cluster = await make_cluster()
    tok = cluster.app[API].tokenizer = CountingTokenizer()
    async with cluster.session.post(cluster.url + "/v1/contexts", json={"model": "tiny", **body}) as resp:
        out = await resp.json()
        assert resp.status == 400 and "maximum context length is 4096" in out["error"]["message"], out
    assert all(n < 4096 for n in tok.encoded), tok.encoded
