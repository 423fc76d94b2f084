"""Prompt logprobs (``echo`` with ``logprobs``) at the conductor, with fake instances: such a
request reuses no cached prefix even where the store holds one (every position's logits are
needed; vLLM's rule), so none is priced, sent as ``prefix_keys`` or migrated; and it goes only to
a prefill that is one process, never a CPP group (whose head refuses it): a 400 naming ``echo``
when there is no other."""

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


async def test_echo_with_logprobs_reuses_no_prefix_and_skips_cpp_groups(make_cluster):
    cluster = await make_cluster(prefill=0, decode=1, strategy="cache-aware")
    await _cpp_group(cluster, "cpp")
    await cluster.add("prefill", "whole", store="whole-store:1")
    keys = prefix_hash(TOK.encode(PROMPT), 4, 0)
    for store in ("cpp-store:1", "whole-store:1"):   # both hold the prompt's first four blocks
        await fakes.block_events(cluster.session, cluster.url, store, stored=keys[:4])
    c = client(cluster)
    plain = await c.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert plain.headers["X-Mooncake-Reused-Blocks"] == "4"          # an ordinary request reuses them
    for _ in range(3):   # the CPP group also holds the prefix: never chosen for prompt logprobs
        raw = await c.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=1, echo=True,
                                                           logprobs=1)
        assert raw.headers["X-Mooncake-Prefill"] == "whole" and raw.headers["X-Mooncake-Reused-Blocks"] == "0"
        sent = cluster.instances["whole"].requests[-1]
        assert sent.sampling.prompt_logprobs == 1 and sent.prefix_keys == () and sent.migrate_from is None
    assert len([r for r in cluster.instances["cpp"].requests if r.sampling.prompt_logprobs is not None]) == 0
    await c.close()


async def test_echo_with_logprobs_and_only_cpp_groups_is_a_400_naming_echo(make_cluster):
    cluster = await make_cluster(prefill=0, decode=1)
    await _cpp_group(cluster, "cpp")
    c = client(cluster)
    with pytest.raises(openai.BadRequestError) as err:
        await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, echo=True, logprobs=1)
    assert err.value.body["param"] == "echo" and "CPP" in err.value.body["message"]
    ok = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, echo=True)   # no logprobs: fine
    assert ok.choices[0].text.startswith(PROMPT)
    assert cluster.instances["cpp"].requests
    await c.close()
