"""Prompt logprobs (``echo`` with ``logprobs``) at the conductor, with fake instances: such a
request reuses no cached prefix even where the store holds one (every position's logits are
needed; vLLM's rule), so none is priced, sent as ``prefix_keys`` or migrated; a CPP group serves
it like a whole prefill (its last stage computes them: tests/prefill/test_cpp_apart.py)."""

from __future__ import annotations

import openai
import pytest

from mooncake_lite.common.hashing import prefix_hash
from tests.conductor import fakes
from tests.conductor.test_api import TOK, client

PROMPT = "0123456789abcdefghij"   # 21 tokens: 5 full blocks of 4


async def _cpp_group(cluster, instance_id: str) -> None:
    inst = await cluster.add("prefill", instance_id, store=f"{instance_id}-store:1", register=False)
    status, body = await fakes.register(cluster.session, cluster.url, inst, pipeline_stages=2)
    assert status == 200, body


@pytest.mark.parametrize("group", ["whole", "cpp"])
async def test_echo_with_logprobs_reuses_no_prefix_on_any_prefill(make_cluster, group):
    cluster = await make_cluster(prefill=0, decode=1, strategy="cache-aware")
    if group == "cpp":
        await _cpp_group(cluster, group)
    else:
        await cluster.add("prefill", group, store=f"{group}-store:1")
    keys = prefix_hash(TOK.encode(PROMPT), 4, 0)
    await fakes.block_events(cluster.session, cluster.url, f"{group}-store:1", stored=keys[:4])
    c = client(cluster)
    plain = await c.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert plain.headers["X-Mooncake-Reused-Blocks"] == "4"          # an ordinary request reuses them
    raw = await c.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=1, echo=True,
                                                       logprobs=1)
    assert raw.headers["X-Mooncake-Prefill"] == group and raw.headers["X-Mooncake-Reused-Blocks"] == "0"
    sent = cluster.instances[group].requests[-1]
    assert sent.sampling.prompt_logprobs == 1 and sent.prefix_keys == () and sent.migrate_from is None
    await c.close()


async def test_a_request_for_its_own_logprobs_reuses_no_prefix_either(make_cluster):
    """Cached blocks may come from int8-activation decode steps (a write-back); a request whose
    logprobs are reported is computed from float activations throughout, so it loads none."""
    cluster = await make_cluster(prefill=0, decode=1, strategy="cache-aware")
    await cluster.add("prefill", "p", store="p-store:1")
    keys = prefix_hash(TOK.encode(PROMPT), 4, 0)
    await fakes.block_events(cluster.session, cluster.url, "p-store:1", stored=keys[:4])
    c = client(cluster)
    raw = await c.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=2, logprobs=1)
    assert raw.headers["X-Mooncake-Reused-Blocks"] == "0"
    sent = cluster.instances["p"].requests[-1]
    assert sent.sampling.logprobs == 1 and sent.prefix_keys == () and sent.migrate_from is None
    plain = await c.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert plain.headers["X-Mooncake-Reused-Blocks"] == "4"
    await c.close()
