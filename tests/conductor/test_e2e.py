"""All four roles as real processes on 127.0.0.1: tokens through the conductor's OpenAI API
equal the monolithic greedy reference, and a shared prefix is served from the store."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import importlib.util
import json
import urllib.request
import openai
import pytest

from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.model.tokenizer import ByteTokenizer
from mooncake_lite.model.weights import build_model

pytestmark = pytest.mark.slow   # whole clusters of real processes

BLOCK = "16"
COMMON = ("--block-size", BLOCK, "--log-level", "warning")
HAS_REMOTE_STORE = importlib.util.find_spec("mooncake_lite.prefill.remote_store") is not None


def STORE_ARGS(store_data: str) -> tuple[str, ...]:  # noqa: N802
    # Until the prefill role can use a store process, it keeps a private in-process store.
    return ("--store", store_data) if HAS_REMOTE_STORE else ()


def _wait_ready(url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            body = json.load(resp)
        if body.get("ready"):
            return body
        time.sleep(0.1)
    raise AssertionError(f"cluster not ready: {body}")


@pytest.fixture(scope="module")
def cluster(module_role_procs):
    """Shared by the tests below: the first leaves it as it found it (its abandoned stream's KV
    freed, asserted), the burst's prompts share no block with the first's."""
    # Early admission with a TTFT SLO a few prefills long (the instances run --no-profile, so the
    # conductor predicts with its shape-derived defaults: ~7 ms for a 200-token tiny prompt).
    conductor = module_role_procs("conductor", "--port", "0", "--model", "tiny", "--admission", "early",
                                  "--ttft-slo", "20ms", *COMMON)
    url = conductor.url()
    store = module_role_procs("store", "--port", "0", "--data-port", "0", "--dram", "64MiB",
                              "--conductor", url, "--event-interval", "0.05", *COMMON)
    store_data = store.addresses["data"]
    # prefill and decode load the model in parallel (each start waits for its ready line)
    with ThreadPoolExecutor(2) as pool:
        started = [pool.submit(module_role_procs, "prefill", "--conductor", url, *STORE_ARGS(store_data),
                               "--model", "tiny", "--threads", "1", "--heartbeat-interval", "0.5",
                               "--no-profile", *COMMON),
                   pool.submit(module_role_procs, "decode", "--conductor", url, "--data-port", "0", "--model", "tiny",
                               "--threads", "1", "--heartbeat-interval", "0.5", "--no-profile", *COMMON)]
        prefill, decode = (f.result() for f in started)
    _wait_ready(url)
    return url, conductor, prefill, decode


def test_tokens_through_the_conductor_equal_the_reference(cluster):
    url, conductor, _, decode = cluster
    tok = ByteTokenizer(320)
    model = build_model("tiny", seed=0)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    shared = "The quick brown fox jumps over the lazy dog; " * 2
    prompts = [shared + "then it rests.", shared + "then it runs away."]
    routes = []
    for i, prompt in enumerate(prompts):
        want = reference_greedy(model, tok.encode(prompt), 8)
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        out = raw.parse()
        assert out.choices[0].model_extra["token_ids"] == want, conductor.logs()[-3000:]
        routes.append((raw.headers["X-Mooncake-Route"], int(raw.headers["X-Mooncake-Reused-Blocks"])))
        assert out.choices[0].text == tok.decode(want), conductor.logs()[-3000:]
        assert out.usage.completion_tokens == 8
        # streamed, the same text arrives chunk by chunk
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == tok.decode(want)
        if i == 0 and HAS_REMOTE_STORE:   # wait for the store's block events to reach the conductor
            full_blocks = len(tok.encode(prompt)) // int(BLOCK)
            deadline = time.monotonic() + 30
            while _indexed_blocks(url) < full_blocks and time.monotonic() < deadline:
                time.sleep(0.05)
    # the second prompt shares its first full blocks with the first: served as a prefix hit
    a, b = (tok.encode(p) for p in prompts)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert routes[0][1] == 0
    if HAS_REMOTE_STORE:
        assert routes[1] == ("local-hit", common // int(BLOCK)) and common // int(BLOCK) == 6

    # a client that walks away mid-stream: decode drops the request and frees its KV
    free_before = _load(decode)["free_blocks"]
    stream = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=2000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(3):      # decode's tokens are flowing: the request is in its batch
        next(chunks)
    assert _load(decode)["num_running"] == 1
    stream.close()
    # (an abort that lands during a decode step frees the blocks when that step commits)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        load = _load(decode)
        if load["num_running"] == 0 and load["free_blocks"] == free_before:
            break
        time.sleep(0.1)
    assert load["num_running"] == 0 and load["free_blocks"] == free_before, load
    client.close()


def test_a_burst_beyond_the_ttft_slo_gets_429s_and_the_rest_stays_exact(cluster):
    url, conductor, _, _ = cluster
    tok = ByteTokenizer(320)
    model = build_model("tiny", seed=0)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

    def one(prompt: str):
        try:
            raw = client.completions.with_raw_response.create(
                model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
            return "ok", raw.parse().choices[0].model_extra["token_ids"]
        except openai.RateLimitError as exc:
            return "429", (exc.message, exc.response.headers.get("Retry-After"))

    # On a loaded machine 16 threads may send their requests so far apart that the prefill keeps
    # up with them and none is rejected: a burst that did not pile up is sent again (new prompts,
    # so no prefix hit shortens them), at most three times; each burst is checked in full.
    seen: set[str] = set()
    for burst in range(3):
        prompts = [f"burst {burst} request {i:02d}: " + "the moon is made of cheese and KV cache. " * 5
                   for i in range(16)]
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, prompts))
        seen.update(kind for kind, _ in results)
        for prompt, (kind, result) in zip(prompts, results):
            if kind == "ok":
                assert result == reference_greedy(model, tok.encode(prompt), 4)
            else:
                message, retry_after = result
                assert "predicted TTFT" in message and int(retry_after) >= 1
        if seen == {"ok", "429"}:
            break
    assert seen == {"ok", "429"}, results
    client.close()


def _indexed_blocks(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("mooncake_conductor_indexed_blocks "):
                return float(line.split()[1])
    return 0.0


def _load(rp) -> dict:
    with urllib.request.urlopen(rp.url() + "/v1/load", timeout=5) as resp:
        return json.load(resp)


@pytest.fixture
def two_stores(role_procs):
    """Two prefill instances, each with its own store, one decode; instances die after 3 s of silence."""
    conductor = role_procs("conductor", "--port", "0", "--model", "tiny", "--admission", "none",
                           "--dead-after", "3s", *COMMON)
    url = conductor.url()
    with ThreadPoolExecutor(2) as pool:
        stores = [f.result() for f in [pool.submit(role_procs, "store", "--port", "0", "--data-port", "0",
                                                   "--dram", "64MiB", "--conductor", url, "--event-interval",
                                                   "0.05", *COMMON) for _ in range(2)]]
    args = ("--conductor", url, "--model", "tiny", "--threads", "1", "--heartbeat-interval", "0.2",
            "--no-profile", *COMMON)
    with ThreadPoolExecutor(3) as pool:
        started = [pool.submit(role_procs, "prefill", "--instance-id", f"p{i}", "--store",
                               stores[i].addresses["data"], *args) for i in range(2)]
        started.append(pool.submit(role_procs, "decode", "--instance-id", "d0", "--data-port", "0", *args))
        procs = [f.result() for f in started]
    _wait_ready(url)
    return url, {"p0": procs[0], "p1": procs[1]}


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=5) as resp:
        return json.load(resp)


def _until(cond, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := cond()):
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.skipif(not HAS_REMOTE_STORE, reason="the prefill role cannot use a store process yet")
def test_hot_spot_migration_replicates_the_prefix_to_where_it_is_used(two_stores):
    url, prefills = two_stores
    tok = ByteTokenizer(320)
    model = build_model("tiny", seed=0)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    shared = "Hot blocks are replicated to where they are used. " * 2        # > 6 blocks of 16
    n_shared = (len(tok.encode(shared))) // int(BLOCK)

    def ask(suffix: str) -> tuple[str, str, int]:
        prompt = shared + suffix
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=prompt, max_tokens=5, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        assert raw.parse().choices[0].model_extra["token_ids"] == reference_greedy(model, tok.encode(prompt), 5)
        return (raw.headers["X-Mooncake-Prefill"], raw.headers["X-Mooncake-Route"],
                int(raw.headers["X-Mooncake-Reused-Blocks"]))

    def store_blocks(store: str) -> int:
        return next((s["num_blocks"] for s in _health(url)["stores"] if s["store"] == store), 0)

    stores = {i["instance_id"]: i["store"] for i in _health(url)["instances"] if i["role"] == "prefill"}
    holder, _, _ = ask("first.")
    other = "p1" if holder == "p0" else "p0"
    _until(lambda: store_blocks(stores[holder]) >= n_shared, "the holder's store to report its blocks")
    assert store_blocks(stores[other]) == 0
    # the holder's prefill instance goes away; its store (and the prefix in it) stays
    prefills[holder].stop()
    _until(lambda: not next(i["alive"] for i in _health(url)["instances"] if i["instance_id"] == holder),
           "the conductor to mark the silent instance dead")
    assert ask("second.") == (other, "transfer", n_shared)      # fetched from the holder's store...
    _until(lambda: store_blocks(stores[other]) >= n_shared, "the migrated blocks to be reported")
    assert ask("third.") == (other, "local-hit", n_shared)      # ...and now local
    client.close()
